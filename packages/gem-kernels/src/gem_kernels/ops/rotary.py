"""Rotary position embedding of queries and keys over packed (jagged) tokens, at arbitrary real positions."""

from __future__ import annotations

import torch

from gem_kernels.ops import _validation as V
from gem_kernels.ops.pytorch.builtin import compiled_on_cuda
from gem_kernels.ops.pytorch.pt_rotary import pt_rotary


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
    if not isinstance(positions, torch.Tensor) or positions.shape != q.shape[:1]:
        raise ValueError(f"positions must be a tensor of shape [{q.shape[0]}] (one per token), got "
                         f"{tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__}")
    if positions.device != q.device or not positions.is_floating_point():
        raise ValueError(f"positions must be a floating tensor on {q.device}, got {positions.dtype} on {positions.device}")
    if positions.requires_grad:
        raise ValueError("positions require grad, but the rotary embedding treats them as data (detach them)")
    if not (isinstance(base, (int, float)) and base > 1):
        raise ValueError(f"base must be a number > 1, got {base!r}")
    if V.use_triton(kernel, q.device) and q.shape[0] > 0:
        V.check_triton_device("q", q)
        from gem_kernels.ops.triton.triton_rotary import triton_rotary

        return triton_rotary(q, k, positions, float(base))
    # builtin: the plain-PyTorch way, the reference's ops compiled into fused kernels on CUDA
    reference = compiled_on_cuda(pt_rotary, q.device, dynamic=True) if kernel == "builtin" else pt_rotary
    return reference(q, positions, base), reference(k, positions, base)
