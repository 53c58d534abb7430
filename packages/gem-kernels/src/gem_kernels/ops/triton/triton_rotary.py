"""Rotary embedding of queries and keys in one Triton pass, forward and backward.

One program takes a tile of tokens: it computes the tile's angles, cosines and sines once (float32) and
rotates every head of q and of k with them, reading each input once and writing each output once. The
backward is the same rotation by the opposite angle (a rotation's transpose), so one kernel serves both.
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
    H: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    pairs = tl.arange(0, BLOCK_HALF)
    rmask = rows < T
    mask = rmask[:, None] & (pairs < HALF)[None, :]
    pos = tl.load(POS + rows, mask=rmask, other=0.0).to(tl.float32)
    freq = tl.exp2(-(pairs.to(tl.float32) / HALF) * log2_base)  # base ** (-2i / D)
    angle = pos[:, None] * freq[None, :]
    cos = tl.cos(angle)
    sin = tl.sin(angle) * sign
    even = 2 * pairs[None, :]
    for h in tl.static_range(H):
        q_at = rows[:, None] * stride_qt + h * stride_qh + even
        o_at = rows[:, None] * (H * 2 * HALF) + h * (2 * HALF) + even
        q0 = tl.load(Q + q_at, mask=mask, other=0.0).to(tl.float32)
        q1 = tl.load(Q + q_at + 1, mask=mask, other=0.0).to(tl.float32)
        tl.store(QO + o_at, (q0 * cos - q1 * sin).to(QO.dtype.element_ty), mask=mask)
        tl.store(QO + o_at + 1, (q0 * sin + q1 * cos).to(QO.dtype.element_ty), mask=mask)
        k_at = rows[:, None] * stride_kt + h * stride_kh + even
        k0 = tl.load(K + k_at, mask=mask, other=0.0).to(tl.float32)
        k1 = tl.load(K + k_at + 1, mask=mask, other=0.0).to(tl.float32)
        tl.store(KO + o_at, (k0 * cos - k1 * sin).to(KO.dtype.element_ty), mask=mask)
        tl.store(KO + o_at + 1, (k0 * sin + k1 * cos).to(KO.dtype.element_ty), mask=mask)


_CANDIDATES = [dict(BLOCK_T=32, num_warps=4), dict(BLOCK_T=16, num_warps=4), dict(BLOCK_T=64, num_warps=8)]


def _rotate(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, base: float, sign: float):
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    T, H, D = q.shape
    q_out, k_out = torch.empty(T, H, D, dtype=q.dtype, device=q.device), torch.empty(T, H, D, dtype=k.dtype, device=k.device)
    half = D // 2
    args = (q, k, q_out, k_out, positions, T, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            math.log2(base), sign)
    consts = dict(H=H, HALF=half, BLOCK_HALF=triton.next_power_of_2(half))
    launch(rotary_kernel, lambda c: (triton.cdiv(T, c["BLOCK_T"]),), args, consts,
           ("rotary", H, half, q.dtype), _CANDIDATES)
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
