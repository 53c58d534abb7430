"""Public ops; each takes kernel= "auto" | "triton" | "pytorch" | "builtin"."""

from gem_kernels.ops.block_attention import block_attention
from gem_kernels.ops.gdpa import gdpa
from gem_kernels.ops.jagged_flash_attention import jagged_flash_attention
from gem_kernels.ops.norms import layer_norm, layer_norm_pair, rms_norm
from gem_kernels.ops.pytorch.pt_activations import ACTIVATIONS
from gem_kernels.ops.rotary import qkv_rotary, rotary
from gem_kernels.ops.rotary_attention import qkv_rotary_attention

__all__ = ["ACTIVATIONS", "block_attention", "gdpa", "jagged_flash_attention", "layer_norm", "layer_norm_pair",
           "qkv_rotary",
           "qkv_rotary_attention", "rms_norm", "rotary"]
