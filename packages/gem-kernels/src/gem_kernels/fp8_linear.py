"""FP8 training GEMMs for Hopper: a linear layer whose GEMMs run on FP8 tensor cores with rowwise or blockwise scales.

For ``y = x @ W^T`` (``x [M, K]``, ``W [N, K]``), every operand is quantised with one scale per row along the
dimension its GEMM contracts (``gem_kernels.fp8``), and ``torch._scaled_mm`` multiplies, accumulating in float32
and writing bfloat16 (on a CPU whose torch takes one scale per tensor only, the dequantised operands' product):

- forward: ``x`` along K, ``W`` along K;
- input gradient ``g @ W``: ``g`` along N, ``W`` along N (its transpose, quantised);
- weight gradient ``g^T @ x``: by default in the input's precision (``weight_gradient="high"``): it contracts the
  token dimension, where one scale would span a million rows, and its error lands in every weight; with
  ``"fp8"`` it is an FP8 GEMM too (``g`` and ``x`` along M).

All operands are E4M3: rowwise scales already give each row its range, so the gradient needs no E5M2.

``Fp8Recipe.scaling = "blockwise"``: one scale per block instead of per row (``gem_kernels.fp8.fp8_blockwise_quantize``):
activations and output gradients in 1 x 128 blocks along the dimension their GEMM contracts, the weight in 128 x 128
blocks (quantised once in the forward; the input gradient reads the same blocks transposed), and, with
``weight_gradient="fp8"``, a weight gradient from 1 x 128 blocks of ``g^T`` and ``x^T`` along the tokens (each 128
tokens' scales local to them: no amax over all of them). A block's scale follows its own range (an outlier token or
channel no longer coarsens its whole row). Layers need in and out features that are multiples of 128; the products
run on ``torch.nn.functional.scaled_mm``'s block-scaled GEMM on CUDA, and as the dequantised blocks' product (the same
numerics) where a device has none (the CPU); the bias is added to the bfloat16 product.

Where FP8 does not pay: a GEMM costs ``2MKN`` while quantising its operands costs memory passes over ``MK`` and
``MN``, so below some ``min(K, N)`` the casts eat the gain; ``Fp8Recipe.min_features`` (a layer narrower than it
stays as it is, decided once when converting) and ``min_tokens`` (a call with fewer rows runs in high precision)
encode that crossover, measured by ``gem_kernels.ops.benchmarks.bench_fp8``. Layers whose sizes are not
multiples of 16 (the scaled GEMM's requirement) also stay; the token count is padded instead.

``emulate=True`` runs the same quantisation through the PyTorch reference and multiplies the dequantised values in
float32 (rounded to bfloat16 like the scaled GEMM's output): the reference twin the tests compare against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from gem_kernels.fp8 import (fp8_blockwise_dequantize, fp8_blockwise_quantize, fp8_blockwise_quantize_reference,
                             fp8_dequantize, fp8_rowwise_quantize, fp8_rowwise_quantize_reference, padded)
from gem_kernels.low_precision import LowPrecisionLinear

_ALIGN = 16  # the scaled GEMM's size multiple
_BLOCK = 128  # the blockwise recipe's block side: its layers' features are multiples of it


@dataclass(frozen=True)
class Fp8Recipe:
    weight_gradient: Literal["high", "fp8"] = "high"
    # the crossover on an H200 (benchmarks/results/fp8-h200.json, forward+backward, quantisation included; rowwise
    # and blockwise scales alike): K = N = 2048 pays from 64k tokens on (rowwise 1.12-1.16x), 1024 not reliably
    # (0.64-1.07x); at 16k tokens only 4096 (1.17x)
    min_features: int = 2048  # layers with in or out features below it stay in high precision
    min_tokens: int = 65536  # calls with fewer rows run in high precision
    kernel: str = "auto"  # the quantisation kernel: "auto" (Triton on CUDA), "triton", "pytorch"
    scaling: Literal["rowwise", "blockwise"] = "rowwise"  # one scale per row, or per 1 x 128 / 128 x 128 block

    def __post_init__(self) -> None:
        if self.weight_gradient not in ("high", "fp8"):
            raise ValueError(f"Fp8Recipe.weight_gradient must be 'high' or 'fp8', got {self.weight_gradient!r}")
        if self.scaling not in ("rowwise", "blockwise"):
            raise ValueError(f"Fp8Recipe.scaling must be 'rowwise' or 'blockwise', got {self.scaling!r}")
        if self.kernel not in ("auto", "triton", "pytorch"):
            raise ValueError(f"Fp8Recipe.kernel must be 'auto', 'triton' or 'pytorch', got {self.kernel!r}")
        for name in ("min_features", "min_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Fp8Recipe.{name} must be an int >= 0, got {value!r}")

    def runs_fp8(self, rows: int) -> bool:
        """Whether a call with ``rows`` rows (tokens) runs in FP8 (fewer than ``min_tokens``: high precision)."""
        return rows >= self.min_tokens

    def linear(self, linear: nn.Linear) -> "Fp8Linear | None":
        """The FP8 twin of ``linear`` on the same parameters, or None where FP8 does not pay or cannot run."""
        k, n = linear.in_features, linear.out_features
        align = _BLOCK if self.scaling == "blockwise" else _ALIGN
        if min(k, n) < self.min_features or k % align or n % align:
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


def _gemm(a, a_scale, b, b_scale, emulate: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale)^T (+ bias)`` in bfloat16, ``a [P, C]`` and ``b [Q, C]`` rowwise E4M3; the
    bias ``[Q]`` is added in float32 before the one rounding (the scaled GEMM's epilogue: no pass of its own)."""
    if bias is not None:
        bias = bias.to(torch.bfloat16)
    if emulate or (a.device.type != "cuda" and not _rowwise_scaled_mm_on(a.device.type)):
        product = fp8_dequantize(a, a_scale) @ fp8_dequantize(b, b_scale).t()
        return (product if bias is None else product + bias.float()).to(torch.bfloat16)
    return torch._scaled_mm(a, b.t(), scale_a=a_scale, scale_b=b_scale.t(), bias=bias, out_dtype=torch.bfloat16)


