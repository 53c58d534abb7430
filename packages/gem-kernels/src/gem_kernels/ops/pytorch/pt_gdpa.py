"""Reference generalized dot-product attention over jagged tensors (the core every attention op reduces to).

Everything is padded to the declared maximum lengths and computed in fp32 with an explicit boolean mask, so the
function is obviously correct and sync-free (it also compiles with ``torch.compile``). Masked entries are
excluded exactly; a query with no visible key outputs 0.
"""

from __future__ import annotations

import torch

from gem_kernels.jagged import segment_ids
from gem_kernels.ops.pytorch.pt_activations import pt_pointwise

_MASKED = -1.0e30  # finite, so a fully masked row gives a uniform (then zeroed) softmax instead of NaN


def _to_padded(values: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """[T, H, D] rows starts[b] + p for p < lengths[b] -> [B, max_len, H, D] in fp32, zeros elsewhere."""
    B = starts.shape[0]
    if values.shape[0] == 0:
        # NOTE: zeros plus a sum over no rows, not new_zeros: the result stays in values' autograd graph, so what made
        # values (a projection's weights) gets a zero gradient rather than none, as on a rank holding rows
        return values.new_zeros(B, max_len, *values.shape[1:], dtype=torch.float32) + values.float().sum()
    pos = torch.arange(max_len, device=values.device)
    valid = pos[None, :] < lengths[:, None]
    idx = (starts[:, None] + pos[None, :]).clamp(0, values.shape[0] - 1)
    # NOTE: where, not a product with the mask: the padding gathers other sequences' rows, and NaN * 0 is NaN.
    # Converted before the gather: the gather's backward sums the gradient of rows read by several sequences (kv
    # sequences shared through kv_index), which in a 16-bit dtype rounds at every addition (~3% off at 700 readers)
    return torch.where(valid[:, :, None, None], values.float()[idx], 0.0)


def _from_padded(padded: torch.Tensor, offsets: torch.Tensor, total: int) -> torch.Tensor:
    tok = torch.arange(total, device=padded.device)
    b = segment_ids(offsets[1:] - offsets[:-1], total)
    return padded[b, tok - offsets[b]]


def attention_mask(
    q_len: torch.Tensor,
    k_len: torch.Tensor,
    max_q: int,
    max_k: int,
    window_left: int | None,
    window_right: int | None,
    block_size: int | None,
    window_blocks: int | None,
) -> torch.Tensor:
    """[B, max_q, max_k] bool: key j is visible to query i."""
    dev = q_len.device
    i = torch.arange(max_q, device=dev)[:, None]
    j = torch.arange(max_k, device=dev)[None, :]
    allowed = (i < q_len[:, None, None]) & (j < k_len[:, None, None])
    if block_size is not None:
        bi, bj = i // block_size, j // block_size
        allowed = allowed & (bj <= bi) & (bj > bi - window_blocks)
    if window_left is not None:
        allowed = allowed & (j >= i - window_left)
    if window_right is not None:
        allowed = allowed & (j <= i + window_right)
    return allowed


def pt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    kv_offsets: torch.Tensor,
    max_seq_len_q: int,
    max_seq_len_kv: int,
    activations: list[str],
    sm_scale: float,
    pw_scale: float,
    kv_index: torch.Tensor | None = None,
    window_left: int | None = None,
    window_right: int | None = None,
    block_size: int | None = None,
    window_blocks: int | None = None,
) -> torch.Tensor:
    """General reference. q is jagged [Tq, H, D] with q_offsets [B+1], or (q_offsets=None) [Nq, H, D]
    broadcast to every kv sequence. k, v: [Tk, H, D] with kv_offsets [R+1]; example b reads kv sequence
    kv_index[b] (default b). activations has one name per head; softmax heads compute
    softmax(sm_scale * q.k) v, pointwise heads pw_scale * sum_j act(q.k_j) v_j. Returns [Tq, H, D] or
    [B, Nq, H, D] (broadcast queries), in q's dtype."""
    H = q.shape[1]
    if q_offsets is None:
        B = kv_offsets.shape[0] - 1 if kv_index is None else kv_index.shape[0]
        Nq = q.shape[0]
        q_pad = q.float()[None].expand(B, Nq, H, q.shape[2])
        q_len = torch.full((B,), Nq, device=q.device, dtype=torch.int64)
        max_q = Nq
    else:
        B = q_offsets.shape[0] - 1
        q_len = q_offsets[1:] - q_offsets[:-1]
        max_q = max_seq_len_q
        q_pad = _to_padded(q, q_offsets[:-1], q_len, max_q)
    kv_b = torch.arange(B, device=q.device) if kv_index is None else kv_index
    k_start = kv_offsets[kv_b]
    k_len = kv_offsets[kv_b + 1] - k_start
    k_pad = _to_padded(k, k_start, k_len, max_seq_len_kv)
    v_pad = _to_padded(v, k_start, k_len, max_seq_len_kv)

    allowed = attention_mask(
        q_len, k_len, max_q, max_seq_len_kv, window_left, window_right, block_size, window_blocks
    )[:, None]  # [B, 1, Mq, Mk]
    s = torch.einsum("bihd,bjhd->bhij", q_pad, k_pad)
    probs = []
    for h, act in enumerate(activations):
        sh, ah = s[:, h : h + 1], allowed
        if act == "softmax":
            p = torch.softmax((sh * sm_scale).masked_fill(~ah, _MASKED), dim=-1)
            probs.append(p.masked_fill(~ah, 0.0))
        else:
            probs.append(pt_pointwise(act, sh).masked_fill(~ah, 0.0) * pw_scale)
    p = torch.cat(probs, dim=1)
    out = torch.einsum("bhij,bjhd->bihd", p, v_pad)
    if q_offsets is None:
        return out.to(q.dtype)
    return _from_padded(out, q_offsets, q.shape[0]).to(q.dtype)
