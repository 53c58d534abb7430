"""ROTE: rotary position embedding whose positions are log(1 + time gap), not token indices.

Recommendation histories are irregular in time: two events a second apart and two a month apart are
equally "adjacent" by index. Rotating queries and keys by angles proportional to log(1 + gap) makes
attention scores depend on how far apart in time two events are, on a scale that resolves recent
events finely and old ones coarsely. The rotation itself is gem-kernels' ``rotary`` (one fused pass over q and k).
"""

from __future__ import annotations

import torch

from gem_kernels.jagged import segment_ids

# The rotation base is small because positions are log-gaps (0 to ~15), not indices in the thousands.
ROTE_BASE = 10.0


def time_gap_positions(timestamps: torch.Tensor, offsets: torch.Tensor, unit_seconds: float = 60.0) -> torch.Tensor:
    """``log(1 + gap / unit)`` per event, the gap measured back from the example's latest event; ``[T]`` float32."""
    lengths = offsets[1:] - offsets[:-1]
    example = segment_ids(lengths, timestamps.numel())
    latest = torch.full((lengths.numel(),), float("-inf"), device=timestamps.device, dtype=timestamps.dtype)
    latest = latest.scatter_reduce(0, example, timestamps, "amax", include_self=True)
    gap = (latest[example] - timestamps).clamp(min=0).float()
    return torch.log1p(gap / unit_seconds)
