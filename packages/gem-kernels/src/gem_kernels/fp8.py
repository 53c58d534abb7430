"""Rowwise and blockwise FP8 quantisation for Hopper's scaled GEMMs, the PyTorch reference.

A matrix is cut into rows along the dimension a GEMM contracts (``dim``), and each row gets one float32 scale:
``elements = x / scale`` in E4M3 (round to nearest even), ``x ~ elements * scale``. The result is always laid out
``[kept, reduced]`` (rows along the kept dimension, each row contiguous along the reduced one): for ``dim=0`` that
is the transpose, which is what ``torch._scaled_mm`` wants for the GEMMs that contract the other dimension.

The scale is the smallest power of two that brings the row's largest magnitude ``amax`` within E4M3's 448
(nothing saturates), computed on the bits of ``amax`` so that every implementation gets the same one:
``amax = m * 2^e`` with ``m`` in [1, 2) gives ``2^(e-8)`` when ``m <= 1.75`` (448 = 1.75 * 2^8), else ``2^(e-7)``.
Power-of-two scales make scaling and unscaling exact: the only rounding is the element's. The scale's exponent
is clamped to float32's normal range (down to 2^-126: an all-zero or all-tiny row gets it and zeros). A row
holding a NaN or an infinity gets a NaN scale and zero elements, so the GEMM's output row is NaN: loud, never a
silently finite number.

Blockwise scales (``fp8_blockwise_quantize``): one scale per ``block`` of the matrix instead of per row: 1 x 128
(a token's 128 channels: activations and gradients along the dimension their GEMM contracts), 128 x 128 (weights:
the transposed weight takes the same blocks, transposed, so one quantisation serves the forward and the input
gradient) and 128 x 1 (128 tokens of a channel: the weight gradient contracts the tokens, and a 128-token block's
scales are local to it, where a row's spans every token). The same scale rule per block, the same non-finite rule
(a NaN scale and zero elements for the block). ``transpose`` writes the transpose's elements and scales (x^T's 1 x
128 blocks from x's 128 x 1), the layout the GEMM of the weight gradient reads.

Padding: the kept dimension can be padded to a multiple of ``rows_to`` (zero rows, scale 1; blockwise: zero rows
within their blocks) and the reduced one
to a multiple of ``cols_to`` (zeros), because the scaled GEMM needs sizes divisible by 16; padded rows and
columns contribute nothing to a product. Or the output's reduced dimension can be ``placed``: a map giving each
output column the input column it holds (-1: a zero column), every input column once, e.g. attention's V^T with
every sequence starting at an aligned column (``sequence_aligned_layout``).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
_MANTISSA_1_75 = 0x600000  # float32 mantissa bits of 1.75
_EXP_OF_MAX = 8  # 448 = 1.75 * 2^8


def padded(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def scale_exponent_field(amax: torch.Tensor) -> torch.Tensor:
    """The biased float32 exponent field (int32, in [1, 247]) of each row's power-of-two scale (module docstring)."""
    bits = amax.float().contiguous().view(torch.int32)
    field, mantissa = bits >> 23, bits & 0x7FFFFF
    exponent = torch.where(mantissa <= _MANTISSA_1_75, field - _EXP_OF_MAX, field - _EXP_OF_MAX + 1)
    return exponent.clamp(min=1)


def _check_input(x: torch.Tensor, dim: int, rows_to: int, cols_to: int, placed, validate: bool = True) -> None:
    from gem_kernels.ops import _validation as V

    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"fp8 rowwise quantisation takes a 2-D float tensor, got shape {tuple(getattr(x, 'shape', ()))} "
                         f"of {getattr(x, 'dtype', type(x).__name__)}")
    if dim not in (0, 1, -1, -2):
        raise ValueError(f"fp8 rowwise quantisation: dim must be 0 or 1 (or -1, -2), got {dim}")
    V.check_positive_int("fp8 rowwise quantisation: rows_to", rows_to)
    V.check_positive_int("fp8 rowwise quantisation: cols_to", cols_to)
    if placed is not None:
        if cols_to != 1:
            raise ValueError("fp8 rowwise quantisation: placed gives the output's columns; cols_to must stay 1")
        if placed.dim() != 1 or placed.dtype != torch.int64:
            raise ValueError(f"fp8 rowwise quantisation: placed must be a 1-D int64 map (each output column's input "
                             f"column, -1 for none), got {placed.dtype} of shape {tuple(placed.shape)}")
        if placed.device != x.device:
            raise ValueError(f"fp8 rowwise quantisation: placed must be on x's device {x.device}, got {placed.device}")
        columns = x.shape[dim]
        if placed.shape[0] < columns:
            raise ValueError(f"fp8 rowwise quantisation: placed ({placed.shape[0]} columns) must place each of the "
                             f"{columns} input columns along dim {dim}")
        if validate and placed.numel():
            # NOTE: one sync; a column out of range would be read past x (the kernel) and a missing or repeated one
            # would drop or duplicate data. Callers holding a map made by sequence_aligned_layout pass validate=False
            held = placed[placed >= 0]
            if bool((placed < -1).any()) or (held.numel() and int(held.max()) >= columns) or not bool(
                    (torch.bincount(held, minlength=columns) == 1).all()):
                raise ValueError(f"fp8 rowwise quantisation: placed must hold each of the {columns} input columns once "
                                 f"(values in [0, {columns}), -1 for a zero column)")


