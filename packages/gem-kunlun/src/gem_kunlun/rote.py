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


def time_gap_positions(timestamps: torch.Tensor, offsets: torch.Tensor, unit_seconds: float = 60.0,
                       in_time_order: bool = False) -> torch.Tensor:
    """``log(1 + gap / unit)`` per event, the gap measured back from the example's latest event; ``[T]`` float32.
    ``in_time_order``: every example's events are known to be in time order (as a merge leaves them), so its
    latest is its last; otherwise the latest is searched for (a scatter of every event onto its example, whose
    atomics on a few hundred rows cost ~0.3 ms at 500,000 events on an H200)."""
    lengths = offsets[1:] - offsets[:-1]
    example = segment_ids(lengths, timestamps.numel())
    if in_time_order:
        if timestamps.numel() == 0:
            return timestamps.new_zeros(0, dtype=torch.float32)
        latest = timestamps[(offsets[1:] - 1).clamp(min=0)]  # an empty example's entry is never read
    else:
        latest = torch.full((lengths.numel(),), float("-inf"), device=timestamps.device, dtype=timestamps.dtype)
        latest = latest.scatter_reduce(0, example, timestamps, "amax", include_self=True)
    gap = (latest[example] - timestamps).clamp(min=0).float()
    return torch.log1p(gap / unit_seconds)
