"""BlockAttention: self-attention in fixed token blocks, each block seeing itself and a few blocks before it."""

from __future__ import annotations

import torch

from gem_kernels.ops import _validation as V
from gem_kernels.ops._dispatch import default_sm_scale, resolve_activations, run_attention


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    block_size: int = 64,
    window_blocks: int = 1,
    activation: str | list[str] = "softmax",
    max_seq_len: int | None = None,
    scale: float | None = None,
    kernel: str = "auto",
    validate: bool = True,
    fp8: bool = False,
) -> torch.Tensor:
    """Each sequence is cut into blocks of block_size tokens (the last one may be short); every token of block
    i attends to every token of blocks i-window_blocks+1..i (window_blocks=1: independent blocks), so the cost is
    linear in the sequence length. q, k, v: [T, H, D], offsets: [B+1] int64. activation as in gdpa (softmax or
    pointwise, or one per head); scale defaults to 1/sqrt(D) for softmax and 1/(block_size * window_blocks)
    for pointwise heads. max_seq_len bounds the lengths (None: read from offsets, one sync). Returns
    [T, H, D]. fp8=True: softmax heads only, FP8 operands as in jagged_flash_attention."""
    V.check_kernel(kernel)
    V.check_self_qkv(q, k, v)
    V.check_offsets_meta("offsets", offsets, q.device)
    V.check_positive_int("block_size", block_size)
    V.check_positive_int("window_blocks", window_blocks)
    V.check_scale(scale)
    if max_seq_len is not None:
        V.check_max_len("max_seq_len", max_seq_len)
    acts = resolve_activations(activation, q.shape[1])
    if fp8 and any(a != "softmax" for a in acts):
        raise ValueError(f"block_attention fp8=True takes softmax heads only, got {list(acts)}")
    if validate or max_seq_len is None:
        real = V.check_offsets_values("offsets", offsets, q.shape[0], max_seq_len, "max_seq_len")
        max_seq_len = max_seq_len or max(real, 1)
    sm_scale = default_sm_scale(q.shape[2]) if scale is None else scale
    pw_scale = 1.0 / (block_size * window_blocks) if scale is None else scale
    return run_attention(
        q, k, v, offsets, offsets, None, max_q=max_seq_len, max_kv=max_seq_len, activations=acts,
        sm_scale=sm_scale, pw_scale=pw_scale, kernel=kernel, block_size=block_size, window_blocks=window_blocks,
        fp8=fp8,
    )
