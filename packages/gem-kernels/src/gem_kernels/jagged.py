"""Index plumbing of jagged tensors (``values [T, ...]`` + ``offsets [B+1]``), shared by the references here and
by the models above."""

from __future__ import annotations

import torch


def segment_ids(lengths: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``[T]`` int64: the sequence each row of a jagged tensor belongs to, for sequence ``lengths [B]``
    (``T = lengths.sum()``; empty sequences own no row). Pass ``total = T`` when it is known: the size is
    otherwise read from the device (one sync)."""
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=total)


def segment_positions(lengths: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """``[T]`` int64: each row's position within its sequence (0, 1, ... per sequence), for ``lengths [B]``."""
    starts = torch.cumsum(lengths, 0) - lengths
    owner = segment_ids(lengths, total)
    return torch.arange(owner.numel(), device=lengths.device) - starts[owner]
