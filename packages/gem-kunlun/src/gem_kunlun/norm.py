"""LayerNorm through gem-kernels: the fused Triton kernel on GPUs, the PyTorch reference elsewhere."""

from __future__ import annotations

import torch
from torch import nn

from gem_kernels import layer_norm


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and state dict) whose forward runs gem-kernels' fused norm.

    Under autocast a float32 input is normalised straight into the autocast dtype: every norm of the models
    feeds a matmul, which autocast would otherwise feed from a cast copy of a float32 output (one more pass over
    the activations forward, and one over their gradient backward); the values are the same."""

    def __init__(self, dim: int, eps: float = 1e-5, kernel: str = "auto", device=None) -> None:
        super().__init__(dim, eps=eps, device=device)
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        low = x.dtype == torch.float32 and torch.is_autocast_enabled(device)
        out_dtype = torch.get_autocast_dtype(device) if low else None
        return layer_norm(x, self.weight, self.bias, self.eps, kernel=self.kernel, out_dtype=out_dtype)
