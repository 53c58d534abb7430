"""The plain-PyTorch way to run the ops: PyTorch's own attention (FlexAttention, ``varlen_attn``), unfused norms.

``kernel="builtin"`` routes here. It is the comparison point of our kernels, not a reference: it computes in
the inputs' dtype with PyTorch's fast built-ins, the way a model written without gem-kernels would.

- BlockAttention (softmax): FlexAttention over the packed tokens with a block mask built directly from the
  offsets (each 128-token query tile sees one contiguous run of key tiles), compiled on CUDA, eager elsewhere
  (forward only: FlexAttention has no backward on CPU, where training takes the reference).
- Softmax self / cross / PMA attention: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 varlen),
  which exists on CUDA only; elsewhere, and for shapes it cannot take (a kv_index), the exact reference.
- Pointwise cross attention (pFFN): queries padded to the declared maximum length and two batched matmuls,
  since no PyTorch attention op takes a pointwise activation.
- Everything else (pointwise self / PMA heads, mixed activations): the exact reference.
- LayerNorm / RMSNorm: ``torch.nn.functional.layer_norm`` / an unfused RMSNorm, with the residual added
  separately.
"""

from __future__ import annotations

import torch

from gem_kernels.jagged import segment_ids
from gem_kernels.ops.pytorch.pt_activations import pt_pointwise
from gem_kernels.ops.pytorch.pt_gdpa import pt_attention

FLEX_TILE = 128  # FlexAttention's default tile: the block mask is described at this granularity
_COMPILED: dict = {}


def compiled_on_cuda(fn, device: torch.device, dynamic: bool):
    """``fn`` compiled once per process on CUDA (where PyTorch's fast path is the compiled one); ``fn`` itself
    elsewhere."""
    if device.type != "cuda":
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=dynamic)
    return _COMPILED[fn]


def _flex_attention(device: torch.device):
    from torch.nn.attention.flex_attention import flex_attention

    return compiled_on_cuda(flex_attention, device, dynamic=False)


def block_key_ranges(offsets: torch.Tensor, total: int, block_size: int, window_blocks: int):
    """Per packed token ``t < total``: the half-open range ``[lo, hi)`` of packed key rows it sees under
    BlockAttention (its block and the ``window_blocks - 1`` blocks before it, within its own sequence)."""
    example = segment_ids(offsets[1:] - offsets[:-1], total)
    start, end = offsets[:-1][example], offsets[1:][example]
    block = (torch.arange(total, device=offsets.device) - start) // block_size
    lo = start + ((block - window_blocks + 1).clamp(min=0) * block_size)
    hi = torch.minimum(start + (block + 1) * block_size, end)
    return lo, hi


def jagged_block_mask(offsets: torch.Tensor, total: int, block_size: int, window_blocks: int):
    """FlexAttention ``BlockMask`` of BlockAttention over ``total`` packed tokens padded to a whole number of
    128-token tiles; returns ``(block_mask, padded_length)``.

    Key ranges are monotone in the packed row (both ends never decrease), so the keys a query tile needs are
    one contiguous run of key tiles, from the first row's ``lo`` to the last row's ``hi``: the block mask is
    built from that run directly (no mask evaluated over all T x T pairs), and ``mask_mod`` trims the
    partial tiles.
    """
    from torch.nn.attention.flex_attention import BlockMask

    device = offsets.device
    tiles = max(1, -(-total // FLEX_TILE))
    padded = tiles * FLEX_TILE
    lo, hi = block_key_ranges(offsets, total, block_size, window_blocks)
    # padded rows see nothing: lo = hi = 0
    lo = torch.nn.functional.pad(lo, (0, padded - total))
    hi = torch.nn.functional.pad(hi, (0, padded - total))
    first = torch.arange(tiles, device=device) * FLEX_TILE
    last = (first + FLEX_TILE).clamp(max=total) - 1
    real = first < total
    tile_lo = lo[first] // FLEX_TILE
    tile_hi = (hi[last.clamp(min=0)] - 1).clamp(min=0) // FLEX_TILE
    max_tiles = (FLEX_TILE + (window_blocks + 1) * block_size) // FLEX_TILE + 2
    count = torch.where(real, tile_hi - tile_lo + 1, torch.zeros_like(tile_lo)).clamp(max=max_tiles)
    # NOTE: FlexAttention wants one index slot per kv tile (it transposes through a dense tile matrix); only
    # the first `count` slots are read
    indices = (tile_lo[:, None] + torch.arange(tiles, device=device)[None, :]).clamp(max=tiles - 1)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= lo[q_idx]) & (kv_idx < hi[q_idx])

    block_mask = BlockMask.from_kv_blocks(
        count.to(torch.int32)[None, None], indices.to(torch.int32)[None, None], BLOCK_SIZE=FLEX_TILE,
        mask_mod=mask_mod, seq_lengths=(padded, padded),
    )
    return block_mask, padded


def flex_block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, block_size: int,
    window_blocks: int, sm_scale: float,
) -> torch.Tensor:
    """Softmax BlockAttention through FlexAttention on the packed ``[T, H, D]`` tokens (the block mask of
    ``jagged_block_mask``); returns ``[T, H, D]``."""
    T = q.shape[0]
    block_mask, padded = jagged_block_mask(offsets, T, block_size, window_blocks)
    pad = padded - T

    def packed(x):
        return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1)[None]  # [1, H, padded, D]

    out = _flex_attention(q.device)(packed(q), packed(k), packed(v), block_mask=block_mask, scale=sm_scale)
    return out[0].transpose(0, 1)[:T]


