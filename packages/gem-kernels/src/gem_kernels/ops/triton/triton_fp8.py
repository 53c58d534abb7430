"""Rowwise FP8 quantisation in Triton: the bits of ``gem_kernels.fp8.fp8_rowwise_quantize_reference``.

Two shapes of work:

- rows along the contiguous dimension (``dim=-1`` of a row-major matrix, the forward's activations and the
  output gradient), up to 8192 wide: one pass, each program holds a few whole rows in registers, reads them
  once and writes elements and scales;
- anything else (``dim=0``: a column's amax runs over all rows, e.g. the weight for the input-gradient GEMM):
  the reduced dimension is cut into chunks, one program per (row block, chunk) writes a partial amax, torch
  takes the max over chunks, and a second grid of the same shape scales and casts its chunk. Every program has
  work however long the reduced dimension is. With ``placed`` the second grid runs over the output's columns,
  each reading the input column placed there (or writing a zero).

``sequence_aligned_layout_kernel`` builds that map for attention's V^T in one launch: a program per sequence sums
the spans of the sequences before it (in blocks) for its first column, then writes its span's tokens.

``fp8_blocks_kernel`` gives the blockwise scales (``gem_kernels.fp8.fp8_blockwise_quantize``): a program reads a
tile that holds whole blocks (rows of 128 for 1 x 128, one block for 128 x 128, columns of 128 for 128 x 1), reduces
each block's amax in registers and writes its elements, transposed where asked, in the same pass.

The scale comes from the bits of ``amax`` (``_scale_fields``), the same integer arithmetic as the reference,
so both produce the same scale and, with an exact power-of-two scaling, the same elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_kernels.fp8 import E4M3_MAX, blockwise_scales, blockwise_shapes, padded
from gem_kernels.ops.triton._tuning import cdiv, interpreting, launch, next_power_of_2

_ONE_PASS_MAX = 8192  # widest contiguous row kept whole in registers
_ONE_PASS_ELEMENTS = 8192  # elements per program in the one-pass kernel
_CHUNK_ROWS, _CHUNK_COLS = 64, 128  # tile of the chunked kernels


@triton.jit
def _scale_fields(amax, bad):
    """Per row: the biased exponent field of the power-of-two scale (see gem_kernels.fp8)."""
    bits = amax.to(tl.int32, bitcast=True)
    field = bits >> 23
    mantissa = bits & 0x7FFFFF
    exponent = tl.where(mantissa <= 0x600000, field - 8, field - 7)
    exponent = tl.maximum(exponent, 1)
    return tl.where(bad != 0, 127, exponent)  # a non-finite row: any finite field (its scale is set to NaN)


@triton.jit
def _amax(x, axis: tl.constexpr):
    """The largest magnitude along ``axis``, infinite where a value is not finite: NaN counts as infinity (it
    compares false), so that one reduction finds both the amax and a non-finite row (a reduction across warps is a
    round trip through shared memory)."""
    ax = tl.abs(x)
    return tl.max(tl.where(ax < float("inf"), ax, float("inf")), axis)


@triton.jit
def _round_to_e4m3(q):
    """``q`` (float32, within +-448) rounded to E4M3's precision, ties to even, so that the cast after it is exact.

    Only under the interpreter (``EXACT_CAST``): the GPU's cast rounds the same, but the Triton interpreter's FP8
    conversion does not (a value just below a binade's top goes down a binade), and the CPU tests compare bits."""
    magnitude = tl.abs(q)
    bits = magnitude.to(tl.int32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # keep 3 of 23 mantissa bits
    subnormal = ((magnitude + 24576.0) - 24576.0).to(tl.int32, bitcast=True)  # multiples of 2^-9 (ulp of 1.5 * 2^14)
    rounded = tl.where(magnitude >= 0.015625, normal, subnormal)
    sign = (q.to(tl.int32, bitcast=True) >> 31) << 31
    return (rounded | sign).to(tl.float32, bitcast=True)


@triton.jit
def _store_scales(S, rows, fields, bad, R, R_out):
    scale = (fields << 23).to(tl.float32, bitcast=True)
    scale = tl.where(bad != 0, float("nan"), scale)
    scale = tl.where(rows < R, scale, 1.0)
    tl.store(S + rows, scale, mask=rows < R_out)


@triton.jit
def store_fp8_rows(Q, S, y, rows, cols, R, C, R_out, C_out, MAX: tl.constexpr, EXACT_CAST: tl.constexpr):
    """Epilogue for a kernel that holds whole rows: the rowwise E4M3 of the float32 tile ``y`` ``[ROWS, BLOCK_C]``
    (rows ``rows`` of ``R``, columns ``cols`` of ``C``) into ``Q`` (``[R_out, C_out]``, row-major) and its scales
    into ``S``: the bits ``fp8_rowwise_quantize`` gives for the same values. Rows in ``[R, R_out)`` and columns in
    ``[C, C_out)`` are padding (zeros; scale 1); ``y`` should hold the values as stored (a producer's: rounded to its
    output dtype). ``EXACT_CAST``: round to E4M3 before the cast (the interpreter's; the GPU's cast rounds right)."""
    y = tl.where((rows < R)[:, None] & (cols < C)[None, :], y, 0.0)
    amax = _amax(y, 1)
    bad = (amax == float("inf")).to(tl.int32)
    fields = _scale_fields(amax, bad)
    _store_scales(S, rows, fields, bad, R, R_out)
    inverse = ((254 - fields) << 23).to(tl.float32, bitcast=True)
    q = tl.where((bad == 0)[:, None], y * inverse[:, None], 0.0)
    q = tl.minimum(tl.maximum(q, -MAX), MAX)
    if EXACT_CAST:
        q = _round_to_e4m3(q)
    out = (rows < R_out)[:, None] & (cols < C_out)[None, :]
    tl.store(Q + rows[:, None] * C_out + cols[None, :], q.to(Q.dtype.element_ty), mask=out)


@triton.jit
def fp8_rows_kernel(X, Q, S, R, C, R_out, C_out, stride_r, MAX: tl.constexpr, EXACT_CAST: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(X + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    store_fp8_rows(Q, S, x, rows, cols, R, C, R_out, C_out, MAX, EXACT_CAST)


@triton.jit
def _chunk_of(row_blocks):
    """(row block, column chunk) of this program of a grid over ``row_blocks`` row blocks times the column chunks,
    row blocks first. One axis: the chunks along a grid's axis 1 would be capped at CUDA's 65,535 there (8.4M
    columns of 128, a token count where the columns are tokens: a weight gradient's, FP8 attention's V^T)."""
    pid = tl.program_id(0)
    return pid % row_blocks, pid // row_blocks


@triton.jit
def fp8_chunk_amax_kernel(X, AMAX, R, C, stride_r, stride_c, row_blocks, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Each row's amax over the chunk of columns, infinite where the chunk holds a non-finite value (``_amax``)."""
    block, chunk = _chunk_of(row_blocks)
    rows = (block * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = (chunk.to(tl.int64) * COLS + tl.arange(0, COLS)).to(tl.int64)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(X + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0).to(tl.float32)
    tl.store(AMAX + chunk.to(tl.int64) * R + rows, _amax(x, 1), mask=rows < R)


@triton.jit
def fp8_chunk_cast_kernel(X, AMAX, Q, S, SOURCE, R, C, R_out, C_out, stride_r, stride_c, row_blocks,
                          MAX: tl.constexpr, EXACT_CAST: tl.constexpr, PLACED: tl.constexpr, ROWS: tl.constexpr,
                          COLS: tl.constexpr):
    block, chunk = _chunk_of(row_blocks)
    rows = (block * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = (chunk.to(tl.int64) * COLS + tl.arange(0, COLS)).to(tl.int64)
    amax = tl.load(AMAX + rows, mask=rows < R, other=0.0)
    bad = (amax == float("inf")).to(tl.int32)
    fields = _scale_fields(amax, bad)
    if chunk == 0:
        _store_scales(S, rows, fields, bad, R, R_out)
    if PLACED:  # output column -> the input's column placed there (-1: none, a zero)
        source = tl.load(SOURCE + cols, mask=cols < C_out, other=-1)
        mask = (rows < R)[:, None] & (source >= 0)[None, :]
        x = tl.load(X + rows[:, None] * stride_r + source[None, :] * stride_c, mask=mask, other=0.0).to(tl.float32)
    else:
        mask = (rows < R)[:, None] & (cols < C)[None, :]
        x = tl.load(X + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0).to(tl.float32)
    inverse = ((254 - fields) << 23).to(tl.float32, bitcast=True)
    q = tl.where((bad == 0)[:, None], x * inverse[:, None], 0.0)
    q = tl.minimum(tl.maximum(q, -MAX), MAX)
    if EXACT_CAST:
        q = _round_to_e4m3(q)
    out = (rows < R_out)[:, None] & (cols < C_out)[None, :]
    tl.store(Q + rows[:, None] * C_out + cols[None, :], q.to(Q.dtype.element_ty), mask=out)


@triton.jit
def fp8_blocks_kernel(X, Q, S, R, C, R_out, stride_xr, stride_xc, stride_qr, stride_qc, stride_sr, stride_sc,
                      MAX: tl.constexpr, EXACT_CAST: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                      TR: tl.constexpr, TC: tl.constexpr):
    """Tile ``[TR, TC]`` of x (rows ``[R, R_out)`` zero padding) as E4M3 with one scale per ``BR x BC`` block (1 x
    128: the tile's rows; 128 x 128: the tile; 128 x 1: its columns). Element (r, c) goes to ``Q + r * stride_qr + c
    * stride_qc`` and block (i, j)'s scale to ``S + i * stride_sr + j * stride_sc`` (swapped strides: transposed)."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = (pid_r * TR + tl.arange(0, TR)).to(tl.int64)
    cols = (pid_c * TC + tl.arange(0, TC)).to(tl.int64)
    x = tl.load(X + rows[:, None] * stride_xr + cols[None, :] * stride_xc,
                mask=(rows < R)[:, None] & (cols < C)[None, :], other=0.0).to(tl.float32)
    if BR == 1:  # a block per row of the tile
        amax = _amax(x, 1)[:, None]
    elif BC == 1:  # a block per column
        amax = _amax(x, 0)[None, :]
    else:  # the tile is one block
        amax = tl.max(_amax(x, 1), 0)
    bad = (amax == float("inf")).to(tl.int32)
    fields = _scale_fields(amax, bad)
    inverse = ((254 - fields) << 23).to(tl.float32, bitcast=True)
    q = tl.where(bad == 0, x * inverse, 0.0)
    q = tl.minimum(tl.maximum(q, -MAX), MAX)
    if EXACT_CAST:
        q = _round_to_e4m3(q)
    tl.store(Q + rows[:, None] * stride_qr + cols[None, :] * stride_qc, q.to(Q.dtype.element_ty),
             mask=(rows < R_out)[:, None] & (cols < C)[None, :])
    scale = tl.where(bad != 0, float("nan"), (fields << 23).to(tl.float32, bitcast=True))
    if BR == 1:
        tl.store(S + rows[:, None] * stride_sr + pid_c * stride_sc, scale, mask=(rows < R_out)[:, None])
    elif BC == 1:
        tl.store(S + pid_r * stride_sr + cols[None, :] * stride_sc, scale, mask=(cols < C)[None, :])
    else:
        tl.store(S + pid_r * stride_sr + pid_c * stride_sc, scale)


def triton_fp8_blockwise_quantize(x: torch.Tensor, block: tuple[int, int], rows_to: int,
                                  transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``gem_kernels.fp8.fp8_blockwise_quantize_reference``'s bits in one pass."""
    R, C = x.shape
    R_out = padded(R, rows_to)
    (q_shape, s_shape) = blockwise_shapes((R, C), block, rows_to, transpose)
    q = torch.empty(q_shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = blockwise_scales(s_shape, block[::-1] if transpose else block, x.device)
    q_strides, s_strides = (q.stride()[::-1], s.stride()[::-1]) if transpose else (q.stride(), s.stride())
    br, bc = block
    # NOTE: a tile of whole blocks, ~4k elements: 32 rows of a 1 x 128 block, one 128 x 128 block, 32 columns of 128 x 1
    tile = (32, 128) if br == 1 else (128, 128) if bc != 1 else (128, 32)
    launch(fp8_blocks_kernel, lambda c: (cdiv(R_out, tile[0]), cdiv(C, tile[1])),
           (x, q, s, R, C, R_out, *x.stride(), *q_strides, *s_strides),
           dict(MAX=E4M3_MAX, EXACT_CAST=interpreting(), BR=br, BC=bc, TR=tile[0], TC=tile[1]),
           ("fp8_blocks", block, transpose, x.dtype), [dict(num_warps=4)])
    return q, s


@triton.jit
def fp8_dequantize_rows_kernel(Q, S, OUT, R, C, stride_r, stride_c, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """OUT[r, c] = Q[r, c] * S[r] in OUT's dtype (the float32 product rounded once, as torch converts it)."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    e = tl.load(Q + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(S + rows, mask=rows < R, other=0.0)
    tl.store(OUT + rows[:, None] * C + cols[None, :], (e * scale[:, None]).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def fp8_dequantize_transposed_kernel(Q, S, TOKEN, OUT, R, W, stride_r, stride_c, row_blocks, ROWS: tl.constexpr,
                                     COLS: tl.constexpr):
    """Q is ``[R, W]`` (rows: the kept dimension; columns: positions); OUT[TOKEN[p], r] = Q[r, p] * S[r] for every
    position holding a token (TOKEN[p] >= 0). Reads run along positions, writes along r: both contiguous."""
    block, chunk = _chunk_of(row_blocks)
    rows = (block * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = (chunk.to(tl.int64) * COLS + tl.arange(0, COLS)).to(tl.int64)
    token = tl.load(TOKEN + cols, mask=cols < W, other=-1)
    e = tl.load(Q + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=(rows < R)[:, None] & (cols < W)[None, :],
                other=0.0).to(tl.float32)
    scale = tl.load(S + rows, mask=rows < R, other=0.0)
    out = (e * scale[:, None]).to(OUT.dtype.element_ty)
    tl.store(OUT + token[None, :] * R + rows[:, None], out, mask=(rows < R)[:, None] & (token >= 0)[None, :])


@triton.jit
def sequence_aligned_layout_kernel(OFF, STARTS, TOKEN, B, W, MULTIPLE: tl.constexpr, STARTS_GIVEN: tl.constexpr,
                                   BLOCK_B: tl.constexpr, BLOCK: tl.constexpr):
    """Program b: STARTS[b], the spans (lengths rounded up to MULTIPLE) of sequences 0 .. b-1 summed (or, where
    ``STARTS_GIVEN``, read); TOKEN over its span: the token at each column, -1 past its length (the last program also
    fills the columns to W)."""
    b = tl.program_id(0)
    if STARTS_GIVEN:
        start = tl.load(STARTS + b).to(tl.int64)
    else:
        start = tl.zeros([], dtype=tl.int64)
        for c in range(0, b, BLOCK_B):
            idx = c + tl.arange(0, BLOCK_B)
            before = idx < b
            lengths = tl.load(OFF + idx + 1, mask=before, other=0) - tl.load(OFF + idx, mask=before, other=0)
            start += tl.sum((lengths + MULTIPLE - 1) // MULTIPLE * MULTIPLE)
        tl.store(STARTS + b, start)
    first = tl.load(OFF + b).to(tl.int64)
    n = tl.load(OFF + b + 1).to(tl.int64) - first
    stop = start + (n + MULTIPLE - 1) // MULTIPLE * MULTIPLE
    if b == B - 1:
        stop = W.to(tl.int64)
    for p0 in range(start, stop, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        j = p - start
        tl.store(TOKEN + p, tl.where(j < n, first + j, -1), mask=p < stop)


# each program of the layout kernel sums the spans of the sequences before it, work that grows with the square of the
# batch: past this many sequences, the starts come from one cumulative sum (a few torch launches) instead
IN_KERNEL_STARTS_MAX = 2048


def triton_sequence_aligned_layout(offsets: torch.Tensor, width: int, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``gem_kernels.fp8.sequence_aligned_layout``'s ``(starts, token)`` in one launch (after a cumulative sum of
    the starts, for batches of more than IN_KERNEL_STARTS_MAX sequences)."""
    B = offsets.shape[0] - 1
    given = B > IN_KERNEL_STARTS_MAX
    if given:
        lengths = (offsets[1:] - offsets[:-1]).long()
        spans = (lengths + multiple - 1) // multiple * multiple
        starts = torch.cumsum(spans, 0) - spans
    else:
        starts = torch.empty(B, dtype=torch.int64, device=offsets.device)
    token = torch.empty(width, dtype=torch.int64, device=offsets.device)
    launch(sequence_aligned_layout_kernel, lambda c: (B,), (offsets, starts, token, B, width),
           dict(MULTIPLE=multiple, STARTS_GIVEN=given), ("sequence_aligned_layout", multiple, given),
           [dict(BLOCK_B=1024, BLOCK=1024, num_warps=4)])
    return starts, token


def triton_fp8_dequantize(elements: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(elements.float() * scale).to(dtype)`` in one pass; ``elements`` ``[R, C]``, ``scale`` ``[R, 1]``."""
    R, C = elements.shape
    out = torch.empty(R, C, dtype=dtype, device=elements.device)
    block_c = next_power_of_2(C)
    rows = max(1, min(64, _ONE_PASS_ELEMENTS // block_c))
    launch(fp8_dequantize_rows_kernel, lambda c: (cdiv(R, c["ROWS"]),),
           (elements, scale, out, R, C, *elements.stride()),
           dict(BLOCK_C=block_c), ("fp8_dequantize_rows", block_c, dtype), [dict(ROWS=rows, num_warps=4)])
    return out


def triton_fp8_dequantize_transposed(elements: torch.Tensor, scale: torch.Tensor, token: torch.Tensor, tokens: int,
                                     dtype: torch.dtype) -> torch.Tensor:
    """``[tokens, R]`` from ``[R, W]`` E4M3 ``elements`` whose column ``p`` holds token ``token[p]`` (-1: none)."""
    R, W = elements.shape
    out = torch.empty(tokens, R, dtype=dtype, device=elements.device)
    row_blocks = cdiv(R, _CHUNK_ROWS)
    launch(fp8_dequantize_transposed_kernel, lambda c: (row_blocks * cdiv(W, c["COLS"]),),
           (elements, scale, token, out, R, W, *elements.stride(), row_blocks), {},
           ("fp8_dequantize_transposed", dtype), [dict(ROWS=_CHUNK_ROWS, COLS=_CHUNK_COLS, num_warps=4)])
    return out


def _one_pass_configs(block_c: int) -> list[dict]:
    """Launch configs of the one-pass kernel: the default first (``_ONE_PASS_ELEMENTS`` per program), then the
    alternatives GEM_KERNELS_AUTOTUNE=1 times."""
    default = dict(ROWS=max(1, min(64, _ONE_PASS_ELEMENTS // block_c)), num_warps=8 if block_c >= 2048 else 4)
    others = [dict(ROWS=rows, num_warps=warps) for rows in (1, 2, 4, 8, 16, 32, 64) for warps in (2, 4, 8, 16)
              if 512 <= rows * block_c <= 32768 and rows * block_c >= 32 * warps * 4]
    return [default] + [c for c in others if c != default]


def triton_fp8_rowwise_quantize(x: torch.Tensor, dim: int, rows_to: int, cols_to: int,
                                placed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    along_rows = dim % 2 == 1
    R, C = x.shape if along_rows else (x.shape[1], x.shape[0])  # kept, reduced
    stride_r, stride_c = (x.stride(0), x.stride(1)) if along_rows else (x.stride(1), x.stride(0))
    R_out, C_out = padded(R, rows_to), padded(C, cols_to) if placed is None else placed.shape[0]
    q = torch.empty(R_out, C_out, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(R_out, dtype=torch.float32, device=x.device)
    if placed is None and stride_c == 1 and C_out <= _ONE_PASS_MAX:
        block_c = next_power_of_2(C_out)
        launch(fp8_rows_kernel, lambda c: (cdiv(R_out, c["ROWS"]),), (x, q, s, R, C, R_out, C_out, stride_r),
               dict(MAX=E4M3_MAX, EXACT_CAST=interpreting(), BLOCK_C=block_c), ("fp8_rows", block_c, x.dtype),
               _one_pass_configs(block_c))
        return q, s[:, None]
    chunks = cdiv(C_out, _CHUNK_COLS)
    row_blocks = cdiv(R_out, _CHUNK_ROWS)
    amax = torch.empty(chunks, R, dtype=torch.float32, device=x.device)
    used = cdiv(C, _CHUNK_COLS)  # chunks wholly in the padding hold nothing
    fp8_chunk_amax_kernel[(row_blocks * used,)](x, amax, R, C, stride_r, stride_c, row_blocks,
                                                ROWS=_CHUNK_ROWS, COLS=_CHUNK_COLS)
    amax = amax[:used].amax(0)  # infinite: the row holds a non-finite value
    fp8_chunk_cast_kernel[(row_blocks * chunks,)](x, amax, q, s, q if placed is None else placed, R, C, R_out, C_out,
                                                  stride_r, stride_c, row_blocks, MAX=E4M3_MAX,
                                                  EXACT_CAST=interpreting(), PLACED=placed is not None,
                                                  ROWS=_CHUNK_ROWS, COLS=_CHUNK_COLS)
    return q, s[:, None]
