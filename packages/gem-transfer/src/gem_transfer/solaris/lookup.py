"""Solaris's lookup: the teacher's embedding of a (user, item) pair from the cache, with a fallback when it has none.

Levels, in order (``gem_transfer.solaris.report.LEVELS``); an entry counts only while fresh (``age <= ttl_s``):
1. ``exact``: the cached entry of the pair;
2. ``user_group``: the mean of the user's newest fresh entries for items of the same group;
3. ``neighbours``: the mean of the fresh entries for this item of the ``neighbours`` users whose behaviour is
   most like this user's (``UserIndex``; bounded, as each user behaved before that time), or, where none of them
   has this item, of their newest entries in the same group;
4. ``default``: the mean of every embedding written so far (``DefaultEmbedding``).
The age of a served answer is that of the oldest entry it used (the default has none). A backend that cannot
reach its server answers nothing (``RedisCache``), so its levels miss and the next one answers.

A lookup for an example of the data may be bounded by its time (``before``: ``example_times``), as a student's
served input is: then no level uses an entry of a later example (future information, e.g. the same user's
held-out pairs reaching a training row). The fallback levels and the default use only entries of examples
strictly before that time; the exact level also takes the pair's entry of that very time (the entry precomputed
for this example). Entries without a time (examples without events) answer only unbounded lookups. The user's
group lists hold the ``recent`` newest entries as written, so a bounded lookup may find fewer there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gem_transfer.solaris.cache import CacheBackend, CacheEntry, read_arrays
from gem_transfer.solaris.neighbours import UserIndex
from gem_transfer.solaris.report import LookupStats


@dataclass(frozen=True)
class Served:
    """What a lookup answered: ``embedding [R]``, the ``level`` that answered and the age of what it used."""

    embedding: np.ndarray
    level: str
    age_s: float | None


class DefaultEmbedding:
    """The running mean of every embedding written (zeros before the first: of ``width``, or empty where the
    width is left to the first embeddings added); thread-safe. Embeddings added with their examples' times are
    also kept per time, so that ``value(before)`` is the mean of those strictly before ``before``."""

    def __init__(self, width: int | None = None) -> None:
        self._sum = np.zeros(width or 0, np.float64)
        self._count = 0
        self._timed: list[tuple[np.ndarray, np.ndarray]] = []  # (times [n], embeddings [n, R]) as added
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None  # (sorted times [N], prefix sums [N + 1, R])
        self._lock = threading.Lock()

    def add(self, embeddings: np.ndarray, times: np.ndarray | None = None) -> None:
        embeddings = np.asarray(embeddings, np.float64)
        with self._lock:
            if self._count == 0 and self._sum.shape[0] != embeddings.shape[1]:
                self._sum = np.zeros(embeddings.shape[1], np.float64)
            self._sum += embeddings.sum(0)
            self._count += len(embeddings)
            if times is not None:
                times = np.asarray(times, np.float64)
                known = ~np.isnan(times)
                self._timed.append((times[known], embeddings[known]))
                self._sorted = None

    def value(self, before: float | None = None) -> np.ndarray:
        with self._lock:
            if before is None:
                return (self._sum / max(self._count, 1)).astype(np.float32)
            times, prefix = self._by_time()
            count = 0 if np.isnan(before) else int(np.searchsorted(times, before, side="left"))  # NaN: no time, none
            return (prefix[count] / max(count, 1)).astype(np.float32)

    def _by_time(self) -> tuple[np.ndarray, np.ndarray]:
        if self._sorted is None:
            width = self._sum.shape[0]
            times = np.concatenate([t for t, _ in self._timed]) if self._timed else np.zeros(0)
            embeddings = np.concatenate([e for _, e in self._timed]) if self._timed else np.zeros((0, width))
            order = np.argsort(times, kind="stable")
            prefix = np.zeros((len(times) + 1, width), np.float64)
            np.cumsum(embeddings[order], axis=0, out=prefix[1:])
            self._sorted = (times[order], prefix)
        return self._sorted

    def state(self) -> dict:
        with self._lock:
            times, prefix = self._by_time()
            return {"sum": self._sum.copy(), "count": self._count, "times": times.copy(), "prefix": prefix.copy()}

    @classmethod
    def from_state(cls, state: dict) -> DefaultEmbedding:
        default = cls(len(state["sum"]))
        default._sum, default._count = np.asarray(state["sum"], np.float64), int(state["count"])
        if "times" in state:
            times, prefix = np.asarray(state["times"], np.float64), np.asarray(state["prefix"], np.float64)
            # kept as added entries too: a later ``add`` rebuilds the order from every entry, these included
            default._timed = [(times, np.diff(prefix, axis=0))]
            default._sorted = (times, prefix)
        return default

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        state = self.state()
        with open(path, "wb") as out:
            np.savez(out, sum=state["sum"], count=np.int64(state["count"]), times=state["times"], prefix=state["prefix"])
        return path

    @classmethod
    def load(cls, path: str | Path) -> DefaultEmbedding:
        total, count, times, prefix = read_arrays(path, ("sum", "count", "times", "prefix"), "default embedding")
        return cls.from_state({"sum": total, "count": int(count), "times": times, "prefix": prefix})


class FallbackLookup:
    """``lookup(user, item, group, behaviour [dim]) -> Served``; see the module docstring. Every lookup is
    recorded in ``stats`` (level, age, latency). ``clock``: seconds since the epoch, as the entries' timestamps."""

    def __init__(self, cache: CacheBackend, index: UserIndex | None, default: DefaultEmbedding, ttl_s: float,
                 neighbours: int = 8, clock: Callable[[], float] | None = None, stats: LookupStats | None = None) -> None:
        if ttl_s <= 0 or neighbours < 0:
            raise ValueError(f"FallbackLookup needs ttl_s > 0 and neighbours >= 0, got {ttl_s}, {neighbours}")
        self.cache, self.index, self.default, self.ttl_s, self.neighbours = cache, index, default, ttl_s, neighbours
        self.clock = clock or time.time
        self.stats = stats if stats is not None else LookupStats()

    def lookup(self, user: int, item: int, group: int, behaviour: np.ndarray | None = None,
               before: float | None = None) -> Served:
        """The pair's embedding; ``before``: the example's time, which bounds every level (module docstring)."""
        started = time.perf_counter()
        served = self._answer(int(user), int(item), int(group), behaviour, self.clock(), before)
        self.stats.record(served.level, served.age_s, time.perf_counter() - started)
        return served

    def _answer(self, user: int, item: int, group: int, behaviour: np.ndarray | None, now: float,
                before: float | None) -> Served:
        oldest = now - self.ttl_s

        def usable(e: CacheEntry) -> bool:  # fresh, and (bounded) of an example strictly before this one
            return e.timestamp >= oldest and (before is None or e.event_time < before)

        (entry,) = self.cache.get([(user, item)])
        if entry is not None and entry.timestamp >= oldest and (before is None or entry.event_time <= before):
            return Served(entry.embedding, "exact", now - entry.timestamp)
        (recent,) = self.cache.recent([(user, group)])
        fresh = [e for e in recent if usable(e)]
        if fresh:
            return self._mean(fresh, "user_group", now)
        if self.index is not None and behaviour is not None and self.neighbours:
            similar = self.index.query(behaviour, self.neighbours, exclude=user, before=before)
            if similar:
                fresh = [e for e in self.cache.get([(u, item) for u in similar]) if e is not None and usable(e)]
                if not fresh:
                    lists = self.cache.recent([(u, group) for u in similar])
                    fresh = [e for entries in lists for e in entries if usable(e)]
                if fresh:
                    return self._mean(fresh, "neighbours", now)
        return Served(self.default.value(before), "default", None)

    @staticmethod
    def _mean(entries: list[CacheEntry], level: str, now: float) -> Served:
        embedding = np.mean([e.embedding for e in entries], axis=0, dtype=np.float32)
        return Served(embedding, level, now - min(e.timestamp for e in entries))