@functools.cache
def _rowwise_scaled_mm_on(device_type: str) -> bool:
    """Whether ``torch._scaled_mm`` takes rowwise scales on this (non-CUDA) device type.

    NOTE: torch 2.13's CPU kernel does; 2.11's takes one scale per tensor only and fails an internal assert on
    rowwise ones. Where it does not, the product is the dequantised operands' (``emulate``'s numerics)."""
    a = torch.ones(16, 16, device=device_type).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device_type),
                         scale_b=torch.ones(1, 16, device=device_type), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def _block_quantize(x: torch.Tensor, block: tuple[int, int], rows_to: int, transpose: bool, kernel: str, emulate: bool):
    if emulate:
        return fp8_blockwise_quantize_reference(x, block, rows_to, transpose)
    return fp8_blockwise_quantize(x, block, rows_to, transpose, kernel=kernel)


_SCALING_TYPES = {(1, 128): "BlockWise1x128", (128, 128): "BlockWise128x128"}


def scaled_mm_arguments(a, a_scale, a_block, b, b_scale, b_block) -> tuple:
    """The positional arguments of ``torch.nn.functional.scaled_mm`` for ``A @ B^T`` (``a [P, C]``, ``b [Q, C]``, block
    scales along ``C`` as ``fp8_blockwise_quantize`` lays them out), as cuBLAS's block scaling reads them: ``b``
    column-major (``b.t()``); 1 x 128 scales of either operand as they are (``[rows, C / 128]``, column-major); ``b``'s
    128 x 128 scales with their contraction blocks contiguous and padded with zeros to a multiple of 4 blocks
    (``[L4, Q / 128]``, stride ``(1, L4)``: cuBLAS's layout for 2-D block scales)."""
    if b_block == (128, 128):
        b_scale = F.pad(b_scale.contiguous(), (0, -b_scale.shape[1] % 4)).t()
    kinds = F.ScalingType
    return (a, b.t(), a_scale, getattr(kinds, _SCALING_TYPES[a_block]), b_scale, getattr(kinds, _SCALING_TYPES[b_block]))


