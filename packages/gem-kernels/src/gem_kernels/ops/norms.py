"""Fused LayerNorm / RMSNorm with an optional residual add."""

from __future__ import annotations

import torch

from gem_kernels.ops import _validation as V
from gem_kernels.ops.pytorch.builtin import builtin_layer_norm, builtin_rms_norm
from gem_kernels.ops.pytorch.pt_norms import pt_layer_norm, pt_layer_norm_pair, pt_rms_norm


def _check(x, weight, bias, residual, kernel, skip: bool = False, out_dtype: torch.dtype | None = None) -> bool:
    V.check_kernel(kernel)
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("x must be a tensor of rank >= 1 ([..., N])")
    if x.dtype not in V.SUPPORTED_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if out_dtype is not None and out_dtype not in V.SUPPORTED_DTYPES:
        raise ValueError(f"out_dtype must be None, float16, bfloat16 or float32, got {out_dtype}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be 1-D of size {x.shape[-1]} (x's last dim), got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != weight.shape):
        raise ValueError(f"bias must be None or 1-D of size {x.shape[-1]}")
    names, tensors = ["x", "weight"], [x, weight]
    if bias is not None:
        names.append("bias")
        tensors.append(bias)
    for n, t in zip(names[1:], tensors[1:]):
        if t.device != x.device:
            raise ValueError(f"{n} is on {t.device} but x is on {x.device}")
        if t.dtype not in V.SUPPORTED_DTYPES:
            raise ValueError(f"{n} must be a floating tensor, got {t.dtype}")
    if residual is not None and skip:
        raise ValueError("residual and skip exclude each other: skip returns x itself, residual returns x + residual")
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}")
        if residual.device != x.device or residual.dtype not in V.SUPPORTED_DTYPES:
            raise ValueError(f"residual must be a float16, bfloat16 or float32 tensor on {x.device}, got "
                             f"{residual.dtype} on {residual.device}")
    use = V.use_triton(kernel, x.device)
    if use and x.shape[-1] > 16384:
        if kernel == "triton":
            raise ValueError(f"x width {x.shape[-1]} is unsupported by the triton kernel (max 16384)")
        use = False
    if use and x.numel() == 0:
        use = False
    if use:
        V.check_triton_device("x", x)
    return use


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
    kernel: str = "auto",
    skip: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dim of x [..., N] with weight / bias [N] (bias may be None). With a residual
    (x's shape, any float dtype: added in float32) it normalises h = x + residual in one pass and returns (y, h), h
    in x's dtype, so the residual stream needs no separate add; otherwise returns y. Statistics are fp32.
    skip: return (y, x), x as the skip path of a pre-norm residual branch ``x + f(y)``: the gradient reaching x
    through it is added inside the norm's backward pass (autograd would add the two gradients of x in a pass of
    its own). out_dtype: y's dtype (None: x's), e.g. the autocast dtype of the matmul that reads y, which then
    needs no cast pass (and y's gradient none back). kernel: "triton", "pytorch", "auto" (Triton on CUDA) or
    "builtin" (torch's unfused ops)."""
    V.check_eps(eps)
    if _check(x, weight, bias, residual, kernel, skip, out_dtype):
        from gem_kernels.ops.triton.triton_norms import triton_layer_norm

        return triton_layer_norm(x, weight, bias, eps, residual, skip, out_dtype)
    if kernel == "builtin":
        y = builtin_layer_norm(x, weight, bias, eps, residual)
    else:
        y = pt_layer_norm(x, weight, bias, eps, residual, out_dtype)
    return _finish(x, y, skip, out_dtype)


def layer_norm_pair(
    x: torch.Tensor,
    first: tuple[torch.Tensor, torch.Tensor],
    second: tuple[torch.Tensor, torch.Tensor],
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
    kernel: str = "auto",
    skip: bool = False,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ...]:
    """Two LayerNorms of one input that differ only in their affine (``first``, ``second``: ``(weight, bias)``, each
    ``[N]``): ``(y1, y2)``, or ``(y1, y2, h)`` with a residual or skip (h as ``layer_norm`` returns it). Both
    normalise the same rows (with a residual, its float32 sum); the Triton kernel reads them once forward and once
    backward for both, where two norms would read the input, and their gradients, twice."""
    for name, pair in (("first", first), ("second", second)):
        if not isinstance(pair, tuple) or len(pair) != 2 or not isinstance(pair[1], torch.Tensor):
            raise ValueError(f"layer_norm_pair: {name} must be a (weight, bias) pair of tensors")
    (w1, b1), (w2, b2) = first, second
    V.check_eps(eps)
    _check(x, w2, b2, residual, kernel, skip, out_dtype)
    if _check(x, w1, b1, residual, kernel, skip, out_dtype):
        from gem_kernels.ops.triton.triton_norms import triton_layer_norm

        return triton_layer_norm(x, w1, b1, eps, residual, skip, out_dtype, weight2=w2, bias2=b2)
    if kernel == "builtin":
        y1, h = builtin_layer_norm(x, w1, b1, eps, residual) if residual is not None else (
            builtin_layer_norm(x, w1, b1, eps), x)
        ys = (y1, builtin_layer_norm(h, w2, b2, eps))
        if out_dtype is not None:
            ys = tuple(y.to(out_dtype) for y in ys)
        return (*ys, h) if residual is not None or skip else ys
    out = pt_layer_norm_pair(x, first, second, eps, residual, out_dtype)
    return (*out, x) if skip else out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    kernel: str = "auto",
    skip: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x [..., N]: y = h / sqrt(mean(h^2) + eps) * weight, h = x (+ residual).
    Returns y, or (y, h) when a residual is given, or (y, x) with skip; see layer_norm."""
    V.check_eps(eps)
    if _check(x, weight, None, residual, kernel, skip, out_dtype):
        from gem_kernels.ops.triton.triton_norms import triton_rms_norm

        return triton_rms_norm(x, weight, eps, residual, skip, out_dtype)
    if kernel == "builtin":
        y = builtin_rms_norm(x, weight, eps, residual)
    else:
        y = pt_rms_norm(x, weight, eps, residual, out_dtype)
    return _finish(x, y, skip, out_dtype)


def _finish(x, y, skip: bool, out_dtype: torch.dtype | None):
    """The unfused paths' result: y (first of ``(y, h)``) in ``out_dtype``, else x's (the builtin norms cast here:
    the RMS norm's product with a wider weight promotes; the references already wrote it), and x beside it with
    ``skip``."""
    dtype = out_dtype or x.dtype
    y = (y[0].to(dtype), y[1]) if isinstance(y, tuple) else y.to(dtype)
    return (y, x) if skip else y
