"""MX (microscaling) formats, the PyTorch reference: MXFP8 quantisation and dequantisation.

An MX tensor stores blocks of ``block`` (32) consecutive elements along one dimension with one shared scale
per block: a power of two kept as an E8M0 byte (the biased exponent, 127 meaning 2^0; 255 is NaN). Elements
are FP8, E4M3 (largest 448, no infinities) or E5M2 (largest 57344). Weights are needed along both
dimensions (the forward GEMM contracts K, the weight-gradient GEMM contracts M), so ``dim`` picks the
dimension the blocks run along.

The shared exponent of a block with largest magnitude ``amax``:

- ``floor`` (the OCP MX v1.0 rule): ``floor(log2(amax)) - emax``, ``emax`` the exponent of the element
  format's largest power of two (8 for E4M3, 15 for E5M2). Up to the top binade of the element format can
  overflow after scaling; such elements saturate to the largest finite value.
- ``rceil`` (round the scale up): ``ceil(log2(amax / max_finite))``, the smallest power of two that brings
  ``amax`` within range: nothing saturates, at the cost of a little resolution.

Both are clamped to the E8M0 range [-127, 127]. Elements are then ``x / 2^e`` rounded to nearest (ties to
even) in the element format, saturating at its largest finite value; values below its smallest subnormal
round to zero. A block holding a NaN or an infinity gets the NaN scale (255), and dequantises to NaN
throughout; an all-zero block gets the smallest scale (2^-127) and zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

BLOCK = 32
E8M0_BIAS, E8M0_NAN = 127, 255
ScaleRounding = Literal["floor", "rceil"]


@dataclass(frozen=True)
class ElementFormat:
    name: str
    dtype: torch.dtype
    emax: int  # exponent of the largest power of two the format holds
    max_finite: float


FORMATS = {
    "e4m3": ElementFormat("e4m3", torch.float8_e4m3fn, 8, 448.0),
    "e5m2": ElementFormat("e5m2", torch.float8_e5m2, 15, 57344.0),
}


@dataclass
class MXTensor:
    """``elements`` (FP8, the input's shape padded to whole blocks along ``dim``) and ``scales`` (uint8 E8M0,
    the same shape with ``dim`` divided by ``block``); ``size`` is the unpadded length along ``dim``."""

    elements: torch.Tensor
    scales: torch.Tensor
    dim: int
    size: int
    block: int = BLOCK


def element_format(name: str) -> ElementFormat:
    if name not in FORMATS:
        raise ValueError(f"MX element format must be one of {sorted(FORMATS)}, got {name!r}")
    return FORMATS[name]


def _blocks(x: torch.Tensor, dim: int, block: int) -> tuple[torch.Tensor, int, int]:
    """``x`` with ``dim`` moved last, zero-padded to whole blocks and split: ``[..., n_blocks, block]``."""
    dim = dim % x.dim()
    moved = x.movedim(dim, -1)
    size = moved.shape[-1]
    pad = (-size) % block
    if pad:
        moved = torch.nn.functional.pad(moved, (0, pad))
    return moved.reshape(*moved.shape[:-1], (size + pad) // block, block), dim, size


def shared_exponents(blocks: torch.Tensor, fmt: ElementFormat, rounding: ScaleRounding) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block ``[..., n_blocks]``: the unbiased shared exponent (int32, clamped to [-127, 127]) and whether
    the block holds a non-finite value."""
    amax = blocks.float().abs().amax(-1)
    non_finite = ~torch.isfinite(blocks.float()).all(-1)
    safe = torch.where(non_finite | (amax == 0), torch.ones_like(amax), amax)
    if rounding == "floor":
        # frexp: safe = m * 2^e with m in [0.5, 1), so floor(log2(safe)) = e - 1, exactly (no log2 rounding)
        exponent = torch.frexp(safe).exponent - 1 - fmt.emax
    elif rounding == "rceil":
        # ceil(log2(safe / max_finite)): frexp of the exact ratio; a power of two needs no rounding up
        mantissa, exp = torch.frexp(safe.double() / fmt.max_finite)
        exponent = torch.where(mantissa == 0.5, exp - 1, exp)
    else:
        raise ValueError(f"MX scale rounding must be 'floor' or 'rceil', got {rounding!r}")
    exponent = exponent.to(torch.int32).clamp(-E8M0_BIAS, E8M0_BIAS)
    exponent = torch.where(amax == 0, torch.full_like(exponent, -E8M0_BIAS), exponent)
    return exponent, non_finite


def mx_quantize(x: torch.Tensor, dim: int = -1, elem: str = "e4m3", rounding: ScaleRounding = "floor",
                block: int = BLOCK) -> MXTensor:
    """``x`` (float) as an MX tensor with blocks of ``block`` along ``dim``; see the module docstring."""
    if not x.is_floating_point():
        raise ValueError(f"mx_quantize takes a floating-point tensor, got {x.dtype}")
    if x.dim() < 1 or isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"mx_quantize: dim must be an int in [{-x.dim()}, {x.dim()}) for a tensor of shape "
                         f"{tuple(x.shape)}, got {dim!r}")
    from gem_kernels.ops import _validation as V

    V.check_positive_int("mx_quantize: block", block)  # a float or a string would fail deep in a reshape
    fmt = element_format(elem)
    blocks, dim, size = _blocks(x, dim, block)
    exponent, non_finite = shared_exponents(blocks, fmt, rounding)
    # NOTE: 2^-e is exact in float32 for |e| <= 127, so scaling itself rounds nothing
    scaled = blocks.float() * torch.exp2(-exponent.float()).unsqueeze(-1)
    scaled = torch.where(non_finite.unsqueeze(-1), torch.zeros_like(scaled), scaled)
    elements = scaled.clamp(-fmt.max_finite, fmt.max_finite).to(fmt.dtype)
    scales = torch.where(non_finite, torch.full_like(exponent, E8M0_NAN), exponent + E8M0_BIAS).to(torch.uint8)
    elements = elements.flatten(-2).movedim(-1, dim)
    return MXTensor(elements, scales.movedim(-1, dim), dim, size, block)


def mx_dequantize(t: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``t`` represents, in ``dtype``, with the padding removed."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"mx_dequantize: dtype must be a floating-point torch.dtype, got {dtype!r}")
    elements = t.elements.movedim(t.dim, -1).float()
    elements = elements.unflatten(-1, (elements.shape[-1] // t.block, t.block))
    codes = t.scales.movedim(t.dim, -1)
    scale = torch.exp2(codes.float() - E8M0_BIAS)
    scale = torch.where(codes == E8M0_NAN, torch.full_like(scale, float("nan")), scale)
    values = (elements * scale.unsqueeze(-1)).flatten(-2)[..., : t.size]
    if dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(values.dtype).max:
        # NOTE: an element rounded up to the next power of two can pass a 16-bit dtype's largest value (fp16 64000 ->
        # 65536): saturate it there rather than turn a finite value into inf
        largest = torch.finfo(dtype).max
        values = values.clamp(-largest, largest)
    return values.movedim(-1, t.dim).to(dtype)


def mx_fake_quantize(x: torch.Tensor, dim: int = -1, elem: str = "e4m3", rounding: ScaleRounding = "floor",
                     block: int = BLOCK) -> torch.Tensor:
    """``x`` rounded through MX and back, in ``x``'s dtype: what an MX GEMM sees of it."""
    return mx_dequantize(mx_quantize(x, dim, elem, rounding, block), x.dtype)
