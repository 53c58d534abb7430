"""Triton kernels shared by JFA, GDPA and BlockAttention.

One forward kernel and two backward kernels (dQ per query tile, which also computes the softmax's ``delta`` for
the dK/dV kernel launched after it, dK/dV per key tile; no atomics, so the backward is deterministic) cover every
attention op of the package:

- queries are jagged (``Q_JAGGED``) or a few broadcast rows (PMA, ``NQ`` rows shared by every example);
- example ``b`` reads kv sequence ``KV_IDX[b]`` (cross attention where one request serves many candidates);
- the visible keys of query ``i`` are one interval ``[lo(i), hi(i)]`` whose ends never decrease with ``i``:
  a window ``[i - Wl, i + Wr]`` (``MASK_KIND=0``; full or causal attention are windows) or whole blocks
  (``MASK_KIND=1``: the ``KB`` blocks of ``BS`` tokens ending at ``i``'s block).

Shapes where every query sees one key tile whole (short kv sequences, independent blocks) or all queries fit one
tile (PMA) also have kernels of their own, which stream tiles through what stays loaded and take the whole backward
in one launch (PMA's per-example dQ partials are then summed by ``triton_sum_rows``).

The general kernels' grids run over the real tiles (``COMPACT``): program ``i`` finds its sequence and tile from the
offsets (``_real_tile``), so a batch of few long sequences among short ones launches no programs that exit at once
(a grid sized by the declared max length launched ~6x the real tiles on the benchmark's batches).
Otherwise a grid numbers each sequence's declared tiles on axis 0 and the sequences on axis 1, or, for batches of
more sequences than CUDA runs along axis 1 (65,535), the other way round (``SEQ_MAJOR``, ``_declared_tile``).

Because the interval is monotone, every (query tile, key tile) pair is classified once per program: tiles
outside the union of intervals are skipped, tiles inside every row's interval run without any mask, and only
the few boundary tiles apply a per-element mask (``tl.where`` to a large negative constant, never -inf).
Softmax heads keep a running max / sum and store the log-sum-exp (base 2) for the backward; pointwise heads
(``ACT > 0``) just accumulate ``act(q.k) v`` tile by tile.
"""

import triton
import triton.language as tl

# the score a masked pair gets (never -inf: a row that sees no key must not compute inf - inf), far below any real
# scaled score; a row whose running max stays under half of it saw no key
MASKED_SCORE = tl.constexpr(-1.0e30)

ACT_CODES = {
    "softmax": 0, "gelu": 1, "gelu_tanh": 2, "gelu_taylor6": 3, "silu": 4, "relu": 5, "relu2": 6, "identity": 7,
}


@triton.jit
def _tanh(x):
    # NOTE: tl has no portable tanh (libdevice is not available to the interpreter).
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 1:
        y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACT == 2:
        y = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    elif ACT == 3:
        x2 = x * x
        y = 0.5 * x + 0.3989422804014327 * x2 * (1.0 - x2 * 0.16666666666666666 + x2 * x2 * 0.025)
    elif ACT == 4:
        y = x * tl.sigmoid(x)
    elif ACT == 5:
        y = tl.maximum(x, 0.0)
    elif ACT == 6:
        y = tl.maximum(x, 0.0)
        y = y * y
    else:
        y = x
    return y


@triton.jit
def _act_grad(x, ACT: tl.constexpr):
    if ACT == 1:
        y = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    elif ACT == 2:
        t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
        y = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
    elif ACT == 3:
        x2 = x * x
        y = 0.5 + 0.3989422804014327 * x * (2.0 - x2 * 0.6666666666666666 + x2 * x2 * 0.15)
    elif ACT == 4:
        sg = tl.sigmoid(x)
        y = sg * (1.0 + x * (1.0 - sg))
    elif ACT == 5:
        y = tl.where(x > 0.0, 1.0, 0.0)
    elif ACT == 6:
        y = 2.0 * tl.maximum(x, 0.0)
    else:
        y = x * 0.0 + 1.0
    return y


@triton.jit
def _key_range(i, Wl, Wr, BS, KB, MASK_KIND: tl.constexpr):
    """Inclusive [lo, hi] of the key positions visible to query position i (i >= 0)."""
    if MASK_KIND == 0:
        lo = i - Wl
        hi = i + Wr
    else:
        blk = i // BS
        lo = (blk - KB + 1) * BS
        hi = (blk + 1) * BS - 1
    return lo, hi


@triton.jit
def _query_range(j, Wl, Wr, BS, KB, MASK_KIND: tl.constexpr):
    """Inclusive [lo, hi] of the query positions that see key position j (j >= 0)."""
    if MASK_KIND == 0:
        lo = j - Wr
        hi = j + Wl
    else:
        blk = j // BS
        lo = blk * BS
        hi = (blk + KB) * BS - 1
    return lo, hi


