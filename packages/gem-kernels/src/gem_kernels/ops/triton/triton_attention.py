"""Launchers and the autograd Function for the shared attention kernels (see triton_attention_kernels)."""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch

from gem_kernels.ops.triton._tuning import (
    PlannedLaunch,
    RowTiles,
    Slot,
    cdiv,
    eager_under_compile,
    interpreting,
    launch,
    next_power_of_2,
    plan,
)
from gem_kernels.ops.triton.triton_attention_kernels import (
    ACT_CODES,
    attn_bwd_delta_kernel,
    attn_bwd_broadcast_q_kernel,
    attn_bwd_dkdv_kernel,
    attn_bwd_dq_kernel,
    attn_bwd_short_kv_kernel,
    attn_fwd_kernel,
    attn_fwd_short_kv_kernel,
)
from gem_kernels.ops.triton.triton_sum_rows import sum_rows

try:  # host-built tensor descriptors (Triton >= 3.4): streamed tiles copied by the TMA unit
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the Triton version
    TensorDescriptor = None

# the general kernels' streamed tiles through tensor descriptors (GEM_KERNELS_TMA=0: pointer loads): on the H200
# (kernels-h200.json against its earlier run) the JFA and block forwards' kernels took 13-21% less time
TMA_LOADS = os.environ.get("GEM_KERNELS_TMA", "1") != "0"

_UNBOUNDED = 1 << 30
_LOG2E = 1.4426950408889634


class AttnSpec(NamedTuple):
    """Everything about one attention call that is not a tensor (a named tuple: part of every call's plan key, which
    it hashes and compares in C)."""

    max_q: int  # declared max query length (or Nq for broadcast queries)
    max_kv: int
    nq: int | None  # broadcast queries (PMA) when set
    activations: tuple[str, ...]  # one per head
    sm_scale: float
    pw_scale: float
    window_left: int | None = None
    window_right: int | None = None
    block_size: int | None = None
    window_blocks: int | None = None

    @property
    def mask_args(self) -> tuple[int, int, int, int, int]:
        if self.block_size is not None:
            return 1, 0, 0, self.block_size, self.window_blocks
        wl = _UNBOUNDED if self.window_left is None else self.window_left
        wr = _UNBOUNDED if self.window_right is None else self.window_right
        return 0, wl, wr, 1, 1


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, next_power_of_2(max(int(n), 1)))


# --- tile configs ---------------------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_M tiles queries, BLOCK_N keys, in all three kernels.

# the H200's shared memory per block
SMEM_LIMIT = 227 * 1024
# shared memory a streaming kernel's config may plan for, counted by its pipelined tiles: Triton's own scratch came
# to ~18% over that count (a PMA dK/dV config counted at 208 KiB asked for 240 KiB)
SMEM_BUDGET = 180 * 1024


