"""Retrieval training: queries scored by dot product against items, and the next-item losses.

A model with a request side independent of the candidate (SASRec; Kunlun's two-tower head) turns a batch
into query vectors and the items into item vectors; ``retrieval_logits`` scores every query against the
items ``NextItemTargets`` names (its positive and sampled negatives, or the whole catalogue) and
``next_item_loss`` turns those scores into the training loss.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from gem_kunlun.batch import NextItemTargets


def scored_item_ids(targets: NextItemTargets, num_items: int) -> torch.Tensor:
    """The item ids whose vectors ``retrieval_logits`` needs: ``[N * (1 + K)]`` (row-major) for sampled
    negatives, every id ``[num_items]`` for the catalogue."""
    scored = targets.scored_items()
    if scored is None:
        return torch.arange(num_items, device=targets.positives.device)
    return scored.reshape(-1)


def dot_scores(queries: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """``queries [N, D]`` against ``vectors``: ``[I, D]`` shared by every query -> ``[N, I]``, or ``[N, K, D]``
    of its own per query -> ``[N, K]``; in float32 also under autocast.

    Ranking reads the order of thousands of close scores: rounded to bfloat16 (8 significant bits) they tie and
    swap, so a model trained under bf16 autocast ranked worse than the same model scored in float32."""
    with torch.autocast(queries.device.type, enabled=False):
        if vectors.dim() == 2:
            return queries.float() @ vectors.float().t()
        return torch.einsum("nd,nkd->nk", queries.float(), vectors.float())


class CosineScore(nn.Module):
    """Puts queries and item vectors where their dot product is a scaled cosine: items unit-normalised, queries
    unit-normalised and multiplied by ``exp(log_scale)``, learned, initialised at 1/0.07 and capped at 100 (as
    CLIP's logit scale). Ranking reads the cosine alone; the scale sets how sharp the softmax over items is."""

    MAX_SCALE = 100.0

    def __init__(self, device=None) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.empty(1, device=device))  # NOTE: [1], not a 0-d scalar: FSDP shards dim 0
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.log_scale.fill_(math.log(1 / 0.07))

    def queries(self, queries: torch.Tensor) -> torch.Tensor:
        scale = self.log_scale.clamp(max=math.log(self.MAX_SCALE)).exp()
        return F.normalize(queries, dim=-1) * scale.to(queries.dtype)

    def items(self, vectors: torch.Tensor) -> torch.Tensor:
        return F.normalize(vectors, dim=-1)


def retrieval_logits(queries: torch.Tensor, item_vectors: torch.Tensor, targets: NextItemTargets) -> torch.Tensor:
    """``queries [N, D]`` and the vectors of ``scored_item_ids`` -> ``[N, 1 + K]`` float32 logits (positive in
    column 0), or ``[N, num_items]`` against the catalogue."""
    if targets.negatives is None:
        return dot_scores(queries, item_vectors)
    return dot_scores(queries, item_vectors.view(queries.shape[0], -1, queries.shape[1]))


def next_item_loss(logits: torch.Tensor, targets: NextItemTargets) -> torch.Tensor:
    """Mean over queries, in float32: ``binary`` sums the positive's and every negative's binary
    cross-entropy (SASRec's objective); ``softmax`` is the cross-entropy of the positive among the scored
    items (column 0, or its id over the catalogue)."""
    logits = logits.float()
    if targets.negatives is None:
        return F.cross_entropy(logits, targets.positives)
    if targets.loss == "softmax":
        return F.cross_entropy(logits, torch.zeros_like(targets.positives))
    labels = torch.zeros_like(logits)
    labels[:, 0] = 1.0
    return F.binary_cross_entropy_with_logits(logits, labels, reduction="none").sum(1).mean()
