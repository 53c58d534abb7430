"""A compact ranking model over the full GEM batch: embeddings, a time-merged event sequence summarised by
learned seed queries (PMA), an MLP, and per-surface multi-task heads. Representation features (LoopFM) are
summarised into one token each (``RepresentationSummary``) and join the MLP input.

It is the reference point the Kunlun model is measured against, and it exercises every part of the input
format: KeyedJaggedTensor ids, jagged event sequences, dense features, surfaces and tasks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from gem_kunlun.batch import Batch
from gem_kunlun.config_checks import check_at_least, check_widths
from gem_kunlun.embedding import FeatureEmbedding
from gem_kunlun.features import FeatureSpec
from gem_kunlun.heads import ModelOutput, MultiTaskHeads
from gem_kunlun.representation_summary import RepresentationSummary
from gem_kunlun.sequence import jagged_to_padded, merge_by_time


@dataclass(frozen=True)
class BaselineConfig:
    dim: int = 32
    num_seeds: int = 2
    num_heads: int = 2
    hidden: tuple[int, ...] = (128, 64)
    max_seq_len: int = 256

    def __post_init__(self) -> None:
        check_at_least(self, {"dim": 1, "num_seeds": 1, "num_heads": 1, "max_seq_len": 1})
        check_widths(self, "hidden")
        if self.dim % self.num_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        if not self.hidden:
            raise ValueError("hidden must list at least one width")


class SeedPooling(nn.Module):
    """Multi-head attention of a few queries over a jagged sequence (PMA).

    Queries are learned seeds shifted by a per-example context vector, so the summary depends on the
    candidate being scored. A learned "null" key/value is always present: an empty history then attends to
    it alone instead of producing a 0/0 softmax.
    """

    def __init__(self, dim: int, num_seeds: int, num_heads: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.dim, self.num_seeds, self.num_heads = dim, num_seeds, num_heads
        self.seeds = nn.Parameter(torch.empty(num_seeds, dim, device=device))
        self.null_kv = nn.Parameter(torch.empty(2, dim, device=device))
        self.context = nn.Linear(dim, dim, device=device)
        self.kv = nn.Linear(dim, 2 * dim, device=device)
        self.out = nn.Linear(dim, dim, device=device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.seeds, std=0.02)
        nn.init.normal_(self.null_kv, std=0.02)

    def forward(self, seq: torch.Tensor, offsets: torch.Tensor, max_len: int, context: torch.Tensor) -> torch.Tensor:
        b, h, d = offsets.numel() - 1, self.num_heads, self.dim // self.num_heads
        padded, mask = jagged_to_padded(self.kv(seq), offsets, max_len)  # [B, L, 2D]
        null = self.null_kv.reshape(1, 1, 2 * self.dim).expand(b, 1, -1)
        kv = torch.cat([null, padded], 1).view(b, max_len + 1, 2, h, d)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # [B, H, L+1, d]
        q = (self.seeds[None] + self.context(context)[:, None]).view(b, self.num_seeds, h, d).transpose(1, 2)
        keep = torch.cat([mask.new_ones(b, 1), mask], 1)[:, None, None, :]
        pooled = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out(pooled.transpose(1, 2).reshape(b, self.num_seeds, self.dim))

    def flops(self, lengths: torch.Tensor) -> dict[str, float]:
        """Forward FLOPs for a batch whose sequences have ``lengths``: projections plus attention over real keys."""
        b, events = lengths.numel(), float(lengths.sum())
        keys = events + b  # the null key of every example
        return {
            "pma.kv_proj": 2.0 * self.dim * 2 * self.dim * events,
            "pma.query_proj": 2.0 * self.dim * self.dim * b,
            "pma.attention": 2.0 * 2.0 * self.num_seeds * self.dim * keys,
            "pma.out_proj": 2.0 * self.dim * self.dim * self.num_seeds * b,
        }


class ZeroInitLinear(nn.Linear):
    """A bias-free linear map whose weights start at zero (a new input joining a layer without changing it)."""

    def __init__(self, in_features: int, out_features: int, device: torch.device | None = None) -> None:
        super().__init__(in_features, out_features, bias=False, device=device)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


class BaselineRanker(nn.Module):
    """``forward(batch) -> ModelOutput(logits [B, num_tasks], aux_loss = 0)``; see the module docstring."""

    def __init__(self, spec: FeatureSpec, config: BaselineConfig = BaselineConfig(), device: torch.device | None = None):
        super().__init__()
        self.spec, self.config = spec, config
        dim = config.dim
        self.embedding = FeatureEmbedding(spec, dim, device=device)
        self.event_type = nn.Embedding(len(spec.events), dim, device=device)
        self.pool = SeedPooling(dim, config.num_seeds, config.num_heads, device=device)
        widths = [(len(spec.sparse) + 1 + config.num_seeds) * dim, *config.hidden]
        self.mlp = nn.Sequential(
            *[m for i, o in zip(widths, widths[1:]) for m in (nn.Linear(i, o, device=device), nn.ReLU())]
        )
        # LoopFM's representation sequences, if the data has them: one more token each, added to the MLP's first
        # layer through columns of their own that start at zero, so that the model starts as the same function
        # (and, initialised by module name, with the same weights) as the model without them
        self.representations = RepresentationSummary(spec.representations, dim, device=device) if spec.representations else None
        self.representation_input = ZeroInitLinear(len(spec.representations) * dim, widths[1], device=device) \
            if spec.representations else None
        self.representation_dim = widths[-1]
        self.heads = MultiTaskHeads(widths[-1], len(spec.tasks), spec.num_surfaces, device=device)

    def forward(self, batch: Batch) -> ModelOutput:
        sparse, dense, events = self.embedding(batch)
        names = [e.name for e in self.spec.events]
        seq, offsets, _, event_type = merge_by_time(
            [events[n] for n in names],
            [batch.sequences[n].lengths() for n in names],
            [batch.sequences[n].timestamps for n in names],
        )
        seq = seq + self.event_type(event_type)
        context = sparse.mean(1) + dense
        summary = self.pool(seq, offsets, self.config.max_seq_len, context)
        x = self.mlp[0](torch.cat([sparse.flatten(1), dense, summary.flatten(1)], 1))
        if self.representations is not None:
            x = x + self.representation_input(self.representations(batch).flatten(1))
        for layer in itertools.islice(self.mlp, 1, None):
            x = layer(x)
        representation = x
        logits = self.heads(representation, batch.surface)
        return ModelOutput(logits=logits, aux_loss=logits.new_zeros((), dtype=torch.float32), representation=representation)

    def flops(self, batch: Batch) -> dict[str, float]:
        """Forward model FLOPs of ``batch`` per component (matmuls and attention over real lengths; embedding
        lookups excluded). Multiply by 3 for training."""
        b = batch.batch_size
        lengths = batch.num_events().clamp(max=self.config.max_seq_len)
        table = {"embedding.dense_proj": 2.0 * self.spec.num_dense * self.config.dim * b}
        table.update(self.pool.flops(lengths))
        if self.representations is not None:
            table.update(self.representations.flops({n: r.lengths.cpu() for n, r in batch.representations.items()}))
        linears = [m for m in (*self.mlp, self.representation_input) if isinstance(m, nn.Linear)]
        table["mlp"] = sum(2.0 * m.in_features * m.out_features for m in linears) * b
        table["heads"] = self.heads.flops_per_example() * b
        return table

    def embedding_bytes(self, batch: Batch) -> float:
        """Bytes read from embedding tables by the forward pass of ``batch`` (float32 rows)."""
        row = 4.0 * self.config.dim
        ids = batch.sparse.values().numel() + sum(s.ids.values().numel() for s in batch.sequences.values())
        return row * ids


__all__ = ["BaselineConfig", "BaselineRanker", "SeedPooling"]