def fp8_rowwise_quantize_reference(x: torch.Tensor, dim: int = -1, rows_to: int = 1, cols_to: int = 1,
                                   placed: torch.Tensor | None = None,
                                   validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (2-D, floating point) as E4M3 rows along ``dim`` and their scales: ``([kept, reduced], [kept, 1])``,
    each padded (or the reduced dimension placed) as the module docstring says. ``validate``: as
    ``fp8_rowwise_quantize``'s."""
    _check_input(x, dim, rows_to, cols_to, placed, validate)
    rows = (x if dim % 2 == 1 else x.t()).float()  # [kept, reduced]
    if placed is not None:
        rows = torch.where(placed >= 0, rows[:, placed.clamp(min=0)], 0.0)
    # a row of no values (no tokens: an expert given no rows) has amax 0
    amax = rows.abs().amax(1) if rows.shape[1] else rows.new_zeros(rows.shape[0])
    finite = torch.isfinite(rows).all(1)
    field = scale_exponent_field(torch.where(finite, amax, torch.zeros_like(amax)))
    scale = (field << 23).view(torch.float32)
    inverse = ((254 - field) << 23).view(torch.float32)  # 1 / scale, exactly
    elements = torch.where(finite[:, None], rows * inverse[:, None], torch.zeros_like(rows))
    elements = elements.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    kept, reduced = rows.shape
    out_kept, out_reduced = padded(kept, rows_to), padded(reduced, cols_to)
    if (out_kept, out_reduced) != (kept, reduced):
        full = torch.zeros(out_kept, out_reduced, dtype=torch.float8_e4m3fn, device=x.device)
        full[:kept, :reduced] = elements
        elements = full
        scale = torch.cat([scale, torch.ones(out_kept - kept, device=x.device)])
    return elements, scale[:, None]


def fp8_rowwise_quantize(x: torch.Tensor, dim: int = -1, rows_to: int = 1, cols_to: int = 1,
                         kernel: str = "auto", placed: torch.Tensor | None = None,
                         validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_rowwise_quantize_reference``'s result, from the Triton kernel on CUDA (``kernel="auto"``; ``"triton"``
    forces it, e.g. under the interpreter) or the reference (``"pytorch"``); both give the same bits.
    ``validate=False`` skips checking ``placed``'s values (one sync): undefined behaviour for a map that would fail."""
    from gem_kernels.ops import _validation as V

    if kernel not in ("auto", "triton", "pytorch"):
        raise ValueError(f"kernel must be 'auto', 'triton' or 'pytorch', got {kernel!r}")
    _check_input(x, dim, rows_to, cols_to, placed, validate)
    if V.use_triton(kernel, x.device) and x.numel():
        V.check_triton_device("x", x)
        from gem_kernels.ops.triton.triton_fp8 import triton_fp8_rowwise_quantize

        return triton_fp8_rowwise_quantize(x, dim, rows_to, cols_to, placed)
    return fp8_rowwise_quantize_reference(x, dim, rows_to, cols_to, placed, validate=False)  # (checked above)


# the block shapes the scaled GEMM takes: 1 x 128 and 128 x 128, and 128 x 1 (1 x 128 of the transpose)
BLOCKS = ((1, 128), (128, 128), (128, 1))


def _check_blockwise(x: torch.Tensor, block: tuple[int, int], rows_to: int) -> None:
    from gem_kernels.ops import _validation as V

    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"fp8 blockwise quantisation takes a 2-D float tensor, got shape {tuple(x.shape)} of {x.dtype}")
    if not isinstance(block, (tuple, list)) or tuple(block) not in BLOCKS:
        raise ValueError(f"fp8 blockwise quantisation: block must be one of {BLOCKS}, got {block!r}")
    V.check_positive_int("fp8 blockwise quantisation: rows_to", rows_to)


