"""What the trainer consumes: any ``BatchSource`` (an iterable of batches with a spec and a resumable state).

``ShardedStream`` is the common base of the finite-or-endless readers. It numbers *global* batches
``0, 1, 2, ...`` of ``world_size * batch_size`` examples and gives rank ``r`` slice ``r`` of each: rows
``[r * batch_size, (r + 1) * batch_size)`` of global batch ``t`` at its step ``t``. The examples a step
trains on therefore do not depend on how many ranks share them: ``W`` ranks of batch ``B`` see exactly
what one process of batch ``W * B`` sees, which is what makes multi-rank training comparable (and
testable) against a single process. Inside a DataLoader with ``K`` workers, worker ``w`` produces the
steps ``position + w, position + w + K, ...``; the DataLoader's round-robin then returns exactly the
sequence a single process would, so the output, and therefore the saved position, does not depend on the
number of workers. ``WorkerLoader`` runs the workers and counts delivered batches in the main process,
which is the state a restarted run needs. The position counts global batches, so a run may resume on
another number of ranks as long as the global batch size stays the same.
"""

from __future__ import annotations

import collections
import multiprocessing
from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from gem_kunlun import Batch, FeatureSpec

from gem_data.batch_ops import select_examples
from gem_data.errors import portable_error
from gem_data.packing import Description, Shared, describe, pack_into, unpack


