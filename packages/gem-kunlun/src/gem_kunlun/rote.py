"""ROTE: rotary position embedding whose positions are log(1 + time gap), not token indices.

Recommendation histories are irregular in time: two events a second apart and two a month apart are
equally "adjacent" by index. Rotating queries and keys by angles proportional to log(1 + gap) makes
attention scores depend on how far apart in time two events are, on a scale that resolves recent
events finely and old ones coarsely.
"""

from __future__ import annotations

import torch

from gem_kernels.jagged import segment_ids


def time_gap_positions(timestamps: torch.Tensor, offsets: torch.Tensor, unit_seconds: float = 60.0) -> torch.Tensor:
    """``log(1 + gap / unit)`` per event, the gap measured back from the example's latest event; ``[T]`` float32."""
    lengths = offsets[1:] - offsets[:-1]
    example = segment_ids(lengths, timestamps.numel())
    latest = torch.full((lengths.numel(),), float("-inf"), device=timestamps.device, dtype=timestamps.dtype)
    latest = latest.scatter_reduce(0, example, timestamps, "amax", include_self=True)
    gap = (latest[example] - timestamps).clamp(min=0).float()
    return torch.log1p(gap / unit_seconds)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, base: float = 10.0) -> torch.Tensor:
    """Rotate pairs of channels of ``x [T, H, D]`` (D even) by ``positions [T]`` times per-pair frequencies.

    The base is small because positions are log-gaps (0 to ~15), not indices in the thousands.
    """
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rotary embedding needs an even head dim, got {d}")
    freqs = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)  # [D/2]
    angles = positions.float()[:, None] * freqs[None, :]  # [T, D/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    rotated = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return rotated.to(x.dtype)
