"""Rotary embedding of queries and keys in one Triton pass, forward and backward.

One program takes a tile of tokens: it computes the tile's angles, cosines and sines once (float32) and
rotates every head of q and of k with them, reading each input once (its pair partners again, from cache) and
writing each output once. The backward is the same rotation by the opposite angle (a rotation's transpose), so
one kernel serves both.
Inputs may be strided views (q and k split from one fused projection); outputs are contiguous.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gem_kernels.ops.triton._tuning import launch


@triton.jit
def rotary_kernel(
    Q, K, QO, KO, POS, T, stride_qt, stride_qh, stride_kt, stride_kh, log2_base, sign,
    H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
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
        o_at = rows[:, None] * (H * D) + h * D + cols[None, :]
        q = tl.load(Q + q_at + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q_partner = tl.load(Q + q_at + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(QO + o_at, (q * cos + q_partner * sin).to(QO.dtype.element_ty), mask=mask)
        k_at = rows[:, None] * stride_kt + h * stride_kh
        k = tl.load(K + k_at + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        k_partner = tl.load(K + k_at + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(KO + o_at, (k * cos + k_partner * sin).to(KO.dtype.element_ty), mask=mask)


_CANDIDATES = [dict(BLOCK_T=16, num_warps=4), dict(BLOCK_T=32, num_warps=8), dict(BLOCK_T=8, num_warps=4)]


def _rotate(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, base: float, sign: float):
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    T, H, D = q.shape
    q_out, k_out = torch.empty(T, H, D, dtype=q.dtype, device=q.device), torch.empty(T, H, D, dtype=k.dtype, device=k.device)
    args = (q, k, q_out, k_out, positions, T, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            math.log2(base), sign)
    consts = dict(H=H, D=D, BLOCK_D=triton.next_power_of_2(D))
    launch(rotary_kernel, lambda c: (triton.cdiv(T, c["BLOCK_T"]),), args, consts,
           ("rotary", H, D, q.dtype), _CANDIDATES)
    return q_out, k_out


class _TritonRotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, positions, base):
        positions = positions.contiguous()
        ctx.save_for_backward(positions)
        ctx.base = base
        return _rotate(q, k, positions, base, 1.0)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        (positions,) = ctx.saved_tensors
        dq, dk = _rotate(dq_out, dk_out, positions, ctx.base, -1.0)
        return dq, dk, None, None


def triton_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, base: float):
    return _TritonRotary.apply(q, k, positions, base)