@runtime_checkable
class BatchSource(Protocol):
    """Anything the trainer can train from: ``spec``, ``iter`` of batches, ``state_dict``/``load_state_dict``."""

    @property
    def spec(self) -> FeatureSpec: ...

    def __iter__(self) -> Iterator[Batch]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ShardedStream(IterableDataset):
    """Base class: subclasses define ``spec`` and ``global_batch(index)`` (the whole global batch, None past
    the end of the data), and may override ``rank_batch`` to read only this rank's rows."""

    def __init__(self, batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, world_size), got rank={rank}, world_size={world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.global_batch_size = batch_size * world_size
        self.position = 0  # global batches (steps) delivered so far

    def global_batch(self, index: int) -> Batch | None:
        raise TypeError(f"{type(self).__name__} must define global_batch")

    def rank_batch(self, index: int) -> Batch | None:
        """This rank's slice of global batch ``index`` (None past the end; a short final batch is split as
        evenly as its rows allow, so a rank may get an empty slice)."""
        batch = self.global_batch(index)
        if batch is None or self.world_size == 1:
            return batch
        rows = torch.arange(batch.batch_size).tensor_split(self.world_size)[self.rank]
        return select_examples(batch, rows)

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        index = self.position + worker
        while True:
            batch = self.rank_batch(index)
            if batch is None:
                return
            if info is None:
                # NOTE: in a worker process this copy's position is meaningless; WorkerLoader counts instead.
                self.position = index + 1
            yield batch
            index += workers

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        saved = state.get("global_batch_size")
        if saved != self.global_batch_size:
            raise ValueError(
                f"the data position was saved for global batches of {saved} examples; this run's global batch is "
                f"{self.global_batch_size} (data.batch_size {self.batch_size} x {self.world_size} ranks): keep the "
                f"global batch size when resuming on another number of ranks"
            )
        self.position = int(state["position"])


class WorkerLoader:
    """A ``ShardedStream`` read by ``num_workers`` DataLoader processes; a ``BatchSource`` itself.

    The output order equals the single-process order (see the module docstring), so ``state_dict`` is the
    stream's own, advanced by one per batch delivered here, and can be resumed with any worker count.

    A worker hands each batch over as ``ProcessReadAhead``'s reading process does: packed (``gem_data.packing``: every
    tensor in one buffer, with the host-side counts the step needs taken there) into one of a few shared-memory
    buffers it reuses, the DataLoader carrying only the batch's description (and a buffer the first time it is used);
    here the buffer is copied out in one piece, handed back (a semaphore per worker) and the batch rebuilt as views of
    the copy. A pickled batch crosses as a shared-memory file per tensor (a few dozen), made and sent for every batch.
    Objects every batch shares (an item catalogue) cross once per worker.
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
        context = multiprocessing.get_context()
        free = [context.Semaphore(0) for _ in range(self.num_workers)]  # batches of each worker copied out here
        # NOTE: a DataLoader iterator draws its workers' base seed from the generator it is given, by default the
        # global one, which then hands a resumed run other dropout masks than the run it continues (the draw
        # falls on the other side of the restored state); the streams draw nothing from it, so a fixed one serves
        loader = DataLoader(
            _ErrorsAsItems(self.stream, free, depth=self.prefetch_factor + 2),
            batch_size=None,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            collate_fn=_identity,
            generator=torch.Generator().manual_seed(0),
        )
        shared: dict[int, dict[int, Any]] = {}  # worker -> token -> the objects its batches share
        buffers: dict[tuple[int, int], torch.Tensor] = {}  # (worker, slot) -> that worker's shared buffer
        for item in loader:
            if isinstance(item, _WorkerError):
                raise item.error
            if item.new_buffer is not None:
                buffers[item.worker, item.slot] = item.new_buffer
            flat = torch.empty(item.description.nbytes, dtype=torch.uint8)
            # NOTE: NumPy's copy is one memcpy (torch's would wake its intra-op threads for it)
            np.copyto(flat.numpy(), buffers[item.worker, item.slot].numpy()[: item.description.nbytes])
            free[item.worker].release()
            known = shared.setdefault(item.worker, {})
            known.update(item.new_shared)
            self.stream.position += 1
            yield unpack(flat, item.description, known)

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)


def _identity(batch: Batch) -> Batch:
    return batch


class _WorkerError:
    """An error a worker's stream raised, handed over as an item and raised where the batch was wanted."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class _Packed(NamedTuple):
    """A batch as a worker hands it over: the worker (whose buffers and shared objects' tokens these are), the slot of
    its buffer the batch is packed in (``new_buffer``: that buffer, where it is new), ``gem_data.packing``'s
    description of the batch, and the shared objects first seen in it."""

    worker: int
    slot: int
    new_buffer: torch.Tensor | None
    description: Description
    new_shared: dict[int, Any]


class _ErrorsAsItems(IterableDataset):
    """``stream`` in a worker, each batch packed (``_Packed``), whose error becomes its last item (``_WorkerError``).

    NOTE: the DataLoader re-raises a worker's error as its type built from one multi-line message (the worker's
    traceback), or as a RuntimeError where that type takes other arguments (``DataError``): a reader's one-line
    error would reach the user as a traceback. An error that cannot cross whole crosses as ``portable_error`` makes
    it."""

    def __init__(self, stream: ShardedStream, free: list, depth: int) -> None:
        self.stream, self.free, self.depth = stream, free, depth

    def __iter__(self) -> Iterator[_Packed | _WorkerError]:
        worker, shared = get_worker_info().id, Shared()
        # NOTE: the main process copies a worker's batches out in the order sent, one release each; the DataLoader keeps
        # at most prefetch_factor batches of a worker in flight, so with more buffers than that a worker never waits
        buffers: list[torch.Tensor | None] = [None] * self.depth
        idle, in_use = list(range(self.depth)), collections.deque()
        try:
            for batch in self.stream:
                if isinstance(batch, Batch):
                    batch.count_on_host()
                description, tensors, new_shared = describe(batch, shared)
                if not idle:
                    self.free[worker].acquire()
                    idle.append(in_use.popleft())
                slot, new_buffer = idle.pop(), None
                if buffers[slot] is None or buffers[slot].numel() < description.nbytes:
                    # room to grow, so that a slightly larger batch later does not send a new buffer
                    size = max(description.nbytes + description.nbytes // 4, 1 << 16)
                    buffers[slot] = new_buffer = torch.empty(size, dtype=torch.uint8).share_memory_()
                pack_into(buffers[slot], description, tensors)
                in_use.append(slot)
                yield _Packed(worker, slot, new_buffer, description, new_shared)
        except Exception as error:  # handed over whole, raised in the main process
            yield _WorkerError(portable_error(error))


def spec_difference(a: FeatureSpec, b: FeatureSpec) -> str | None:
    """A one-line description of how two specs differ, or None when they are equal."""
    if a == b:
        return None
    for name in ("num_dense", "tasks", "num_surfaces", "candidate", "candidate_dense", "shared_ids", "representations"):
        if getattr(a, name) != getattr(b, name):
            return f"{name}: {getattr(a, name)!r} != {getattr(b, name)!r}"
    if a.sparse != b.sparse:
        return f"sparse: {[(f.name, f.num_embeddings) for f in a.sparse]} != {[(f.name, f.num_embeddings) for f in b.sparse]}"
    return f"events: {a.events!r} != {b.events!r}"
