"""How a model reads float vector sequences (``Batch.representations``, LoopFM's deep history): one token each.

Every representation feature of the spec becomes one ``dim``-wide token per example: its vectors are
projected to a key and a value, and a learned query attends over them (softmax over the example's own
vectors only, computed on the jagged layout without padding). A learned null key/value is always present,
so an example without vectors gets the null value rather than a 0/0 softmax, and one with a few vectors
can still put weight on "nothing useful here". The models append these tokens to their non-sequence
tokens (Kunlun) or to the MLP input (the baseline).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gem_kunlun.batch import Batch
from gem_kunlun.features import RepresentationFeature
from gem_kunlun.sequence import segment_ids


class RepresentationSummary(nn.Module):
    """``forward(batch) -> [B, F, dim]``: one token per feature of ``features`` (F of them), see the module
    docstring."""

    def __init__(self, features: tuple[RepresentationFeature, ...], dim: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.features, self.dim = features, dim
        self.key_value = nn.ModuleList([nn.Linear(f.dim, 2 * dim, device=device) for f in features])
        self.query = nn.Parameter(torch.empty(len(features), dim, device=device))
        self.null_key_value = nn.Parameter(torch.empty(len(features), 2, dim, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.query, std=0.02)
        nn.init.normal_(self.null_key_value, std=0.02)

    def forward(self, batch: Batch) -> torch.Tensor:
        tokens = [self._pool(i, batch.representations[f.name].values, batch.representations[f.name].lengths)
                  for i, f in enumerate(self.features)]
        return torch.stack(tokens, 1)

    def _pool(self, index: int, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Attention of feature ``index``'s query over ``values [T, d]`` (jagged by ``lengths [B]``): ``[B, dim]``."""
        b, scale = lengths.numel(), 1.0 / math.sqrt(self.dim)
        # in float32: under autocast the projection gives bf16 / fp16, which the pooling's float32 null entry and
        # index_add would refuse (and a sum over many vectors keeps its precision)
        key, value = self.key_value[index](values.to(self.query.dtype)).float().chunk(2, -1)
        query, (null_key, null_value) = self.query[index], self.null_key_value[index]
        owner = segment_ids(lengths, values.shape[0])
        scores = (key @ query) * scale  # [T]
        null_score = (null_key @ query * scale).expand(b)
        # NOTE: the softmax is shift-invariant, so the per-example maximum is taken without gradient
        peak = null_score.detach().scatter_reduce(0, owner, scores.detach(), "amax", include_self=True)
        weights, null_weight = torch.exp(scores - peak[owner]), torch.exp(null_score - peak)
        total = null_weight.index_add(0, owner, weights)
        pooled = (null_weight[:, None] * null_value).index_add(0, owner, weights[:, None] * value)
        return pooled / total[:, None]

    def flops(self, lengths: dict[str, torch.Tensor]) -> dict[str, float]:
        """Forward FLOPs for feature name -> vectors per example ``[B]``: the key/value projection and the
        attention (score and weighted sum) over every vector and the null entry."""
        table = {}
        for f in self.features:
            vectors, b = float(lengths[f.name].sum()), lengths[f.name].numel()
            table[f"representations.{f.name}"] = 2.0 * f.dim * 2 * self.dim * vectors + 4.0 * self.dim * (vectors + b)
        return table


__all__ = ["RepresentationSummary"]
