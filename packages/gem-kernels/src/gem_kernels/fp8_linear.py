"""FP8 training GEMMs for Hopper: a linear layer whose GEMMs run on FP8 tensor cores with rowwise scales.

For ``y = x @ W^T`` (``x [M, K]``, ``W [N, K]``), every operand is quantised with one scale per row along the
dimension its GEMM contracts (``gem_kernels.fp8``), and ``torch._scaled_mm`` multiplies, accumulating in float32
and writing bfloat16:

- forward: ``x`` along K, ``W`` along K;
- input gradient ``g @ W``: ``g`` along N, ``W`` along N (its transpose, quantised);
- weight gradient ``g^T @ x``: by default in the input's precision (``weight_gradient="high"``): it contracts the
  token dimension, where one scale would span a million rows, and its error lands in every weight; with
  ``"fp8"`` it is an FP8 GEMM too (``g`` and ``x`` along M).

All operands are E4M3: rowwise scales already give each row its range, so the gradient needs no E5M2.

Where FP8 does not pay: a GEMM costs ``2MKN`` while quantising its operands costs memory passes over ``MK`` and
``MN``, so below some ``min(K, N)`` the casts eat the gain; ``Fp8Recipe.min_features`` (a layer narrower than it
stays as it is, decided once when converting) and ``min_tokens`` (a call with fewer rows runs in high precision)
encode that crossover, measured by ``gem_kernels.ops.benchmarks.bench_fp8``. Layers whose sizes are not
multiples of 16 (the scaled GEMM's requirement) also stay; the token count is padded instead.

``emulate=True`` runs the same quantisation through the PyTorch reference and multiplies the dequantised values in
float32 (rounded to bfloat16 like the scaled GEMM's output): the reference twin the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from gem_kernels.fp8 import fp8_dequantize, fp8_rowwise_quantize, fp8_rowwise_quantize_reference
from gem_kernels.low_precision import LowPrecisionLinear

_ALIGN = 16  # the scaled GEMM's size multiple


@dataclass(frozen=True)
class Fp8Recipe:
    weight_gradient: Literal["high", "fp8"] = "high"
    # the crossover on an H200 (benchmarks/results/fp8-h200.json, forward+backward, quantisation included):
    # K = N = 2048 pays from 64k tokens on (1.09-1.13x), 1024 never (at most 0.97x); at 16k tokens only 4096 (1.21x)
    min_features: int = 2048  # layers with in or out features below it stay in high precision
    min_tokens: int = 65536  # calls with fewer rows run in high precision
    kernel: str = "auto"  # the quantisation kernel: "auto" (Triton on CUDA), "triton", "pytorch"

    def __post_init__(self) -> None:
        if self.weight_gradient not in ("high", "fp8"):
            raise ValueError(f"Fp8Recipe.weight_gradient must be 'high' or 'fp8', got {self.weight_gradient!r}")
        if self.min_features < 0 or self.min_tokens < 0:
            raise ValueError(f"Fp8Recipe.min_features / min_tokens must be >= 0, got {self.min_features} / {self.min_tokens}")

    def linear(self, linear: nn.Linear) -> "Fp8Linear | None":
        """The FP8 twin of ``linear`` on the same parameters, or None where FP8 does not pay or cannot run."""
        k, n = linear.in_features, linear.out_features
        if min(k, n) < self.min_features or k % _ALIGN or n % _ALIGN:
            return None
        return Fp8Linear.from_linear(linear, self)

    def matmul(self):
        """Token products of raw parameters (``low_precision_matmul``) stay: their inner sizes (tokens, ranks)
        are far below the crossover."""
        return None


def _quantize(x: torch.Tensor, dim: int, rows_to: int, cols_to: int, kernel: str, emulate: bool):
    if emulate:
        return fp8_rowwise_quantize_reference(x, dim, rows_to, cols_to)
    return fp8_rowwise_quantize(x, dim, rows_to, cols_to, kernel=kernel)


def _gemm(a, a_scale, b, b_scale, emulate: bool) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale)^T`` in bfloat16, ``a [P, C]`` and ``b [Q, C]`` rowwise E4M3."""
    if emulate:
        return (fp8_dequantize(a, a_scale) @ fp8_dequantize(b, b_scale).t()).to(torch.bfloat16)
    return torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale.t(), out_dtype=torch.bfloat16)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, recipe: Fp8Recipe, emulate: bool, dtype: torch.dtype):
        """``dtype``: the output's, and the high-precision weight gradient's (autocast's, else the input's)."""
        m = x.shape[0]
        xq, xs = _quantize(x, -1, _ALIGN, 1, recipe.kernel, emulate)
        wq, ws = _quantize(weight, -1, 1, 1, recipe.kernel, emulate)
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.emulate, ctx.dtype = recipe, emulate, dtype
        return _gemm(xq, xs, wq, ws, emulate)[:m].to(dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        recipe, emulate = ctx.recipe, ctx.emulate
        m = grad.shape[0]
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gq, gs = _quantize(grad, -1, _ALIGN, 1, recipe.kernel, emulate)
            wtq, wts = _quantize(weight, 0, 1, 1, recipe.kernel, emulate)  # W^T: rows along N
            grad_x = _gemm(gq, gs, wtq, wts, emulate)[:m].to(x.dtype)
        if ctx.needs_input_grad[1]:
            if recipe.weight_gradient == "fp8":
                gtq, gts = _quantize(grad, 0, 1, _ALIGN, recipe.kernel, emulate)  # [N, M]
                xtq, xts = _quantize(x, 0, 1, _ALIGN, recipe.kernel, emulate)  # [K, M]
                grad_w = _gemm(gtq, gts, xtq, xts, emulate)
            else:
                grad_w = grad.t().to(ctx.dtype) @ x.to(ctx.dtype)
            grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe = Fp8Recipe(), emulate: bool = False) -> torch.Tensor:
    """``x @ weight^T`` (``x [M, K]``, ``weight [N, K]``, no bias) with FP8 GEMMs (module docstring). The output
    has autocast's dtype when autocast is on for ``x``'s device, else ``x``'s."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x [M, K] and weight [N, K] needed, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] % _ALIGN or weight.shape[0] % _ALIGN:
        raise ValueError(f"fp8_linear: in and out features must be multiples of {_ALIGN}, got {tuple(weight.shape)}")
    device = x.device.type
    autocast = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else x.dtype
    return _Fp8Linear.apply(x, weight, recipe, emulate, dtype)


class Fp8Linear(LowPrecisionLinear):
    """``nn.Linear`` whose GEMMs run in FP8 with rowwise scales (``fp8_linear``); the bias is added after, in the
    output's precision. Calls with fewer than ``recipe.min_tokens`` rows run as a plain linear."""

    recipe: Fp8Recipe = Fp8Recipe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] < self.recipe.min_tokens:
            return F.linear(x, self.weight, self.bias)
        y = fp8_linear(flat, self.weight, self.recipe)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8 rowwise, weight gradient {self.recipe.weight_gradient}"
