"""gem-kernels: jagged attention (JFA, GDPA, BlockAttention), fused norms and rotary embedding for recommendation models, and
MXFP8 numerics (quantisation, an emulated MX linear for training).

Every attention, norm and rotary op has an exact PyTorch reference and a Triton kernel (forward and backward);
``kernel="auto"`` picks Triton on CUDA and the reference elsewhere. Importing this package never touches a GPU.
"""

from gem_kernels.mx import MXTensor, mx_dequantize, mx_fake_quantize, mx_quantize
from gem_kernels.mx_linear import MXLinear, MXRecipe, convert_to_mx, mx_matmul

from gem_kernels.ops import (
    ACTIVATIONS,
    block_attention,
    gdpa,
    jagged_flash_attention,
    layer_norm,
    rms_norm,
    rotary,
)

__all__ = [
    "ACTIVATIONS",
    "MXLinear",
    "MXRecipe",
    "MXTensor",
    "block_attention",
    "convert_to_mx",
    "gdpa",
    "jagged_flash_attention",
    "layer_norm",
    "mx_dequantize",
    "mx_fake_quantize",
    "mx_matmul",
    "mx_quantize",
    "rms_norm",
    "rotary",
]
