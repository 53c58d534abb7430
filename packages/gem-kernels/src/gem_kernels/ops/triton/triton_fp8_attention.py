"""Softmax self-attention on FP8 tensor cores (JFA and BlockAttention masks), forward and backward.

Q and K are E4M3 with one power-of-two scale per token and head (rows along the head dimension, the contraction of
``Q K^T``); V is E4M3 with one scale per head channel over all tokens (the contraction of ``P V`` runs over
tokens, so its scale must not vary along them), stored transposed ``[H * D, T]`` so that a tile is contiguous
along the contracted tokens, as Hopper's FP8 products want their second operand. All three come from
``gem_kernels.fp8``'s quantiser in one pass each. K's and V^T's tiles come through tensor descriptors (the TMA
unit) where the general kernels' do (``triton_attention.TMA_LOADS``), else through pointer loads; for those, V's
columns are laid out so that every sequence starts at a multiple of 16 (zeros between sequences): a tile of V^T is
then read from 16-byte aligned addresses in wide loads (dense columns start a sequence anywhere, and the compiler
must read such a tile byte by byte). Inside,
``S = (Q8 K8^T) * q_scale * k_scale`` in float32, the online softmax as in the bf16 kernel, and ``P`` (in [0, 1])
is multiplied by 256 and rounded to E4M3 for the second product; the output is divided by 256 and V's channel
scales at the end. The forward also writes each row's log-sum-exp, as the bf16 kernel does.

The backward is the exact gradient of attention at the quantised operands (the quantiser passes gradients
through unchanged, a straight-through estimate): the operands are kept in FP8 between the passes (a byte per
value), dequantised to the input's dtype in one pass each (exact: every scale is a power of two) and run through
the bf16 backward kernels against the stored output and log-sum-exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_kernels.fp8 import fp8_attention_dequantize, fp8_attention_operands, sequence_aligned_layout
from gem_kernels.ops.triton._tuning import cdiv, eager_under_compile, interpreting, launch, next_power_of_2
from gem_kernels.ops.triton import triton_attention
from gem_kernels.ops.triton.triton_attention import TensorDescriptor, _declared_grid, _seq_major, attention_backward
from gem_kernels.ops.triton.triton_attention_kernels import (MASKED_SCORE, _declared_tile, _key_tiles, _load_cols,
                                                              _online_softmax, _softmax_output, _store_rows, _visible)
from gem_kernels.ops.triton.triton_fp8 import _round_to_e4m3

P_SCALE = tl.constexpr(256.0)  # P in [0, 1] -> [0, 256]: E4M3's largest power of two below 448
P_LOG2 = tl.constexpr(8.0)  # log2(P_SCALE)


@triton.jit
def _fp8_tiles(acc, m_i, l_i, q, q_scale, K_base, KS_base, VT_base, K_desc, VT_desc, k_row, v_col, h_col, stride_kt,
               stride_ks, VW, offs_m, offs_d, start, end, k_len, Wl, Wr, BS, KB, MASK_KIND: tl.constexpr,
               MASKED: tl.constexpr, EXACT_CAST: tl.constexpr, FOLD: tl.constexpr, TMA: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """``TMA``: K's and V^T's tiles through tensor descriptors (``K_desc``: K as ``[T, H * D]``, a tile from row
    ``k_row + n0``; ``VT_desc``: V^T, a ``[D, BLOCK_N]`` tile from column ``v_col + n0``; head column ``h_col``), as
    the bf16 kernel reads K and V: whole-tile copies in place of the pointer loads' address and mask arithmetic."""
    # V^T's columns up to the next multiple of 16 belong to this sequence (zeros past its end): masking at that
    # bound keeps the mask constant over 16 columns, so the loads stay wide
    v_len = tl.multiple_of((k_len + 15) // 16 * 16, 16)
    # a segment that has tiles starts at a multiple of BLOCK_N (``_segments``); written so that the compiler sees
    # it too, and reads V^T's tiles in wide, pipelined copies (tl.multiple_of on a loop bound does not survive)
    first = start // BLOCK_N * BLOCK_N
    for n0 in range(first, first + tl.cdiv(end - start, BLOCK_N) * BLOCK_N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kmask = offs_n < k_len
        if TMA:
            # NOTE: a tile crossing the sequence's end reads the next sequence's keys and V^T columns. Its scores are
            # masked by a select, so a non-finite key there never reaches them; its V^T columns meet zero
            # probabilities, and they are finite: V's scale is one per channel over every token, so a non-finite
            # value makes its whole channel NaN in every sequence, read from anywhere (the pointer loads' zeros
            # give the same bits)
            kt = tl.trans(K_desc.load([k_row + n0, h_col]))  # [D, BLOCK_N]
            v = tl.trans(VT_desc.load([h_col, v_col + n0]))  # [BLOCK_N, D] of V^T
        else:
            kt = _load_cols(K_base, offs_n, stride_kt, offs_d, kmask, MASKED)  # [D, BLOCK_N]
            v_ptrs = VT_base + offs_n[:, None] + offs_d[None, :].to(tl.int64) * VW  # [BLOCK_N, D] of V^T
            if MASKED:
                v = tl.load(v_ptrs, mask=(offs_n < v_len)[:, None], other=0.0)
            else:
                v = tl.load(v_ptrs)
        if MASKED:
            ks = tl.load(KS_base + offs_n * stride_ks, mask=kmask, other=0.0)
        else:
            ks = tl.load(KS_base + offs_n * stride_ks)
        s = tl.dot(q, kt) * ks[None, :]
        if FOLD and not MASKED:
            # the query's scale (> 0) and P_SCALE folded into the exponents, as _online_softmax_scaled folds the
            # scale: one fused multiply-add per score where three multiplies and a subtraction were
            m_new = tl.maximum(m_i, tl.max(s, 1) * q_scale)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s * q_scale[:, None] - (m_new - P_LOG2)[:, None])  # P * P_SCALE
            l_i = l_i * alpha + tl.sum(p, 1) * (1.0 / P_SCALE)
            acc = acc * alpha[:, None]
            m_i = m_new
        else:
            s = s * q_scale[:, None]
            if MASKED:
                s = tl.where(_visible(offs_m, offs_n, kmask, Wl, Wr, BS, KB, MASK_KIND), s, MASKED_SCORE)
            p, m_i, l_i, acc = _online_softmax(s, m_i, l_i, acc)
            p = p * P_SCALE
        if EXACT_CAST:  # the interpreter's FP8 cast rounds wrongly; the GPU's is exact
            p = _round_to_e4m3(p)
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_i, l_i


@triton.jit
def attn_fwd_fp8_kernel(
    Q, QS, K, KS, VT, VS, O, LSE, OFF, V_OFF, VW, stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
    H, qk_scale, Wl, Wr, BS, KB, K_desc, VT_desc,
    MASK_KIND: tl.constexpr, EXACT_CAST: tl.constexpr, FOLD: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SEQ_MAJOR: tl.constexpr,
):
    b, pid_m = _declared_tile(SEQ_MAJOR)
    h = tl.program_id(2)
    start = tl.load(OFF + b)
    n = (tl.load(OFF + b + 1) - start).to(tl.int32)
    m0 = pid_m * BLOCK_M
    if m0 < n:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        qmask = offs_m < n
        rows = start + offs_m
        q = tl.load(Q + h * stride_qh + rows[:, None] * stride_qt + offs_d[None, :], mask=qmask[:, None], other=0.0)
        q_scale = tl.load(QS + rows * H + h, mask=qmask, other=0.0) * qk_scale
        K_base = K + h * stride_kh + start * stride_kt
        KS_base = KS + start * H + h
        v_col = tl.multiple_of(tl.load(V_OFF + b), 16)
        VT_base = VT + (h * BLOCK_D).to(tl.int64) * VW + v_col
        k_row, v_col, h_col = start.to(tl.int32), v_col.to(tl.int32), h * BLOCK_D
        lo_al, fs, fe, hi = _key_tiles(m0, n, n, Wl, Wr, BS, KB, MASK_KIND, BLOCK_M, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], MASKED_SCORE, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc, m_i, l_i = _fp8_tiles(acc, m_i, l_i, q, q_scale, K_base, KS_base, VT_base, K_desc, VT_desc, k_row, v_col,
                                   h_col, stride_kt, H, VW, offs_m, offs_d, lo_al, fs, n, Wl, Wr, BS, KB, MASK_KIND,
                                   True, EXACT_CAST, FOLD, TMA, BLOCK_N)
        acc, m_i, l_i = _fp8_tiles(acc, m_i, l_i, q, q_scale, K_base, KS_base, VT_base, K_desc, VT_desc, k_row, v_col,
                                   h_col, stride_kt, H, VW, offs_m, offs_d, fs, fe, n, Wl, Wr, BS, KB, MASK_KIND,
                                   False, EXACT_CAST, FOLD, TMA, BLOCK_N)
        acc, m_i, l_i = _fp8_tiles(acc, m_i, l_i, q, q_scale, K_base, KS_base, VT_base, K_desc, VT_desc, k_row, v_col,
                                   h_col, stride_kt, H, VW, offs_m, offs_d, fe, hi, n, Wl, Wr, BS, KB, MASK_KIND,
                                   True, EXACT_CAST, FOLD, TMA, BLOCK_N)
        v_scale = tl.load(VS + h * BLOCK_D + offs_d) / P_SCALE
        out, lse = _softmax_output(acc, m_i, l_i)  # as the bf16 kernel's, before V's channel scales
        _store_rows(O + h * stride_oh, rows, stride_ot, offs_d, (out * v_scale[None, :]).to(O.dtype.element_ty), qmask)
        tl.store(LSE + rows * H + h, lse, mask=qmask)


def _candidates(block_size: int | None) -> list[dict]:
    if interpreting():
        return [dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1)]
    # first: the fastest on the H200 on all three jfa cases (one warpgroup per 64 query rows; 128-row tiles on two
    # warpgroups ran 1.2-1.4x slower)
    cands = [(64, 128, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 128, 4, 4),
             (128, 64, 4, 4)]
    out = []
    for bm, bn, w, st in cands:
        if block_size is not None and block_size % 32 == 0:
            bm, bn = min(bm, block_size), min(bn, block_size)  # tiles inside blocks stay unmasked
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
        if cfg not in out:
            out.append(cfg)
    return out


