"""Solaris's nearest-neighbour user index: which users with cached entries behave most like a given user.

Each user is a behaviour vector (``gem_transfer.solaris.keys.behaviour_vectors``: a normalised hashed bag of the
ids in their event history, computed from the request alone, without the teacher), kept as one row of a matrix;
a query is an exact cosine search over every row (one matrix-vector product: ~1 ms for 100k users of width 64
on one core). A user seen again replaces their row with the newer vector. Safe for a writing worker thread and
reading threads.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from gem_transfer.solaris.cache import read_arrays


class UserIndex:
    """``add(users [N], vectors [N, dim])``, ``query(vector [dim], k, exclude)`` -> the ``k`` most similar users."""

    def __init__(self, dim: int, capacity: int = 1024) -> None:
        if dim < 1:
            raise ValueError(f"UserIndex needs dim >= 1, got {dim}")
        self.dim = dim
        self._vectors = np.zeros((capacity, dim), np.float32)
        self._users = np.zeros(capacity, np.int64)
        self._rows: dict[int, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, users: np.ndarray, vectors: np.ndarray) -> None:
        vectors = np.asarray(vectors, np.float32)
        if vectors.ndim != 2 or vectors.shape != (len(users), self.dim):
            raise ValueError(f"UserIndex.add: vectors {vectors.shape} for {len(users)} users of width {self.dim}")
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = np.divide(vectors, norms, out=np.zeros_like(vectors), where=norms > 0)
        with self._lock:
            for user, vector in zip(np.asarray(users, np.int64).tolist(), vectors):
                row = self._rows.get(user)
                if row is None:
                    row = self._rows[user] = len(self._rows)
                    if row == len(self._users):  # full: double, so that adding stays amortised O(1)
                        self._vectors = np.concatenate([self._vectors, np.zeros_like(self._vectors)])
                        self._users = np.concatenate([self._users, np.zeros_like(self._users)])
                    self._users[row] = user
                self._vectors[row] = vector

    def query(self, vector: np.ndarray, k: int, exclude: int | None = None) -> list[int]:
        """The (at most) ``k`` users most similar to ``vector`` by cosine, most similar first, without ``exclude``;
        none for a zero vector (no behaviour to compare) or an empty index."""
        vector = np.asarray(vector, np.float32)
        norm = float(np.linalg.norm(vector))
        if norm == 0 or k < 1:
            return []
        with self._lock:
            n = len(self._rows)
            if n == 0:
                return []
            scores = self._vectors[:n] @ (vector / norm)
            users = self._users[:n].copy()
            excluded = self._rows.get(exclude) if exclude is not None else None
        if excluded is not None:
            scores[excluded] = -np.inf
        take = min(k, n)
        top = np.argpartition(-scores, take - 1)[:take]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [int(users[i]) for i in top if np.isfinite(scores[i])]

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        with self._lock, open(path, "wb") as out:
            n = len(self._rows)
            np.savez(out, users=self._users[:n], vectors=self._vectors[:n])
        return path

    @classmethod
    def load(cls, path: str | Path) -> UserIndex:
        users, vectors = read_arrays(path, ("users", "vectors"), "user index")
        index = cls(vectors.shape[1], capacity=max(1, len(users)))
        index.add(users, vectors)
        return index
