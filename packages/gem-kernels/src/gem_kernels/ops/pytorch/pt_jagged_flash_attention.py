"""Reference jagged softmax attention (self-attention, optional causal mask and window)."""

from __future__ import annotations

import torch

from gem_kernels.ops.pytorch.pt_gdpa import pt_attention


def pt_jagged_flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    causal: bool,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    return pt_attention(
        q, k, v, offsets, offsets, max_seq_len, max_seq_len, ["softmax"] * q.shape[1], scale, 1.0,
        window_left=window, window_right=0 if causal else window,
    )