def fp8_attention_inputs(q, k, v, offsets) -> tuple[tuple, torch.Tensor, torch.Tensor]:
    """What the kernel reads, from ``[T, H, D]`` q, k, v: the FP8 operands with their scales, V^T's first column
    of each sequence and the token of each of its columns."""
    v_starts, v_placed = sequence_aligned_layout(offsets, q.shape[0], kernel="triton")
    return fp8_attention_operands(q, k, v, kernel="triton", v_placed=v_placed), v_starts, v_placed


def _tma_tiles(k8: torch.Tensor, vt8: torch.Tensor, T: int, D: int) -> bool:
    """Whether the kernel reads K's and V^T's tiles through tensor descriptors: where the general kernels do
    (``triton_attention.TMA_LOADS``) and the TMA unit can (16-byte aligned starts and row strides)."""
    return (triton_attention.TMA_LOADS and TensorDescriptor is not None and T > 0 and k8.is_contiguous()
            and vt8.stride(1) == 1 and vt8.stride(0) % 16 == 0 and k8.data_ptr() % 16 == 0
            and vt8.data_ptr() % 16 == 0 and D % 16 == 0)


def fp8_attend(operands, v_starts, v_placed, offsets, max_len: int, spec, shape,
               dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The output ``[T, H, D]`` in ``dtype`` and the log-sum-exp ``[T, H]`` from ``fp8_attention_inputs``."""
    T, H, D = shape
    (q8, qs), (k8, ks), (vt8, vs) = operands
    o = torch.empty(shape, dtype=dtype, device=q8.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=q8.device)
    mask_kind, wl, wr, bs, kb = spec.mask_args
    B = offsets.shape[0] - 1
    args = (q8, qs, k8, ks, vt8, vs, o, lse, offsets, v_starts, v_placed.shape[0], H * D, D, H * D, D, H * D, D,
            H, spec.sm_scale * 1.4426950408889634, wl, wr, bs, kb)
    tma = _tma_tiles(k8, vt8, T, D)

    def with_tiles(c: dict) -> tuple:
        if not tma:
            return (*args, k8, vt8)  # (unread)
        return (*args, TensorDescriptor(k8.view(T, H * D), [T, H * D], [H * D, 1], [c["BLOCK_N"], D]),
                TensorDescriptor(vt8, list(vt8.shape), [vt8.stride(0), 1], [D, c["BLOCK_N"]]))

    seq_major = _seq_major(B)
    consts = dict(MASK_KIND=mask_kind, EXACT_CAST=interpreting(), FOLD=spec.sm_scale > 0, TMA=tma, BLOCK_D=D,
                  SEQ_MAJOR=seq_major)
    key = ("fwd_fp8", mask_kind, D, dtype, next_power_of_2(max_len), spec.block_size, tma)
    launch(attn_fwd_fp8_kernel, lambda c: _declared_grid(cdiv(max_len, c["BLOCK_M"]), B, H, seq_major), with_tiles,
           consts, key, lambda: _candidates(spec.block_size))
    return o, lse


def _fp8_forward(q, k, v, offsets, max_len: int, spec) -> tuple[torch.Tensor, torch.Tensor, tuple, torch.Tensor]:
    """The output, the log-sum-exp, the FP8 operands and V^T's column map (what the backward needs)."""
    operands, v_starts, v_placed = fp8_attention_inputs(q, k, v, offsets)
    o, lse = fp8_attend(operands, v_starts, v_placed, offsets, max_len, spec, q.shape, q.dtype)
    return o, lse, operands, v_placed


class _Fp8Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, max_len, spec):
        o, lse, operands, v_placed = _fp8_forward(q, k, v, offsets, max_len, spec)
        (q8, qs), (k8, ks), (vt8, vs) = operands
        ctx.save_for_backward(q8, qs, k8, ks, vt8, vs, v_placed, o, lse, offsets)
        ctx.spec, ctx.shape, ctx.dtype = spec, q.shape, q.dtype
        return o

    @staticmethod
    def backward(ctx, do):
        q8, qs, k8, ks, vt8, vs, v_placed, o, lse, offsets = ctx.saved_tensors
        q, k, v = fp8_attention_dequantize(((q8, qs), (k8, ks), (vt8, vs)), ctx.shape, ctx.dtype, v_placed,
                                           kernel="triton")
        dq, dk, dv = attention_backward(do, q, k, v, o, lse, offsets, offsets, None, ctx.spec)
        return dq, dk, dv, None, None, None


@eager_under_compile
def triton_fp8_attention(q, k, v, offsets, max_len: int, spec) -> torch.Tensor:
    """q, k, v ``[T, H, D]`` jagged by ``offsets``, softmax heads masked as ``spec`` (an ``AttnSpec``) says;
    returns ``[T, H, D]`` in q's dtype, differentiable (see the module docstring)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _Fp8Attention.apply(q, k, v, offsets, max_len, spec)
    return _fp8_forward(q, k, v, offsets, max_len, spec)[0]
