"""Solaris's worker: scores candidate pairs with the teacher on a background thread and caches the embeddings.

The earlier stage hands over candidate pairs as batches of model input (one row per (user, candidate) pair)
with their keys (``PairKeys``). ``submit`` keeps the rows whose pair it has not seen before (each pair is
written once; a batch holding a new pair is scored whole, its repeats too, and one with no new pair is not scored at
all) and queues the batch; the worker
thread runs ``score`` (the teacher: batch -> ``[B, R]`` embeddings) on it, stamps the new rows with the time
and each example's own time (``example_times``),
writes them to the cache in one call, adds their users' behaviour to the ``UserIndex`` and their embeddings
to the ``DefaultEmbedding``. The queue is bounded: a reader faster than the teacher waits in ``submit``
instead of filling memory. An error in the thread stops the work and is raised again by the next ``submit``
or by ``close`` (a ``ValueError``, e.g. a caller's configuration error, as it is; any other wrapped in a
``RuntimeError`` naming the worker).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from gem_kunlun import Batch
from gem_transfer.representation_store import example_times
from gem_transfer.solaris.cache import CacheBackend, CacheEntry
from gem_transfer.solaris.keys import PairKeys
from gem_transfer.solaris.lookup import DefaultEmbedding
from gem_transfer.solaris.neighbours import UserIndex


class PrecomputeWorker:
    """See the module docstring. ``clock``: seconds since the epoch for the timestamps (default: ``time.time``)."""

    def __init__(self, score: Callable[[Batch], torch.Tensor | np.ndarray], cache: CacheBackend,
                 index: UserIndex | None = None, default: DefaultEmbedding | None = None,
                 clock: Callable[[], float] | None = None, queue_size: int = 4) -> None:
        self.score, self.cache, self.index, self.default = score, cache, index, default
        self.clock = clock or time.time
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self._seen: set[tuple[int, int]] = set()
        self._error: BaseException | None = None
        self._aborted = False
        self.counts = {"submitted_rows": 0, "duplicate_rows": 0, "scored_batches": 0, "scored_rows": 0, "written_pairs": 0}
        self.seconds = {"score": 0.0, "write": 0.0}
        self._thread = threading.Thread(target=self._run, name="solaris-precompute", daemon=True)
        self._thread.start()

    def submit(self, batch: Batch, keys: PairKeys, rows: np.ndarray | None = None) -> int:
        """Queue the pairs of ``batch`` (only ``rows``, if given) not submitted before; returns how many."""
        self._raise_if_failed()
        if len(keys) != batch.batch_size:
            raise ValueError(f"PrecomputeWorker.submit: {len(keys)} keys for a batch of {batch.batch_size} rows")
        candidates = range(len(keys)) if rows is None else np.asarray(rows).tolist()
        users, items = keys.users.tolist(), keys.items.tolist()
        new = []
        for row in candidates:
            pair = (users[row], items[row])
            if pair not in self._seen:
                self._seen.add(pair)
                new.append(row)
        self.counts["submitted_rows"] += len(candidates)
        self.counts["duplicate_rows"] += len(candidates) - len(new)
        if new:
            self._queue.put((batch, keys, np.asarray(new, np.int64)))
        return len(new)

    def close(self) -> dict:
        """Wait for every queued batch to be written, stop the thread; returns ``stats()``."""
        self._queue.put(None)
        self._thread.join()
        self._raise_if_failed()
        return self.stats()

    def abort(self) -> None:
        """Stop without writing what is still queued (the caller is failing anyway); never raises."""
        self._aborted = True
        self._queue.put(None)
        self._thread.join()

    def stats(self) -> dict:
        return {**self.counts, "score_s": round(self.seconds["score"], 3), "write_s": round(self.seconds["write"], 3)}

    def _raise_if_failed(self) -> None:
        if isinstance(self._error, ValueError):
            # NOTE: a bad input or configuration (a caller's ConfigError is a ValueError) is already one line for
            # its caller to report; wrapping it would turn it into an unexpected error with a traceback
            raise self._error
        if self._error is not None:
            raise RuntimeError(f"Solaris precompute worker failed: {self._error}") from self._error

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._error is None and not self._aborted:  # else drained unprocessed, so submit never blocks
                try:
                    self._process(*job)
                except BaseException as error:  # noqa: BLE001 - handed to the submitting thread
                    self._error = error

    def _process(self, batch: Batch, keys: PairKeys, rows: np.ndarray) -> None:
        started = time.perf_counter()
        scored = self.score(batch)
        embeddings = (scored.detach().float().cpu().numpy() if isinstance(scored, torch.Tensor) else np.asarray(scored, np.float32))
        if embeddings.ndim != 2 or embeddings.shape[0] != batch.batch_size:
            raise ValueError(f"the scorer returned {embeddings.shape} for a batch of {batch.batch_size} rows, not [B, R]")
        embeddings = embeddings[rows]
        written = time.perf_counter()
        self.seconds["score"] += written - started
        now = self.clock()
        users, items, groups = keys.users[rows].tolist(), keys.items[rows].tolist(), keys.groups[rows].tolist()
        times = example_times(batch).numpy()[rows]
        self.cache.put([CacheEntry(u, i, g, now, e, float(t)) for u, i, g, e, t in zip(users, items, groups, embeddings, times)])
        if self.index is not None:
            self.index.add(keys.users[rows], keys.behaviour[rows], times)
        if self.default is not None:
            self.default.add(embeddings, times)
        self.seconds["write"] += time.perf_counter() - written
        self.counts["scored_batches"] += 1
        self.counts["scored_rows"] += batch.batch_size
        self.counts["written_pairs"] += len(rows)
