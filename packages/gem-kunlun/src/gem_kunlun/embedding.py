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
    vectors (the sum of that event's id embeddings; ``event_dims`` may give an event type its own width).
    """

    def __init__(
        self, spec: FeatureSpec, dim: int, event_dims: dict[str, int] | None = None, device: torch.device | None = None
    ) -> None:
        super().__init__()
        event_dims = event_dims or {}
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
        # NOTE: an EmbeddingCollection holds tables of one width, so event types are grouped by width.
        self.event_widths = {e.name: event_dims.get(e.name, dim) for e in spec.events}
        self.events = nn.ModuleDict()
        for width in sorted(set(self.event_widths.values())):
            self.events[f"width{width}"] = EmbeddingCollection(
                tables=[
                    EmbeddingConfig(
                        name=table_name(f.name), embedding_dim=width, num_embeddings=f.num_embeddings, feature_names=[f.name]
                    )
                    for e in spec.events
                    if self.event_widths[e.name] == width
                    for f in e.features
                ],
                device=device,
            )
        self.dense = nn.Linear(spec.num_dense, dim, device=device)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        b = batch.batch_size
        sparse = self.bags(batch.sparse).values().view(b, len(self.spec.sparse), self.dim)
        dense = self.dense(batch.dense)
        events = {}
        for key, collection in self.events.items():
            width = int(key.removeprefix("width"))
            types = [e for e in self.spec.events if self.event_widths[e.name] == width]
            # one lookup per collection: a sharded EmbeddingCollection takes a single KJT
            looked_up = collection(KeyedJaggedTensor.concat([batch.sequences[e.name].ids for e in types]))
            for e in types:
                events[e.name] = torch.stack([looked_up[f.name].values() for f in e.features], 0).sum(0)
        return sparse, dense, events
