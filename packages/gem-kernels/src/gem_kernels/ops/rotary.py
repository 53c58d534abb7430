"""Rotary position embedding of queries and keys over packed (jagged) tokens, at arbitrary real positions."""

from __future__ import annotations

import math

import torch

from gem_kernels.ops import _validation as V
from gem_kernels.ops.pytorch.builtin import compiled_on_cuda
from gem_kernels.ops.pytorch.pt_rotary import pt_rotary


def _check_positions(positions, q: torch.Tensor, base) -> None:
    if not isinstance(positions, torch.Tensor) or positions.shape != q.shape[:1]:
        raise ValueError(f"positions must be a tensor of shape [{q.shape[0]}] (one per token), got "
                         f"{tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__}")
    if positions.device != q.device or not positions.is_floating_point():
        raise ValueError(f"positions must be a floating tensor on {q.device}, got {positions.dtype} on {positions.device}")
    if positions.requires_grad:
        raise ValueError("positions require grad, but the rotary embedding treats them as data (detach them)")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 1:
        raise ValueError(f"base must be a finite number > 1, got {base!r}")


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, base: float = 10.0,
           kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate each channel pair ``(2i, 2i + 1)`` of every head of ``q`` and ``k [T, H, D]`` (D even) by the angle
    ``positions[t] * base ** (-2i / D)``; returns ``(q_rotated, k_rotated)`` in the inputs' dtype (math in
    float32). Positions are real numbers (e.g. log time gaps), not necessarily token indices, and are treated as
    data: no gradient flows to them. q and k may be strided views with unit stride in the last dimension.
    kernel: "triton", "pytorch", "auto" (Triton on CUDA) or "builtin" (the reference's ops, compiled on CUDA)."""
    V.check_kernel(kernel)
    for name, t in (("q", q), ("k", k)):
        V.check_values(name, t, 3, "[T, H, D]")
    V.check_same(["q", "k"], [q, k])
    if k.shape != q.shape:
        raise ValueError(f"q and k must have the same shape [T, H, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[-1] % 2:
        raise ValueError(f"rotary embedding needs an even head dim, got {q.shape[-1]}")
    _check_positions(positions, q, base)
    if V.use_triton(kernel, q.device) and q.shape[0] > 0:
        V.check_triton_device("q", q)
        from gem_kernels.ops.triton.triton_rotary import triton_rotary

        return triton_rotary(q, k, positions, float(base))
    # builtin: the plain-PyTorch way, the reference's ops compiled into fused kernels on CUDA
    reference = compiled_on_cuda(pt_rotary, q.device, dynamic=True) if kernel == "builtin" else pt_rotary
    return reference(q, positions, base), reference(k, positions, base)


def qkv_rotary(qkv: torch.Tensor, positions: torch.Tensor, base: float = 10.0,
               kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused projection's output ``qkv [T, 3, H, D]`` -> ``(rotary(q), rotary(k), v)``, each ``[T, H, D]``
    contiguous (what the attention kernels read). The Triton path does it in one pass and writes the
    projection's gradient in one pass (rotation undone, v's gradient beside it); the result equals ``rotary``
    on ``qkv.unbind(1)``. kernel: as for ``rotary``."""
    V.check_kernel(kernel)
    V.check_values("qkv", qkv, 4, "[T, 3, H, D]")
    if qkv.shape[1] != 3 or qkv.shape[-1] % 2:
        raise ValueError(f"qkv must be [T, 3, H, D] with an even head dim D, got {tuple(qkv.shape)}")
    _check_positions(positions, qkv, base)
    if V.use_triton(kernel, qkv.device) and qkv.shape[0] > 0:
        V.check_triton_device("qkv", qkv)
        from gem_kernels.ops.triton.triton_rotary import triton_qkv_rotary

        return triton_qkv_rotary(qkv, positions, float(base))
    q, k, v = qkv.unbind(1)
    return (*rotary(q, k, positions, base, kernel), v.contiguous())  # not a view of qkv: as the Triton path's
