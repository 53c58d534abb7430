"""An FP8 MLP block whose activations arrive quantised: LayerNorm -> Linear -> GELU -> Linear.

Quantising a GEMM's activation in a pass of its own reads it once more and writes it again, which at K = N = 1024-2048
costs most of what FP8 saves (``benchmarks/results/fp8-h200.json``). Here every producer of a GEMM operand writes
its rowwise E4M3 as it writes its output, from the values it already holds in registers:

- the LayerNorm's forward writes ``n`` and ``n``'s E4M3 rows (the first GEMM's input);
- the GELU pass after the first GEMM (whose epilogue adds the bias) writes ``a`` and ``a``'s E4M3 rows (the
  second GEMM's input);
- in the backward, GELU's gradient pass writes ``dh`` and its E4M3 rows (the first GEMM's input gradient).

What is still quantised in a pass of its own: the block's output gradient (it arrives from outside) and the
weights (``[N, K]``, small next to ``M`` tokens). The weight gradients follow ``Fp8Recipe.weight_gradient`` and
read the high-precision ``n``, ``a`` and ``dh``, which the producers write anyway.

``kernel="pytorch"`` (the recipe's) computes the same producers in PyTorch and quantises with the reference:
the twin the Triton path is tested against; ``emulate=True`` multiplies the dequantised operands in float32 (no
scaled GEMM needed: CPU tests).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from gem_kernels.fp8 import fp8_rowwise_quantize_reference
from gem_kernels.fp8_linear import (_ALIGN, Fp8Recipe, check_linear_shapes, compute_dtype, forward_gemm, fp8_linear,
                                    linear_gradients)
from gem_kernels.ops import _validation as V


def _use_triton(recipe: Fp8Recipe, x: torch.Tensor, width: int) -> bool:
    from gem_kernels.ops.triton.triton_fp8_gelu import MAX_WIDTH

    if not V.use_triton(recipe.kernel, x.device):
        return False
    if width > MAX_WIDTH:
        if recipe.kernel == "triton":
            raise ValueError(f"fp8 MLP: width {width} is over the Triton producers' {MAX_WIDTH}")
        return False
    V.check_triton_device("x", x)
    return True


def fp8_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5,
                   recipe: Fp8Recipe = Fp8Recipe(), out_dtype: torch.dtype | None = None):
    """LayerNorm of ``x [M, K]`` (``out_dtype``, None: x's) and its E4M3 rows and scales, rows padded to a multiple
    of 16: ``(y, (elements, scales))``; only ``y`` carries a gradient."""
    from gem_kernels.ops.norms import _check, layer_norm

    if x.dim() != 2:
        raise ValueError(f"fp8_layer_norm: x must be [M, K], got {tuple(x.shape)}")
    V.check_eps(eps)
    _check(x, weight, bias, None, "pytorch", out_dtype=out_dtype)  # the shapes, devices and dtypes, one line each
    if _use_triton(recipe, x, x.shape[1]):
        from gem_kernels.ops.triton.triton_norms import triton_layer_norm

        y, elements, scales = triton_layer_norm(x, weight, bias, eps, out_dtype=out_dtype, fp8_rows_to=_ALIGN)
        return y, (elements, scales)
    y = layer_norm(x, weight, bias, eps, kernel="pytorch", out_dtype=out_dtype)
    return y, fp8_rowwise_quantize_reference(y.detach(), -1, _ALIGN)


def _gelu_reference(h: torch.Tensor) -> torch.Tensor:
    return F.gelu(h.float()).to(h.dtype)


def _gelu_gradient_reference(da: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    x = h.float()
    cdf = 0.5 * (1.0 + torch.erf(x * 0.7071067811865476))
    pdf = torch.exp(-0.5 * x * x) * 0.3989422804014327
    return (da.float() * (cdf + x * pdf)).to(h.dtype)


class _Fp8LinearGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, x_elements, x_scales, recipe: Fp8Recipe, emulate: bool, triton: bool,
                dtype: torch.dtype):
        x_fp8 = None if x_elements is None else (x_elements, x_scales)
        h = forward_gemm(x, x_fp8, weight, recipe, emulate, bias).to(dtype)
        if triton:
            from gem_kernels.ops.triton.triton_fp8_gelu import triton_gelu_fp8

            a, elements, scales = triton_gelu_fp8(h, _ALIGN)
        else:
            a = _gelu_reference(h)
            elements, scales = fp8_rowwise_quantize_reference(a, -1, _ALIGN)
        ctx.save_for_backward(x, weight, h)
        ctx.recipe, ctx.emulate, ctx.triton, ctx.dtype = recipe, emulate, triton, dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.mark_non_differentiable(elements, scales)
        # NOTE: no zero gradients made for the E4M3 outputs (autograd would fill an [M, N] tensor for each); ``a``'s
        # always arrives, as only it can carry one
        ctx.set_materialize_grads(False)
        return a, elements, scales

    @staticmethod
    def backward(ctx, da, *_):
        x, weight, h = ctx.saved_tensors
        if ctx.triton:
            from gem_kernels.ops.triton.triton_fp8_gelu import triton_gelu_fp8_backward

            dh, elements, scales = triton_gelu_fp8_backward(da, h, _ALIGN)
        else:
            dh = _gelu_gradient_reference(da, h)
            elements, scales = fp8_rowwise_quantize_reference(dh, -1, _ALIGN)
        return (*linear_gradients(ctx, dh, (elements, scales), x, weight), None, None, None, None, None, None)


def _check_rowwise(name: str, recipe: Fp8Recipe) -> None:
    if recipe.scaling != "rowwise":
        raise ValueError(f"{name}: its producers write rowwise E4M3; it takes a rowwise Fp8Recipe, got scaling "
                         f"{recipe.scaling!r} (use Fp8Linear layers for blockwise scales)")


def fp8_linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: Fp8Recipe = Fp8Recipe(),
                    emulate: bool = False, x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None):
    """``gelu(x @ weight^T + bias)`` (erf GELU) with FP8 GEMMs, and the result's E4M3 rows and scales for the
    next GEMM: ``(a, (elements, scales))``. ``x_fp8`` as ``fp8_linear``'s."""
    _check_rowwise("fp8_linear_gelu", recipe)
    check_linear_shapes("fp8_linear_gelu", x, weight, x_fp8, bias)
    elements, scales = (None, None) if x_fp8 is None else x_fp8
    a, a_elements, a_scales = _Fp8LinearGelu.apply(x, weight, bias, elements, scales, recipe, emulate,
                                                   _use_triton(recipe, x, weight.shape[0]), compute_dtype(x))
    return a, (a_elements, a_scales)


def fp8_norm_mlp(x: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor | None, eps: float,
                 weight1: torch.Tensor, bias1: torch.Tensor | None, weight2: torch.Tensor, bias2: torch.Tensor | None,
                 recipe: Fp8Recipe = Fp8Recipe(), emulate: bool = False) -> torch.Tensor:
    """``linear2(gelu(linear1(layer_norm(x))))`` over ``x [..., K]`` with FP8 GEMMs whose activations come
    quantised from their producers (module docstring). The output has autocast's dtype when autocast is on for
    x's device, else x's."""
    _check_rowwise("fp8_norm_mlp", recipe)
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    dtype = compute_dtype(flat)
    n, n_fp8 = fp8_layer_norm(flat, norm_weight, norm_bias, eps, recipe, out_dtype=dtype)
    a, a_fp8 = fp8_linear_gelu(n, weight1, bias1, recipe, emulate, x_fp8=n_fp8)
    y = fp8_linear(a, weight2, recipe, emulate, x_fp8=a_fp8, bias=bias2)
    return y.reshape(*shape[:-1], weight2.shape[0])
