"""Feature embedding: every input feature to vectors of one width, through torchrec."""

from __future__ import annotations

import functools

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

from gem_kernels.jagged import segment_ids
from gem_kunlun.batch import Batch, EventSequence
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
    order = tuple(present.index(k) for k in keys)
    return kjt.permute(list(order), _permutation(order, kjt.device()))


@functools.lru_cache(maxsize=64)
def _permutation(order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``order`` on ``device``, made once: TorchRec would copy it from the host at every permute, and that copy
    waits for the GPU to finish everything queued before it."""
    return torch.tensor(order, dtype=torch.int, device=device)


def pooled_in_order(pooled: KeyedTensor, keys: list[str]) -> list[torch.Tensor]:
    """The ``[B, D]`` pooled embedding of each of ``keys``, in that order.

    NOTE: by key, never by position in ``pooled.values()``: a sharded collection returns its features
    grouped by the rank that holds their tables, not in the order they were declared.
    """
    by_key = pooled.to_dict()
    return [by_key[k] for k in keys]


def mean_per_row(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[R, D]``: the mean of each row's ``lengths[r]`` consecutive vectors of ``values [N, D]`` (zeros for an
    empty row), as a mean-pooled bag."""
    sums = values.new_zeros(lengths.numel(), values.shape[1]).index_add_(0, segment_ids(lengths, values.shape[0]), values)
    return sums / lengths.clamp(min=1).to(values.dtype)[:, None]


# ids per row of a lookup without pooling (event ids, shared ids): see ``spread_lengths``
IDS_PER_ROW = 64


def spread_lengths(n: int, rows: int, device) -> torch.Tensor:
    """``[rows]`` int64: ``n`` ids spread evenly over ``rows`` rows (the first ``n % rows`` rows one more).

    NOTE: a lookup without pooling returns its vectors in id order whatever the rows, but its kernel gives each
    row to one group of threads, which reads the row's ids one after another: a batch's events as one row per
    example (hundreds of ids each, a few hundred rows) left most of a GPU idle (the lookup took ~8x its memory
    traffic's time at 512 examples of ~1,000 events). ``n`` is a host int, never read back from the GPU."""
    row = torch.arange(rows, device=device)
    return (row < n % rows).long() + n // rows


def spread_events(events: EventSequence, rows: int) -> KeyedJaggedTensor:
    """The event ids of ``events`` (one id per feature and event) as a KJT of ``rows`` rows for a lookup without
    pooling: the same ids in the same order, each feature's spread by ``spread_lengths``."""
    ids, n = events.ids, events.timestamps.shape[0]
    keys = ids.keys()
    if ids.values().numel() != n * len(keys):
        raise ValueError(f"event ids: {ids.values().numel()} ids for {len(keys)} features {keys} of {n} events; "
                         "each feature carries exactly one id per event")
    lengths = spread_lengths(n, rows, ids.values().device).repeat(len(keys))
    return KeyedJaggedTensor(keys=keys, values=ids.values(), lengths=lengths, stride=rows,
                             length_per_key=[n] * len(keys))


class FeatureEmbedding(nn.Module):
    """Non-sequence ids through an EmbeddingBagCollection (mean-pooled bags), event ids through an
    EmbeddingCollection (one vector per event, jagged), dense floats through a linear projection.

    ``forward`` returns ``sparse [B, F, D]``, ``dense [B, D]`` and, per event type, ``[T_e, D]`` event
    vectors (the sum of that event's id embeddings; ``event_dims`` may give an event type its own width).

    ``shared`` (extra feature -> event feature) lets other ids read an event feature's table (a two-tower item
    side embedding candidate ids through the history's item table): ``forward(batch, shared_ids)`` looks them up
    in the same call as the events (one lookup, one fused update of the table) and returns their ``{name: [N,
    D]}`` vectors fourth; ``lookup_shared(ids)`` looks them up alone.
    """

    def __init__(
        self, spec: FeatureSpec, dim: int, event_dims: dict[str, int] | None = None, device: torch.device | None = None,
        shared: dict[str, str] | None = None, dense_columns: tuple[int, ...] | None = None,
    ) -> None:
        """``dense_columns``: the columns of ``batch.dense`` read (``spec.num_dense`` of them; None: all of them)."""
        super().__init__()
        event_dims = event_dims or {}
        self.spec = spec
        self.dim = dim
        self.shared = dict(shared or {})
        event_features = {f.name: e.name for e in spec.events for f in e.features}
        unknown = sorted(set(self.shared.values()) - set(event_features))
        if unknown:
            raise ValueError(f"shared tables must be event features' tables, {unknown} is not an event feature")
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
                    EmbeddingConfig(name=table_name(f.name), embedding_dim=width, num_embeddings=f.num_embeddings,
                                    feature_names=[f.name, *(k for k, v in self.shared.items() if v == f.name)])
                    for e in spec.events
                    if self.event_widths[e.name] == width
                    for f in e.features
                ],
                device=device,
            )
        # the collection that holds each shared feature's table
        self.shared_collection = {k: f"width{self.event_widths[event_features[v]]}" for k, v in self.shared.items()}
        self.dense = nn.Linear(spec.num_dense, dim, device=device)
        # NOTE: a model may read only some of a batch's dense columns too (a two-tower request side: not the
        # candidate's); leading columns are a view, others a gather
        if dense_columns is not None and len(dense_columns) != spec.num_dense:
            raise ValueError(f"FeatureEmbedding: {len(dense_columns)} dense columns given for a spec of {spec.num_dense}")
        columns = None if dense_columns is None else tuple(dense_columns)
        self.dense_prefix = len(columns) if columns is not None and columns == tuple(range(len(columns))) else None
        self.dense_columns = None if columns is None or self.dense_prefix is not None else columns
        self._dense_index: dict[torch.device, torch.Tensor] = {}  # the columns as an index, made once per device

    def shared_width(self, name: str) -> int:
        return int(self.shared_collection[name].removeprefix("width"))

    def forward(self, batch: Batch, shared_ids: dict[str, torch.Tensor] | None = None):
        """``(sparse, dense, events)``; with ``shared_ids`` (name -> ``[N]`` ids, any N) also their vectors."""
        b = batch.batch_size
        if self.bags is None:
            sparse = batch.dense.new_zeros(b, 0, self.dim)
        else:
            features = select_keys(batch.sparse, [f.name for f in self.spec.sparse])
            sparse = torch.stack(pooled_in_order(self.bags(features), [f.name for f in self.spec.sparse]), 1)
        dense_input = batch.dense
        if self.dense_prefix is not None:
            dense_input = dense_input[:, : self.dense_prefix]
        elif self.dense_columns is not None:
            # NOTE: a list index would be copied to the device at every call (a copy that waits for the GPU)
            index = self._dense_index.get(dense_input.device)
            if index is None:
                index = self._dense_index[dense_input.device] = torch.tensor(self.dense_columns, device=dense_input.device)
            dense_input = dense_input.index_select(1, index)
        dense = self.dense(dense_input)
        events, shared = {}, {}
        for key, collection in self.events.items():
            width = int(key.removeprefix("width"))
            types = [e for e in self.spec.events if self.event_widths[e.name] == width]
            # one lookup per collection: a sharded EmbeddingCollection takes a single KJT, every key with
            # as many rows
            sequences = [batch.sequences[e.name] for e in types]
            names = [k for k, c in self.shared_collection.items() if c == key]
            given = shared_ids or {}
            counts = [s.timestamps.shape[0] for s in sequences] + [given[k].numel() for k in names if k in given]
            rows = max(1, -(-max(counts, default=0) // IDS_PER_ROW))
            inputs = [spread_events(s, rows) for s in sequences]
            if names:
                inputs.append(self._shared_input(names, given, rows, batch.dense.device))
            looked_up = collection(KeyedJaggedTensor.concat(inputs))
            for e in types:
                # NOTE: added one after another: stacking them first writes every vector once more
                events[e.name] = functools.reduce(torch.add, [looked_up[f.name].values() for f in e.features])
            shared.update({name: looked_up[name].values() for name in names if shared_ids and name in shared_ids})
        return (sparse, dense, events) if shared_ids is None else (sparse, dense, events, shared)

    def lookup_shared(self, ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{name: [N, D]}``: the vectors of ``ids`` (name -> ``[N]``) through the tables they share, the
        collections called with their event features empty (the same keys, in the same order, as ``forward``)."""
        shared = {}
        for key, collection in self.events.items():
            names = [k for k, c in self.shared_collection.items() if c == key and k in ids]
            if not names:
                continue
            device = next(iter(ids.values())).device
            events = [e for e in self.spec.events if f"width{self.event_widths[e.name]}" == key]
            keys = [f.name for e in events for f in e.features]
            rows = max(1, -(-max(ids[name].numel() for name in names) // IDS_PER_ROW))
            empty = KeyedJaggedTensor(keys=keys, values=torch.zeros(0, dtype=torch.int64, device=device),
                                      lengths=torch.zeros(len(keys) * rows, dtype=torch.int64, device=device),
                                      stride=rows, length_per_key=[0] * len(keys))
            every = [k for k, c in self.shared_collection.items() if c == key]
            looked_up = collection(KeyedJaggedTensor.concat([empty, self._shared_input(every, ids, rows, device)]))
            shared.update({name: looked_up[name].values() for name in names})
        return shared

    @staticmethod
    def _shared_input(names: list[str], ids: dict[str, torch.Tensor], rows: int, device) -> KeyedJaggedTensor:
        """The shared features' ids as ``rows`` rows, each feature's ids spread over them (``spread_lengths``),
        none where a feature has no ids."""
        values, lengths, per_key = [], [], []
        for name in names:
            n = ids[name].numel() if name in ids else 0
            if n:
                values.append(ids[name].to(device=device, dtype=torch.int64))
            lengths.append(spread_lengths(n, rows, device))
            per_key.append(n)
        values = torch.cat(values) if values else torch.zeros(0, dtype=torch.int64, device=device)
        return KeyedJaggedTensor(keys=names, values=values, lengths=torch.cat(lengths), stride=rows,
                                 length_per_key=per_key)


class ItemTower(nn.Module):
    """The item side of a two-tower model: an item's candidate features (its id, its attribute bags), each
    mean-pooled to ``dim``, concatenated and projected to ``out_dim``. ``forward(kjt [M rows]) -> [M, out_dim]``.

    The features named in ``shared`` have no table here: ``forward`` takes their ids' vectors, looked up
    elsewhere (``FeatureEmbedding``: the history's table of the same ids), and mean-pools them alike."""

    def __init__(self, features: tuple, dim: int, out_dim: int, device: torch.device | None = None,
                 shared: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.names = [f.name for f in features]
        self.shared = tuple(shared)
        self.owned = [n for n in self.names if n not in self.shared]  # the features with a table here
        self.dim = dim
        self.bags = None if not self.owned else EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=f"item_tower_{table_name(f.name)}", embedding_dim=dim, num_embeddings=f.num_embeddings,
                                   feature_names=[f.name], pooling=PoolingType.MEAN)
                for f in features if f.name in self.owned
            ],
            device=device,
        )
        self.project = nn.Linear(len(features) * dim, out_dim, device=device)

    def shared_ids(self, features: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        """The ids of the shared features, whose vectors ``forward`` needs."""
        return {name: features[name].values() for name in self.shared}

    def forward(self, features: KeyedJaggedTensor, shared_vectors: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        owned = self.owned
        pooled = {} if self.bags is None else dict(zip(owned, pooled_in_order(self.bags(select_keys(features, owned)), owned)))
        for name in self.shared:
            if shared_vectors is None or name not in shared_vectors:
                raise ValueError(f"the item tower embeds {name!r} through a shared table: pass its vectors")
            pooled[name] = mean_per_row(shared_vectors[name], features[name].lengths())
        return self.project(torch.cat([pooled[n] for n in self.names], 1))

    def flops(self, num_items: int) -> float:
        return 2.0 * self.project.in_features * self.project.out_features * num_items
