"""Solaris's nearest-neighbour user index: which users with cached entries behave most like a given user.

Each user is a behaviour vector (``gem_transfer.solaris.keys.behaviour_vectors``: a normalised hashed bag of the
ids in their event history, computed from the request alone, without the teacher), kept as one row of a matrix;
a query is an exact cosine search over every row (one matrix-vector product: ~1 ms for 100k users of width 64
on one core). A user seen again replaces their row with the newer vector. Safe for a writing worker thread and
reading threads.

Vectors added with their examples' times are also kept as they were at each time, so that a query bounded by a
time (``before``: a training example's) compares each user as they were strictly before it: a user's newest
vector may hold ids of events after the example (their later history), and choosing neighbours by it would let
the example's features depend on the future. A bounded query finds the vectors of that time from a snapshot of
each user's newest row, taken every ``users`` rows in time order, and the rows after it: its cost stays that of
the unbounded query (a pass over the users), whatever the number of rows. Vectors without a time answer only
unbounded queries.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from gem_transfer.solaris.cache import read_arrays


class UserIndex:
    """``add(users [N], vectors [N, dim], times [N])``, ``query(vector [dim], k, exclude, before)`` -> the ``k``
    most similar users."""

    def __init__(self, dim: int, capacity: int = 1024) -> None:
        if dim < 1:
            raise ValueError(f"UserIndex needs dim >= 1, got {dim}")
        self.dim = dim
        self._vectors = np.zeros((capacity, dim), np.float32)
        self._users = np.zeros(capacity, np.int64)
        self._rows: dict[int, int] = {}
        self._timed: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (users, times, unit vectors) as added
        self._by_time: _TimedRows | None = None  # built from _timed on the first bounded query after an add
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, users: np.ndarray, vectors: np.ndarray, times: np.ndarray | None = None) -> None:
        """The users' newest ``vectors``; ``times``: their examples' times (NaN: none), for bounded queries."""
        vectors = np.asarray(vectors, np.float32)
        users = np.asarray(users, np.int64)
        if vectors.ndim != 2 or vectors.shape != (len(users), self.dim):
            raise ValueError(f"UserIndex.add: vectors {vectors.shape} for {len(users)} users of width {self.dim}")
        if times is not None and np.shape(times) != users.shape:
            raise ValueError(f"UserIndex.add: times of shape {np.shape(times)} for {len(users)} users")
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = np.divide(vectors, norms, out=np.zeros_like(vectors), where=norms > 0)
        with self._lock:
            for user, vector in zip(users.tolist(), vectors):
                row = self._rows.get(user)
                if row is None:
                    row = self._rows[user] = len(self._rows)
                    if row == len(self._users):  # full: double, so that adding stays amortised O(1)
                        self._vectors = np.concatenate([self._vectors, np.zeros_like(self._vectors)])
                        self._users = np.concatenate([self._users, np.zeros_like(self._users)])
                    self._users[row] = user
                self._vectors[row] = vector
            if times is not None:
                times = np.asarray(times, np.float64)
                known = ~np.isnan(times)
                if known.any():
                    self._timed.append((users[known], times[known], vectors[known]))
                    self._by_time = None

    def query(self, vector: np.ndarray, k: int, exclude: int | None = None, before: float | None = None) -> list[int]:
        """The (at most) ``k`` users most similar to ``vector`` by cosine, most similar first, without ``exclude``;
        none for a zero vector (no behaviour to compare) or an empty index. ``before``: each user as their newest
        vector of a time strictly before it (users without one are not candidates)."""
        vector = np.asarray(vector, np.float32)
        norm = float(np.linalg.norm(vector))
        if norm == 0 or k < 1:
            return []
        with self._lock:
            if before is None:
                n = len(self._rows)
                scores = self._vectors[:n] @ (vector / norm)
                users = self._users[:n].copy()
            else:
                if self._by_time is None:
                    self._by_time = _TimedRows.build(self._timed, self.dim)
                users, vectors = self._by_time.before(before)
                scores = vectors @ (vector / norm)
        if exclude is not None:
            scores[users == exclude] = -np.inf
        take = min(k, len(users))
        if take == 0:
            return []
        top = np.argpartition(-scores, take - 1)[:take]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [int(users[i]) for i in top if np.isfinite(scores[i])]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        with self._lock, open(path, "wb") as out:
            n = len(self._rows)
            timed = _TimedRows.join(self._timed, self.dim)
            np.savez(out, users=self._users[:n], vectors=self._vectors[:n], timed_users=timed[0], timed_times=timed[1],
                     timed_vectors=timed[2])
        return path

    @classmethod
    def load(cls, path: str | Path) -> UserIndex:
        """An index written by ``save`` (one written before the timed rows were kept answers only unbounded queries)."""
        users, vectors = read_arrays(path, ("users", "vectors"), "user index")
        index = cls(vectors.shape[1], capacity=max(1, len(users)))
        index.add(users, vectors)
        with np.load(Path(path)) as data:
            if "timed_users" in data:
                timed = data["timed_users"], data["timed_times"], data["timed_vectors"]
                if len(timed[0]):
                    index._timed.append(timed)
        return index


class _TimedRows:
    """Every timed vector in time order, and each user's newest row among the first ``s * stride`` rows (``snapshots
    [s]``): the rows before a time are a prefix, and each user's newest row in it is the snapshot's, or a later row
    of the (at most ``stride``) rows after the snapshot."""

    def __init__(self, times: np.ndarray, slots: np.ndarray, vectors: np.ndarray, users: np.ndarray, stride: int) -> None:
        self.times, self.slots, self.vectors, self.users, self.stride = times, slots, vectors, users, stride
        snapshots, newest = [], np.full(len(users), -1, np.int64)
        for start in range(0, len(times) + 1, stride):
            snapshots.append(newest.copy())
            self._advance(newest, start, min(start + stride, len(times)))
        self.snapshots = snapshots

    def _advance(self, newest: np.ndarray, start: int, end: int) -> None:
        """``newest`` (each user's newest row before ``start``) moved on to ``end``: a user's last row there wins.
        NOTE: found with ``unique`` (NumPy leaves the winner of a repeated index's assignment unspecified)."""
        slots, first = np.unique(self.slots[start:end][::-1], return_index=True)
        newest[slots] = end - 1 - first

    @staticmethod
    def join(timed: list[tuple[np.ndarray, np.ndarray, np.ndarray]], dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not timed:
            return np.zeros(0, np.int64), np.zeros(0, np.float64), np.zeros((0, dim), np.float32)
        return tuple(np.concatenate(part) for part in zip(*timed))

    @classmethod
    def build(cls, timed: list[tuple[np.ndarray, np.ndarray, np.ndarray]], dim: int) -> _TimedRows:
        users, times, vectors = cls.join(timed, dim)
        order = np.argsort(times, kind="stable")  # equal times: as added
        distinct, slots = np.unique(users[order], return_inverse=True)
        return cls(times[order], slots.reshape(-1), vectors[order], distinct, max(len(distinct), 1))

    def before(self, time: float) -> tuple[np.ndarray, np.ndarray]:
        """``(users, vectors)``: each user's newest vector of a time strictly before ``time``."""
        end = 0 if np.isnan(time) else int(np.searchsorted(self.times, time, side="left"))  # NaN: no time, none
        start = end - end % self.stride
        newest = self.snapshots[start // self.stride].copy()
        self._advance(newest, start, end)
        known = newest >= 0
        return self.users[known], self.vectors[newest[known]]
