"""Generalized dot-product attention (GDPA): softmax or pointwise activations, self / cross / PMA modes."""

from __future__ import annotations

import torch

from gem_kernels.ops import _validation as V
from gem_kernels.ops._dispatch import default_sm_scale, resolve_activations, run_attention


def gdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    q_offsets: torch.Tensor | None,
    kv_offsets: torch.Tensor | None = None,
    *,
    activation: str | list[str] = "softmax",
    max_seq_len_q: int | None = None,
    max_seq_len_kv: int | None = None,
    kv_index: torch.Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    kernel: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """O_i = scale * sum_j act(q_i . k_j) v_j over jagged tensors, or softmax(scale * q_i . k) v for softmax.
    The mode follows from the arguments. Self: kv_offsets None, q/k/v [T, H, D] share q_offsets [B+1].
    Cross (pFFN): q [Tq, H, D] jagged by q_offsets [B+1], k/v [Tk, H, D] jagged by kv_offsets [R+1]; example b
    reads kv sequence kv_index[b] (kv_index [B] int64, default b with R == B), so one request's kv serves many
    candidates. PMA: q_offsets None and q [Nq, H, D] holds learned queries broadcast to every kv sequence;
    returns [R, Nq, H, D] (otherwise [Tq, H, D]). activation: one of softmax, gelu, gelu_tanh, gelu_taylor6
    (polynomial, for bounded inputs), silu, relu, relu2, identity, or a list with one per head. window=W keeps
    |i - j| <= W, causal keeps j <= i (positions within each sequence). scale defaults to 1/sqrt(D) for softmax
    (inside the softmax) and 1/max_seq_len_kv for pointwise heads (outside the sum). max_seq_len_q / _kv bound
    the lengths and size the kernel grid; None reads them from the offsets (one device sync). kernel and
    validate are as in jagged_flash_attention. k and v may come packed as one fused key-value projection: k
    ``[Tk, 2, H, D]`` (k, v its slots) and v None; the Triton backward then writes their gradient in one buffer."""
    V.check_kernel(kernel)
    packed = None
    if v is None:
        V.check_values("k", k, 4, "[Tk, 2, H, D] with v None")
        if k.shape[1] != 2:
            raise ValueError(f"k packed with v (v None) must be [Tk, 2, H, D], got {tuple(k.shape)}")
        packed = k
        k, v = packed.unbind(1)
    for name, t in (("q", q), ("k", k), ("v", v)):
        V.check_values(name, t, 3, "[T, H, D]" if name != "q" or q_offsets is not None else "[Nq, H, D]")
    V.check_same(["q", "k", "v"], [q, k, v])
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[1:] != k.shape[1:]:
        raise ValueError(f"q and k must agree on [H, D], got {tuple(q.shape[1:])} and {tuple(k.shape[1:])}")
    V.check_window(window)
    V.check_scale(scale)
    acts = resolve_activations(activation, q.shape[1])

    if q_offsets is None:  # PMA
        if kv_offsets is None:
            raise ValueError("kv_offsets is required when q_offsets is None (broadcast queries, PMA)")
        if kv_index is not None:
            raise ValueError("kv_index is only supported with jagged queries (q_offsets given)")
        if q.shape[0] < 1:
            raise ValueError("q must hold at least one broadcast query (PMA)")
    else:
        V.check_offsets_meta("q_offsets", q_offsets, q.device)
    self_mode = kv_offsets is None
    if self_mode:
        if kv_index is not None:
            raise ValueError("kv_index needs kv_offsets (cross attention)")
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"self attention (kv_offsets None) needs k with q's {q.shape[0]} rows, "
                             f"got {k.shape[0]}")
        kv_offsets = q_offsets
    else:
        V.check_offsets_meta("kv_offsets", kv_offsets, q.device)
    if kv_index is not None:
        if not isinstance(kv_index, torch.Tensor) or kv_index.dim() != 1 or kv_index.dtype != torch.int64:
            raise ValueError("kv_index must be a 1-D int64 tensor with one kv sequence id per example")
        if kv_index.device != q.device:
            raise ValueError(f"kv_index is on {kv_index.device} but q is on {q.device}")
        if kv_index.shape[0] != q_offsets.shape[0] - 1:
            raise ValueError(f"kv_index has {kv_index.shape[0]} entries but q_offsets holds "
                             f"{q_offsets.shape[0] - 1} examples")
    elif q_offsets is not None and not self_mode and kv_offsets.shape[0] != q_offsets.shape[0]:
        raise ValueError(f"kv_offsets holds {kv_offsets.shape[0] - 1} sequences but q_offsets "
                         f"{q_offsets.shape[0] - 1}; pass kv_index to map examples to kv sequences")
    for name, val in (("max_seq_len_q", max_seq_len_q), ("max_seq_len_kv", max_seq_len_kv)):
        if val is not None:
            V.check_max_len(name, val)

    if q_offsets is not None and (validate or max_seq_len_q is None):
        real = V.check_offsets_values("q_offsets", q_offsets, q.shape[0], max_seq_len_q, "max_seq_len_q")
        if self_mode:  # the keys share q_offsets: their longest sequence is the queries' one
            V.check_max_len_covers("max_seq_len_kv", max_seq_len_kv, real)
        max_seq_len_q = max_seq_len_q or max(real, 1)
    if self_mode:
        max_seq_len_kv = max_seq_len_kv or max_seq_len_q
    elif validate or max_seq_len_kv is None:
        real = V.check_offsets_values("kv_offsets", kv_offsets, k.shape[0], max_seq_len_kv, "max_seq_len_kv")
        max_seq_len_kv = max_seq_len_kv or max(real, 1)
    if validate and kv_index is not None and kv_index.numel() > 0:
        lo, hi = torch.stack([kv_index.min(), kv_index.max()]).tolist()
        if lo < 0 or hi >= kv_offsets.shape[0] - 1:
            raise ValueError(f"kv_index values must lie in [0, {kv_offsets.shape[0] - 1}), got [{lo}, {hi}]")
    max_q = q.shape[0] if q_offsets is None else max_seq_len_q

    sm_scale = default_sm_scale(q.shape[2]) if scale is None else scale
    pw_scale = 1.0 / max_seq_len_kv if scale is None else scale
    return run_attention(
        q, k, v, q_offsets, kv_offsets, kv_index, max_q=max_q, max_kv=max_seq_len_kv, activations=acts,
        sm_scale=sm_scale, pw_scale=pw_scale, kernel=kernel, window_left=window,
        window_right=0 if causal else window, kv=packed,
    )
