"""LoopFM on the student side: a batch stream whose batches carry each example's deep history from the store.

``RepresentationJoin`` wraps any batch stream (``spec``, iteration, ``state_dict`` / ``load_state_dict``) and
adds one representation feature to its spec and batches: for every example, the store's representations
of the same user (``user_feature``) strictly before the example's time (``example_times``), the newest
``max_events`` of them, oldest first. The store is read-only here and the join is a pure function of
(user, time), so the stream's own position stays the whole resumable state and any split of a global
batch over ranks joins each example the same way. ``FeatureJoin`` is the wrapper it shares with Solaris's join.

With ``key_only`` the user feature keys the store and nothing else: the join removes it from the spec and the
batches it passes on (``without_sparse_feature``), so no model reads it. Next-item data carries user ids only as
a sparse feature (``with_user_id``); a key-only join lets a student read its users' deep histories without also
learning a table of user ids, and lets the teacher's pass read the data as a teacher trained without them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from gem_kunlun import Batch, FeatureSpec, RepresentationFeature

from gem_transfer.representation_store import RepresentationError, RepresentationStore, example_times, example_users


def without_sparse_feature(spec: FeatureSpec, name: str) -> FeatureSpec:
    """``spec`` without sparse feature ``name`` (a key, which no candidate or shared table may involve)."""
    if name not in {f.name for f in spec.sparse}:
        raise RepresentationError(f"{name!r} is not among the data's sparse features {[f.name for f in spec.sparse]}")
    if name in spec.candidate or any(name in pair for pair in spec.shared_ids):
        raise RepresentationError(f"{name!r} describes the candidate or shares a table: it cannot be a key only")
    return dataclasses.replace(spec, sparse=tuple(f for f in spec.sparse if f.name != name))


def without_sparse_key(batch: Batch, name: str) -> Batch:
    """``batch`` without the ids of sparse feature ``name`` (the other features' ids untouched, in order)."""
    keys = batch.sparse.keys()
    return dataclasses.replace(batch, sparse=batch.sparse.permute([i for i, key in enumerate(keys) if key != name]))


class FeatureJoin:
    """A batch stream: ``source``'s batches (any stream with ``spec``, iteration and ``state_dict`` /
    ``load_state_dict``) with one more representation feature ``name``, ``dim`` wide, which ``attach`` adds to each
    batch. The join is a function of the batch, so the source's position stays the whole resumable state."""

    def __init__(self, source: Any, name: str, dim: int, error: type[Exception] = ValueError) -> None:
        if name in {r.name for r in source.spec.representations}:
            raise error(f"the data already has a representation feature {name!r}")
        self.source, self.name = source, name
        self._spec = dataclasses.replace(source.spec, representations=(*source.spec.representations,
                                                                       RepresentationFeature(name, dim)))

    @property
    def spec(self) -> FeatureSpec:
        return self._spec

    def attach(self, batch: Batch) -> Batch:
        raise TypeError(f"{type(self).__name__} must define attach")

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.source:
            yield self.attach(batch)

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state)


class RepresentationJoin(FeatureJoin):
    """``source``'s batches with feature ``name`` joined from ``store`` (see the module docstring); ``key_only``:
    without the user feature afterwards."""

    def __init__(self, source: Any, store: RepresentationStore, user_feature: str, max_events: int, name: str = "loopfm",
                 key_only: bool = False) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        if user_feature not in {f.name for f in source.spec.sparse}:
            raise RepresentationError(f"user feature {user_feature!r} is not among the data's sparse features "
                                      f"{[f.name for f in source.spec.sparse]}")
        super().__init__(source, name, store.dim, RepresentationError)
        self.store, self.user_feature, self.max_events, self.key_only = store, user_feature, max_events, key_only
        if key_only:
            self._spec = without_sparse_feature(self._spec, user_feature)

    def attach(self, batch: Batch) -> Batch:
        """``batch`` with its examples' histories from the store as ``representations[name]``."""
        history = self.store.history(example_users(batch, self.user_feature), example_times(batch), self.max_events)
        batch = dataclasses.replace(batch, representations={**batch.representations, self.name: history})
        return without_sparse_key(batch, self.user_feature) if self.key_only else batch
