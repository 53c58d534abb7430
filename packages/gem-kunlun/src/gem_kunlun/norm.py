"""LayerNorm through gem-kernels: the fused Triton kernel on GPUs, the PyTorch reference elsewhere."""

from __future__ import annotations

import torch
from torch import nn

from gem_kernels import layer_norm


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and state dict) whose forward runs gem-kernels' fused norm."""

    def __init__(self, dim: int, eps: float = 1e-5, kernel: str = "auto", device=None) -> None:
        super().__init__(dim, eps=eps, device=device)
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, kernel=self.kernel)
