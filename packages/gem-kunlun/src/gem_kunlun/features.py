"""What a model is fed: the feature description every reader declares and every model is built from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SparseFeature:
    """A categorical id feature with its vocabulary size (ids must lie in ``[0, num_embeddings)``)."""

    name: str
    num_embeddings: int


@dataclass(frozen=True)
class EventType:
    """One kind of event in a user's history (a purchase, a post...) and the id features that describe it."""

    name: str
    features: tuple[SparseFeature, ...]


@dataclass(frozen=True)
class RepresentationFeature:
    """A float-valued jagged input: per example a sequence of ``dim``-wide vectors, oldest first (LoopFM: a
    foundation model's compact representations of the user's earlier events)."""

    name: str
    dim: int

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError(f"RepresentationFeature {self.name!r}: dim must be >= 1, got {self.dim}")


@dataclass(frozen=True)
class FeatureSpec:
    """The full input description: non-sequence dense and sparse features, event sequences, tasks and surfaces."""

    num_dense: int
    sparse: tuple[SparseFeature, ...]
    events: tuple[EventType, ...]
    tasks: tuple[str, ...]
    num_surfaces: int = 1
    # the sparse features that describe the candidate item (its id, its attributes): what a two-tower
    # model's item side reads and its request side leaves out
    candidate: tuple[str, ...] = ()
    # the dense columns that describe the candidate item (its float fields), by index: a two-tower model's request
    # side leaves them out as it leaves out the candidate's sparse features (reading them would let the query see
    # the item it is to find)
    candidate_dense: tuple[int, ...] = ()
    # float vector sequences per example (``Batch.representations``), read by the models that support them
    representations: tuple[RepresentationFeature, ...] = ()
    # (sparse feature, event feature) pairs whose ids name the same things (the candidate's item id and the
    # history's): a model may embed both through one table
    shared_ids: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        names = [f.name for f in self.sparse] + [f.name for e in self.events for f in e.features]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"feature names must be unique across sparse and event features, repeated: {duplicated}")
        if not self.tasks:
            raise ValueError("FeatureSpec.tasks must name at least one task")
        unknown = sorted(set(self.candidate) - {f.name for f in self.sparse})
        if unknown:
            raise ValueError(f"FeatureSpec.candidate names {unknown}, which are not sparse features")
        if len(set(self.candidate_dense)) != len(self.candidate_dense) or any(not 0 <= i < self.num_dense for i in self.candidate_dense):
            raise ValueError(f"FeatureSpec.candidate_dense must name distinct dense columns in [0, {self.num_dense}), "
                             f"got {list(self.candidate_dense)}")
        vectors = [r.name for r in self.representations]
        if len(set(vectors)) != len(vectors):
            raise ValueError(f"FeatureSpec.representations names must be unique, got {vectors}")
        if self.num_surfaces < 1:
            raise ValueError(f"FeatureSpec.num_surfaces must be >= 1, got {self.num_surfaces}")
        sizes = {f.name: f.num_embeddings for f in self.sparse}
        event_sizes = {f.name: f.num_embeddings for e in self.events for f in e.features}
        for sparse, event in self.shared_ids:
            if sparse not in sizes or event not in event_sizes:
                raise ValueError(f"FeatureSpec.shared_ids pairs a sparse feature with an event feature, got ({sparse!r}, {event!r})")
            if sizes[sparse] != event_sizes[event]:
                raise ValueError(f"FeatureSpec.shared_ids: {sparse!r} has {sizes[sparse]} ids, {event!r} {event_sizes[event]}")
