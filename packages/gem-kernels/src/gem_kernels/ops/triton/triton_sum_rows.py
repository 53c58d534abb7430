"""Column sums of fp32 partials, cast to the gradient's dtype, in one launch.

Backward kernels that must stay deterministic write one row of partial sums per program (the norms' weight and
bias gradients) or per example (PMA's broadcast-query gradient); this pass adds the rows up in a fixed order and
writes the result in its final dtype. In PyTorch ops the same finish is a sum and a cast per tensor: four
launches and allocations for a norm's weight and bias, each costing host time the GPU waits for in a short call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_kernels.ops.triton._tuning import cdiv, interpreting, launch, next_power_of_2


@triton.jit
def sum_rows_kernel(X, Y, OUT_X, OUT_Y, G, N, HAS_Y: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """OUT_X[n] = sum_g X[g, n] (and OUT_Y from Y) for contiguous [G, N] fp32 X, Y; a program owns BLOCK_N
    columns and walks the rows in BLOCK_G chunks, so every run adds in the same order."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc_x = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    acc_y = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        rows = (g0 + tl.arange(0, BLOCK_G)).to(tl.int64)
        mask = (rows < G)[:, None] & cmask[None, :]
        offs = rows[:, None] * N + cols[None, :]
        acc_x += tl.load(X + offs, mask=mask, other=0.0)
        if HAS_Y:
            acc_y += tl.load(Y + offs, mask=mask, other=0.0)
    tl.store(OUT_X + cols, tl.sum(acc_x, 0).to(OUT_X.dtype.element_ty), mask=cmask)
    if HAS_Y:
        tl.store(OUT_Y + cols, tl.sum(acc_y, 0).to(OUT_Y.dtype.element_ty), mask=cmask)


def _candidates(n: int) -> list[dict]:
    if interpreting():
        return [dict(BLOCK_G=4, BLOCK_N=16, num_warps=4)]
    block_n = min(64, next_power_of_2(n))
    return [dict(BLOCK_G=32, BLOCK_N=block_n, num_warps=4),
            dict(BLOCK_G=16, BLOCK_N=min(128, 2 * block_n), num_warps=4),
            dict(BLOCK_G=64, BLOCK_N=max(16, block_n // 2), num_warps=8)]


def sum_rows(x: torch.Tensor, dtype: torch.dtype, y: torch.Tensor | None = None, y_dtype: torch.dtype | None = None):
    """``x.sum(0).to(dtype)`` for a contiguous fp32 ``[G, N]`` x (and the same for y, of x's shape, into
    ``y_dtype``) in one launch; returns the sum, or both sums when y is given."""
    G, N = x.shape
    out_x = torch.empty(N, dtype=dtype, device=x.device)
    out_y = None if y is None else torch.empty(N, dtype=y_dtype or dtype, device=x.device)
    launch(sum_rows_kernel, lambda c: (cdiv(N, c["BLOCK_N"]),), (x, x if y is None else y, out_x,
           out_x if out_y is None else out_y, G, N), dict(HAS_Y=y is not None),
           ("sum_rows", y is not None, next_power_of_2(N), dtype), lambda: _candidates(N))
    return out_x if y is None else (out_x, out_y)