def blockwise_shapes(shape: tuple[int, int], block: tuple[int, int], rows_to: int,
                     transpose: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """The elements' and scales' shapes of ``fp8_blockwise_quantize``: ``[R', C]`` and ``[ceil(R' / br), ceil(C /
    bc)]`` for ``R'`` the rows padded to ``rows_to``; transposed with ``transpose``."""
    rows, cols = padded(shape[0], rows_to), shape[1]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    return ((cols, rows), grid[::-1]) if transpose else ((rows, cols), grid)


def blockwise_scales(grid: tuple[int, int], block: tuple[int, int], device) -> torch.Tensor:
    """An empty float32 scale tensor of shape ``grid`` laid out as the scaled GEMM reads it: a 1 x 128 block's scales
    column-major (each block column's scales contiguous), a 128 x 128 block's row-major."""
    if block[0] == 1:
        return torch.empty(grid[::-1], dtype=torch.float32, device=device).t()
    return torch.empty(grid, dtype=torch.float32, device=device)


def fp8_blockwise_quantize_reference(x: torch.Tensor, block: tuple[int, int], rows_to: int = 1,
                                     transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (2-D, floating point; rows padded with zeros to a multiple of ``rows_to``) as E4M3 with one scale per
    ``block`` (module docstring): ``(elements, scales)``, shapes as ``blockwise_shapes`` gives, the scales laid out
    as ``blockwise_scales`` (of the output's blocks: 1 x 128 for ``transpose`` of 128 x 1)."""
    _check_blockwise(x, block, rows_to)
    (rows, cols), (grid_r, grid_c) = blockwise_shapes(tuple(x.shape), block, rows_to, False)
    br, bc = block
    full = torch.zeros(grid_r * br, grid_c * bc, dtype=torch.float32, device=x.device)
    full[: x.shape[0], :cols] = x.float()
    tiles = full.view(grid_r, br, grid_c, bc)
    finite = torch.isfinite(tiles).all(3).all(1)
    amax = tiles.abs().amax(3).amax(1)
    field = scale_exponent_field(torch.where(finite, amax, torch.zeros_like(amax)))
    scale = torch.where(finite, (field << 23).view(torch.float32), float("nan"))
    inverse = ((254 - field) << 23).view(torch.float32)[:, None, :, None]
    elements = torch.where(finite[:, None, :, None], tiles * inverse, 0.0).clamp(-E4M3_MAX, E4M3_MAX)
    elements = elements.to(torch.float8_e4m3fn).view(grid_r * br, grid_c * bc)[:rows, :cols]
    out_block = block[::-1] if transpose else block
    if transpose:
        elements, scale = elements.t(), scale.t()
    laid_out = blockwise_scales(tuple(scale.shape), out_block, x.device)
    laid_out.copy_(scale)
    return elements.contiguous(), laid_out


def fp8_blockwise_quantize(x: torch.Tensor, block: tuple[int, int], rows_to: int = 1, transpose: bool = False,
                           kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_blockwise_quantize_reference``'s result, from the Triton kernel on CUDA (``kernel="auto"``; ``"triton"``
    forces it, e.g. under the interpreter) or the reference (``"pytorch"``); both give the same bits."""
    from gem_kernels.ops import _validation as V

    if kernel not in ("auto", "triton", "pytorch"):
        raise ValueError(f"kernel must be 'auto', 'triton' or 'pytorch', got {kernel!r}")
    _check_blockwise(x, block, rows_to)
    if V.use_triton(kernel, x.device) and x.numel():
        V.check_triton_device("x", x)
        from gem_kernels.ops.triton.triton_fp8 import triton_fp8_blockwise_quantize

        return triton_fp8_blockwise_quantize(x, tuple(block), rows_to, transpose)
    return fp8_blockwise_quantize_reference(x, tuple(block), rows_to, transpose)


def fp8_blockwise_dequantize(elements: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The float32 values E4M3 ``elements`` with one scale per ``block`` stand for."""
    if not isinstance(block, (tuple, list)) or tuple(block) not in BLOCKS:
        raise ValueError(f"fp8_blockwise_dequantize: block must be one of {BLOCKS}, got {block!r}")
    if elements.dim() != 2 or elements.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_blockwise_dequantize: elements must be 2-D E4M3, got {elements.dtype} of shape "
                         f"{tuple(elements.shape)}")
    rows, cols = elements.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scales.shape) != grid:
        raise ValueError(f"fp8_blockwise_dequantize: {rows} x {cols} elements in {block[0]} x {block[1]} blocks take "
                         f"{grid[0]} x {grid[1]} scales, got scales of shape {tuple(scales.shape)}")
    expanded = scales.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return elements.float() * expanded


def sequence_aligned_layout(offsets: torch.Tensor, total: int, multiple: int = 16,
                            kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """A token-major layout of the ``total`` tokens of sequences ``offsets`` in which every sequence starts at a
    multiple of ``multiple``: each sequence's first column ``[B]`` and each column's token ``[width]`` (-1 between
    sequences and after the last). ``width = padded(total + (multiple - 1) * B, multiple)``, a bound that needs no
    value read back to the host. ``kernel`` as ``fp8_rowwise_quantize``'s: one Triton launch, or the reference."""
    from gem_kernels.ops import _validation as V

    num_sequences = offsets.shape[0] - 1
    width = padded(total + (multiple - 1) * num_sequences, multiple)
    if V.use_triton(kernel, offsets.device) and num_sequences:
        from gem_kernels.ops.triton.triton_fp8 import triton_sequence_aligned_layout

        return triton_sequence_aligned_layout(offsets, width, multiple)
    offsets = offsets.long()
    lengths = offsets[1:] - offsets[:-1]
    spans = (lengths + multiple - 1) // multiple * multiple
    starts = torch.cumsum(spans, 0) - spans
    sequence = torch.repeat_interleave(torch.arange(num_sequences, device=offsets.device), lengths, output_size=total)
    columns = torch.arange(total, device=offsets.device) + (starts - offsets[:-1])[sequence]
    token = torch.full((width,), -1, dtype=torch.int64, device=offsets.device)
    return starts, token.index_copy_(0, columns, torch.arange(total, device=offsets.device))


def fp8_attention_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str = "auto",
                           v_placed: torch.Tensor | None = None):
    """Attention's FP8 operands from ``[T, H, D]`` q, k, v: Q and K rows per token and head ``([T * H, D],
    [T * H, 1])``, V per head channel over the tokens (its product contracts them), transposed ``([H * D, T],
    [H * D, 1])``. With ``v_placed`` (each column's token, from ``sequence_aligned_layout``) V^T is ``[H * D,
    width]`` with the tokens at those columns, zeros elsewhere: a kernel then reads each sequence's tiles from
    16-byte aligned addresses. The values, and so the scales, are the same either way."""
    t, h, d = q.shape
    return (fp8_rowwise_quantize(q.reshape(t * h, d), -1, kernel=kernel),
            fp8_rowwise_quantize(k.reshape(t * h, d), -1, kernel=kernel),
            fp8_rowwise_quantize(v.reshape(t, h * d), 0, kernel=kernel, placed=v_placed, validate=False))


def fp8_attention_dequantize(operands, shape: tuple[int, int, int], dtype: torch.dtype,
                             v_placed: torch.Tensor | None = None, kernel: str = "auto"):
    """Q, K, V ``[T, H, D]`` in ``dtype`` from ``fp8_attention_operands``' output (``v_placed``: the map it was
    given). Exact wherever ``dtype`` holds the values: every scale is a power of two, and E4M3's 3-bit mantissa
    fits any 16-bit float's. ``kernel`` as ``fp8_rowwise_quantize``'s: one Triton pass per operand, or the
    PyTorch reference; the same bits."""
    from gem_kernels.ops import _validation as V

    T, H, D = shape
    (q8, qs), (k8, ks), (vt8, vs) = operands
    token = torch.arange(vt8.shape[1], device=vt8.device) if v_placed is None else v_placed
    if V.use_triton(kernel, q8.device) and T:
        from gem_kernels.ops.triton.triton_fp8 import triton_fp8_dequantize, triton_fp8_dequantize_transposed

        q, k = (triton_fp8_dequantize(t, s, dtype).view(T, H, D) for t, s in ((q8, qs), (k8, ks)))
        return q, k, triton_fp8_dequantize_transposed(vt8, vs, token, T, dtype).view(T, H, D)
    q, k = (fp8_dequantize(t, s).to(dtype).view(T, H, D) for t, s in ((q8, qs), (k8, ks)))
    columns = fp8_dequantize(vt8, vs).to(dtype).t()  # [width, H * D]
    held = token >= 0
    v = columns.new_empty(T, H * D).index_copy_(0, token[held], columns[held])  # kernels read rows of unit stride
    return q, k, v.view(T, H, D)


def fp8_dequantize(elements: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values rows of E4M3 ``elements`` with per-row ``scale`` ``[rows, 1]`` stand for."""
    if elements.dim() != 2 or elements.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_dequantize: elements must be 2-D E4M3 rows, got {elements.dtype} of shape "
                         f"{tuple(elements.shape)}")
    if tuple(scale.shape) != (elements.shape[0], 1):
        raise ValueError(f"fp8_dequantize: scale must be [rows, 1] = [{elements.shape[0]}, 1] (one per row), got "
                         f"shape {tuple(scale.shape)}")
    return elements.float() * scale
