"""Local self-attention over a jagged history: BlockAttention or a sliding window, with ROTE positions.

Recent events matter most and histories are long, so each event attends only to its neighbourhood: its own
block and a few blocks before it (``mode="block"``, cost linear in the length), or the events within
``window`` positions (``mode="window"``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from gem_kernels import block_attention, jagged_flash_attention, qkv_rotary_attention
from gem_kunlun.norm import LayerNorm
from gem_kunlun.rote import ROTE_BASE


class LocalAttention(nn.Module):
    """Pre-norm self-attention over a jagged sequence restricted to nearby events (blocks or a window).

    ``fp8``: the attention's Q, K and V in E4M3 (``gem_kernels``' ``fp8=True``; a low-precision recipe sets it)."""

    def __init__(self, dim: int, num_heads: int, mode: str, block_size: int, window_blocks: int, window: int,
                 rote: bool, kernel: str, device=None, fp8: bool = False) -> None:
        super().__init__()
        self.dim, self.num_heads, self.mode = dim, num_heads, mode
        self.block_size, self.window_blocks, self.window, self.rote, self.kernel = block_size, window_blocks, window, rote, kernel
        self.fp8 = fp8
        self.norm = LayerNorm(dim, kernel=kernel, device=device)
        self.qkv = nn.Linear(dim, 3 * dim, device=device)
        self.out = nn.Linear(dim, dim, device=device)

    def forward(self, seq: torch.Tensor, offsets: torch.Tensor, positions: torch.Tensor, max_len: int,
                pending: torch.Tensor | None = None, defer: bool = False):
        """``seq + update``; ``pending`` and ``defer`` as in ``PersonalizedFFN.forward``."""
        h, d = self.num_heads, self.dim // self.num_heads
        normed, seq = self.norm(seq, skip=True, pending=pending)
        qkv = self.qkv(normed).view(-1, 3, h, d)
        if self.rote:
            # NOTE: one call, so that on the GPU q and k are rotated inside the projection's buffer (which nothing
            # else reads) and its gradient is written whole by the attention's backward
            window = dict(block_size=self.block_size, window_blocks=self.window_blocks) if self.mode == "block" else \
                dict(window=self.window)
            o = qkv_rotary_attention(qkv, positions, offsets, max_len, ROTE_BASE, **window, kernel=self.kernel,
                                     validate=False, fp8=self.fp8)
        elif self.mode == "block":
            o = block_attention(*qkv.unbind(1), offsets, block_size=self.block_size, window_blocks=self.window_blocks,
                                max_seq_len=max_len, kernel=self.kernel, validate=False, fp8=self.fp8)
        else:
            o = jagged_flash_attention(*qkv.unbind(1), offsets, max_len, window=self.window, kernel=self.kernel,
                                       validate=False, fp8=self.fp8)
        update = self.out(o.reshape(-1, self.dim))
        return (seq, update) if defer else seq + update

    def visible_pairs(self, lengths: torch.Tensor) -> float:
        """Query-key pairs the attention computes over real tokens, in closed form per sequence (FLOP counting
        runs on the host every step: a pass over every position cost ~15 ms per layer on long histories)."""
        # NOTE: in NumPy: a NumPy op on a short array costs ~1 us, a torch op ~5 us, and this runs every step
        n = lengths.detach().to("cpu", torch.int64).numpy()
        if self.mode == "block":
            bs, wb = self.block_size, self.window_blocks
            full, rest = n // bs, n % bs
            # a full block b sees min(b + 1, window_blocks) blocks of keys; the last, partial block sees the
            # keys from the first block of its window to its own end
            seen = np.where(full <= wb, full * (full + 1) // 2, wb * (wb + 1) // 2 + (full - wb) * wb)
            last = rest * (n - np.maximum((full - wb + 1) * bs, 0))
            return float((bs * bs * seen + last).sum())
        w = self.window
        # query i sees keys max(0, i - w) .. min(n, i + w + 1)
        unclipped = np.maximum(n - w, 0)  # queries whose window ends inside the sequence
        upper = unclipped * (unclipped - 1) // 2 + unclipped * (w + 1) + (n - unclipped) * n
        over = np.maximum(n - 1 - w, 0)
        return float((upper - over * (over + 1) // 2).sum())

    def flops(self, lengths: torch.Tensor) -> float:
        tokens = float(lengths.sum())
        return 2.0 * self.dim * 4 * self.dim * tokens + 4.0 * self.dim * self.visible_pairs(lengths)