def _blockwise_gemm(a, a_scale, a_block, b, b_scale, b_block, emulate: bool,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``A @ B^T (+ bias)`` in bfloat16 for E4M3 ``a [P, C]`` and ``b [Q, C]`` with block scales along ``C``
    (``a_block`` / ``b_block``: 1 x 128 or 128 x 128, scales as ``fp8_blockwise_quantize`` lays them out)."""
    if emulate or a.device.type != "cuda":  # no block-scaled GEMM on the CPU: the dequantised blocks' product
        product = fp8_blockwise_dequantize(a, a_scale, a_block) @ fp8_blockwise_dequantize(b, b_scale, b_block).t()
        out = product.to(torch.bfloat16)
    else:
        if getattr(F, "scaled_mm", None) is None:
            raise RuntimeError("Fp8Recipe(scaling='blockwise') needs torch.nn.functional.scaled_mm (torch >= 2.10)")
        out = F.scaled_mm(*scaled_mm_arguments(a, a_scale, a_block, b, b_scale, b_block), output_dtype=torch.bfloat16)
    return out if bias is None else out + bias.to(torch.bfloat16)


def quantize_weight(weight: torch.Tensor, recipe: Fp8Recipe, emulate: bool):
    """The blockwise recipe's weight: 128 x 128 blocks of ``weight`` ``[N, K]`` (None for the rowwise recipe, which
    quantises the weight along each GEMM's contraction)."""
    if recipe.scaling != "blockwise":
        return None
    return _block_quantize(weight, (_BLOCK, _BLOCK), 1, False, recipe.kernel, emulate)


def forward_gemm(x, x_fp8, weight, recipe: Fp8Recipe, emulate: bool, bias: torch.Tensor | None = None,
                 weight_fp8=None) -> torch.Tensor:
    """``x @ weight^T (+ bias)`` in bfloat16 from E4M3 operands; ``x_fp8``: x's rows already quantised by its
    producer (``(elements, scales)``, rows padded to a multiple of 16), or None to quantise them here;
    ``weight_fp8``: the blockwise recipe's ``quantize_weight`` (None: quantised here)."""
    if recipe.scaling == "blockwise":
        xq, xs = _block_quantize(x, (1, _BLOCK), _ALIGN, False, recipe.kernel, emulate)
        wq, ws = quantize_weight(weight, recipe, emulate) if weight_fp8 is None else weight_fp8
        return _blockwise_gemm(xq, xs, (1, _BLOCK), wq, ws, (_BLOCK, _BLOCK), emulate, bias)[: x.shape[0]]
    xq, xs = _quantize(x, -1, _ALIGN, 1, recipe.kernel, emulate) if x_fp8 is None else x_fp8
    wq, ws = _quantize(weight, -1, 1, 1, recipe.kernel, emulate)
    return _gemm(xq, xs, wq, ws, emulate, bias)[: x.shape[0]]


def input_gradient(grad_fp8, rows: int, weight, recipe: Fp8Recipe, emulate: bool, weight_fp8=None) -> torch.Tensor:
    """``grad @ weight`` in bfloat16 from the output gradient's E4M3 rows (along N) and ``W^T``'s; blockwise: the
    gradient's 1 x 128 blocks and the forward's 128 x 128 blocks of the weight (``weight_fp8``), transposed."""
    if recipe.scaling == "blockwise":
        wq, ws = quantize_weight(weight, recipe, emulate) if weight_fp8 is None else weight_fp8
        wtq, wts = wq.t().contiguous(), ws.t().contiguous()  # W^T [K, N]: the same blocks, transposed
        return _blockwise_gemm(*grad_fp8, (1, _BLOCK), wtq, wts, (_BLOCK, _BLOCK), emulate)[:rows]
    # NOTE: W^T's rows from a transposed copy: a weight is small, and the one-pass kernel over its copy took a third
    # of the two-pass column kernel's time on the H200 (2048 x 2048: 0.15 ms for the columns, 0.04 for the rows)
    wtq, wts = _quantize(weight.t().contiguous(), -1, 1, 1, recipe.kernel, emulate)  # W^T: rows along N
    return _gemm(*grad_fp8, wtq, wts, emulate)[:rows]


def weight_gradient(grad, x, weight, recipe: Fp8Recipe, emulate: bool, dtype: torch.dtype) -> torch.Tensor:
    """``grad^T @ x`` in the weight's dtype: in ``dtype`` or, with ``recipe.weight_gradient == "fp8"``, from E4M3
    columns along M."""
    if recipe.weight_gradient == "fp8" and recipe.scaling == "blockwise":
        # g^T [N, M] and x^T [K, M] in 1 x 128 blocks along the tokens: 128 x 1 blocks of g and x, written transposed
        gtq, gts = _block_quantize(grad, (_BLOCK, 1), _BLOCK, True, recipe.kernel, emulate)
        xtq, xts = _block_quantize(x, (_BLOCK, 1), _BLOCK, True, recipe.kernel, emulate)
        grad_w = _blockwise_gemm(gtq, gts, (1, _BLOCK), xtq, xts, (1, _BLOCK), emulate)
    elif recipe.weight_gradient == "fp8":
        gtq, gts = _quantize(grad, 0, 1, _ALIGN, recipe.kernel, emulate)  # [N, M]
        xtq, xts = _quantize(x, 0, 1, _ALIGN, recipe.kernel, emulate)  # [K, M]
        grad_w = _gemm(gtq, gts, xtq, xts, emulate)
    else:
        grad_w = grad.t().to(dtype) @ x.to(dtype)
    return grad_w.to(weight.dtype)


def linear_gradients(ctx, grad, grad_fp8, x, weight, weight_fp8=None):
    """The input, weight and bias gradients of an FP8 linear (those ``ctx.needs_input_grad`` asks for, inputs
    ``x, weight, bias`` first) from its output gradient ``grad`` and that gradient's E4M3 rows (None: quantised
    here). ``ctx`` holds ``recipe``, ``emulate``, ``dtype`` and ``bias_dtype`` (None: no bias); ``weight_fp8``: the
    blockwise recipe's quantised weight from the forward."""
    recipe, emulate = ctx.recipe, ctx.emulate
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        if grad_fp8 is None and recipe.scaling == "blockwise":
            grad_fp8 = _block_quantize(grad, (1, _BLOCK), _ALIGN, False, recipe.kernel, emulate)
        elif grad_fp8 is None:
            grad_fp8 = _quantize(grad, -1, _ALIGN, 1, recipe.kernel, emulate)
        grad_x = input_gradient(grad_fp8, grad.shape[0], weight, recipe, emulate, weight_fp8).to(x.dtype)
    if ctx.needs_input_grad[1]:
        grad_w = weight_gradient(grad, x, weight, recipe, emulate, ctx.dtype)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        grad_b = grad.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return grad_x, grad_w, grad_b


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, x_elements, x_scales, recipe: Fp8Recipe, emulate: bool, dtype: torch.dtype):
        """``dtype``: the output's, and the high-precision weight gradient's (autocast's, else the input's);
        ``x_elements`` / ``x_scales``: x already quantised (None: quantise here)."""
        weight_fp8 = quantize_weight(weight, recipe, emulate)  # blockwise: once, for the forward and the backward
        ctx.save_for_backward(x, weight, *(weight_fp8 or ()))
        ctx.recipe, ctx.emulate, ctx.dtype = recipe, emulate, dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        x_fp8 = None if x_elements is None else (x_elements, x_scales)
        return forward_gemm(x, x_fp8, weight, recipe, emulate, bias, weight_fp8).to(dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, *weight_fp8 = ctx.saved_tensors
        gradients = linear_gradients(ctx, grad.contiguous(), None, x, weight, tuple(weight_fp8) or None)
        return (*gradients, None, None, None, None, None)


def check_linear_shapes(name: str, x: torch.Tensor, weight: torch.Tensor, x_fp8, bias: torch.Tensor | None,
                        recipe: Fp8Recipe | None = None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{name}: x [M, K] and weight [N, K] needed, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] % _ALIGN or weight.shape[0] % _ALIGN:
        raise ValueError(f"{name}: in and out features must be multiples of {_ALIGN}, got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{name}: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if recipe is not None and recipe.scaling == "blockwise":
        if x.shape[1] % _BLOCK or weight.shape[0] % _BLOCK:
            raise ValueError(f"{name}: blockwise scaling needs in and out features that are multiples of {_BLOCK}, got "
                             f"{tuple(weight.shape)}")
        if x_fp8 is not None:
            raise ValueError(f"{name}: x_fp8 holds rowwise E4M3 (a producer's); the blockwise recipe quantises x itself")
    if x_fp8 is not None:
        # NOTE: the values are the producer's to get right (fp8_layer_norm, fp8_linear_gelu write them from x's own
        # registers); their layout, dtypes and device are checked here, where a mistake would fail deep in the GEMM
        if not isinstance(x_fp8, tuple) or len(x_fp8) != 2:
            raise ValueError(f"{name}: x_fp8 must be a pair (elements, scales), got {type(x_fp8).__name__}")
        elements, scales = x_fp8
        rows = padded(x.shape[0], _ALIGN)
        if (elements.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32
                or tuple(elements.shape) != (rows, x.shape[1]) or tuple(scales.shape) != (rows, 1)):
            raise ValueError(f"{name}: x_fp8 must be E4M3 elements [{rows}, {x.shape[1]}] (rows padded to {_ALIGN}) and "
                             f"float32 scales [{rows}, 1], got {elements.dtype} {tuple(elements.shape)} and "
                             f"{scales.dtype} {tuple(scales.shape)}")
        if elements.device != x.device or scales.device != x.device:
            raise ValueError(f"{name}: x_fp8 must be on x's device {x.device}, got {elements.device} and {scales.device}")


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Autocast's dtype when autocast is on for ``x``'s device, else ``x``'s."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe = Fp8Recipe(), emulate: bool = False,
               x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` (``x [M, K]``, ``weight [N, K]``, ``bias [N]`` or None) with FP8 GEMMs (module
    docstring); rowwise, the bias is added in the GEMM's epilogue (bfloat16 bias, float32 sum), blockwise to the
    bfloat16 product. The output has autocast's dtype when autocast is on for ``x``'s device, else ``x``'s.
    ``x_fp8``: x's E4M3 rows and scales from its producer (``fp8_layer_norm``, ``fp8_linear_gelu``), which spares
    the quantisation pass (rowwise recipes)."""
    if not isinstance(recipe, Fp8Recipe):
        raise ValueError(f"fp8_linear: recipe must be an Fp8Recipe, got {type(recipe).__name__}")
    check_linear_shapes("fp8_linear", x, weight, x_fp8, bias, recipe)
    elements, scales = (None, None) if x_fp8 is None else x_fp8
    return _Fp8Linear.apply(x, weight, bias, elements, scales, recipe, emulate, compute_dtype(x))


class Fp8Linear(LowPrecisionLinear):
    """``nn.Linear`` whose GEMMs run in FP8 with the recipe's scales (``fp8_linear``).
    Calls with fewer than ``recipe.min_tokens`` rows run as a plain linear."""

    recipe: Fp8Recipe = Fp8Recipe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.rows(x)
        if not self.recipe.runs_fp8(flat.shape[0]):
            return F.linear(x, self.weight, self.bias)
        y = fp8_linear(flat, self.weight, self.recipe, bias=self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8 {self.recipe.scaling}, weight gradient {self.recipe.weight_gradient}"
