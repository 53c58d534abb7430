"""Rotary embedding of queries and keys in one Triton pass, forward and backward.

One program takes a tile of tokens: it computes the tile's angles, cosines and sines once (float32) and
rotates every head of q and of k with them, reading each input once (its pair partners again, from cache) and
writing each output once. The backward is the same rotation by the opposite angle (a rotation's transpose), so
one kernel serves both.
Inputs may be strided views (q and k split from one fused projection); outputs are contiguous, or the inputs
themselves (``rotate_qk_in_place``: attention kernels then read q, k and v in the projection's buffer).
``qkv_rotary`` takes the fused projection ``[T, 3, H, D]`` whole: the same pass also writes v contiguous, and its backward
writes the projection's gradient in one buffer (where separate rotation, copy and stacking passes would each
read and write it again).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gem_kernels.ops.triton._tuning import cdiv, eager_under_compile, launch, next_power_of_2


@triton.jit
def rotary_kernel(
    Q, K, V, QO, KO, VO, POS, T, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, log2_base, sign,
    H: tl.constexpr, D: tl.constexpr, HAS_V: tl.constexpr, IN_PLACE: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # QO, KO (and VO) share the output strides ``stride_ot, stride_oh``; with HAS_V, v is copied along.
    # IN_PLACE: QO is Q and KO is K. A channel's pair partner may be loaded by another thread than the one storing
    # over it, so every load of a head is done before the barrier and every store after it.
    # NOTE: every load and store covers whole rows of D channels (wide, coalesced accesses); the pair partner
    # of each channel (2i <-> 2i + 1) is a second load of the same row, served from L1. Loading even and odd
    # channels apart and storing them apart (stride-2 accesses) ran at a sixteenth of the bandwidth.
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    partner = cols + 1 - 2 * (cols % 2)
    rmask = rows < T
    mask = rmask[:, None] & (cols < D)[None, :]
    pos = tl.load(POS + rows, mask=rmask, other=0.0).to(tl.float32)
    freq = tl.exp2(-((cols // 2).to(tl.float32) * 2.0 / D) * log2_base)  # base ** (-2i / D) for channel 2i, 2i + 1
    angle = pos[:, None] * freq[None, :]
    cos = tl.cos(angle)
    # out[2i] = x[2i] cos - x[2i+1] sin; out[2i+1] = x[2i+1] cos + x[2i] sin (sign -1: the inverse rotation)
    sin = tl.sin(angle) * tl.where(cols % 2 == 0, -sign, sign)[None, :]
    for h in tl.static_range(H):
        q_at = rows[:, None] * stride_qt + h * stride_qh
        o_at = rows[:, None] * stride_ot + h * stride_oh + cols[None, :]
        q = tl.load(Q + q_at + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q_partner = tl.load(Q + q_at + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        k_at = rows[:, None] * stride_kt + h * stride_kh
        k = tl.load(K + k_at + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        k_partner = tl.load(K + k_at + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        if IN_PLACE:
            tl.debug_barrier()
        tl.store(QO + o_at, (q * cos + q_partner * sin).to(QO.dtype.element_ty), mask=mask)
        tl.store(KO + o_at, (k * cos + k_partner * sin).to(KO.dtype.element_ty), mask=mask)
        if HAS_V:
            v = tl.load(V + rows[:, None] * stride_vt + h * stride_vh + cols[None, :], mask=mask, other=0.0)
            tl.store(VO + o_at, v.to(VO.dtype.element_ty), mask=mask)


_CANDIDATES = [dict(BLOCK_T=16, num_warps=4), dict(BLOCK_T=32, num_warps=8), dict(BLOCK_T=8, num_warps=4)]
# the in-place rotation's one config: the fastest of six timed on the H200 by hand at head dim 128
_IN_PLACE_CONFIG = dict(BLOCK_T=2, num_warps=2)


def _rotate(q, k, v, outputs, positions: torch.Tensor, base: float, sign: float) -> None:
    """Rotate ``q``, ``k`` (and copy ``v``, when given) ``[T, H, D]`` into ``outputs``, views with one layout."""
    T, H, D = q.shape
    qo = outputs[0]
    assert all(o.stride() == qo.stride() for o in outputs) and all(x.stride(-1) == 1 for x in (q, k, *outputs))
    vi, vo = (v, outputs[2]) if v is not None else (q, qo)  # not read without HAS_V
    args = (q, k, vi, outputs[0], outputs[1], vo, positions, T, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            vi.stride(0), vi.stride(1), qo.stride(0), qo.stride(1), math.log2(base), sign)
    in_place = outputs[0].data_ptr() == q.data_ptr()
    assert not in_place or (v is None and outputs[1].data_ptr() == k.data_ptr()
                            and qo.stride() == q.stride() == k.stride())
    consts = dict(H=H, D=D, HAS_V=v is not None, IN_PLACE=in_place, BLOCK_D=next_power_of_2(D))
    # NOTE: the tuner times a candidate by running it again, which an in-place rotation must not be: one config
    launch(rotary_kernel, lambda c: (cdiv(T, c["BLOCK_T"]),), args, consts,
           ("rotary", H, D, q.dtype, v is not None) + (("in_place",) if in_place else ()),
           [_IN_PLACE_CONFIG] if in_place else _CANDIDATES)


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _TritonRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, positions, base):
        positions = positions.contiguous()
        ctx.save_for_backward(positions)
        ctx.base = base
        q, k = _unit_stride(q), _unit_stride(k)
        outputs = (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device))
        _rotate(q, k, None, outputs, positions, base, 1.0)
        return outputs

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        (positions,) = ctx.saved_tensors
        dq_out, dk_out = _unit_stride(dq_out), _unit_stride(dk_out)
        grads = tuple(torch.empty(g.shape, dtype=g.dtype, device=g.device) for g in (dq_out, dk_out))
        _rotate(dq_out, dk_out, None, grads, positions, ctx.base, -1.0)
        return grads[0], grads[1], None, None


class _TritonQkvRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, positions, base):
        positions = positions.contiguous()
        ctx.save_for_backward(positions)
        ctx.base = base
        qkv = _unit_stride(qkv)
        T, _, H, D = qkv.shape
        outputs = tuple(torch.empty((T, H, D), dtype=qkv.dtype, device=qkv.device) for _ in range(3))
        _rotate(qkv[:, 0], qkv[:, 1], qkv[:, 2], outputs, positions, base, 1.0)
        return outputs

    @staticmethod
    def backward(ctx, dq, dk, dv):
        (positions,) = ctx.saved_tensors
        # an output that reached no loss has no gradient: zeros stand in
        given = next(g for g in (dq, dk, dv) if g is not None)
        dq, dk, dv = (_unit_stride(g) if g is not None else torch.zeros_like(given) for g in (dq, dk, dv))
        T, H, D = dq.shape
        dqkv = torch.empty((T, 3, H, D), dtype=dq.dtype, device=dq.device)
        _rotate(dq, dk, dv, (dqkv[:, 0], dqkv[:, 1], dqkv[:, 2]), positions, ctx.base, -1.0)
        return dqkv, None, None


def rotate_qk_in_place(qkv: torch.Tensor, positions: torch.Tensor, base: float, inverse: bool = False) -> None:
    """Rotate the q and k slots of a fused projection ``qkv [T, 3, H, D]`` (unit stride in D) where they lie (by the
    opposite angles with ``inverse``: a rotation's gradient)."""
    _rotate(qkv[:, 0], qkv[:, 1], None, (qkv[:, 0], qkv[:, 1]), positions.contiguous(), base, -1.0 if inverse else 1.0)


@eager_under_compile
def triton_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, base: float):
    return _TritonRotary.apply(q, k, positions, base)


@eager_under_compile
def triton_qkv_rotary(qkv: torch.Tensor, positions: torch.Tensor, base: float):
    return _TritonQkvRotary.apply(qkv, positions, base)
