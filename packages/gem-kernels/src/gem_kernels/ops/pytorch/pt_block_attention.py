"""Reference block attention: tokens in block i see every token of blocks i-window_blocks+1..i."""

from __future__ import annotations

import torch

from gem_kernels.ops.pytorch.pt_gdpa import pt_attention


def pt_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    block_size: int,
    window_blocks: int,
    activations: list[str],
    sm_scale: float,
    pw_scale: float,
) -> torch.Tensor:
    return pt_attention(
        q, k, v, offsets, offsets, max_seq_len, max_seq_len, activations, sm_scale, pw_scale,
        block_size=block_size, window_blocks=window_blocks,
    )
