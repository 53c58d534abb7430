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
    KeyedTensor,
    PoolingType,
)

from gem_kunlun.batch import Batch
from gem_kunlun.features import FeatureSpec


def table_name(feature: str) -> str:
    return f"t_{feature}"


def select_keys(kjt: KeyedJaggedTensor, keys: list[str] | tuple[str, ...]) -> KeyedJaggedTensor:
    """The features ``keys`` of ``kjt`` (in that order), every example kept."""
    present = kjt.keys()
    missing = [k for k in keys if k not in present]
    if missing:
        raise ValueError(f"features {missing} are missing from the batch, which has {present}")
    if list(keys) == present:
        return kjt
    return kjt.permute([present.index(k) for k in keys])


def pooled_in_order(pooled: KeyedTensor, keys: list[str]) -> list[torch.Tensor]:
    """The ``[B, D]`` pooled embedding of each of ``keys``, in that order.

    NOTE: by key, never by position in ``pooled.values()``: a sharded collection returns its features
    grouped by the rank that holds their tables, not in the order they were declared.
    """
    by_key = pooled.to_dict()
    return [by_key[k] for k in keys]


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
        # NOTE: a model may read only some of a batch's non-sequence features (a two-tower request side);
        # with none at all there is no bag collection (TorchRec cannot shard an empty one)
        self.bags = None if not spec.sparse else EmbeddingBagCollection(
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
        if self.bags is None:
            sparse = batch.dense.new_zeros(b, 0, self.dim)
        else:
            features = select_keys(batch.sparse, [f.name for f in self.spec.sparse])
            sparse = torch.stack(pooled_in_order(self.bags(features), [f.name for f in self.spec.sparse]), 1)
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


class ItemTower(nn.Module):
    """The item side of a two-tower model: an item's candidate features (its id, its attribute bags), each
    mean-pooled to ``dim``, concatenated and projected to ``out_dim``. ``forward(kjt [M rows]) -> [M, out_dim]``."""

    def __init__(self, features: tuple, dim: int, out_dim: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.names = [f.name for f in features]
        self.dim = dim
        self.bags = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=f"item_tower_{table_name(f.name)}", embedding_dim=dim, num_embeddings=f.num_embeddings,
                                   feature_names=[f.name], pooling=PoolingType.MEAN)
                for f in features
            ],
            device=device,
        )
        self.project = nn.Linear(len(features) * dim, out_dim, device=device)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.project(torch.cat(pooled_in_order(self.bags(select_keys(features, self.names)), self.names), 1))

    def flops(self, num_items: int) -> float:
        return 2.0 * self.project.in_features * self.project.out_features * num_items
