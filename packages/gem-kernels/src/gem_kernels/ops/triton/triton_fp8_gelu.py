"""GELU between two FP8 GEMMs, in Triton: each pass also writes the rowwise E4M3 of what it produces.

Forward: ``a = gelu(h)`` (erf form, float32 arithmetic, rounded once; ``h`` is the first GEMM's output, its bias
added in the GEMM's epilogue) and ``a``'s E4M3 rows and scales for the next GEMM. Backward: ``dh = da * gelu'(h)``
and ``dh``'s E4M3 rows for the input-gradient GEMM. Each program holds a few whole rows, so a row's scale is known
before its elements are written and nothing is read twice (``store_fp8_rows``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_kernels.fp8 import E4M3_MAX, padded
from gem_kernels.ops.triton._tuning import cdiv, interpreting, launch, next_power_of_2
from gem_kernels.ops.triton.triton_fp8 import store_fp8_rows

MAX_WIDTH = 8192  # widest row a program holds in registers
_ELEMENTS = 8192  # elements per program
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def gelu_fp8_fwd_kernel(H, A, Q, S, R, C, R_out, MAX: tl.constexpr, EXACT_CAST: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(H + rows[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = (0.5 * x * (1.0 + tl.math.erf(x * _SQRT1_2))).to(A.dtype.element_ty)
    tl.store(A + rows[:, None] * C + cols[None, :], a, mask=mask)
    store_fp8_rows(Q, S, a.to(tl.float32), rows, cols, R, C, R_out, C, MAX, EXACT_CAST)


@triton.jit
def gelu_fp8_bwd_kernel(DA, H, DH, Q, S, R, C, R_out, MAX: tl.constexpr, EXACT_CAST: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    da = tl.load(DA + rows[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.load(H + rows[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    cdf = 0.5 * (1.0 + tl.math.erf(x * _SQRT1_2))
    pdf = tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
    dh = (da * (cdf + x * pdf)).to(DH.dtype.element_ty)
    tl.store(DH + rows[:, None] * C + cols[None, :], dh, mask=mask)
    store_fp8_rows(Q, S, dh.to(tl.float32), rows, cols, R, C, R_out, C, MAX, EXACT_CAST)


def _configs(block_c: int) -> list[dict]:
    default = dict(ROWS=max(1, min(64, _ELEMENTS // block_c)), num_warps=8 if block_c >= 2048 else 4)
    if interpreting():
        return [default]
    others = [dict(ROWS=rows, num_warps=warps) for rows in (1, 2, 4, 8, 16) for warps in (4, 8, 16)
              if 1024 <= rows * block_c <= 32768]
    return [default] + [c for c in others if c != default]


def _outputs(R: int, C: int, rows_to: int, device) -> tuple[int, torch.Tensor, torch.Tensor]:
    R_out = padded(R, rows_to)
    return (R_out, torch.empty(R_out, C, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(R_out, dtype=torch.float32, device=device))


def triton_gelu_fp8(h: torch.Tensor, rows_to: int):
    """``(a, a_e4m3, a_scales)`` from a contiguous ``[R, C]`` ``h`` (see the module docstring)."""
    R, C = h.shape
    block_c = next_power_of_2(C)
    a = torch.empty_like(h)
    R_out, q, s = _outputs(R, C, rows_to, h.device)
    launch(gelu_fp8_fwd_kernel, lambda c: (cdiv(R_out, c["ROWS"]),), (h, a, q, s, R, C, R_out),
           dict(MAX=E4M3_MAX, EXACT_CAST=interpreting(), BLOCK_C=block_c), ("gelu_fp8_fwd", block_c, h.dtype),
           lambda: _configs(block_c))
    return a, q, s[:, None]


def triton_gelu_fp8_backward(da: torch.Tensor, h: torch.Tensor, rows_to: int):
    """``(dh, dh_e4m3, dh_scales)``: the gradient at GELU's input from ``da`` at its output (``[R, C]`` each)."""
    R, C = h.shape
    block_c = next_power_of_2(C)
    da = da.contiguous()
    dh = torch.empty_like(h)
    R_out, q, s = _outputs(R, C, rows_to, h.device)
    launch(gelu_fp8_bwd_kernel, lambda c: (cdiv(R_out, c["ROWS"]),), (da, h, dh, q, s, R, C, R_out),
           dict(MAX=E4M3_MAX, EXACT_CAST=interpreting(), BLOCK_C=block_c), ("gelu_fp8_bwd", block_c, h.dtype, da.dtype),
           lambda: _configs(block_c))
    return dh, q, s[:, None]
