"""Solaris on the student side: a batch stream whose batches carry, per example, the teacher's embedding of its
(user, candidate) pair as a representation feature of one vector (``Batch.representations[name]``).

Where the vector comes from is the ``represent`` function (batch -> ``[B, R]``): ``fresh`` runs the teacher on
the batch (what a serving path without a cache would need), ``served_embeddings`` asks a ``FallbackLookup`` for
every row (what Solaris serves: the cached pair, or its fallback). The stream's own position stays its whole
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


class SolarisJoin(FeatureJoin):
    """``source``'s batches with feature ``name`` (one ``width``-wide vector per example) from ``represent``."""

    def __init__(self, source: Any, represent: Callable[[Batch], np.ndarray | torch.Tensor], width: int,
                 name: str = "solaris") -> None:
        super().__init__(source, name, width)
        self.represent, self.width = represent, width

    def attach(self, batch: Batch) -> Batch:
        """``batch`` with each example's pair embedding as ``representations[name]``."""
        vectors = self.represent(batch)
        vectors = vectors.detach().float().cpu() if isinstance(vectors, torch.Tensor) else torch.from_numpy(
            np.ascontiguousarray(vectors, np.float32))
        if tuple(vectors.shape) != (batch.batch_size, self.width):
            raise ValueError(f"SolarisJoin: {tuple(vectors.shape)} embeddings for {batch.batch_size} rows of width {self.width}")
        feature = JaggedFloats(vectors, torch.ones(batch.batch_size, dtype=torch.int64))
        return dataclasses.replace(batch, representations={**batch.representations, self.name: feature})


def served_embeddings(lookup: FallbackLookup, keys: Callable[[Batch], PairKeys]) -> Callable[[Batch], np.ndarray]:
    """A ``represent`` function for ``SolarisJoin``: every row of a batch looked up (``keys`` reads its pair),
    bounded by the row's time (``example_times``), so no row reads what later examples wrote."""
    def represent(batch: Batch) -> np.ndarray:
        k, times = keys(batch), example_times(batch).tolist()
        return np.stack([lookup.lookup(k.users[r], k.items[r], k.groups[r], k.behaviour[r], before=times[r]).embedding
                         for r in range(len(k))])

    return represent