@triton.jit
def _segments(first_lo, last_hi, full_lo, full_hi, n, BLOCK: tl.constexpr):
    """Split the visible columns [first_lo, last_hi) of a row tile into masked / unmasked / masked tiles.

    full_lo / full_hi bound the columns visible to every row of the tile; all bounds are clamped to [0, n)
    before any division, so the integer divisions never see negative numbers (C and Python round those
    differently, and the interpreter runs Python's).
    """
    lo = tl.maximum(first_lo, 0)
    hi = tl.minimum(last_hi, n)
    lo_al = (lo // BLOCK) * BLOCK
    full_lo = tl.maximum(full_lo, 0)
    full_hi = tl.maximum(tl.minimum(full_hi, n), 0)
    fs = tl.minimum(tl.maximum(((full_lo + BLOCK - 1) // BLOCK) * BLOCK, lo_al), hi)
    fe = tl.maximum((full_hi // BLOCK) * BLOCK, fs)
    return lo_al, fs, fe, hi


@triton.jit
def _key_tiles(m0, q_len, k_len, Wl, Wr, BS, KB, MASK_KIND: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The key tiles of the query tile starting at m0, as ``_segments`` splits them."""
    m1 = tl.minimum(m0 + BLOCK_M, q_len)
    first_lo, full_hi = _key_range(m0, Wl, Wr, BS, KB, MASK_KIND)
    full_lo, last_hi = _key_range(m1 - 1, Wl, Wr, BS, KB, MASK_KIND)
    return _segments(first_lo, last_hi + 1, full_lo, full_hi + 1, k_len, BLOCK_N)


@triton.jit
def _visible(offs_m, offs_n, kmask, Wl, Wr, BS, KB, MASK_KIND: tl.constexpr):
    """[BLOCK_M, BLOCK_N]: key offs_n[j] lies in its sequence (kmask) and is visible to query offs_m[i]."""
    lo, hi = _key_range(offs_m, Wl, Wr, BS, KB, MASK_KIND)
    return (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] <= hi[:, None]) & kmask[None, :]


@triton.jit
def _load_rows(base, rows, stride_t, offs_d, mask, MASKED: tl.constexpr):
    """The [rows, BLOCK_D] tile of one head (``base`` points at its row 0), zeros where ``mask`` is off;
    MASKED=False loads tiles known to lie inside the sequence without a mask."""
    ptrs = base + rows[:, None] * stride_t + offs_d[None, :]
    if MASKED:
        x = tl.load(ptrs, mask=mask[:, None], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _load_cols(base, rows, stride_t, offs_d, mask, MASKED: tl.constexpr):
    """``_load_rows`` transposed: the [BLOCK_D, rows] tile, the operand of a product with rows as columns."""
    ptrs = base + rows[None, :] * stride_t + offs_d[:, None]
    if MASKED:
        x = tl.load(ptrs, mask=mask[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _store_rows(base, rows, stride_t, offs_d, x, mask):
    tl.store(base + rows[:, None] * stride_t + offs_d[None, :], x, mask=mask[:, None])


@triton.jit
def _load_softmax_stats(LSE_base, DELTA_base, rows, stride_lt, mask, MASKED: tl.constexpr):
    """A softmax head's log-sum-exp and ``delta = rowsum(dO * O)`` for ``rows``; rows outside the sequence get
    an LSE so large that ``exp2(s - lse)`` is 0 for them."""
    if MASKED:
        lse = tl.load(LSE_base + rows * stride_lt, mask=mask, other=1.0e30)
        delta = tl.load(DELTA_base + rows * stride_lt, mask=mask, other=0.0)
    else:
        lse = tl.load(LSE_base + rows * stride_lt)
        delta = tl.load(DELTA_base + rows * stride_lt)
    return lse, delta


@triton.jit
def _softmax_stats_from_o(LSE_base, O_base, do, rows, stride_lt, stride_ot, offs_d, mask):
    """As ``_load_softmax_stats``, with ``delta`` computed here from O's rows (laid out as dO's) instead of read
    from the pre-pass: for the few broadcast queries (PMA) that saves a launch the whole call would wait for."""
    lse = tl.load(LSE_base + rows * stride_lt, mask=mask, other=1.0e30)
    o = _load_rows(O_base, rows, stride_ot, offs_d, mask, True)
    return lse, tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)


@triton.jit
def _online_softmax(s, m_i, l_i, acc):
    """One key tile of the online softmax (scores in the log2 domain): the tile's probabilities against the new
    running max, and the running max, sum and output accumulator moved to it."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None]


@triton.jit
def _online_softmax_scaled(s, scale, m_i, l_i, acc):
    """``_online_softmax(s * scale, ...)`` for unmasked raw scores ``s`` and ``scale > 0``, one multiply per score
    fewer: the row max is taken before scaling (rounding is monotonic, so ``max(s) * scale`` is exactly the max of
    the scaled scores) and each exponent is one fused ``s * scale - max``, rounded once instead of twice."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * scale - m_new[:, None])
    return p, m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None]


@triton.jit
def _softmax_output(acc, m_i, l_i):
    """A softmax head's output rows and log-sum-exp (base 2) from its running max, sum and accumulator. A row that
    saw no visible key only ever met MASKED_SCORE: it outputs 0 and gets a huge LSE, so that the backward's
    ``exp2(s - lse)`` is exactly 0 for it.

    NOTE: a row that met a NaN score (a NaN query or key) has a NaN sum, and outputs NaN with a NaN LSE, as the
    reference. Its max cannot tell: ``tl.max`` drops NaNs (a NaN query's row keeps the mask value's max, and passed
    for a row that saw no key, with an output of 0)."""
    seen = (m_i > MASKED_SCORE * 0.5) | (l_i != l_i)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    return tl.where(seen[:, None], acc / l_safe[:, None], 0.0), tl.where(seen, m_i + tl.log2(l_safe), 1.0e30)


@triton.jit
def _row_tiles(A_base, B_base, A_desc, B_desc, a_row, b_row, h_col, offs, stride_a, stride_b, offs_d, mask, inside,
               TMA: tl.constexpr, MASKED: tl.constexpr):
    """Two ``[rows, D]`` tiles of the same rows (K and V, or Q and dO): through their descriptors (from rows ``a_row``
    and ``b_row``, head column ``h_col``) or pointer loads; a ``MASKED`` tile that is not ``inside`` its sequence has
    zeros in the rows outside ``mask``.

    NOTE: a descriptor load reads whole tiles. An unmasked tile lies inside its sequence, as do most masked ones (a
    causal diagonal, a window's edge, a whole diagonal block); the one that crosses the sequence's end reads another
    sequence's rows, and a non-finite one would reach this sequence's results through the zero probabilities that mask
    it (0 * inf = NaN): they are replaced by zeros after the load. Pointer loads of that tile instead (zeros past the
    end) made the JFA forward and forward+backward ~10% slower on an H100."""
    if TMA:
        a = A_desc.load([a_row, h_col])
        b = B_desc.load([b_row, h_col])
        if MASKED:
            if not inside:
                a = tl.where(mask[:, None], a, 0.0)
                b = tl.where(mask[:, None], b, 0.0)
    else:
        a = _load_rows(A_base, offs, stride_a, offs_d, mask, MASKED)
        b = _load_rows(B_base, offs, stride_b, offs_d, mask, MASKED)
    return a, b


@triton.jit
def _fwd_tiles(
    acc, m_i, l_i, q, K_base, V_base, K_desc, V_desc, desc_row, h_col, stride_kt, stride_vt, offs_m, offs_d, start,
    end, k_len, qk_scale, Wl, Wr, BS, KB,
    ACT: tl.constexpr, MASK_KIND: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    FOLD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kmask = offs_n < k_len
        k, v = _row_tiles(K_base, V_base, K_desc, V_desc, desc_row + n0, desc_row + n0, h_col, offs_n, stride_kt,
                          stride_vt, offs_d, kmask, n0 + BLOCK_N <= k_len, TMA, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        if MASKED:
            allowed = _visible(offs_m, offs_n, kmask, Wl, Wr, BS, KB, MASK_KIND)
        if ACT == 0:
            if FOLD and not MASKED:
                p, m_i, l_i, acc = _online_softmax_scaled(s, qk_scale, m_i, l_i, acc)
            else:
                s = s * qk_scale
                if MASKED:
                    s = tl.where(allowed, s, MASKED_SCORE)
                p, m_i, l_i, acc = _online_softmax(s, m_i, l_i, acc)
        else:
            p = _act(s, ACT)
            if MASKED:
                p = tl.where(allowed, p, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
    return acc, m_i, l_i


@triton.jit
def _q_rows(Q_OFF, b, NQ, Q_JAGGED: tl.constexpr):
    """Example b's queries: first row in Q, count, first row of its outputs. Broadcast queries (PMA) are the
    NQ rows of Q, shared, with outputs of their own per example."""
    if Q_JAGGED:
        q_start = tl.load(Q_OFF + b)
        q_len = (tl.load(Q_OFF + b + 1) - q_start).to(tl.int32)
        o_start = q_start
    else:
        q_start = tl.full([], 0, tl.int64)
        q_len = NQ
        o_start = b.to(tl.int64) * NQ
    return q_start, q_len, o_start


@triton.jit
def _kv_rows(KV_OFF, r):
    """Kv sequence r: first row in K / V and count."""
    k_start = tl.load(KV_OFF + r)
    k_len = (tl.load(KV_OFF + r + 1) - k_start).to(tl.int32)
    return k_start, k_len


@triton.jit
def _seq_bounds(Q_OFF, KV_OFF, KV_IDX, b, NQ, Q_JAGGED: tl.constexpr, HAS_KV_IDX: tl.constexpr):
    q_start, q_len, o_start = _q_rows(Q_OFF, b, NQ, Q_JAGGED)
    if HAS_KV_IDX:
        r = tl.load(KV_IDX + b)
    else:
        r = b
    k_start, k_len = _kv_rows(KV_OFF, r)
    return q_start, q_len, o_start, k_start, k_len


@triton.jit
def _declared_tile(SEQ_MAJOR: tl.constexpr):
    """(sequence, tile) of a program of a grid over each sequence's declared tiles: the tile on axis 0 and the
    sequence on axis 1, or, ``SEQ_MAJOR`` (more sequences than axis 1 holds), the other way round."""
    if SEQ_MAJOR:
        s = tl.program_id(0)
        t = tl.program_id(1)
    else:
        s = tl.program_id(1)
        t = tl.program_id(0)
    return s, t


@triton.jit
def _real_tile(OFF, n_seqs, COMPACT: tl.constexpr, SEQS: tl.constexpr, BLOCK: tl.constexpr, SEQ_MAJOR: tl.constexpr):
    """(sequence, tile) of this program. ``COMPACT``: axis 0 numbers the real ``BLOCK``-row tiles of the ``n_seqs``
    (at most ``SEQS``, a power of two) sequences of offsets ``OFF``, sequence after sequence; a program past the last
    tile gets the last sequence and a tile past its end. Otherwise a grid sized by the declared max length
    (``_declared_tile``)."""
    if COMPACT:
        i = tl.program_id(0)
        j = tl.arange(0, SEQS)
        seq = j < n_seqs
        lo = tl.load(OFF + j, mask=seq, other=0)
        hi = tl.load(OFF + j + 1, mask=seq, other=0)
        tiles = ((hi - lo + BLOCK - 1) // BLOCK).to(tl.int32)  # 0 past the last sequence
        ends = tl.cumsum(tiles, 0)
        s = tl.minimum(tl.sum((ends <= i).to(tl.int32), 0), n_seqs - 1)
        t = i - tl.sum(tl.where(j == s, ends - tiles, 0), 0)
    else:
        s, t = _declared_tile(SEQ_MAJOR)
    return s, t


@triton.jit
def attn_fwd_kernel(
    Q, K, V, O, LSE, Q_OFF, KV_OFF, KV_IDX, HEAD_IDS, K_desc, V_desc,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lt,
    NQ, NB, qk_scale, out_scale, Wl, Wr, BS, KB,
    ACT: tl.constexpr, MASK_KIND: tl.constexpr, Q_JAGGED: tl.constexpr, HAS_KV_IDX: tl.constexpr,
    PREC: tl.constexpr, TMA: tl.constexpr, COMPACT: tl.constexpr, SEQS: tl.constexpr, FOLD: tl.constexpr,
    SEQ_MAJOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``TMA``: K and V tiles through tensor descriptors of ``[Tk, H * D]`` views (``K_desc`` / ``V_desc``, blocks of
    ``[BLOCK_N, BLOCK_D]``): whole-tile copies the pointer loads' address arithmetic does not pay for. ``COMPACT``:
    a grid over the real query tiles of the ``NB`` examples (``_real_tile``). ``FOLD``: the scale is positive, and
    unmasked tiles fold it into their exponents (``_online_softmax_scaled``)."""
    b, pid_m = _real_tile(Q_OFF, NB, COMPACT, SEQS, BLOCK_M, SEQ_MAJOR)
    h = tl.load(HEAD_IDS + tl.program_id(2))
    q_start, q_len, o_start, k_start, k_len = _seq_bounds(Q_OFF, KV_OFF, KV_IDX, b, NQ, Q_JAGGED, HAS_KV_IDX)
    m0 = pid_m * BLOCK_M
    # NOTE: tiles past this sequence's end (a grid sized by the declared max length, or past the last real tile)
    # exit at once
    if m0 < q_len:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        qmask = offs_m < q_len
        q = _load_rows(Q + h * stride_qh, q_start + offs_m, stride_qt, offs_d, qmask, True)
        K_base = K + h * stride_kh + k_start * stride_kt
        V_base = V + h * stride_vh + k_start * stride_vt
        desc_row = k_start.to(tl.int32)
        h_col = h * BLOCK_D
        lo_al, fs, fe, hi = _key_tiles(m0, q_len, k_len, Wl, Wr, BS, KB, MASK_KIND, BLOCK_M, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], MASKED_SCORE, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, K_base, V_base, K_desc, V_desc, desc_row, h_col, stride_kt,
                                   stride_vt, offs_m, offs_d, lo_al, fs, k_len, qk_scale, Wl, Wr, BS, KB, ACT,
                                   MASK_KIND, True, PREC, TMA, FOLD, BLOCK_N)
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, K_base, V_base, K_desc, V_desc, desc_row, h_col, stride_kt,
                                   stride_vt, offs_m, offs_d, fs, fe, k_len, qk_scale, Wl, Wr, BS, KB, ACT,
                                   MASK_KIND, False, PREC, TMA, FOLD, BLOCK_N)
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, K_base, V_base, K_desc, V_desc, desc_row, h_col, stride_kt,
                                   stride_vt, offs_m, offs_d, fe, hi, k_len, qk_scale, Wl, Wr, BS, KB, ACT,
                                   MASK_KIND, True, PREC, TMA, FOLD, BLOCK_N)
        if ACT == 0:
            out, lse = _softmax_output(acc, m_i, l_i)
            tl.store(LSE + (o_start + offs_m) * stride_lt + h, lse, mask=qmask)
        else:
            out = acc * out_scale
        _store_rows(O + h * stride_oh, o_start + offs_m, stride_ot, offs_d, out.to(O.dtype.element_ty), qmask)


@triton.jit
def attn_fwd_short_kv_kernel(
    Q, K, V, O, LSE, Q_OFF, KV_OFF, KV_IDX, HEAD_IDS, Q_desc, K_desc, V_desc,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lt,
    NQ, NB, qk_scale, out_scale,
    ACT: tl.constexpr, Q_JAGGED: tl.constexpr, HAS_KV_IDX: tl.constexpr, DIAGONAL: tl.constexpr,
    PREC: tl.constexpr, TMA: tl.constexpr, FOLD: tl.constexpr, COMPACT: tl.constexpr, SEQS: tl.constexpr,
    SEQ_MAJOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, Q_TILES: tl.constexpr,
):
    """The forward of attention where every query sees exactly one key tile, whole:

    - full (unwindowed) attention to kv sequences that fit one tile (cross attention to a few candidate or context
      rows): the program loads its K / V tile once and streams ``Q_TILES`` query tiles of its example through it;
    - ``DIAGONAL``: independent blocks of ``BLOCK_M = BLOCK_N`` tokens (BlockAttention with one block per
      window): query tile i sees key tile i, and the program streams ``Q_TILES`` such pairs.

    Streaming several tiles per program lets their loads pipeline behind the previous tile's work. One key tile
    makes the softmax exact in one step (no running max), with the same results as ``attn_fwd_kernel``. ``TMA``: the
    streamed tiles (query tiles, and the diagonal's key tiles) through tensor descriptors; rows past a sequence
    give outputs that are never stored, or meet masked scores. ``COMPACT``: a grid over the real runs of ``Q_TILES``
    query tiles of the ``NB`` examples (``_real_tile``)."""
    b, pid_m = _real_tile(Q_OFF, NB, COMPACT, SEQS, Q_TILES * BLOCK_M, SEQ_MAJOR)
    h = tl.load(HEAD_IDS + tl.program_id(2))
    q_start, q_len, o_start, k_start, k_len = _seq_bounds(Q_OFF, KV_OFF, KV_IDX, b, NQ, Q_JAGGED, HAS_KV_IDX)
    m_first = pid_m * (Q_TILES * BLOCK_M)
    if m_first < q_len:
        offs_d = tl.arange(0, BLOCK_D)
        K_base = K + h * stride_kh + k_start * stride_kt
        V_base = V + h * stride_vh + k_start * stride_vt
        if not DIAGONAL:
            offs_n = tl.arange(0, BLOCK_N)
            kmask = offs_n < k_len
            kt = _load_cols(K_base, offs_n, stride_kt, offs_d, kmask, True)
            v = _load_rows(V_base, offs_n, stride_vt, offs_d, kmask, True)
        m_end = tl.minimum(m_first + Q_TILES * BLOCK_M, q_len)
        for m0 in range(m_first, m_end, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            qmask = offs_m < q_len
            if TMA:
                q = Q_desc.load([(q_start + m0).to(tl.int32), h * BLOCK_D])
            else:
                q = _load_rows(Q + h * stride_qh, q_start + offs_m, stride_qt, offs_d, qmask, True)
            if DIAGONAL:
                offs_n = m0 + tl.arange(0, BLOCK_N)
                kmask = offs_n < k_len
                # a sequence's last block may be partial: masked, through a descriptor only when whole
                row = (k_start + m0).to(tl.int32)
                k, v = _row_tiles(K_base, V_base, K_desc, V_desc, row, row, h * BLOCK_D, offs_n, stride_kt, stride_vt,
                                  offs_d, kmask, m0 + BLOCK_N <= k_len, TMA, True)
                kt = tl.trans(k)
            s = tl.dot(q, kt, input_precision=PREC)
            if ACT == 0:
                if FOLD:  # the scale folded into the exponents, as in _online_softmax_scaled
                    # NOTE: keys past the sequence score -inf before scaling (-inf after it, at a scale > 0), and a
                    # row that sees no key keeps MASKED_SCORE as its max, as below
                    s = tl.where(kmask[None, :], s, float("-inf"))
                    m_i = tl.maximum(tl.max(s, 1) * qk_scale, MASKED_SCORE)
                    p = tl.exp2(s * qk_scale - m_i[:, None])
                else:
                    s = tl.where(kmask[None, :], s * qk_scale, MASKED_SCORE)
                    m_i = tl.max(s, 1)
                    p = tl.exp2(s - m_i[:, None])
                l_i = tl.sum(p, 1)
                acc = tl.dot(p.to(v.dtype), v, input_precision=PREC)
                out, lse = _softmax_output(acc, m_i, l_i)
                tl.store(LSE + (o_start + offs_m) * stride_lt + h, lse, mask=qmask)
            else:
                p = tl.where(kmask[None, :], _act(s, ACT), 0.0)
                out = tl.dot(p.to(v.dtype), v, input_precision=PREC) * out_scale
            _store_rows(O + h * stride_oh, o_start + offs_m, stride_ot, offs_d, out.to(O.dtype.element_ty), qmask)


@triton.jit
def _bwd_kv_tiles(
    dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, Q_desc, DO_desc, q_row, o_row, h_col, stride_qt, stride_dot,
    stride_lt, offs_n, offs_d, start, end, q_len, k_len, qk_scale, Wl, Wr, BS, KB,
    ACT: tl.constexpr, MASK_KIND: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        qmask = offs_m < q_len
        q, do = _row_tiles(Q_base, DO_base, Q_desc, DO_desc, q_row + m0, o_row + m0, h_col, offs_m, stride_qt,
                           stride_dot, offs_d, qmask, m0 + BLOCK_M <= q_len, TMA, MASKED)
        # NOTE: both products are issued before the mask and the statistics' loads, which then overlap them: with
        # the loads first, run_all's backward kernel times were 5-7% above the run before (kernels-h200.json at
        # 1049b4a against 39c5bf6); in this order the sm_90 instruction stream is the earlier run's again
        s_t = tl.dot(k, tl.trans(q), input_precision=PREC)  # [BLOCK_N, BLOCK_M]
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
        if MASKED:
            lo, hi = _key_range(offs_m, Wl, Wr, BS, KB, MASK_KIND)
            allowed = ((offs_n[:, None] >= lo[None, :]) & (offs_n[:, None] <= hi[None, :])
                       & qmask[None, :] & (offs_n < k_len)[:, None])
        else:
            allowed = qmask[None, :]  # unread: unmasked tiles
        if ACT == 0:
            lse, delta = _load_softmax_stats(LSE_base, DELTA_base, offs_m, stride_lt, qmask, MASKED)
        else:
            lse = offs_m.to(tl.float32)  # unread by pointwise heads
            delta = lse
        dk, dv, _ = _kv_tile_grads(dk, dv, s_t, dp_t, q, do, lse, delta, allowed, qk_scale, ACT, MASKED, PREC)
    return dk, dv


@triton.jit
def _kv_tile_grads(dk, dv, s_t, dp_t, q, do, lse, delta, allowed, qk_scale, ACT: tl.constexpr, MASKED: tl.constexpr,
                   PREC: tl.constexpr):
    """One (key tile, query tile) pair of the dK / dV backward, added into ``dk`` and ``dv``, from its transposed
    scores ``s_t = K Q^T`` and ``dp_t = V dO^T``: their probabilities (softmax heads, from the stored log-sum-exp)
    or activations, and the scores' gradients; pairs outside ``allowed`` give nothing where MASKED. Also returns
    the transposed scores' gradient (for a dQ summed in the same loop)."""
    if ACT == 0:
        p_t = tl.exp2(s_t * qk_scale - lse[None, :])
        if MASKED:
            p_t = tl.where(allowed, p_t, 0.0)
        ds_t = p_t * (dp_t - delta[None, :])
    else:
        p_t = _act(s_t, ACT)
        ds_t = dp_t * _act_grad(s_t, ACT)
        if MASKED:
            p_t = tl.where(allowed, p_t, 0.0)
            ds_t = tl.where(allowed, ds_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PREC)
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PREC)
    return dk, dv, ds_t


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, Q_OFF, KV_OFF, CAND_OFF, CAND_IDS, HEAD_IDS, Q_desc, DO_desc,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lt,
    NQ, NR, qk_scale, dk_scale, dv_scale, Wl, Wr, BS, KB,
    ACT: tl.constexpr, MASK_KIND: tl.constexpr, Q_JAGGED: tl.constexpr, HAS_CAND: tl.constexpr,
    PREC: tl.constexpr, TMA: tl.constexpr, COMPACT: tl.constexpr, SEQS: tl.constexpr, BLOCK_M: tl.constexpr,
    SEQ_MAJOR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``TMA``: the streamed Q and dO tiles through tensor descriptors (as ``attn_fwd_kernel``'s K / V).
    ``COMPACT``: a grid over the real key tiles of the ``NR`` kv sequences."""
    r, pid_n = _real_tile(KV_OFF, NR, COMPACT, SEQS, BLOCK_N, SEQ_MAJOR)
    h = tl.load(HEAD_IDS + tl.program_id(2))
    k_start, k_len = _kv_rows(KV_OFF, r)
    n0 = pid_n * BLOCK_N
    if n0 < k_len:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        kmask = offs_n < k_len
        k = _load_rows(K + h * stride_kh, k_start + offs_n, stride_kt, offs_d, kmask, True)
        v = _load_rows(V + h * stride_vh, k_start + offs_n, stride_vt, offs_d, kmask, True)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        n1 = tl.minimum(n0 + BLOCK_N, k_len)
        first_lo, full_hi = _query_range(n0, Wl, Wr, BS, KB, MASK_KIND)
        full_lo, last_hi = _query_range(n1 - 1, Wl, Wr, BS, KB, MASK_KIND)
        # NOTE: every example that reads this kv sequence is visited here, in a fixed order: the sum over
        # candidates stays in registers, deterministic and free of atomics.
        if HAS_CAND:
            c_lo = tl.load(CAND_OFF + r)
            c_hi = tl.load(CAND_OFF + r + 1)
        else:
            c_lo = r
            c_hi = r + 1
        for c in range(c_lo, c_hi):
            if HAS_CAND:
                b = tl.load(CAND_IDS + c)
            else:
                b = c
            q_start, q_len, o_start = _q_rows(Q_OFF, b, NQ, Q_JAGGED)
            lo_al, fs, fe, hi = _segments(first_lo, last_hi + 1, full_lo, full_hi + 1, q_len, BLOCK_M)
            Q_base = Q + h * stride_qh + q_start * stride_qt
            DO_base = DO + h * stride_doh + o_start * stride_dot
            LSE_base = LSE + o_start * stride_lt + h
            DELTA_base = DELTA + o_start * stride_lt + h
            q_row, o_row, h_col = q_start.to(tl.int32), o_start.to(tl.int32), h * BLOCK_D
            dk, dv = _bwd_kv_tiles(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, Q_desc, DO_desc, q_row, o_row,
                                   h_col, stride_qt, stride_dot, stride_lt, offs_n, offs_d, lo_al, fs, q_len, k_len,
                                   qk_scale, Wl, Wr, BS, KB, ACT, MASK_KIND, True, PREC, TMA, BLOCK_M)
            dk, dv = _bwd_kv_tiles(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, Q_desc, DO_desc, q_row, o_row,
                                   h_col, stride_qt, stride_dot, stride_lt, offs_n, offs_d, fs, fe, q_len, k_len,
                                   qk_scale, Wl, Wr, BS, KB, ACT, MASK_KIND, False, PREC, TMA, BLOCK_M)
            dk, dv = _bwd_kv_tiles(dk, dv, k, v, Q_base, DO_base, LSE_base, DELTA_base, Q_desc, DO_desc, q_row, o_row,
                                   h_col, stride_qt, stride_dot, stride_lt, offs_n, offs_d, fe, hi, q_len, k_len,
                                   qk_scale, Wl, Wr, BS, KB, ACT, MASK_KIND, True, PREC, TMA, BLOCK_M)
        _store_rows(DK + h * stride_dkh, k_start + offs_n, stride_dkt, offs_d, (dk * dk_scale).to(DK.dtype.element_ty),
                    kmask)
        _store_rows(DV + h * stride_dvh, k_start + offs_n, stride_dvt, offs_d, (dv * dv_scale).to(DV.dtype.element_ty),
                    kmask)


@triton.jit
def attn_bwd_broadcast_q_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, KV_OFF, HEAD_IDS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lt, stride_dqt, stride_dqh,
    NQ, qk_scale, dk_scale, dv_scale, dq_scale,
    ACT: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DELTA_FROM_O: tl.constexpr, SEQ_MAJOR: tl.constexpr,
):
    """The backward of full attention from ``NQ <= BLOCK_M`` broadcast queries (PMA), one program per (kv sequence,
    head): the queries, their dO and softmax statistics fit one tile, loaded once, and every key tile of the kv
    sequence streams through them, writing its dK / dV; the example's dQ of the queries (rows ``r * NQ ..`` of DQ,
    summed over examples afterwards) is summed over the tiles in registers, so K and V are read once.
    DELTA_FROM_O: DELTA is the output O (in dO's layout) and delta is computed from it."""
    r, _ = _declared_tile(SEQ_MAJOR)
    h = tl.load(HEAD_IDS + tl.program_id(2))
    k_start, k_len = _kv_rows(KV_OFF, r)
    # NOTE: an empty kv sequence still writes its (zero) dQ
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qmask = offs_m < NQ
    o_start = r.to(tl.int64) * NQ
    q = _load_rows(Q + h * stride_qh, offs_m, stride_qt, offs_d, qmask, True)
    do = _load_rows(DO + h * stride_doh, o_start + offs_m, stride_dot, offs_d, qmask, True)
    if ACT == 0 and DELTA_FROM_O:
        lse, delta = _softmax_stats_from_o(LSE + h, DELTA + h * stride_doh, do, o_start + offs_m, stride_lt,
                                           stride_dot, offs_d, qmask)
    elif ACT == 0:
        lse, delta = _load_softmax_stats(LSE + h, DELTA + h, o_start + offs_m, stride_lt, qmask, True)
    else:
        lse = offs_m.to(tl.float32)  # unread by pointwise heads
        delta = lse
    K_base = K + h * stride_kh + k_start * stride_kt
    V_base = V + h * stride_vh + k_start * stride_vt
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, k_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kmask = offs_n < k_len
        k = _load_rows(K_base, offs_n, stride_kt, offs_d, kmask, True)
        v = _load_rows(V_base, offs_n, stride_vt, offs_d, kmask, True)
        zeros = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        s_t = tl.dot(k, tl.trans(q), input_precision=PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
        dk, dv, ds_t = _kv_tile_grads(zeros, zeros, s_t, dp_t, q, do, lse, delta, kmask[:, None] & qmask[None, :],
                                      qk_scale, ACT, True, PREC)
        dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, dq, input_precision=PREC)
        _store_rows(DK + h * stride_dkh, k_start + offs_n, stride_dkt, offs_d, (dk * dk_scale).to(DK.dtype.element_ty),
                    kmask)
        _store_rows(DV + h * stride_dvh, k_start + offs_n, stride_dvt, offs_d, (dv * dv_scale).to(DV.dtype.element_ty),
                    kmask)
    _store_rows(DQ + h * stride_dqh, o_start + offs_m, stride_dqt, offs_d, (dq * dq_scale).to(DQ.dtype.element_ty),
                qmask)


@triton.jit
def _bwd_q_tiles(
    dq, q, do, lse, delta, K_base, V_base, K_desc, V_desc, desc_row, h_col, stride_kt, stride_vt, offs_m, offs_d,
    start, end, k_len, qk_scale, Wl, Wr, BS, KB,
    ACT: tl.constexpr, MASK_KIND: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kmask = offs_n < k_len
        k, v = _row_tiles(K_base, V_base, K_desc, V_desc, desc_row + n0, desc_row + n0, h_col, offs_n, stride_kt,
                          stride_vt, offs_d, kmask, n0 + BLOCK_N <= k_len, TMA, MASKED)
        vt = tl.trans(v)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        dp = tl.dot(do, vt, input_precision=PREC)
        if MASKED:
            allowed = _visible(offs_m, offs_n, kmask, Wl, Wr, BS, KB, MASK_KIND)
        if ACT == 0:
            p = tl.exp2(s * qk_scale - lse[:, None])
            if MASKED:
                p = tl.where(allowed, p, 0.0)
            ds = p * (dp - delta[:, None])
        else:
            ds = dp * _act_grad(s, ACT)
            if MASKED:
                ds = tl.where(allowed, ds, 0.0)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, O, DO, LSE, DELTA, DQ, Q_OFF, KV_OFF, KV_IDX, HEAD_IDS, K_desc, V_desc,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lt,
    NQ, NB, qk_scale, dq_scale, Wl, Wr, BS, KB,
    ACT: tl.constexpr, MASK_KIND: tl.constexpr, Q_JAGGED: tl.constexpr, HAS_KV_IDX: tl.constexpr,
    PREC: tl.constexpr, TMA: tl.constexpr, DELTA_FROM_O: tl.constexpr, COMPACT: tl.constexpr, SEQS: tl.constexpr,
    SEQ_MAJOR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``TMA``: the streamed K and V tiles through tensor descriptors (as ``attn_fwd_kernel``'s). ``DELTA_FROM_O``
    (softmax heads): ``delta = rowsum(dO * O)`` of the program's query rows computed here from its dO tile and O's
    rows, and stored to DELTA for the dK / dV kernel launched after this one (no pre-pass launch). ``COMPACT``: a
    grid over the real query tiles of the ``NB`` examples."""
    b, pid_m = _real_tile(Q_OFF, NB, COMPACT, SEQS, BLOCK_M, SEQ_MAJOR)
    h = tl.load(HEAD_IDS + tl.program_id(2))
    q_start, q_len, o_start, k_start, k_len = _seq_bounds(Q_OFF, KV_OFF, KV_IDX, b, NQ, Q_JAGGED, HAS_KV_IDX)
    m0 = pid_m * BLOCK_M
    if m0 < q_len:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        qmask = offs_m < q_len
        q = _load_rows(Q + h * stride_qh, q_start + offs_m, stride_qt, offs_d, qmask, True)
        do = _load_rows(DO + h * stride_doh, o_start + offs_m, stride_dot, offs_d, qmask, True)
        if ACT == 0 and DELTA_FROM_O:
            lse = tl.load(LSE + h + (o_start + offs_m) * stride_lt, mask=qmask, other=1.0e30)
            o = _load_rows(O + h * stride_oh, o_start + offs_m, stride_ot, offs_d, qmask, True)
            delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
            tl.store(DELTA + h + (o_start + offs_m) * stride_lt, delta, mask=qmask)
        elif ACT == 0:
            lse, delta = _load_softmax_stats(LSE + h, DELTA + h, o_start + offs_m, stride_lt, qmask, True)
        else:
            lse = tl.zeros([BLOCK_M], dtype=tl.float32)
            delta = lse
        K_base = K + h * stride_kh + k_start * stride_kt
        V_base = V + h * stride_vh + k_start * stride_vt
        lo_al, fs, fe, hi = _key_tiles(m0, q_len, k_len, Wl, Wr, BS, KB, MASK_KIND, BLOCK_M, BLOCK_N)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        desc_row, h_col = k_start.to(tl.int32), h * BLOCK_D
        dq = _bwd_q_tiles(dq, q, do, lse, delta, K_base, V_base, K_desc, V_desc, desc_row, h_col, stride_kt, stride_vt,
                          offs_m, offs_d, lo_al, fs, k_len, qk_scale, Wl, Wr, BS, KB, ACT, MASK_KIND, True, PREC, TMA,
                          BLOCK_N)
        dq = _bwd_q_tiles(dq, q, do, lse, delta, K_base, V_base, K_desc, V_desc, desc_row, h_col, stride_kt, stride_vt,
                          offs_m, offs_d, fs, fe, k_len, qk_scale, Wl, Wr, BS, KB, ACT, MASK_KIND, False, PREC, TMA,
                          BLOCK_N)
        dq = _bwd_q_tiles(dq, q, do, lse, delta, K_base, V_base, K_desc, V_desc, desc_row, h_col, stride_kt, stride_vt,
                          offs_m, offs_d, fe, hi, k_len, qk_scale, Wl, Wr, BS, KB, ACT, MASK_KIND, True, PREC, TMA,
                          BLOCK_N)
        _store_rows(DQ + h * stride_dqh, o_start + offs_m, stride_dqt, offs_d, (dq * dq_scale).to(DQ.dtype.element_ty),
                    qmask)


@triton.jit
def attn_bwd_short_kv_kernel(
    Q, K, V, O, DO, LSE, DQ, DK, DV, Q_OFF, KV_OFF, HEAD_IDS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lt,
    qk_scale, dq_scale, dk_scale, dv_scale,
    ACT: tl.constexpr, DIAGONAL: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, Q_TILES: tl.constexpr, SEQ_MAJOR: tl.constexpr,
):
    """The whole backward (dQ, dK and dV in one launch) of attention where every query sees exactly one key tile,
    whole, as in ``attn_fwd_short_kv_kernel`` (example b reads kv sequence b):

    - ``DIAGONAL`` (independent blocks of ``BLOCK_M = BLOCK_N`` tokens): each (query tile, key tile) pair is the
      only one of both tiles, so the program writes all three gradients of its ``Q_TILES`` blocks;
    - otherwise (full attention to a kv sequence of one tile): the program holds K / V and their gradients for the
      whole example, streams every query tile of it (writing its dQ) and writes dK / dV once at the end: the sum
      over query tiles stays in registers, in a fixed order (deterministic, no atomics).

    Each query row is visited once, so a softmax head's ``delta = rowsum(dO * O)`` is computed here from O instead
    of by a pre-pass. Equal to ``attn_bwd_dkdv_kernel`` + ``attn_bwd_dq_kernel`` on these shapes, in one launch
    that reads Q, dO and O once."""
    b, pid_m = _declared_tile(SEQ_MAJOR)
    h = tl.load(HEAD_IDS + tl.program_id(2))
    q_start, q_len, o_start = _q_rows(Q_OFF, b, 0, True)
    k_start, k_len = _kv_rows(KV_OFF, b)
    if DIAGONAL:
        m_first = pid_m * (Q_TILES * BLOCK_M)
        m_end = tl.minimum(m_first + Q_TILES * BLOCK_M, q_len)
    else:
        m_first = 0
        m_end = q_len
    # NOTE: an example with queries but no keys still writes its (zero) dQ; keys without queries get zero dK / dV
    if m_first < q_len or (not DIAGONAL and k_len > 0):
        offs_d = tl.arange(0, BLOCK_D)
        K_base = K + h * stride_kh + k_start * stride_kt
        V_base = V + h * stride_vh + k_start * stride_vt
        if not DIAGONAL:
            offs_n = tl.arange(0, BLOCK_N)
            kmask = offs_n < k_len
            k = _load_rows(K_base, offs_n, stride_kt, offs_d, kmask, True)
            v = _load_rows(V_base, offs_n, stride_vt, offs_d, kmask, True)
            dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        for m0 in range(m_first, m_end, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            qmask = offs_m < q_len
            rows = q_start + offs_m
            if DIAGONAL:
                offs_n = m0 + tl.arange(0, BLOCK_N)
                kmask = offs_n < k_len
                k = _load_rows(K_base, offs_n, stride_kt, offs_d, kmask, True)
                v = _load_rows(V_base, offs_n, stride_vt, offs_d, kmask, True)
            q = _load_rows(Q + h * stride_qh, rows, stride_qt, offs_d, qmask, True)
            do = _load_rows(DO + h * stride_doh, rows, stride_dot, offs_d, qmask, True)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)  # [BLOCK_M, BLOCK_N]
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            allowed = qmask[:, None] & kmask[None, :]
            if ACT == 0:
                lse, delta = _softmax_stats_from_o(LSE + h, O + h * stride_oh, do, rows, stride_lt, stride_ot,
                                                   offs_d, qmask)
                p = tl.where(allowed, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
                ds = p * (dp - delta[:, None])
            else:
                p = tl.where(allowed, _act(s, ACT), 0.0)
                ds = tl.where(allowed, dp * _act_grad(s, ACT), 0.0)
            dq = tl.dot(ds.to(k.dtype), k, input_precision=PREC)
            _store_rows(DQ + h * stride_dqh, rows, stride_dqt, offs_d, (dq * dq_scale).to(DQ.dtype.element_ty), qmask)
            if DIAGONAL:
                dv_tile = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
                dk_tile = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
                _store_rows(DK + h * stride_dkh, k_start + offs_n, stride_dkt, offs_d,
                            (dk_tile * dk_scale).to(DK.dtype.element_ty), kmask)
                _store_rows(DV + h * stride_dvh, k_start + offs_n, stride_dvt, offs_d,
                            (dv_tile * dv_scale).to(DV.dtype.element_ty), kmask)
            else:
                dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=PREC)
                dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=PREC)
        if not DIAGONAL:
            _store_rows(DK + h * stride_dkh, k_start + offs_n, stride_dkt, offs_d,
                        (dk * dk_scale).to(DK.dtype.element_ty), kmask)
            _store_rows(DV + h * stride_dvh, k_start + offs_n, stride_dvt, offs_d,
                        (dv * dv_scale).to(DV.dtype.element_ty), kmask)


@triton.jit
def attn_bwd_delta_kernel(DO, O, DELTA, R, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """``delta[r] = sum_d dO[r, d] * O[r, d]`` over the ``R = T * H`` rows of contiguous ``[T, H, D]`` tensors, in
    float32: one read of each, where the same sum in PyTorch ops writes and rereads float32 copies of both."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    at = rows[:, None] * D + cols[None, :]
    do = tl.load(DO + at, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(O + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(do * o, axis=1), mask=rows < R)
