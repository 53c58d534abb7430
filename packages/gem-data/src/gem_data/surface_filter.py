"""Only some surfaces (domains) of a stream: what a one-model-per-domain baseline trains on.

A model of domain ``d`` trained on the examples of ``d`` that a shared model reads, in the same order, does
exactly the shared model's per-domain share of the work: the models of all domains together cost what the shared
one costs. That is the comparison this filter makes possible. A step is a global batch that holds examples of
``d`` (at least one per rank): the others are skipped, and counted (``skipped``), so a domain's model takes fewer
steps than the shared one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from gem_kunlun import Batch, FeatureSpec

from gem_data.batch_ops import select_examples
from gem_data.source import BatchSource


class SurfaceFilterStream:
    """The examples of ``surfaces`` from every global batch of ``global_source``; rank ``rank`` of
    ``world_size`` gets part ``rank`` of them (sizes differ by at most one); a ``BatchSource``.

    Every rank reads the whole global batch (built with ``rank=0, world_size=1``), so the kept examples of a
    step do not depend on the number of ranks. Batches vary in size with the domain's share of each global
    batch; a global batch with fewer kept examples than ranks is skipped, so that no rank gets none. That one
    depends on the ranks: where a global batch can keep fewer examples than there are ranks (a rare domain, small
    batches), ``world_size`` ranks train on other steps than one process does.
    """

    def __init__(self, global_source: BatchSource, surfaces: tuple[int, ...], rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"SurfaceFilterStream: rank {rank} is outside [0, world_size = {world_size})")
        if not surfaces:
            raise ValueError("SurfaceFilterStream needs at least one surface to keep")
        unknown = [s for s in surfaces if not 0 <= s < global_source.spec.num_surfaces]
        if unknown:
            raise ValueError(f"surfaces {unknown} lie outside the data's [0, {global_source.spec.num_surfaces})")
        self.source, self.rank, self.world_size = global_source, rank, world_size
        self.surfaces = torch.tensor(sorted(set(surfaces)), dtype=torch.int64)
        # global batches skipped so far and the kept examples they held (trained on by no rank); part of the state
        self.skipped = {"batches": 0, "examples": 0}

    @property
    def spec(self) -> FeatureSpec:
        return self.source.spec

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.source:
            kept = torch.isin(batch.surface, self.surfaces).nonzero().squeeze(1)
            if kept.numel() < self.world_size:
                self.skipped["batches"] += 1
                self.skipped["examples"] += kept.numel()
                continue
            yield select_examples(batch, kept.tensor_split(self.world_size)[self.rank])

    def state_dict(self) -> dict[str, Any]:
        return {**self.source.state_dict(), "surface_filter_skipped": dict(self.skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.skipped = dict(state.pop("surface_filter_skipped", {"batches": 0, "examples": 0}))
        self.source.load_state_dict(state)
