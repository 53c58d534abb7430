"""gem-kernels: jagged attention (JFA, GDPA, BlockAttention) and fused norms for recommendation models.

Every op has an exact PyTorch reference and a Triton kernel (forward and backward); ``kernel="auto"`` picks
Triton on CUDA and the reference elsewhere. Importing this package never touches a GPU.
"""

from gem_kernels.ops import (
    ACTIVATIONS,
    block_attention,
    gdpa,
    jagged_flash_attention,
    layer_norm,
    rms_norm,
)

__all__ = ["ACTIVATIONS", "block_attention", "gdpa", "jagged_flash_attention", "layer_norm", "rms_norm"]
