"""Feature embedding: every input feature to vectors of one width, through torchrec."""

from __future__ import annotations

import torch
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)

from gem_kunlun.batch import Batch
from gem_kunlun.features import FeatureSpec


def table_name(feature: str) -> str:
    return f"t_{feature}"


class FeatureEmbedding(nn.Module):
    """Non-sequence ids through an EmbeddingBagCollection (mean-pooled bags), event ids through an
    EmbeddingCollection (one vector per event, jagged), dense floats through a linear projection.

    ``forward`` returns ``sparse [B, F, D]``, ``dense [B, D]`` and, per event type, ``[T_e, D]`` event
    vectors (the sum of that event's id embeddings).
    """

    def __init__(self, spec: FeatureSpec, dim: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.dim = dim
        self.bags = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=table_name(f.name),
                    embedding_dim=dim,
                    num_embeddings=f.num_embeddings,
                    feature_names=[f.name],
                    pooling=PoolingType.MEAN,
                )
                for f in spec.sparse
            ],
            device=device,
        )
        self.events = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name=table_name(f.name), embedding_dim=dim, num_embeddings=f.num_embeddings, feature_names=[f.name]
                )
                for e in spec.events
                for f in e.features
            ],
            device=device,
        )
        self.dense = nn.Linear(spec.num_dense, dim, device=device)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        b = batch.batch_size
        sparse = self.bags(batch.sparse).values().view(b, len(self.spec.sparse), self.dim)
        dense = self.dense(batch.dense)
        # NOTE: one lookup for all event types: a sharded EmbeddingCollection takes a single KJT.
        ids = KeyedJaggedTensor.concat([batch.sequences[e.name].ids for e in self.spec.events])
        looked_up = self.events(ids)
        events = {}
        for e in self.spec.events:
            vectors = [looked_up[f.name].values() for f in e.features]
            events[e.name] = torch.stack(vectors, 0).sum(0)
        return sparse, dense, events
