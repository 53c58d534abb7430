"""Sequence summarization: a jagged sequence to a few tokens, by PMA or Hierarchical Seed Pooling."""

from __future__ import annotations

import torch
from torch import nn

from gem_kernels import gdpa


class PMA(nn.Module):
    """Pooling by multi-head attention: ``num_seeds`` learned queries attend over each jagged sequence.

    ``forward(seq [T, D], offsets [B+1], max_len) -> [B, num_seeds, D]``. An empty sequence gives zeros
    before the output projection (no keys, no attention mass).
    """

    def __init__(self, dim: int, num_seeds: int, num_heads: int, kernel: str = "auto", device=None) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.dim, self.num_seeds, self.num_heads, self.kernel = dim, num_seeds, num_heads, kernel
        self.seeds = nn.Parameter(torch.empty(num_seeds, dim, device=device))
        self.kv = nn.Linear(dim, 2 * dim, device=device)
        self.out = nn.Linear(dim, dim, device=device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.seeds, std=dim_std(self.dim))

    def forward(self, seq: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
        h, d = self.num_heads, self.dim // self.num_heads
        kv = self.kv(seq).view(-1, 2, h, d)  # k and v packed: their gradient comes back in one buffer
        q = self.seeds.view(self.num_seeds, h, d).to(kv.dtype)
        pooled = gdpa(q, kv, None, None, offsets, activation="softmax", max_seq_len_kv=max_len, kernel=self.kernel,
                      validate=False)  # [B, Nq, H, d]
        return self.out(pooled.reshape(pooled.shape[0], self.num_seeds, self.dim))

    def flops(self, num_events: float, batch_size: int) -> float:
        return 2.0 * self.dim * 2 * self.dim * num_events + 4.0 * self.num_seeds * self.dim * num_events + (
            2.0 * self.dim * self.dim * self.num_seeds * batch_size
        )


class SumKronLinear(nn.Module):
    """``Y = sum_i A_i^T Z W_i``: a linear map of token matrices ``Z [B, K_in, D] -> [B, K_out, D_out]``.

    A sum of ``rank`` Kronecker products (token mixing ``A_i [K_in, K_out]`` times feature mixing
    ``W_i [D, D_out]``) stands in for one dense ``(K_in*D) x (K_out*D_out)`` matrix with far fewer parameters.
    """

    def __init__(self, k_in: int, k_out: int, dim: int, dim_out: int, rank: int, device=None) -> None:
        super().__init__()
        self.k_in, self.k_out, self.dim, self.dim_out, self.rank = k_in, k_out, dim, dim_out, rank
        self.token = nn.Parameter(torch.empty(rank, k_in, k_out, device=device))
        self.feature = nn.Parameter(torch.empty(rank, dim, dim_out, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.token, std=(1.0 / (self.k_in * self.rank)) ** 0.5)
        nn.init.normal_(self.feature, std=dim_std(self.dim))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        mixed = torch.einsum("bkd,rkm->brmd", z, self.token.to(z.dtype))
        return torch.einsum("brmd,rde->bme", mixed, self.feature.to(z.dtype))

    def flops_per_example(self) -> float:
        return 2.0 * self.rank * (self.k_in * self.k_out * self.dim + self.k_out * self.dim * self.dim_out)


class HierarchicalSeedPooling(nn.Module):
    """Over-complete seeds (``num_seeds * expansion``) attend over the sequence, then a SumKronLinear reduces
    them to ``num_seeds`` tokens: richer pooling than PMA at the parameter cost of a few small matrices."""

    def __init__(self, dim: int, num_seeds: int, num_heads: int, expansion: int = 4, rank: int = 2,
                 kernel: str = "auto", device=None) -> None:
        super().__init__()
        self.pool = PMA(dim, num_seeds * expansion, num_heads, kernel=kernel, device=device)
        self.reduce = SumKronLinear(num_seeds * expansion, num_seeds, dim, dim, rank, device=device)

    def forward(self, seq: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
        return self.reduce(self.pool(seq, offsets, max_len))

    def flops(self, num_events: float, batch_size: int) -> float:
        return self.pool.flops(num_events, batch_size) + self.reduce.flops_per_example() * batch_size


def dim_std(dim: int) -> float:
    return dim**-0.5
