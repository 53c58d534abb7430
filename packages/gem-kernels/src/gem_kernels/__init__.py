"""gem-kernels: jagged attention (JFA, GDPA, BlockAttention), fused norms and rotary embedding for recommendation models, and
low-precision GEMMs for training: FP8 with rowwise scales on Hopper, and MXFP8 numerics (quantisation, an
emulated MX linear).

Every attention, norm and rotary op has an exact PyTorch reference and a Triton kernel (forward and backward);
``kernel="auto"`` picks Triton on CUDA and the reference elsewhere. Importing this package never touches a GPU.
"""

from gem_kernels.mx import MXTensor, mx_dequantize, mx_fake_quantize, mx_quantize
from gem_kernels.fp8 import fp8_blockwise_dequantize, fp8_blockwise_quantize, fp8_dequantize, fp8_rowwise_quantize
from gem_kernels.fp8_linear import Fp8Linear, Fp8Recipe, fp8_linear
from gem_kernels.low_precision import convert_to_low_precision
from gem_kernels.mx_linear import MXLinear, MXRecipe, mx_matmul

from gem_kernels.ops import (
    ACTIVATIONS,
    block_attention,
    gdpa,
    jagged_flash_attention,
    layer_norm,
    layer_norm_pair,
    qkv_rotary,
    qkv_rotary_attention,
    rms_norm,
    rotary,
)

__all__ = [
    "ACTIVATIONS",
    "Fp8Linear",
    "Fp8Recipe",
    "MXLinear",
    "MXRecipe",
    "MXTensor",
    "block_attention",
    "convert_to_low_precision",
    "fp8_blockwise_dequantize",
    "fp8_blockwise_quantize",
    "fp8_dequantize",
    "fp8_linear",
    "fp8_rowwise_quantize",
    "gdpa",
    "jagged_flash_attention",
    "layer_norm",
    "layer_norm_pair",
    "mx_dequantize",
    "mx_fake_quantize",
    "mx_matmul",
    "mx_quantize",
    "qkv_rotary",
    "qkv_rotary_attention",
    "rms_norm",
    "rotary",
]
