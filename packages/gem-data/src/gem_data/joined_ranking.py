"""Ranking evaluation of data whose training batches carry a joined feature.

A stream wrapper can add a feature to every training batch that the data set itself does not produce (LoopFM's
deep history, joined by user and time). The ranking evaluation assembles its request and candidate batches from
the data set, not from the stream, so they must get the same feature: ``JoinedRanking`` wraps a next-item data
set (or an ``AlignedRanking``) and passes each batch it assembles through the join's ``attach``. The join is a
function of the batch (its users and its history's times), so an evaluated request reads what a training
example of the same user at the same time would read, and nothing later.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torchrec import KeyedJaggedTensor

from gem_kunlun import Batch, EventSequence, FeatureSpec

from gem_data.sequential.examples import RankingExamples


class JoinedRanking:
    """``dataset``'s ranking inputs with ``attach`` applied to every batch it assembles, described by ``spec``
    (the joined stream's spec)."""

    def __init__(self, dataset: Any, spec: FeatureSpec, attach: Callable[[Batch], Batch]) -> None:
        self.dataset, self._spec, self.attach = dataset, spec, attach

    @property
    def spec(self) -> FeatureSpec:
        return self._spec

    @property
    def sampler(self):
        return self.dataset.sampler

    @property
    def corpus(self):
        return self.dataset.corpus

    def catalogue(self) -> KeyedJaggedTensor:
        """Every item's candidate features: items have no user, so nothing is joined to them."""
        return self.dataset.catalogue()

    def fewest_free_items(self, split: str = "test") -> int:
        return self.dataset.fewest_free_items(split)

    def ranking_examples(self, split: str = "test", protocol: str = "sampled", num_negatives: int = 99, seed: int = 0) -> RankingExamples:
        return self.dataset.ranking_examples(split, protocol, num_negatives, seed)

    def history(self, users: torch.Tensor, history_length: torch.Tensor) -> EventSequence:
        return self.dataset.history(users, history_length)

    def assemble(self, users: torch.Tensor, history: EventSequence, candidates: torch.Tensor, labels: torch.Tensor) -> Batch:
        return self.attach(self.dataset.assemble(users, history, candidates, labels))

    def scoring_batches(self, ranking: RankingExamples, chunk_size: int = 8192) -> Iterator[tuple[int, Batch]]:
        for start, batch in self.dataset.scoring_batches(ranking, chunk_size):
            yield start, self.attach(batch)
