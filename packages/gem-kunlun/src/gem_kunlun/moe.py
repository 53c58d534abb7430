"""Cross interaction: a mixture of Wukong-style experts over a few feature tokens per example.

Each expert is a Wukong block (arXiv 2403.02545): a factorisation-machine block (pairwise token
interactions through a low-rank projection, then an MLP) beside a linear-compression block (a learned
mix of the tokens), concatenated back to the input's token count. A gate picks the top-k experts per
example; experts have a capacity, assignments past it are dropped (the residual carries the input on);
a load-balancing loss keeps the gate from collapsing onto a few experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


class WukongBlock(nn.Module):
    """``[B, n, D] -> [B, n, D]``: FM block (``n_fm`` tokens) beside a linear-compression block (the rest)."""

    def __init__(self, num_tokens: int, dim: int, rank: int = 8, hidden: int = 256, device=None) -> None:
        super().__init__()
        self.num_tokens, self.dim, self.rank = num_tokens, dim, rank
        self.n_fm = max(1, num_tokens // 2)
        self.n_lc = num_tokens - self.n_fm
        self.projection = nn.Parameter(torch.empty(num_tokens, rank, device=device))
        self.fm_norm = nn.LayerNorm(num_tokens * rank, device=device)
        self.fm_mlp = nn.Sequential(
            nn.Linear(num_tokens * rank, hidden, device=device), nn.GELU(), nn.Linear(hidden, self.n_fm * dim, device=device)
        )
        self.compress = nn.Parameter(torch.empty(num_tokens, self.n_lc, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.projection, std=self.num_tokens**-0.5)
        nn.init.normal_(self.compress, std=self.num_tokens**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        # X (X^T Y): every token's interaction with rank-many projected summaries, O(n * D * rank)
        summaries = torch.einsum("bnd,nk->bdk", x, self.projection.to(x.dtype))
        interactions = torch.einsum("bnd,bdk->bnk", x, summaries).reshape(b, -1)
        fm = self.fm_mlp(self.fm_norm(interactions)).view(b, self.n_fm, self.dim)
        lc = torch.einsum("bnd,nm->bmd", x, self.compress.to(x.dtype))
        return torch.cat([fm, lc], 1)

    def flops_per_example(self) -> float:
        n, d, k = self.num_tokens, self.dim, self.rank
        mlp = sum(2.0 * m.in_features * m.out_features for m in self.fm_mlp if isinstance(m, nn.Linear))
        return 2.0 * n * d * k * 2 + mlp + 2.0 * n * self.n_lc * d


@dataclass
class RoutingStats:
    """What the gate did in the last forward: assignments per expert (before and after capacity) and the loss."""

    assigned: torch.Tensor  # [E] int64, top-k choices per expert
    kept: torch.Tensor  # [E] int64, after the capacity limit
    balance_loss: torch.Tensor  # scalar


class MixtureOfExperts(nn.Module):
    """Top-k gated experts over ``[B, n, D]`` token sets; returns the gate-weighted sum of expert outputs.

    ``capacity_factor`` bounds each expert to ``ceil(factor * B * k / E)`` examples (<= 0: unbounded) in
    training, where it keeps the per-expert work bounded. Higher choices (top-1 before top-2) and earlier
    examples claim capacity first. In eval mode nothing is dropped: an example's output must not depend on
    which other requests share its batch (ranking one user's candidates, serving). ``last_stats`` holds the routing
    of the last call; ``balance_loss`` is the Switch-Transformer loss ``E * sum_e f_e * p_e``.
    """

    def __init__(self, num_tokens: int, dim: int, num_experts: int, top_k: int, capacity_factor: float = 1.25,
                 rank: int = 8, hidden: int = 256, device=None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.gate = nn.Linear(num_tokens * dim, num_experts, device=device)
        self.experts = nn.ModuleList(WukongBlock(num_tokens, dim, rank, hidden, device=device) for _ in range(num_experts))
        self.last_stats: RoutingStats | None = None

    def capacity(self, batch_size: int) -> int:
        if self.capacity_factor <= 0:
            return batch_size
        return max(1, math.ceil(self.capacity_factor * batch_size * self.top_k / self.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, e, k = x.shape[0], self.num_experts, self.top_k
        probs = torch.softmax(self.gate(x.flatten(1)).float(), dim=-1)  # [B, E]
        weights, chosen = probs.topk(k, dim=-1)  # [B, k]
        weights = weights / weights.sum(-1, keepdim=True)
        # slot-major order: every example's first choice claims capacity before any second choice
        expert = chosen.t().reshape(-1)  # [k*B]
        example = torch.arange(b, device=x.device).repeat(k)
        weight = weights.t().reshape(-1)
        order = torch.sort(expert, stable=True).indices
        counts = torch.bincount(expert, minlength=e)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel(), device=x.device) - starts[expert[order]]
        keep = position < (self.capacity(b) if self.training else b)

        out = torch.zeros_like(x)
        kept = torch.zeros(e, dtype=torch.int64, device=x.device)
        for index, block in enumerate(self.experts):
            mine = keep & (expert == index)
            rows = example[mine]
            kept[index] = rows.numel()
            if rows.numel():
                out.index_add_(0, rows, block(x[rows]) * weight[mine].to(x.dtype)[:, None, None])
        fraction = counts.float() / counts.sum()
        balance = e * (fraction * probs.mean(0)).sum()
        self.last_stats = RoutingStats(assigned=counts.detach(), kept=kept.detach(), balance_loss=balance)
        return out

    def flops(self, batch_size: int) -> float:
        """Gate for every example plus the active experts (top-k per example, at most the capacity each)."""
        active = min(batch_size * self.top_k, self.capacity(batch_size) * self.num_experts)
        return 2.0 * self.gate.in_features * self.num_experts * batch_size + active * self.experts[0].flops_per_example()


def dense_moe_reference(moe: MixtureOfExperts, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every example, weighted by the renormalised top-k gate (zero elsewhere): what the
    routed forward computes when no expert is over capacity."""
    probs = torch.softmax(moe.gate(x.flatten(1)).float(), dim=-1)
    weights, chosen = probs.topk(moe.top_k, dim=-1)
    dense = torch.zeros_like(probs).scatter(1, chosen, weights / weights.sum(-1, keepdim=True))
    outputs = torch.stack([block(x) for block in moe.experts], 1)  # [B, E, n, D]
    return (outputs * dense.to(x.dtype)[:, :, None, None]).sum(1)


__all__ = ["MixtureOfExperts", "RoutingStats", "WukongBlock", "dense_moe_reference"]
