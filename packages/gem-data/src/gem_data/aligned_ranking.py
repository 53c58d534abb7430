"""Ranking evaluation of one mixed source in the mixture's union spec.

A model trained on a mixture reads union batches: its item ids of a source in a disjoint id space start at
that space's offset. ``AlignedRanking`` wraps one source's next-item data set and answers what the ranking
evaluation asks of a data set (``ranking_examples``, ``history``, ``assemble``, ``scoring_batches``,
``sampler``, ``catalogue``) with candidates in union ids and batches in the union spec, so per-domain metrics of a
cross-domain model come from the same evaluation code as single-source ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from torchrec import KeyedJaggedTensor

from gem_kunlun import Batch, EventSequence, FeatureSpec

from gem_data.alignment import AlignmentError, FeatureAlignment
from gem_data.sequential.examples import NextItemDataset, RankingExamples
from gem_data.sequential.sampling import NegativeSampler


class AlignedRanking:
    """``dataset`` (source ``name`` of ``alignment``) as seen through the union spec."""

    def __init__(self, dataset: NextItemDataset, alignment: FeatureAlignment, name: str) -> None:
        self.dataset, self.alignment, self.name = dataset, alignment, name
        # candidates are item indices, which are the ids of the item feature, the first candidate feature
        self.item_offset = alignment.offset(name, dataset.spec.candidate[0])

    @property
    def spec(self) -> FeatureSpec:
        return self.alignment.spec

    @property
    def sampler(self) -> NegativeSampler:
        return self.dataset.sampler

    @property
    def corpus(self):
        return self.dataset.corpus

    def catalogue(self) -> KeyedJaggedTensor:
        """Every item's candidate features, for two-tower models: only where the source needs no re-keying
        (a catalogue spans one id space; mixtures of several are refused for such models)."""
        if not self.alignment.is_identity(self.name):
            raise AlignmentError(f"source {self.name!r}: a catalogue spans one id space; the mixture has {list(self.alignment.spaces)}")
        return self.dataset.catalogue()

    def fewest_free_items(self, split: str = "test") -> int:
        return self.dataset.fewest_free_items(split)

    def ranking_examples(self, split: str = "test", protocol: str = "sampled", num_negatives: int = 99, seed: int = 0) -> RankingExamples:
        """The source's ranking inputs with candidates in union ids (``target_index`` is unchanged)."""
        ranking = self.dataset.ranking_examples(split, protocol, num_negatives, seed)
        return dataclasses.replace(ranking, candidates=ranking.candidates + self.item_offset)

    def history(self, users: torch.Tensor, history_length: torch.Tensor) -> EventSequence:
        """The source's own history rows; ``assemble`` puts them into the union spec."""
        return self.dataset.history(users, history_length)

    def assemble(self, users: torch.Tensor, history: EventSequence, candidates: torch.Tensor, labels: torch.Tensor) -> Batch:
        """A union batch of ``(user, history from ``history``, candidate in union ids, label)`` rows."""
        batch = self.dataset.assemble(users, history, candidates - self.item_offset, labels)
        return self.alignment.align(self.name, batch)

    def scoring_batches(self, ranking: RankingExamples, chunk_size: int = 8192) -> Iterator[tuple[int, Batch]]:
        local = dataclasses.replace(ranking, candidates=ranking.candidates - self.item_offset)
        for start, batch in self.dataset.scoring_batches(local, chunk_size):
            yield start, self.alignment.align(self.name, batch)