def varlen_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_softmax(q, k, v, q_offsets, kv_offsets, max_q, max_kv, sm_scale, window=(-1, -1)) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, q_offsets.to(torch.int32), kv_offsets.to(torch.int32), max_q, max_kv,
                       scale=sm_scale, window_size=window)


def padded_pointwise_cross(q, k, v, q_offsets, kv_offsets, max_q, max_kv, activation, pw_scale) -> torch.Tensor:
    """``O_t = pw_scale * sum_j act(q_t . k_j) v_j`` over each example's short kv, as batched matmuls on queries
    padded to ``max_q`` (the padded rows are computed and thrown away: the cost of padding)."""
    from gem_kernels.ops.pytorch.pt_gdpa import _from_padded

    q_len = q_offsets[1:] - q_offsets[:-1]
    k_start, k_len = kv_offsets[:-1], kv_offsets[1:] - kv_offsets[:-1]

    def pad(x, starts, lengths, m):  # [T, H, D] -> [B, H, m, D] in x's dtype, zeros past each length
        pos = torch.arange(m, device=x.device)
        valid = pos[None, :] < lengths[:, None]
        rows = (starts[:, None] + pos[None, :]).clamp(0, max(x.shape[0] - 1, 0))
        # where, not a product with the mask: the padding gathers other sequences' rows, and NaN * 0 is NaN
        return torch.where(valid[:, :, None, None], x[rows], 0.0).permute(0, 2, 1, 3)

    qp = pad(q, q_offsets[:-1], q_len, max_q)
    kp, vp = pad(k, k_start, k_len, max_kv), pad(v, k_start, k_len, max_kv)
    scores = qp @ kp.transpose(-1, -2)  # [B, H, max_q, max_kv]
    visible = torch.arange(max_kv, device=q.device)[None, :] < k_len[:, None]  # [B, max_kv]
    p = pt_pointwise(activation, scores) * visible[:, None, None, :].to(scores.dtype) * pw_scale
    out = (p @ vp).permute(0, 2, 1, 3)  # [B, max_q, H, D]
    return _from_padded(out, q_offsets, q.shape[0]).to(q.dtype)


def builtin_attention(
    q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, activations, sm_scale, pw_scale, *,
    kv_index=None, window_left=None, window_right=None, block_size=None, window_blocks=None,
) -> torch.Tensor:
    """Same contract as ``pt_attention``; see the module docstring for what runs where."""
    acts = list(activations)
    all_softmax = all(a == "softmax" for a in acts)
    self_mode = q_offsets is not None and kv_offsets is q_offsets
    # NOTE: FlexAttention has no backward on CPU, so training there takes the reference
    flex_ok = q.device.type == "cuda" or not (q.requires_grad or k.requires_grad or v.requires_grad)
    if block_size is not None:
        if all_softmax and window_left is None and window_right is None and flex_ok:
            return flex_block_attention(q, k, v, q_offsets, block_size, window_blocks, sm_scale)
    elif all_softmax and kv_index is None and varlen_available(q.device):
        if q_offsets is None:  # PMA: the learned queries repeated per kv sequence
            B, nq = kv_offsets.shape[0] - 1, q.shape[0]
            q_rep = q[None].expand(B, *q.shape).reshape(B * nq, *q.shape[1:])
            q_off = torch.arange(0, (B + 1) * nq, nq, device=q.device)
            out = varlen_softmax(q_rep, k, v, q_off, kv_offsets, nq, max_seq_len_kv, sm_scale)
            return out.view(B, nq, *q.shape[1:])
        if self_mode or (window_left is None and window_right is None):
            window = (-1 if window_left is None else window_left, -1 if window_right is None else window_right)
            return varlen_softmax(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, sm_scale, window)
    elif (q_offsets is not None and not self_mode and kv_index is None and len(set(acts)) == 1
          and not all_softmax and window_left is None and window_right is None):
        return padded_pointwise_cross(q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, acts[0],
                                      pw_scale)
    return pt_attention(
        q, k, v, q_offsets, kv_offsets, max_seq_len_q, max_seq_len_kv, acts, sm_scale, pw_scale,
        kv_index=kv_index, window_left=window_left, window_right=window_right, block_size=block_size,
        window_blocks=window_blocks,
    )


def builtin_layer_norm(x, weight, bias, eps, residual=None):
    h = x if residual is None else (x + residual).to(x.dtype)
    y = torch.nn.functional.layer_norm(h, (h.shape[-1],), weight, bias, eps)
    return y if residual is None else (y, h)


def builtin_rms_norm(x, weight, eps, residual=None):
    h = x if residual is None else (x + residual).to(x.dtype)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight
    return y if residual is None else (y, h)


__all__ = ["builtin_attention", "builtin_layer_norm", "builtin_rms_norm", "block_key_ranges",
           "flex_block_attention", "jagged_block_mask", "padded_pointwise_cross", "varlen_available"]
