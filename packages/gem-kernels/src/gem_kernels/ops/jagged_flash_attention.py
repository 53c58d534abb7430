"""Jagged flash attention (JFA): softmax self-attention over jagged sequences."""

from __future__ import annotations

import torch

from gem_kernels.ops import _validation as V
from gem_kernels.ops._dispatch import default_sm_scale, run_attention


def jagged_flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    kernel: str = "auto",
    validate: bool = True,
    fp8: bool = False,
) -> torch.Tensor:
    """Softmax attention within each sequence of a jagged batch. q, k, v: [T, H, D] (fp16/bf16/fp32, same
    dtype and device), offsets: [B+1] int64 with sequence b at rows offsets[b]:offsets[b+1], max_seq_len: an
    upper bound on the lengths (sizes the kernel grid). causal keeps keys j <= i; window=W keeps |i - j| <= W
    (with causal: i - W <= j <= i). scale defaults to 1/sqrt(D). kernel: "triton", "pytorch" (the exact fp32
    reference) or "auto" (Triton on CUDA, the reference elsewhere). validate=False skips the offset value checks,
    which cost one device sync: offsets that would fail them are then undefined behaviour (the kernels may read out
    of bounds or leave rows unwritten). fp8=True: Q, K and V in E4M3 with per-token (Q, K) and per-channel (V) power-of-two
    scales, the forward on FP8 tensor cores; the backward is the exact gradient at the quantised operands (kept in
    FP8 between the passes, the quantiser passing gradients through unchanged; see
    gem_kernels.ops.triton.triton_fp8_attention); its "pytorch" twin runs the reference on the dequantised
    operands. Returns [T, H, D] in q's dtype."""
    V.check_kernel(kernel)
    V.check_self_qkv(q, k, v)
    V.check_offsets_meta("offsets", offsets, q.device)
    V.check_max_len("max_seq_len", max_seq_len)
    V.check_window(window)
    V.check_scale(scale)
    if validate:
        V.check_offsets_values("offsets", offsets, q.shape[0], max_seq_len, "max_seq_len")
    return run_attention(
        q, k, v, offsets, offsets, None, max_q=max_seq_len, max_kv=max_seq_len,
        activations=("softmax",) * q.shape[1], sm_scale=default_sm_scale(q.shape[2]) if scale is None else scale,
        pw_scale=1.0, kernel=kernel, window_left=window, window_right=0 if causal else window, fp8=fp8,
    )