def _candidates(kind: str, spec: AttnSpec, head_dim: int, itemsize: int = 2) -> list[dict]:
    if interpreting():
        return [dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)]
    big = head_dim <= 128
    kv_cap = _pow2_at_least(spec.max_kv, 16)
    q_cap = _pow2_at_least(spec.max_q, 16)
    block = spec.block_size
    if kind == "fwd":
        cands = [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 3)] if big else \
            [(64, 32, 8, 2), (64, 64, 8, 2), (32, 32, 4, 2)]
    elif kind == "dkdv":
        cands = [(64, 128, 8, 2), (64, 64, 4, 2), (32, 128, 8, 2), (64, 128, 8, 3), (128, 64, 8, 2),
                 (64, 64, 4, 3)] if big else [(32, 64, 8, 1), (32, 32, 4, 1)]
    else:
        cands = [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3),
                 (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 2)] if big else [(64, 32, 8, 1), (32, 32, 4, 1)]
    out = []
    for bm, bn, w, st in cands:
        bm, bn = min(bm, q_cap), min(bn, kv_cap)
        if block is not None and block % 16 == 0:
            # NOTE: tiles that divide the block size never straddle a block edge, so they stay unmasked.
            bm, bn = math.gcd(bm, block), math.gcd(bn, block)
        bm, bn = max(bm, 16), max(bn, 16)
        if bm * bn <= 64 * 64:
            # NOTE: a 128-row candidate cut to a block size of 64 would keep its eight warps; every config the H200's
            # tuning runs picked for tiles this small has four (tuned/nvidia-h200.json)
            w = min(w, 4)
        if kind == "dkdv":
            # NOTE: dK/dV keeps its K and V tiles and needs about four query tiles more, whatever its stages: in
            # fp32 at head dim 128 the (64, 128) tiles asked the H200 for 256.5 KiB (Triton's count when compiling
            # for sm_90: 262656 B at 2 stages, 262144 at 1; (64, 64) takes 164352). 16-bit tiles fit as they are.
            row = head_dim * itemsize
            while 2 * bn * row + 4 * bm * row > SMEM_LIMIT and max(bm, bn) > 16:
                bm, bn = (bm, bn // 2) if bn >= bm else (bm // 2, bn)
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
        if cfg not in out:
            out.append(cfg)
    return out


# kv sequences up to this long are one key tile of attn_fwd_short_kv_kernel, where that tile's K and V fit in
# SHORT_KV_BYTES: 256 keys in 16 bits at head dim 128 (the pair alone fills half an SM's shared memory) still ran
# faster loaded once than streamed per query tile by the general forward (cross_kv256, tuned either way); a wider
# pair would leave no room for the pipelined query tiles
SHORT_KV_MAX = 256
SHORT_KV_BYTES = 128 * 1024
# blocks up to this size are one query and one key tile of it (a block's scores are a square tile)
DIAGONAL_BLOCK_MAX = 128


def _unmasked(spec: AttnSpec) -> bool:
    """Full attention: no blocks, no window."""
    return spec.block_size is None and spec.window_left is None and spec.window_right is None


def _short_kv(spec: AttnSpec, head_dim: int, itemsize: int) -> bool:
    """Full attention over kv sequences that fit one key tile."""
    kv_bytes = 2 * _pow2_at_least(spec.max_kv, 16) * head_dim * itemsize
    return spec.max_kv <= SHORT_KV_MAX and kv_bytes <= SHORT_KV_BYTES and _unmasked(spec)


def _diagonal_blocks(spec: AttnSpec) -> bool:
    """Independent blocks (one block per window) of a tile's size: a power of two from 16 to DIAGONAL_BLOCK_MAX."""
    bs = spec.block_size
    return bs is not None and spec.window_blocks == 1 and 16 <= bs <= DIAGONAL_BLOCK_MAX and bs & (bs - 1) == 0


def _fit_stages(stages: int, fixed: int, per_stage: int) -> int:
    """The deepest pipeline up to ``stages`` whose buffers (``fixed`` bytes plus ``per_stage`` per stage) fit
    SMEM_BUDGET: a config asking for more does not compile, and the untuned default must always run."""
    while stages > 1 and fixed + stages * per_stage > SMEM_BUDGET:
        stages -= 1
    return stages


def _short_kv_candidates(spec: AttnSpec, head_dim: int, itemsize: int) -> list[dict]:
    """(BLOCK_M, Q_TILES, num_warps, num_stages): query tile, query tiles per program, warps, pipeline depth.
    Diagonal blocks fix the query tile to the block."""
    if interpreting():
        return [dict(BLOCK_M=spec.block_size or 16, Q_TILES=2, num_warps=4, num_stages=1)]
    q_cap = _pow2_at_least(spec.max_q, 16)
    diagonal = _diagonal_blocks(spec)
    block_n = spec.block_size if diagonal else _pow2_at_least(spec.max_kv, 16)
    kv_bytes = 2 * block_n * head_dim * itemsize  # one K and one V tile
    out = []
    for bm, tiles, w, st in [(128, 4, 8, 3), (128, 1, 8, 2), (128, 2, 8, 3), (128, 8, 8, 3), (64, 4, 4, 3),
                             (64, 8, 4, 3), (64, 2, 4, 2), (128, 4, 4, 3), (64, 1, 4, 2), (128, 16, 8, 4),
                             (64, 16, 4, 3), (64, 8, 4, 2), (64, 8, 8, 2), (64, 16, 8, 3)]:
        # NOTE: 8 warps on 64-row tiles split each tile's scores between two warp groups by key (half the registers a
        # thread holds of a 64 x 256 score tile), where 128-row tiles give each group its own 64 rows
        bm = spec.block_size or min(bm, q_cap)
        q_bytes = bm * head_dim * itemsize
        # diagonal blocks stream K / V with the queries; otherwise they are loaded once
        st = _fit_stages(st, 0 if diagonal else kv_bytes, q_bytes + (kv_bytes if diagonal else 0))
        cfg = dict(BLOCK_M=bm, Q_TILES=tiles, num_warps=w, num_stages=st)
        if cfg not in out:
            out.append(cfg)
    return out


# kv sequences up to this long take the one-launch backward: with 128 keys its dK / dV tiles, kept in registers
# across the loop, made it slower than the separate kernels on the H200 (kernels-h200.json, tuning_runs)
FUSED_BWD_KV_MAX = 64
# and head dims up to this: it holds Q, dO, O, K and V tiles at once, which wider heads would not fit (the separate
# kernels shrink their tiles for them)
FUSED_BWD_HEAD_DIM_MAX = 128


def _fused_backward(spec: AttnSpec, kv_index, head_dim: int) -> bool:
    """Shapes whose whole backward is one launch of attn_bwd_short_kv_kernel: jagged queries that each see one key
    tile whole (a short kv sequence of their own, or their own block)."""
    return spec.nq is None and kv_index is None and head_dim <= FUSED_BWD_HEAD_DIM_MAX and (
        _diagonal_blocks(spec) or (_unmasked(spec) and spec.max_kv <= FUSED_BWD_KV_MAX))


def _short_kv_bwd_candidates(spec: AttnSpec, head_dim: int, itemsize: int) -> list[dict]:
    """(BLOCK_M, Q_TILES, num_warps, num_stages) of attn_bwd_short_kv_kernel. Diagonal blocks fix the query tile to
    the block and spread the blocks of a sequence over programs (Q_TILES each); short kv sequences take a whole
    example per program (Q_TILES unused)."""
    if interpreting():
        return [dict(BLOCK_M=spec.block_size or 16, Q_TILES=2, num_warps=4, num_stages=1)]
    diagonal = _diagonal_blocks(spec)
    q_cap = _pow2_at_least(spec.max_q, 16)
    block_n = spec.block_size if diagonal else _pow2_at_least(spec.max_kv, 16)
    kv_bytes = 2 * block_n * head_dim * itemsize
    out = []
    table = ([(0, 4, 4, 2), (0, 2, 4, 2), (0, 8, 4, 2), (0, 1, 4, 2), (0, 4, 8, 2), (0, 8, 8, 2), (0, 4, 4, 3),
              (0, 16, 4, 2)] if diagonal else
             [(64, 1, 8, 2), (64, 1, 4, 2), (32, 1, 4, 2), (128, 1, 8, 2), (64, 1, 8, 3), (32, 1, 4, 3),
              (128, 1, 8, 3)])
    for bm, tiles, w, st in table:
        bm = spec.block_size if diagonal else min(bm, q_cap)
        q_bytes = 3 * bm * head_dim * itemsize  # Q, dO and O tiles each step
        st = _fit_stages(st, 0 if diagonal else kv_bytes, q_bytes + (kv_bytes if diagonal else 0))
        cfg = dict(BLOCK_M=bm, Q_TILES=tiles, num_warps=w, num_stages=st)
        if cfg not in out:
            out.append(cfg)
    return out


# at most this many broadcast queries (PMA) take attn_bwd_broadcast_q_kernel, which keeps them in one tile
BROADCAST_Q_MAX = 64


def _broadcast_q(spec: AttnSpec) -> bool:
    """Full attention from a few broadcast queries."""
    return spec.nq is not None and spec.nq <= BROADCAST_Q_MAX and _unmasked(spec)


def _broadcast_q_candidates(spec: AttnSpec, head_dim: int, itemsize: int) -> list[dict]:
    """(BLOCK_N, num_warps, num_stages): key tile, warps, pipeline depth."""
    if interpreting():
        return [dict(BLOCK_N=16, num_warps=4, num_stages=1)]
    kv_cap = _pow2_at_least(spec.max_kv, 16)
    q_bytes = 2 * _pow2_at_least(spec.nq, 16) * head_dim * itemsize  # the queries and their dO, loaded once
    out = []
    for bn, w, st in [(64, 8, 3), (64, 4, 3), (32, 4, 3), (128, 8, 2), (32, 4, 2), (64, 4, 2), (128, 4, 2)]:
        bn = min(bn, kv_cap)
        cfg = dict(BLOCK_N=bn, num_warps=w, num_stages=_fit_stages(st, q_bytes, 2 * bn * head_dim * itemsize))
        if cfg not in out:
            out.append(cfg)
    return out


# the general kernels' grids run over the real tiles (see triton_attention_kernels) for batches of up to this many
# sequences: each program finds its tile among all the sequences' offsets, loaded as one vector. NOTE: the largest
# batch timed with it (the benchmark's JFA and cross cases, 256 sequences); past it, every program's lookup grows
# with the batch while its own work may be a short sequence's few tiles
COMPACT_MAX_SEQS = 256
# ... and whose rows fill less than this share of their declared lengths: there the declared grid launches many
# programs that exit at once. Where the sequences fill them (BlockAttention's equal lengths), the grid over the real
# tiles saves no program and each program still pays its lookup (benchmarks/grid_choice times the real-tile, the
# declared and this choice's grids)
COMPACT_FILL = 0.75


# CUDA runs at most this many programs along a grid's axes 1 and 2: a grid over the declared tiles of more sequences
# numbers the sequences along axis 0 instead (SEQ_MAJOR: see triton_attention_kernels._declared_tile)
MAX_GRID_YZ = 65535


def _seq_major(n_seqs: int) -> bool:
    """Whether a grid over the declared tiles of ``n_seqs`` sequences numbers them along axis 0."""
    return n_seqs > MAX_GRID_YZ


def _declared_grid(tiles: int, n_seqs: int, nh: int, seq_major: bool) -> tuple[int, int, int]:
    """The grid of ``tiles`` programs for each of ``n_seqs`` sequences and ``nh`` heads: tiles along axis 0 and
    sequences along axis 1, or, where ``seq_major`` (``_seq_major``), sequences along axis 0 and tiles along axis 1."""
    grid = (n_seqs, tiles, nh) if seq_major else (tiles, n_seqs, nh)
    if grid[1] > MAX_GRID_YZ or nh > MAX_GRID_YZ:
        raise ValueError(f"attention over {n_seqs} sequences of {tiles} tiles and {nh} heads needs more programs than "
                         f"a CUDA grid holds (at most {MAX_GRID_YZ} along axes 1 and 2): split the batch")
    return grid


def _sparse_grid(rows: int, n_seqs: int, declared: int) -> bool:
    """Whether ``n_seqs`` sequences of ``rows`` rows in all fill less than COMPACT_FILL of their declared lengths
    (a grid over their real tiles then pays)."""
    return rows < COMPACT_FILL * n_seqs * declared


def _tile_grid(n_seqs: int, nh: int, declared: int, rows: Slot, block: str, sparse: bool, tiles: str | None = None):
    """(grid function, rows slot index or None, COMPACT / SEQS constexprs) of a kernel's programs over the tiles of
    ``block`` rows (times ``tiles``, for a program that streams that many of them) of ``n_seqs`` sequences of at
    most ``declared`` rows: over the real tiles where the sequences are ``sparse`` (jagged, filling little of their
    declared lengths: ``_sparse_grid``) and at most COMPACT_MAX_SEQS, else one per declared tile of each sequence.
    The real tiles are at most ``cdiv(T, tile) + n_seqs`` (T: the rows of the call's tensor ``rows``) and at most
    the declared ones (the fewer for sequences of equal length)."""
    size = (lambda c: c[block]) if tiles is None else (lambda c: c[block] * c[tiles])
    if sparse and 0 < n_seqs <= COMPACT_MAX_SEQS:
        return ((lambda c, n: (min(cdiv(n, size(c)) + n_seqs, cdiv(declared, size(c)) * n_seqs), 1, nh)), rows.index,
                dict(COMPACT=True, SEQS=_pow2_at_least(n_seqs, 16), SEQ_MAJOR=False))
    seq_major = _seq_major(n_seqs)
    return ((lambda c: _declared_grid(cdiv(declared, size(c)), n_seqs, nh, seq_major)), None,
            dict(COMPACT=False, SEQS=16, SEQ_MAJOR=seq_major))


def _bucket(n: int) -> int:
    return next_power_of_2(max(int(n), 1))


@functools.lru_cache(maxsize=None)
def _head_groups_on(activations: tuple[str, ...], device: torch.device) -> tuple[tuple[str, torch.Tensor], ...]:
    groups: dict[str, list[int]] = {}
    for h, a in enumerate(activations):
        groups.setdefault(a, []).append(h)
    return tuple((a, torch.tensor(hs, dtype=torch.int32, device=device)) for a, hs in groups.items())


def _head_groups(spec: AttnSpec, device: torch.device) -> tuple[tuple[str, torch.Tensor], ...]:
    """The heads of each activation as a device index tensor, made once per (activations, device): copying a
    Python list to the GPU waits for the GPU to finish its queue, and every launch asked for them (26 host
    synchronisations per step of the H200 benchmark's trainer)."""
    return _head_groups_on(tuple(spec.activations), device)


def _tma_rows(x: torch.Tensor) -> bool:
    """Whether ``x [T, H, D]`` reads as the ``[T, H * D]`` matrix a tensor descriptor tiles: 16-bit values (float32
    inputs are for exactness, and their tiles of the larger configs would not fit shared memory with the descriptors'
    buffers), heads side by side, a power-of-two head dim, start and row stride 16-byte aligned (the TMA unit's
    requirements)."""
    T, H, D = x.shape
    size = x.element_size()
    return (TMA_LOADS and TensorDescriptor is not None and T > 0 and size == 2 and x.stride(2) == 1 and x.stride(1) == D
            and D & (D - 1) == 0 and D * size >= 16 and x.stride(0) * size % 16 == 0 and x.data_ptr() % 16 == 0)


def _prec(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 dots (the reference's precision); 16-bit inputs use the tensor cores anyway.
    return "ieee" if dtype == torch.float32 else "tf32"


class _Fwd:
    """The forward's tensors, as its plans' slots number them."""

    Q, K, V, O, LSE, Q_OFF, KV_OFF, KV_IDX = (Slot(i) for i in range(8))


class _Bwd:
    """The backward's tensors, as its plans' slots number them."""

    DO, Q, K, V, O, LSE, DELTA, DQ, DK, DV, Q_OFF, KV_OFF, CAND_OFF, CAND_IDS, KV_IDX = (Slot(i) for i in range(15))


def _layout(x: torch.Tensor) -> tuple:
    """What a plan depends on in a ``[T, H, D]`` tensor beyond its length: shape, strides, dtype and whether it starts
    16-byte aligned (tensor descriptors, and Triton's specialisation)."""
    return x.shape[1:], x.stride(), x.dtype, x.data_ptr() & 15 == 0


def _index_layout(x: torch.Tensor | None) -> tuple | None:
    """The same for offsets and indices: their length sizes the grid."""
    return None if x is None else (x.shape[0], x.stride(0), x.data_ptr() & 15 == 0)


def _tiles(template: tuple, at: int, views: list[tuple[torch.Tensor, Slot, str | int]]) -> tuple[tuple, bool]:
    """``(template, TMA)``: when every view's tensor takes a descriptor (``_tma_rows``), the template with its slots
    ``at, at + 1, ...`` made ``RowTiles`` of the views ((tensor, its slot, tile rows: a config key or a number)), and
    True; else the template as it is and False."""
    if not all(_tma_rows(x) for x, _, _ in views):
        return template, False
    tiles = tuple(RowTiles(slot.index, rows) for _, slot, rows in views)
    return template[:at] + tiles + template[at + len(views):], True


def attention_forward(q, k, v, q_offsets, kv_offsets, kv_index, spec: AttnSpec):
    T_out = q.shape[0] if spec.nq is None else (kv_offsets.shape[0] - 1) * spec.nq
    H, D = q.shape[1], q.shape[2]
    o = torch.empty((T_out, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((T_out, H), dtype=torch.float32, device=q.device)
    tensors = (q, k, v, o, lse, kv_offsets if q_offsets is None else q_offsets, kv_offsets,
               kv_offsets if kv_index is None else kv_index)
    sparse = q_offsets is not None and _sparse_grid(q.shape[0], q_offsets.shape[0] - 1, spec.max_q)
    key = ("fwd", spec, q.get_device(), TMA_LOADS, _layout(q), _layout(k), _layout(v), _index_layout(q_offsets),
           _index_layout(kv_offsets), _index_layout(kv_index), sparse)
    for planned in plan(key, lambda: _forward_plan(q, k, v, q_offsets, kv_offsets, kv_index, spec, sparse)):
        planned(tensors)
    return o, lse


def _forward_plan(q, k, v, q_offsets, kv_offsets, kv_index, spec: AttnSpec, sparse: bool) -> list[PlannedLaunch]:
    """The forward's launches for the layouts of these tensors: one per activation's heads. ``sparse``: the query
    sequences fill little of their declared lengths (``_sparse_grid``)."""
    B = q_offsets.shape[0] - 1 if spec.nq is None else kv_offsets.shape[0] - 1
    H, D = q.shape[1], q.shape[2]
    # NOTE: the plan outlives the call: what its functions read of the tensors is taken here, so that they do not
    # hold the tensors themselves
    itemsize = q.element_size()
    mask_kind, wl, wr, bs, kb = spec.mask_args
    F = _Fwd
    launches = []
    for act, head_ids in _head_groups(spec, q.device):
        code = ACT_CODES[act]
        # o [T_out, H, D] and lse [T_out, H] are new, contiguous
        args = (F.Q, F.K, F.V, F.O, F.LSE, F.Q_OFF, F.KV_OFF, F.KV_IDX, head_ids, F.K, F.V,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), H * D, D, H,
                spec.nq or 0, spec.sm_scale * _LOG2E, spec.pw_scale, wl, wr, bs, kb)
        # NOTE: a negative scale reverses the order of the scores (the max of the scaled scores is no longer the
        # scaled max), and a zero one would scale the masked keys' -inf to NaN: only a scale > 0 is folded into the
        # exponents (FOLD)
        consts = dict(ACT=code, MASK_KIND=mask_kind, Q_JAGGED=spec.nq is None, HAS_KV_IDX=kv_index is not None,
                      PREC=_prec(q.dtype), FOLD=spec.sm_scale > 0, BLOCK_D=D)
        key = ("fwd", code, mask_kind, spec.nq is None, kv_index is not None, D, q.dtype,
               _bucket(spec.max_q), _bucket(spec.max_kv), spec.block_size, spec.window_left is None,
               spec.window_right is None)
        nh = head_ids.numel()
        diagonal = _diagonal_blocks(spec)
        if diagonal or _short_kv(spec, D, itemsize):
            # no window / block arguments: each query sees its one key tile whole
            block_n = spec.block_size if diagonal else _pow2_at_least(spec.max_kv, 16)
            # descriptors for the streamed tiles: query tiles, and the diagonal's key tiles
            short_args, tma = _tiles(args[:9] + (F.Q, F.K, F.V) + args[11:-6] + (B,) + args[-6:-4], 9,
                                     [(q, F.Q, "BLOCK_M")] + ([(k, F.K, block_n), (v, F.V, block_n)] if diagonal else []))
            # a program streams Q_TILES query tiles: its grid runs over the real runs of that many
            grid, rows, compact = _tile_grid(B, nh, spec.max_q, F.Q, "BLOCK_M", sparse=sparse, tiles="Q_TILES")
            launches.append(PlannedLaunch(
                attn_fwd_short_kv_kernel, grid, short_args,
                dict(ACT=code, Q_JAGGED=spec.nq is None, HAS_KV_IDX=kv_index is not None, DIAGONAL=diagonal,
                     PREC=_prec(q.dtype), TMA=tma, FOLD=consts["FOLD"], BLOCK_D=D, BLOCK_N=block_n, **compact),
                ("fwd_short",) + key[1:], lambda: _short_kv_candidates(spec, D, itemsize), rows=rows))
            continue
        args = args[:-6] + (B,) + args[-6:]  # the general kernel also takes the number of examples, after NQ
        args, consts["TMA"] = _tiles(args, 9, [(k, F.K, "BLOCK_N"), (v, F.V, "BLOCK_N")])
        grid, rows, compact = _tile_grid(B, nh, spec.max_q, F.Q, "BLOCK_M", sparse=sparse)
        launches.append(PlannedLaunch(attn_fwd_kernel, grid, args, dict(consts, **compact), key,
                                      lambda: _candidates("fwd", spec, D), rows=rows))
    return launches


_DELTA_CANDIDATES = [dict(BLOCK_R=32, num_warps=4), dict(BLOCK_R=64, num_warps=8), dict(BLOCK_R=16, num_warps=4)]


def softmax_delta(do: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """``(do.float() * o.float()).sum(-1)`` for contiguous ``[T, H, D]`` tensors, in one Triton pass."""
    T, H, D = o.shape
    delta = torch.empty((T, H), dtype=torch.float32, device=o.device)
    rows = T * H
    if rows:
        launch(attn_bwd_delta_kernel, lambda c: (cdiv(rows, c["BLOCK_R"]),), (do, o, delta, rows),
               dict(D=D, BLOCK_D=next_power_of_2(D)), ("delta", D, o.dtype), _DELTA_CANDIDATES)
    return delta


def attention_backward(do, q, k, v, o, lse, q_offsets, kv_offsets, kv_index, spec: AttnSpec, grads=None):
    """dq, dk, dv. ``grads``: the (dq, dk, dv) tensors to write, e.g. views of one projection's gradient ([T, H, D],
    unit stride in the last dimension), any of them None for a new one."""
    H, D = q.shape[1], q.shape[2]
    R = kv_offsets.shape[0] - 1
    B = q_offsets.shape[0] - 1 if spec.nq is None else R
    do = do.contiguous()
    fused = _fused_backward(spec, kv_index, D)
    # delta = rowsum(dO * O), [T_out, H]: only the softmax heads read it. The one-launch backward and the few
    # broadcast queries (PMA) compute it from O in their kernels; in the general pair of kernels the dQ kernel does,
    # for its query rows, and stores it for the dK / dV kernel launched after it.
    broadcast = _broadcast_q(spec) and kv_index is None
    delta_from_o = broadcast and o.stride() == do.stride()
    if fused:
        delta = lse  # not read
    elif broadcast:
        delta = o if delta_from_o else softmax_delta(do, o)
    else:
        delta = torch.empty(o.shape[:2], dtype=torch.float32, device=o.device)
    dq, dk, dv = grads if grads is not None else (None, None, None)
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    if dq is None:
        # NOTE: broadcast queries collect one partial dQ per example, summed afterwards (deterministic).
        dq = torch.empty_like(q) if spec.nq is None else torch.empty((B * spec.nq, H, D), dtype=torch.float32,
                                                                     device=q.device)
    elif spec.nq is not None:
        raise ValueError("broadcast queries (PMA) sum their gradient from per-example partials: pass dq as None")
    if kv_index is not None:
        order = torch.argsort(kv_index, stable=True)
        cand_off = torch.searchsorted(kv_index[order], torch.arange(R + 1, device=q.device))
        cand_ids = order
    else:
        cand_off = cand_ids = kv_offsets
    tensors = (do, q, k, v, o, lse, delta, dq, dk, dv, kv_offsets if q_offsets is None else q_offsets, kv_offsets,
               cand_off, cand_ids, kv_offsets if kv_index is None else kv_index)
    # (the query sequences' and the kv sequences' fill of their declared lengths: see _sparse_grid)
    sparse = (q_offsets is not None and _sparse_grid(q.shape[0], B, spec.max_q), _sparse_grid(k.shape[0], R, spec.max_kv))
    key = ("bwd", spec, q.get_device(), TMA_LOADS, _layout(do), _layout(q), _layout(k), _layout(v), _layout(o), lse.stride(),
           _layout(dq), _layout(dk), _layout(dv), delta_from_o, _index_layout(q_offsets), _index_layout(kv_offsets),
           _index_layout(kv_index), sparse)
    for planned in plan(key, lambda: _backward_plan(do, q, k, v, o, lse, dq, dk, dv, kv_index is not None, spec, B, R,
                                                    fused, broadcast, delta_from_o, sparse)):
        planned(tensors)
    if spec.nq is not None:  # the broadcast queries' gradient: the per-example partials summed
        dq = sum_rows(dq.view(B, spec.nq * H * D), q.dtype).view(spec.nq, H, D)
    return dq, dk, dv


def _backward_plan(do, q, k, v, o, lse, dq, dk, dv, has_kv_index: bool, spec: AttnSpec, B: int, R: int, fused: bool,
                   broadcast: bool, delta_from_o: bool, sparse: tuple[bool, bool]) -> list[PlannedLaunch]:
    """The backward's launches for the layouts of these tensors: per activation's heads, the one-launch backward
    (short kv sequences, diagonal blocks), the broadcast queries' one (PMA), or dQ then dK / dV. ``sparse``: whether
    the query and the kv sequences fill little of their declared lengths (``_sparse_grid``)."""
    D = q.shape[2]
    itemsize = q.element_size()  # (the plan must not hold the tensors: see _forward_plan)
    mask_kind, wl, wr, bs, kb = spec.mask_args
    G = _Bwd
    launches = []
    for act, head_ids in _head_groups(spec, q.device):
        code = ACT_CODES[act]
        scale = spec.sm_scale if code == 0 else spec.pw_scale
        nh = head_ids.numel()
        common = dict(ACT=code, MASK_KIND=mask_kind, Q_JAGGED=spec.nq is None, PREC=_prec(q.dtype), BLOCK_D=D)
        key_tail = (code, mask_kind, spec.nq is None, has_kv_index, D, q.dtype, _bucket(spec.max_q),
                    _bucket(spec.max_kv), spec.block_size, spec.window_left is None, spec.window_right is None)
        strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                   do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0))
        scales = (spec.nq or 0, spec.sm_scale * _LOG2E, scale, 1.0 if code == 0 else scale)
        if fused:
            diagonal = _diagonal_blocks(spec)
            fargs = (G.Q, G.K, G.V, G.O, G.DO, G.LSE, G.DQ, G.DK, G.DV, G.Q_OFF, G.KV_OFF, head_ids,
                     q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                     o.stride(0), o.stride(1), do.stride(0), do.stride(1), dq.stride(0), dq.stride(1),
                     dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), lse.stride(0),
                     spec.sm_scale * _LOG2E, scale, scale, 1.0 if code == 0 else scale)
            seq_major = _seq_major(B)
            launches.append(PlannedLaunch(
                attn_bwd_short_kv_kernel,
                (lambda c, nh=nh, sm=seq_major: _declared_grid(cdiv(spec.max_q, c["BLOCK_M"] * c["Q_TILES"]), B, nh,
                                                               sm))
                if diagonal else (lambda c, nh=nh, sm=seq_major: _declared_grid(1, B, nh, sm)), fargs,
                dict(ACT=code, DIAGONAL=diagonal, PREC=_prec(q.dtype), BLOCK_D=D, SEQ_MAJOR=seq_major,
                     BLOCK_N=spec.block_size if diagonal else _pow2_at_least(spec.max_kv, 16)),
                ("bwd_short",) + key_tail, lambda: _short_kv_bwd_candidates(spec, D, itemsize)))
            continue
        if broadcast:  # example r reads kv sequence r
            # one program per kv sequence: dK / dV of its key tiles and the example's dQ partial, in one pass
            bargs = (G.Q, G.K, G.V, G.DO, G.LSE, G.DELTA, G.DK, G.DV, G.DQ, G.KV_OFF, head_ids, *strides,
                     dq.stride(0), dq.stride(1), *scales, scale)
            seq_major = _seq_major(R)
            launches.append(PlannedLaunch(
                attn_bwd_broadcast_q_kernel, lambda c, nh=nh, sm=seq_major: _declared_grid(1, R, nh, sm), bargs,
                dict(ACT=code, PREC=_prec(q.dtype), BLOCK_D=D, BLOCK_M=_pow2_at_least(spec.nq, 16),
                     DELTA_FROM_O=delta_from_o, SEQ_MAJOR=seq_major),
                ("bwd_broadcast_q",) + key_tail, lambda: _broadcast_q_candidates(spec, D, itemsize)))
            continue
        # dQ first: it writes delta (softmax heads) for dK / dV. The streamed tiles through tensor descriptors where
        # their layouts allow (see attn_fwd_kernel).
        args, tma = _tiles(
            (G.Q, G.K, G.V, G.O, G.DO, G.LSE, G.DELTA, G.DQ, G.Q_OFF, G.KV_OFF, G.KV_IDX, head_ids, G.K, G.V,
             q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
             o.stride(0), o.stride(1), do.stride(0), do.stride(1), dq.stride(0), dq.stride(1), lse.stride(0),
             spec.nq or 0, B, spec.sm_scale * _LOG2E, scale, wl, wr, bs, kb), 12,
            [(k, G.K, "BLOCK_N"), (v, G.V, "BLOCK_N")])
        grid, rows, compact = _tile_grid(B, nh, spec.max_q, G.DO, "BLOCK_M", sparse=sparse[0])
        launches.append(PlannedLaunch(
            attn_bwd_dq_kernel, grid, args,
            dict(common, HAS_KV_IDX=has_kv_index, TMA=tma, DELTA_FROM_O=code == 0, **compact),
            ("dq",) + key_tail, lambda: _candidates("dq", spec, D), rows=rows))
        args, tma = _tiles(
            (G.Q, G.K, G.V, G.DO, G.LSE, G.DELTA, G.DK, G.DV, G.Q_OFF, G.KV_OFF, G.CAND_OFF, G.CAND_IDS, head_ids,
             G.Q, G.DO, *strides, scales[0], R, *scales[1:], wl, wr, bs, kb), 13,
            [(q, G.Q, "BLOCK_M"), (do, G.DO, "BLOCK_M")])
        grid, rows, compact = _tile_grid(R, nh, spec.max_kv, G.K, "BLOCK_N", sparse=sparse[1])
        launches.append(PlannedLaunch(
            attn_bwd_dkdv_kernel, grid, args,
            dict(common, HAS_CAND=has_kv_index, TMA=tma, **compact),
            ("dkdv",) + key_tail, lambda: _candidates("dkdv", spec, D, itemsize), rows=rows))
    return launches


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_offsets, kv_offsets, kv_index, spec):
        o, lse = attention_forward(q, k, v, q_offsets, kv_offsets, kv_index, spec)
        ctx.save_for_backward(q, k, v, o, lse, q_offsets, kv_offsets, kv_index)
        ctx.spec = spec
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, q_offsets, kv_offsets, kv_index = ctx.saved_tensors
        dq, dk, dv = attention_backward(do, q, k, v, o, lse, q_offsets, kv_offsets, kv_index, ctx.spec)
        return dq, dk, dv, None, None, None, None


class _TritonPackedKvAttention(torch.autograd.Function):
    """Attention whose k and v are the two slots of one ``kv [Tk, 2, H, D]`` (a fused key-value projection): the
    backward writes dk and dv into one gradient of kv, where two gradients of its slots would be stacked by autograd
    in a pass of their own."""

    @staticmethod
    def forward(ctx, q, kv, q_offsets, kv_offsets, kv_index, spec):
        k, v = kv.unbind(1)
        o, lse = attention_forward(q, k, v, q_offsets, kv_offsets, kv_index, spec)
        ctx.save_for_backward(q, kv, o, lse, q_offsets, kv_offsets, kv_index)
        ctx.spec = spec
        return o

    @staticmethod
    def backward(ctx, do):
        q, kv, o, lse, q_offsets, kv_offsets, kv_index = ctx.saved_tensors
        dkv = torch.empty_like(kv)
        dq, _, _ = attention_backward(do, q, *kv.unbind(1), o, lse, q_offsets, kv_offsets, kv_index, ctx.spec,
                                      grads=(None, *dkv.unbind(1)))
        return dq, dkv, None, None, None, None


@eager_under_compile
def triton_attention(q, k, v, q_offsets, kv_offsets, kv_index, spec: AttnSpec) -> torch.Tensor:
    """q [Tq, H, D] jagged by q_offsets, or [Nq, H, D] broadcast (q_offsets None, spec.nq set); k, v [Tk, H, D]
    jagged by kv_offsets; returns [Tq, H, D] or [B, Nq, H, D]."""
    # NOTE: the kernels take row and head strides: views split from one fused projection are read in place
    # (copying them cost ~6 ms a step of the H200 benchmark), only a strided last dimension is copied
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    o = _TritonAttention.apply(q, k, v, q_offsets, kv_offsets, kv_index, spec)
    return o if spec.nq is None else o.view(-1, spec.nq, q.shape[1], q.shape[2])


@eager_under_compile
def triton_packed_kv_attention(q, kv, q_offsets, kv_offsets, kv_index, spec: AttnSpec) -> torch.Tensor:
    """``triton_attention`` with k and v the slots of ``kv [Tk, 2, H, D]`` (see _TritonPackedKvAttention)."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    o = _TritonPackedKvAttention.apply(q, kv, q_offsets, kv_offsets, kv_index, spec)
    return o if spec.nq is None else o.view(-1, spec.nq, q.shape[1], q.shape[2])
