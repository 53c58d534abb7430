"""MXFP8 GEMMs for training, emulated: every operand of the three GEMMs of a linear layer goes through MX
the way an MX tensor core would take it, and the products accumulate in float32.

For ``y = a @ b`` (``a [..., M, K]``, ``b [..., K, N]``):

- forward: ``a`` in blocks along K, ``b`` along K (the contraction);
- input gradient ``g @ b^T``: ``g`` (the output gradient) and ``b`` in blocks along N;
- weight gradient ``a^T @ g``: ``a`` and ``g`` in blocks along M.

Activations and weights use ``recipe.elem`` (E4M3 by default), output gradients ``recipe.grad_elem`` (E5M2 by
default: gradients need range more than precision). This is the numerics of Blackwell-class MX tensor cores,
available anywhere (CPU tests, quality studies); it is not a speed path: emulation costs more than the GEMM it
models. ``gem_kernels.low_precision.convert_to_low_precision`` swaps a model's layers for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gem_kernels.low_precision import LowPrecisionLinear
from gem_kernels.mx import BLOCK, ScaleRounding, element_format, mx_fake_quantize


@dataclass(frozen=True)
class MXRecipe:
    elem: str = "e4m3"  # activations and weights
    grad_elem: str = "e5m2"  # output gradients
    rounding: ScaleRounding = "floor"
    block: int = BLOCK

    def __post_init__(self) -> None:
        for name in (self.elem, self.grad_elem):
            element_format(name)  # an unknown format is a ValueError naming it
        if self.rounding not in ("floor", "rceil"):
            raise ValueError(f"MXRecipe.rounding must be 'floor' or 'rceil', got {self.rounding!r}")
        from gem_kernels.ops import _validation as V

        V.check_positive_int("MXRecipe.block", self.block)

    def linear(self, linear: nn.Linear) -> "MXLinear":
        return MXLinear.from_linear(linear, self)

    def matmul(self) -> "MXMatmul":
        return MXMatmul(self)


class _MXMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, recipe: MXRecipe) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.recipe = recipe
        q = lambda x, dim: mx_fake_quantize(x.float(), dim, recipe.elem, recipe.rounding, recipe.block)  # noqa: E731
        return torch.matmul(q(a, -1), q(b, -2)).to(torch.promote_types(a.dtype, b.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        r = ctx.recipe
        q = lambda x, dim, elem: mx_fake_quantize(x.float(), dim, elem, r.rounding, r.block)  # noqa: E731
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = torch.matmul(q(grad, -1, r.grad_elem), q(b, -1, r.elem).transpose(-1, -2))
            grad_a = grad_a.sum_to_size(a.shape).to(a.dtype)
        if ctx.needs_input_grad[1]:
            grad_b = torch.matmul(q(a, -2, r.elem).transpose(-1, -2), q(grad, -2, r.grad_elem))
            grad_b = grad_b.sum_to_size(b.shape).to(b.dtype)
        return grad_a, grad_b, None


def mx_matmul(a: torch.Tensor, b: torch.Tensor, recipe: MXRecipe = MXRecipe()) -> torch.Tensor:
    """``a @ b`` (broadcasting like ``torch.matmul``, both at least 2-D) with MXFP8 operands in all three GEMMs."""
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(f"mx_matmul needs operands of at least 2 dimensions, got {tuple(a.shape)} and {tuple(b.shape)}")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise ValueError(f"mx_matmul takes floating-point operands, got {a.dtype} and {b.dtype}")
    if not isinstance(recipe, MXRecipe):
        raise ValueError(f"mx_matmul: recipe must be an MXRecipe, got {type(recipe).__name__}")
    return _MXMatmul.apply(a, b, recipe)


class MXMatmul:
    """``torch.matmul``'s place in a module that takes its matmul as an attribute (``low_precision_matmul``)."""

    def __init__(self, recipe: MXRecipe) -> None:
        self.recipe = recipe

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return mx_matmul(a, b, self.recipe)


class MXLinear(LowPrecisionLinear):
    """``nn.Linear`` whose GEMMs run in emulated MXFP8 (the bias is added in the input's precision)."""

    recipe: MXRecipe = MXRecipe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.rows(x)
        y = mx_matmul(flat, self.weight.t(), self.recipe)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mx={self.recipe.elem}/{self.recipe.grad_elem} {self.recipe.rounding}"
