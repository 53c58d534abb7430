"""Exact reference of the rotary embedding: float32 math, the result in the input's dtype."""

from __future__ import annotations

import torch


def rotary_frequencies(head_dim: int, base: float, device: torch.device) -> torch.Tensor:
    """``base ** (-2i / head_dim)`` for the ``head_dim / 2`` channel pairs ``(2i, 2i + 1)``; ``[D/2]`` float32."""
    return base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)


def pt_rotary(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate each channel pair ``(2i, 2i + 1)`` of ``x [T, H, D]`` by ``positions [T]`` times its frequency."""
    angles = positions.float()[:, None] * rotary_frequencies(x.shape[-1], base, x.device)[None, :]  # [T, D/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return rotated.to(x.dtype)
