"""Fused LayerNorm / RMSNorm (+ residual add) in Triton, forward and backward.

Forward: one pass reads x (and the residual), writes y (and the sum), and keeps per-row mean / rstd in fp32.
With ``skip`` x itself is a second output (the skip path of a residual branch): no extra write, and the backward
adds the gradient that reaches it, as it adds the residual stream's.
Backward: each program walks a fixed, strided set of row tiles and keeps its weight / bias gradient partials in
registers; the partials are summed in a fixed order afterwards (``triton_sum_rows``), so the result is
deterministic (no atomics).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from gem_kernels.fp8 import E4M3_MAX, padded
from gem_kernels.ops.triton._tuning import cdiv, eager_under_compile, interpreting, launch, next_power_of_2
from gem_kernels.ops.triton.triton_fp8 import store_fp8_rows
from gem_kernels.ops.triton.triton_sum_rows import sum_rows

_E4M3_MAX = tl.constexpr(E4M3_MAX)  # a kernel reads module globals only as constexprs


@triton.jit
def norm_fwd_kernel(
    X, RES, W, B, Y, H, MEAN, RSTD, Q, S, W2, B2, Y2, M, M_out, N, eps, stride_x, stride_r, stride_y, stride_h,
    IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, FP8: tl.constexpr, EXACT_CAST: tl.constexpr,
    TWO: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # FP8: y's rowwise E4M3 (for the scaled GEMM that reads y) goes to Q / S as well, rows M .. M_out padding
    # TWO: a second affine of the same normalised rows, y2 = xhat * W2 + B2 (laid out as y)
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(RES + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(H + rows[:, None] * stride_h + cols[None, :], x.to(H.dtype.element_ty), mask=mask)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, 1) / N
        tl.store(MEAN + rows, mean, mask=rmask)
        xc = tl.where(cmask[None, :], x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=rmask)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    xhat = xc * rstd[:, None]
    y = xhat * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    y = y.to(Y.dtype.element_ty)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y, mask=mask)
    if TWO:
        y2 = xhat * tl.load(W2 + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        y2 += tl.load(B2 + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y2 + rows[:, None] * stride_y + cols[None, :], y2.to(Y2.dtype.element_ty), mask=mask)
    if FP8:
        store_fp8_rows(Q, S, y.to(tl.float32), rows, cols, M, N, M_out, N, _E4M3_MAX, EXACT_CAST)


@triton.jit
def _bwd_load(XN, DY, MEAN, RSTD, t, M, cols, cmask, stride_x, stride_dy, IS_RMS: tl.constexpr, ROWS: tl.constexpr):
    """Row tile t of the saved input, dy and the row statistics, in storage precision (zeros past row M)."""
    rows = (t * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    rmask = rows < M
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(XN + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
    if IS_RMS:
        mean = rstd * 0.0
    else:
        mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
    return x, dy, mean, rstd


@triton.jit
def norm_bwd_kernel(
    XN, DY, DH, W, MEAN, RSTD, DX, DR, DW, DB, DY2, W2, DW2, DB2, M, N, stride_x, stride_dy, stride_dh, stride_dx,
    IS_RMS: tl.constexpr, HAS_DH: tl.constexpr, HAS_DR: tl.constexpr, HAS_BIAS: tl.constexpr, TWO: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr, PER_SM: tl.constexpr,
):
    # PER_SM only sizes the grid (programs per SM); it is a parameter so that the tuner's configs carry it.
    # TWO: the second affine's output gradient DY2 (laid out as DY) joins the first's: the normalised rows'
    # gradient is dy * w + dy2 * w2, and W2 / B2 get partials of their own
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    if TWO:
        w2 = tl.load(W2 + cols, mask=cmask, other=0.0).to(tl.float32)
    # NOTE: the weight / bias partials stay [ROWS, BLOCK_N] until the end: summing over the tile's rows once
    # per tile would put a cross-thread reduction in every iteration.
    dw = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    dw2 = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    db2 = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    n_tiles = tl.cdiv(M, ROWS)
    if PREFETCH:
        x_n, dy_n, mean_n, rstd_n = _bwd_load(XN, DY, MEAN, RSTD, pid, M, cols, cmask, stride_x, stride_dy,
                                              IS_RMS, ROWS)
    for t in range(pid, n_tiles, nprog):
        if PREFETCH:
            # the next tile's loads are issued before this tile's arithmetic, so they overlap it
            x_raw, dy_raw, mean, rstd = x_n, dy_n, mean_n, rstd_n
            x_n, dy_n, mean_n, rstd_n = _bwd_load(XN, DY, MEAN, RSTD, t + nprog, M, cols, cmask, stride_x,
                                                  stride_dy, IS_RMS, ROWS)
        else:
            x_raw, dy_raw, mean, rstd = _bwd_load(XN, DY, MEAN, RSTD, t, M, cols, cmask, stride_x, stride_dy,
                                                  IS_RMS, ROWS)
        rows = (t * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        mask = (rows < M)[:, None] & cmask[None, :]
        x = x_raw.to(tl.float32)
        dy = dy_raw.to(tl.float32)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        if TWO:
            dy2 = tl.load(DY2 + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            g += dy2 * w2[None, :]
            dw2 += dy2 * xhat
            db2 += dy2
        c1 = tl.sum(g * xhat, 1) / N
        if IS_RMS:
            dx = (g - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(g, 1) / N
            dx = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
        if HAS_DH:
            dx += tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_DR:  # the residual's gradient in its own dtype (laid out as DX)
            tl.store(DR + rows[:, None] * stride_dx + cols[None, :], dx.to(DR.dtype.element_ty), mask=mask)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(DW + pid * N + cols, tl.sum(dw, 0), mask=cmask)
    if HAS_BIAS:
        tl.store(DB + pid * N + cols, tl.sum(db, 0), mask=cmask)
    if TWO:
        tl.store(DW2 + pid * N + cols, tl.sum(dw2, 0), mask=cmask)
        tl.store(DB2 + pid * N + cols, tl.sum(db2, 0), mask=cmask)


MAX_WIDTH = 16384


def _fwd_cands(block_n: int) -> list[dict]:
    if interpreting():
        return [dict(ROWS=4, num_warps=4)]
    base = max(1, min(16, 8192 // block_n))
    cands = [dict(ROWS=base, num_warps=8), dict(ROWS=base, num_warps=4), dict(ROWS=max(1, base // 2), num_warps=4),
             dict(ROWS=min(32, base * 2), num_warps=8)]
    out = []
    for c in cands:
        if c not in out:
            out.append(c)
    return out


def _bwd_cands(block_n: int) -> list[dict]:
    """ROWS x BLOCK_N tiles, warps, register prefetch of the next tile and programs per SM (the backward is a
    persistent kernel: its partials have one row per program)."""
    if interpreting():
        return [dict(ROWS=4, num_warps=4, PREFETCH=True, PER_SM=1)]  # the other configs: test_triton_norms
    base = max(1, min(8, 4096 // block_n))
    # first (the untuned default): what run_all's tuning picked on the H200 at width 1024 (tuned/nvidia-h200.json)
    cands = [dict(ROWS=max(1, base // 2), num_warps=4, PREFETCH=True, PER_SM=4)]
    for rows in sorted({base, max(1, base // 2), max(1, base // 4), min(16, base * 2)}):
        for warps in (4, 8):
            for per_sm in (4, 8):
                for prefetch in (True, False):
                    c = dict(ROWS=rows, num_warps=warps, PREFETCH=prefetch, PER_SM=per_sm)
                    if c not in cands and per_sm * warps <= 64:
                        cands.append(c)
    return cands


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_bwd_programs(m: int, cfg: dict, device: torch.device) -> int:
    tiles = cdiv(m, cfg["ROWS"])
    if interpreting() or device.type != "cuda":
        return max(1, min(4, tiles))
    return max(1, min(cfg["PER_SM"] * _sm_count(device), tiles))


class _TritonNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, is_rms, skip=False, out_dtype=None, fp8_rows_to=0, weight2=None,
                bias2=None):
        # skip: x is also an output (the skip path); its gradient arrives as dh and is added in the backward.
        # out_dtype: y's dtype (None: x's); its gradient then arrives in it and is read as it is
        # fp8_rows_to: also return y's rowwise E4M3 and scales ([M, N] rows padded to a multiple of it, [.., 1]),
        # constants to autograd (the scaled GEMM that reads them has its own backward)
        # weight2 / bias2: a second affine of the same normalised rows, y2 returned right after y (layer norm only)
        shape = x.shape
        N = shape[-1]
        x2 = x.reshape(-1, N).contiguous()
        # the kernels read the affine parameters with unit stride (a parameter already has it: no copy)
        weight, bias, weight2, bias2 = (None if t is None else t.contiguous() for t in (weight, bias, weight2, bias2))
        M = x2.shape[0]
        res2 = None if residual is None else residual.reshape(-1, N).contiguous()
        y = torch.empty(x2.shape, dtype=out_dtype or x.dtype, device=x.device)
        two = weight2 is not None
        y2 = torch.empty_like(y) if two else y
        h = torch.empty_like(x2) if res2 is not None else x2
        mean = torch.empty(M, dtype=torch.float32, device=x.device)
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
        block_n = next_power_of_2(N)
        M_out = padded(M, fp8_rows_to) if fp8_rows_to else M
        q = torch.empty(M_out, N, dtype=torch.float8_e4m3fn, device=x.device) if fp8_rows_to else y
        s = torch.empty(M_out, dtype=torch.float32, device=x.device) if fp8_rows_to else mean
        args = (x2, x2 if res2 is None else res2, weight, weight if bias is None else bias, y, h, mean, rstd, q, s,
                weight2 if two else weight, bias2 if two else weight, y2, M, M_out, N, eps, x2.stride(0),
                x2.stride(0) if res2 is None else res2.stride(0), y.stride(0), h.stride(0))
        consts = dict(IS_RMS=is_rms, HAS_RES=res2 is not None, HAS_BIAS=bias is not None, FP8=bool(fp8_rows_to),
                      EXACT_CAST=bool(fp8_rows_to) and interpreting(), TWO=two, BLOCK_N=block_n)
        launch(norm_fwd_kernel, lambda c: (cdiv(M_out, c["ROWS"]),), args, consts,
               ("norm_fwd", is_rms, res2 is not None, bias is not None, block_n, x.dtype)
               + (() if y.dtype == x.dtype else (y.dtype,)) + (("fp8",) if fp8_rows_to else ()) + (("two",) if two else ()),
               lambda: _fwd_cands(block_n))
        ctx.save_for_backward(h, weight, bias, mean, rstd, weight2, bias2)
        ctx.is_rms, ctx.has_res, ctx.has_dh, ctx.shape = is_rms, res2 is not None, res2 is not None or skip, shape
        ctx.two = two
        # a residual of another dtype gets its gradient written in it by the kernel (no cast pass after)
        ctx.residual_dtype = None if res2 is None or res2.dtype == x.dtype else res2.dtype
        if fp8_rows_to:
            ctx.mark_non_differentiable(q, s)
            # NOTE: no zero gradients made for the E4M3 outputs (autograd would fill an [M, N] tensor for each)
            ctx.set_materialize_grads(False)
            ctx.y_dtype = y.dtype
            return (y.view(shape), *((h.view(shape),) if ctx.has_dh else ()), q, s[:, None])
        ys = (y.view(shape), y2.view(shape)) if two else (y.view(shape),)
        if not ctx.has_dh:
            return ys if two else ys[0]
        return *ys, h.view(shape)

    @staticmethod
    def backward(ctx, dy, *others):
        dy2, others = (others[0], others[1:]) if ctx.two else (None, others)
        dh = others[0] if ctx.has_dh else None  # the rest: the E4M3 outputs' (constants)
        h, weight, bias, mean, rstd, weight2, bias2 = ctx.saved_tensors
        if dy is None:  # gradients not materialised (E4M3 outputs) and y reached no loss, only the skip path did
            dy = torch.zeros(ctx.shape, dtype=ctx.y_dtype, device=h.device)
        if ctx.two and (dy is None or dy2 is None):  # one of the two outputs reached no loss
            given = dy if dy is not None else dy2
            dy, dy2 = (torch.zeros_like(given) if g is None else g for g in (dy, dy2))
        N = h.shape[-1]
        M = h.shape[0]
        dy_rows = dy.reshape(-1, N).contiguous()
        dy2_rows = dy2.reshape(-1, N).contiguous().to(dy_rows.dtype) if ctx.two else dy_rows
        dh2 = None if (dh is None or not ctx.has_dh) else dh.reshape(-1, N).contiguous()
        dx = torch.empty_like(h)
        dr = None if ctx.residual_dtype is None else torch.empty(h.shape, dtype=ctx.residual_dtype, device=h.device)
        block_n = next_power_of_2(N)
        key = ("norm_bwd", ctx.is_rms, dh2 is not None, bias is not None, block_n, h.dtype) + (
            () if dy_rows.dtype == h.dtype else (dy_rows.dtype,)) + (() if dr is None else ("dr", dr.dtype)) + (
            ("two",) if ctx.two else ())
        partials = []

        def args(cfg):
            # one row of weight / bias partials per program, as many programs as this config launches
            G = _num_bwd_programs(M, cfg, h.device)
            # NOTE: one allocation for all partials (host time: this runs on autograd's device thread)
            kinds = (2 if bias is not None else 1) + (2 if ctx.two else 0)
            dw_db = torch.empty((kinds, G, N), dtype=torch.float32, device=h.device)
            dw, db = dw_db[0], dw_db[1 if bias is not None else 0]
            dw2, db2 = (dw_db[-2], dw_db[-1]) if ctx.two else (dw, db)
            partials[:] = [dw, db, dw2, db2]  # the last launch's are the result
            return (h, dy_rows, dy_rows if dh2 is None else dh2, weight, mean, rstd, dx, dx if dr is None else dr, dw, db,
                    dy2_rows, weight2 if ctx.two else weight, dw2, db2, M, N, h.stride(0), dy_rows.stride(0),
                    dy_rows.stride(0) if dh2 is None else dh2.stride(0), dx.stride(0))

        consts = dict(IS_RMS=ctx.is_rms, HAS_DH=dh2 is not None, HAS_DR=dr is not None, HAS_BIAS=bias is not None,
                      TWO=ctx.two, BLOCK_N=block_n)
        launch(norm_bwd_kernel, lambda c: (_num_bwd_programs(M, c, h.device),), args, consts, key,
               lambda: _bwd_cands(block_n))
        dw, db, dw2, db2 = partials
        dx = dx.view(ctx.shape)
        if bias is None:
            dweight, dbias = sum_rows(dw, weight.dtype), None
        else:
            dweight, dbias = sum_rows(dw, weight.dtype, db, bias.dtype)
        dweight2 = dbias2 = None
        if ctx.two:
            dweight2, dbias2 = sum_rows(dw2, weight2.dtype, db2, bias2.dtype)
        dresidual = (dx if dr is None else dr.view(ctx.shape)) if ctx.has_res else None
        return dx, dweight, dbias, dresidual, None, None, None, None, None, dweight2, dbias2


@eager_under_compile
def triton_layer_norm(x, weight, bias, eps, residual=None, skip=False, out_dtype=None, fp8_rows_to=0, weight2=None,
                      bias2=None):
    return _TritonNorm.apply(x, weight, bias, residual, eps, False, skip, out_dtype, fp8_rows_to, weight2, bias2)


@eager_under_compile
def triton_rms_norm(x, weight, eps, residual=None, skip=False, out_dtype=None):
    return _TritonNorm.apply(x, weight, None, residual, eps, True, skip, out_dtype)
