"""LayerNorm through gem-kernels: the fused Triton kernel on GPUs, the PyTorch reference elsewhere; and a LayerNorm
feeding a Linear-GELU-Linear MLP, which runs as one FP8 block where a recipe made both linears FP8."""

from __future__ import annotations

import torch
from torch import nn

from gem_kernels import Fp8Linear, layer_norm, layer_norm_pair
from gem_kernels.fp8_mlp import fp8_norm_mlp


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and state dict) whose forward runs gem-kernels' fused norm.

    The norms of the models that use it feed matmuls (a projection, an MLP, an expert), so under autocast the
    output is written in autocast's dtype, the dtype those matmuls read: the value is the one the matmul's cast
    would make, without the cast's pass over a float32 copy forward, or the gradient's cast back to float32.
    (InterFormer's newest-event token is a norm's output read as it is: it too is in autocast's dtype.)"""

    def __init__(self, dim: int, eps: float = 1e-5, kernel: str = "auto", device=None) -> None:
        super().__init__(dim, eps=eps, device=device)
        self.kernel = kernel

    def forward(self, x: torch.Tensor, skip: bool = False, pending: torch.Tensor | None = None,
                also: "LayerNorm | None" = None):
        """``norm(x)``; with ``skip``, ``(norm(x), x)`` for a pre-norm residual branch ``x + f(norm(x))`` written
        with the returned x: the gradient reaching x along the skip path is added inside the norm's backward kernel,
        where autograd would add the two gradients of x (each [tokens, d] in float32) in a pass of its own.
        ``pending``: the previous branch's update, not yet added to x (``x + pending`` is the stream): returns
        ``(norm(x + pending), x + pending)``, the sum made in the norm's own pass instead of an add of its own.
        ``also``: another norm of the same stream (a second pre-norm branch reading it), with ``skip``: returns
        ``(norm(x'), also(x'), x')``, both in one pass over the stream forward and one backward (gem-kernels'
        ``layer_norm_pair``) where the two share eps and kernel and have biases, else one after the other."""
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        if also is not None:
            if not skip:
                raise ValueError("LayerNorm(also=...) returns the stream too: it needs skip=True")
            if (also.eps, also.kernel) == (self.eps, self.kernel) and self.bias is not None and also.bias is not None:
                return layer_norm_pair(x, (self.weight, self.bias), (also.weight, also.bias), self.eps, residual=pending,
                                       kernel=self.kernel, skip=pending is None, out_dtype=out_dtype)
            normed, stream = self(x, skip=True, pending=pending)
            return normed, also(stream), stream
        return layer_norm(x, self.weight, self.bias, self.eps, residual=pending, kernel=self.kernel,
                          skip=skip and pending is None, out_dtype=out_dtype)


def norm_mlp(norm: nn.LayerNorm, mlp: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """``mlp(norm(x))`` for an MLP ``Linear, GELU, Linear``. Where a low-precision recipe made both linears FP8
    (``Fp8Linear``, the same rowwise recipe) and the call has the recipe's tokens, it runs as gem-kernels'
    ``fp8_norm_mlp``: the same parameters and function, with the norm and GELU passes writing the E4M3 operands of the
    GEMMs after them (no quantisation passes of their own). A blockwise recipe's linears quantise their own inputs."""
    first, second = mlp[0], mlp[-1]
    fused = (len(mlp) == 3 and isinstance(first, Fp8Linear) and isinstance(second, Fp8Linear)
             and first.recipe == second.recipe and first.recipe.scaling == "rowwise"
             and type(mlp[1]) is nn.GELU and mlp[1].approximate == "none"
             and first.recipe.runs_fp8(x.numel() // x.shape[-1]))
    if not fused:
        return mlp(norm(x))
    return fp8_norm_mlp(x, norm.weight, norm.bias, norm.eps, first.weight, first.bias, second.weight, second.bias,
                        first.recipe)
