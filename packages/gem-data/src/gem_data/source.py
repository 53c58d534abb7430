"""What the trainer consumes: any ``BatchSource`` (an iterable of batches with a spec and a resumable state).

``ShardedStream`` is the common base of the finite-or-endless readers: it numbers *global* batches
``0, 1, 2, ...`` and gives rank ``r`` of ``W`` the batches ``r, r + W, ...`` (the rank-level sequence
``j = 0, 1, ...`` maps to global batch ``j * W + r``). Inside a DataLoader with ``K`` workers, worker ``w``
produces the rank-level batches ``position + w, position + w + K, ...``; the DataLoader's round-robin
then returns exactly the sequence a single process would, so the output, and therefore the saved
position, does not depend on the number of workers. ``WorkerLoader`` runs the workers and counts
delivered batches in the main process, which is the state a restarted run needs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from gem_kunlun import Batch, FeatureSpec


@runtime_checkable
class BatchSource(Protocol):
    """Anything the trainer can train from: ``spec``, ``iter`` of batches, ``state_dict``/``load_state_dict``."""

    @property
    def spec(self) -> FeatureSpec: ...

    def __iter__(self) -> Iterator[Batch]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ShardedStream(IterableDataset):
    """Base class: subclasses define ``spec`` and ``global_batch(index)`` (None past the end of the data)."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, world_size), got rank={rank}, world_size={world_size}")
        self.rank, self.world_size = rank, world_size
        self.position = 0  # rank-level batches delivered so far

    def global_batch(self, index: int) -> Batch | None:
        raise TypeError(f"{type(self).__name__} must define global_batch")

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        local = self.position + worker
        while True:
            batch = self.global_batch(local * self.world_size + self.rank)
            if batch is None:
                return
            if info is None:
                # NOTE: in a worker process this copy's position is meaningless; WorkerLoader counts instead.
                self.position = local + 1
            yield batch
            local += workers

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["world_size"] != self.world_size:
            raise ValueError(
                f"data state was saved with world_size={state['world_size']}, resuming with {self.world_size}"
            )
        self.position = int(state["position"])


class WorkerLoader:
    """A ``ShardedStream`` read by ``num_workers`` DataLoader processes; a ``BatchSource`` itself.

    The output order equals the single-process order (see the module docstring), so ``state_dict`` is the
    stream's own, advanced by one per batch delivered here, and can be resumed with any worker count.
    """

    def __init__(self, stream: ShardedStream, num_workers: int = 0, prefetch_factor: int = 2) -> None:
        self.stream, self.num_workers, self.prefetch_factor = stream, num_workers, prefetch_factor

    @property
    def spec(self) -> FeatureSpec:
        return self.stream.spec

    def __iter__(self) -> Iterator[Batch]:
        if self.num_workers == 0:
            yield from self.stream
            return
        loader = DataLoader(
            self.stream,
            batch_size=None,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            collate_fn=_identity,
        )
        for batch in loader:
            self.stream.position += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)


def _identity(batch: Batch) -> Batch:
    return batch


def spec_difference(a: FeatureSpec, b: FeatureSpec) -> str | None:
    """A one-line description of how two specs differ, or None when they are equal."""
    if a == b:
        return None
    for name in ("num_dense", "tasks", "num_surfaces"):
        if getattr(a, name) != getattr(b, name):
            return f"{name}: {getattr(a, name)!r} != {getattr(b, name)!r}"
    if a.sparse != b.sparse:
        return f"sparse: {[(f.name, f.num_embeddings) for f in a.sparse]} != {[(f.name, f.num_embeddings) for f in b.sparse]}"
    return f"events: {a.events!r} != {b.events!r}"
