"""Solaris's cache: the teacher's embeddings of (user, item) pairs, with the time each was computed.

Every backend answers the same three questions, in batches so that a networked one pays one round trip:
``get(pairs)`` (the entry of each (user, item) pair, or None), ``recent(user_groups)`` (the user's newest
entries in an item group, newest first, at most ``recent`` of them) and ``put(entries)``. Keys are int64
(a user key, an item id, a group id); an embedding is a float32 vector of the teacher's width.

A backend keeps an entry for ``ttl_s`` after its timestamp and may forget it after that (the in-process cache
drops it when it is next read; Redis expires it itself); whether an entry is still fresh enough to serve is
the lookup's decision, made on the entry's timestamp, so every backend serves the same entries.
"""

from __future__ import annotations

import math
import threading
import time
import zipfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np


class CacheError(ValueError):
    """A cache that cannot be used as configured (an unreachable server, an unreadable snapshot); one line."""


@dataclass(frozen=True)
class CacheEntry:
    """The teacher's embedding ``[R]`` float32 of ``user`` with candidate ``item`` (of ``group``), computed at
    ``timestamp`` (seconds since the epoch) for an example of ``event_time`` (the data's time of the example,
    ``gem_transfer.example_times``; NaN where unknown): what a lookup bounded by an example's time compares."""

    user: int
    item: int
    group: int
    timestamp: float
    embedding: np.ndarray
    event_time: float = math.nan


class CacheBackend(Protocol):
    """What the worker writes to and the lookup reads from; see the module docstring."""

    def put(self, entries: list[CacheEntry]) -> None: ...

    def get(self, pairs: list[tuple[int, int]]) -> list[CacheEntry | None]: ...

    def recent(self, user_groups: list[tuple[int, int]]) -> list[list[CacheEntry]]: ...

    def close(self) -> None: ...


class MemoryCache:
    """The in-process backend (the default): dictionaries under one lock, safe for a writing worker thread and
    any number of reading threads. ``clock`` (seconds) decides when an entry is old enough to forget."""

    def __init__(self, ttl_s: float, recent: int = 8, clock: Callable[[], float] | None = None) -> None:
        if ttl_s <= 0 or recent < 1:
            raise ValueError(f"MemoryCache needs ttl_s > 0 and recent >= 1, got {ttl_s}, {recent}")
        self.ttl_s, self.recent_size, self.clock = ttl_s, recent, clock or time.time
        self._entries: dict[tuple[int, int], CacheEntry] = {}
        self._groups: dict[tuple[int, int], deque[CacheEntry]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entries: list[CacheEntry]) -> None:
        with self._lock:
            for e in entries:
                self._entries[(e.user, e.item)] = e
                group = self._groups.get((e.user, e.group))
                if group is None:
                    group = self._groups[(e.user, e.group)] = deque(maxlen=self.recent_size)
                # NOTE: a rewritten pair replaces its older embedding in the group's list instead of counting twice
                for i, old in enumerate(group):
                    if old.item == e.item:
                        del group[i]
                        break
                group.appendleft(e)

    def get(self, pairs: list[tuple[int, int]]) -> list[CacheEntry | None]:
        oldest = self.clock() - self.ttl_s
        found = []
        with self._lock:
            for pair in pairs:
                entry = self._entries.get(pair)
                if entry is not None and entry.timestamp < oldest:
                    del self._entries[pair]  # expired: forgotten on read, so memory follows the live entries
                    entry = None
                found.append(entry)
        return found

    def recent(self, user_groups: list[tuple[int, int]]) -> list[list[CacheEntry]]:
        oldest = self.clock() - self.ttl_s
        with self._lock:
            lists = []
            for key in user_groups:
                group = self._groups.get(key)
                if group is None:
                    lists.append([])
                    continue
                while group and group[-1].timestamp < oldest:
                    group.pop()  # newest first: the expired ones are at the end
                if not group:
                    del self._groups[key]
                lists.append(list(group))
            return lists

    def entries(self) -> list[CacheEntry]:
        """Every entry held, oldest first (what a snapshot or a flush writes)."""
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.timestamp)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._groups.clear()

    def close(self) -> None:
        pass

    def save(self, path: str | Path) -> Path:
        """Write every entry to ``path`` (``.npz``): what outlives the process of an in-process cache."""
        return save_entries(self.entries(), path)

    @classmethod
    def load(cls, path: str | Path, ttl_s: float, recent: int = 8, clock: Callable[[], float] | None = None) -> MemoryCache:
        cache = cls(ttl_s, recent, clock)
        cache.put(load_entries(path))
        return cache


def save_entries(entries: list[CacheEntry], path: str | Path) -> Path:
    """``entries`` as one ``.npz`` file: users, items, groups (int64), timestamps, event times (float64),
    embeddings ``[N, R]``."""
    path = Path(path)
    width = entries[0].embedding.shape[0] if entries else 0
    embeddings = np.stack([e.embedding for e in entries]) if entries else np.zeros((0, width), np.float32)
    with open(path, "wb") as out:  # an open file: numpy would otherwise append .npz to a name without it
        np.savez(out, users=np.array([e.user for e in entries], np.int64), items=np.array([e.item for e in entries], np.int64),
                 groups=np.array([e.group for e in entries], np.int64),
                 timestamps=np.array([e.timestamp for e in entries], np.float64),
                 event_times=np.array([e.event_time for e in entries], np.float64), embeddings=embeddings.astype(np.float32))
    return path


def read_arrays(path: str | Path, names: tuple[str, ...], what: str) -> list[np.ndarray]:
    """The arrays ``names`` of the ``.npz`` file at ``path``; a missing or damaged file is a ``CacheError`` saying
    it is not a Solaris ``what``."""
    try:
        with np.load(Path(path)) as data:
            return [data[name] for name in names]
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as error:  # BadZipFile: a file cut short
        raise CacheError(f"{path}: not a Solaris {what} ({error})") from None


def load_entries(path: str | Path) -> list[CacheEntry]:
    """The entries of a file written by ``save_entries``; a missing or damaged file is a ``CacheError``."""
    users, items, groups, timestamps, event_times, embeddings = read_arrays(
        path, ("users", "items", "groups", "timestamps", "event_times", "embeddings"), "cache snapshot")
    return [CacheEntry(int(u), int(i), int(g), float(t), e, float(x))
            for u, i, g, t, x, e in zip(users, items, groups, timestamps, event_times, embeddings)]
