"""Solaris on the student side: a batch stream whose batches carry, per example, the teacher's embedding of its
(user, candidate) pair as a representation feature of one vector (``Batch.representations[name]``).

Where the embedding comes from is the ``represent`` function: ``fresh_embeddings`` runs the teacher on the batch
(what a serving path without a cache would need), ``served_embeddings`` asks a ``FallbackLookup`` for every row
(what Solaris serves: the cached pair, or its fallback). The vector is the embedding followed by a one-hot of the
level that answered (``LEVELS``; a fresh embedding is ``exact``): a fallback is a guess (the mean of other pairs, or
of everything), and a student that sees which guess it got can learn how far to trust each; without it, the rows
served by the default and by exact entries look alike to the student. The stream's own position stays its whole
resumable state: the join is a function of the batch (and, served, of the cache).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gem_kunlun import Batch, JaggedFloats
from gem_transfer.representation_join import FeatureJoin
from gem_transfer.representation_store import example_times
from gem_transfer.solaris.keys import PairKeys
from gem_transfer.solaris.lookup import FallbackLookup
from gem_transfer.solaris.report import LEVELS

# represent(batch) -> (embeddings [B, R], the level that answered each row: indices into LEVELS [B])
Represent = Callable[[Batch], tuple[np.ndarray | torch.Tensor, np.ndarray]]


class SolarisJoin(FeatureJoin):
    """``source``'s batches with feature ``name``: per example, its ``width``-wide pair embedding from ``represent``
    and the one-hot of its level (``width + len(LEVELS)`` wide in all)."""

    def __init__(self, source: Any, represent: Represent, width: int, name: str = "solaris") -> None:
        super().__init__(source, name, width + len(LEVELS))
        self.represent, self.width = represent, width

    def attach(self, batch: Batch) -> Batch:
        """``batch`` with each example's pair embedding and level as ``representations[name]``."""
        if not batch.batch_size:  # a rank's empty share of a short last batch: nothing to look up (or to score)
            embeddings, levels = torch.zeros(0, self.width), np.zeros(0, np.int64)
        else:
            embeddings, levels = self.represent(batch)
        embeddings = embeddings.detach().float().cpu() if isinstance(embeddings, torch.Tensor) else torch.from_numpy(
            np.ascontiguousarray(embeddings, np.float32))
        if tuple(embeddings.shape) != (batch.batch_size, self.width):
            raise ValueError(f"SolarisJoin: {tuple(embeddings.shape)} embeddings for {batch.batch_size} rows of width {self.width}")
        one_hot = torch.nn.functional.one_hot(torch.as_tensor(np.asarray(levels), dtype=torch.int64), len(LEVELS))
        vectors = torch.cat([embeddings, one_hot.float()], 1)
        feature = JaggedFloats(vectors, torch.ones(batch.batch_size, dtype=torch.int64))
        return dataclasses.replace(batch, representations={**batch.representations, self.name: feature})


def fresh_embeddings(score: Callable[[Batch], np.ndarray | torch.Tensor]) -> Represent:
    """A ``represent`` function for ``SolarisJoin``: the teacher's ``score(batch) -> [B, R]``, every row ``exact``."""
    exact = LEVELS.index("exact")

    def represent(batch: Batch) -> tuple[np.ndarray | torch.Tensor, np.ndarray]:
        return score(batch), np.full(batch.batch_size, exact, np.int64)

    return represent


def served_embeddings(lookup: FallbackLookup, keys: Callable[[Batch], PairKeys]) -> Represent:
    """A ``represent`` function for ``SolarisJoin``: every row of a batch looked up (``keys`` reads its pair),
    bounded by the row's time (``example_times``), so no row reads what later examples wrote."""
    def represent(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        k, times = keys(batch), example_times(batch).tolist()
        served = [lookup.lookup(k.users[r], k.items[r], k.groups[r], k.behaviour[r], before=times[r]) for r in range(len(k))]
        return np.stack([s.embedding for s in served]), np.array([LEVELS.index(s.level) for s in served], np.int64)

    return represent
