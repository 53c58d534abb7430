"""A time split of a timestamped corpus: train on an offline period and an online stream, evaluate after them.

Two cut-offs, given as quantiles of the corpus' event times, divide it into three periods::

    offline [first event, online_from)   online [online_from, next_from)   next [next_from, last event]

A third, ``next_until`` (1: the last event), ends the next period early: events from it on are neither trained
on nor evaluated. It makes a validation fold of a test split, the same protocol moved back in time: schedules
tuned on ``(0.6, 0.8, 0.9)`` never see the next period of ``(0.7, 0.9)``.

A training example is an event with at least one earlier event of its user (history = the user's events
before it, target = the event), assigned to the period of its target's time:

- ``offline``: the offline log, read shuffled; each user's last offline event is held out of it;
- ``online``: the near-real-time stream, read in time order (target time, then corpus order: user, then file
  order), as it arrived;
- ``before_next``: both, shuffled (joint training on everything before the next period).

Sampled training negatives avoid every item of the user's sequence, later ones included, as ``NextItemDataset``'s
do (the published convention; a softmax over the whole catalogue, as the benchmark config trains, samples none).

Evaluation ranks the target among candidates, as ``NextItemDataset.ranking_examples`` does, but only among the
items rated before the event (the catalogue at its time: an item that did not exist yet is an easy negative for a
model trained before it appeared, and not for one the online stream has shown it to), on two splits:
``next_period``, every event of the next period (what the model serves after training; a user may have
several rows, each with the history before that event), and ``offline_period``, the held-out last offline
event of each user (how much of the offline period is remembered: forgetting). Histories hold every earlier
event whatever its period, since at serving time they are known inputs, not training targets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from gem_kunlun import segment_ids

from gem_data.sequential.corpus import SequenceCorpus
from gem_data.sequential.examples import NextItemConfig, NextItemDataset, RankingExamples, jagged_index, seen_items
from gem_data.sequential.sampling import NegativeSampler, salt_of

Period = Literal["offline", "online", "before_next"]
PERIODS = ("offline", "online", "before_next")
SPLITS = ("next_period", "offline_period")


@dataclass(frozen=True)
class TimeSplit:
    online_from: float  # quantile of event times where the online period starts
    next_from: float  # quantile where the next (evaluation) period starts
    next_until: float = 1.0  # quantile where the next period ends (1: with the last event; less: a validation fold)

    def __post_init__(self) -> None:
        if not 0.0 < self.online_from < self.next_from < self.next_until <= 1.0:
            raise ValueError(f"a time split needs 0 < online_from < next_from < next_until <= 1, got {self.online_from}, "
                             f"{self.next_from}, {self.next_until}")

    def cutoffs(self, corpus: SequenceCorpus) -> tuple[float, float, float]:
        """The three cut-off times (seconds, as ``corpus.timestamps``): the next period holds the events at or after
        the second and before the third (``inf`` for ``next_until = 1``: every later event)."""
        # NOTE: NumPy's quantile (the same linear interpolation as torch's), which takes any number of events (torch's
        # refuses more than 2**24)
        quantiles = np.quantile(corpus.timestamps.double().numpy(), [self.online_from, self.next_from, self.next_until])
        return float(quantiles[0]), float(quantiles[1]), float(quantiles[2]) if self.next_until < 1.0 else math.inf


class TimeSplitDataset(NextItemDataset):
    """The next-item task over one training ``period`` of ``split``; ranking adds the two time-split splits.

    Its training table reads the period's examples in their order: shuffle it for ``offline`` and
    ``before_next``; read ``online`` unshuffled to replay the stream in time order.
    """

    def __init__(self, corpus: SequenceCorpus, config: NextItemConfig, split: TimeSplit, period: Period) -> None:
        if period not in PERIODS:
            raise ValueError(f"period must be one of {PERIODS}, got {period!r}")
        if config.objective == "retrieval" and config.queries == "every":
            raise ValueError("a time split trains on events in time order: use queries = \"last\" (one query per event)")
        if not corpus.timed:
            raise ValueError(f"a time split cuts at event times, and corpus {corpus.name!r} has none (its events are in "
                             f"file order)")
        super().__init__(corpus, config)
        self.split, self.period = split, period
        self.online_from_time, self.next_from_time, self.next_until_time = split.cutoffs(corpus)
        times = corpus.timestamps
        users = segment_ids(corpus.lengths())
        position = torch.arange(times.numel()) - corpus.offsets[users]  # k: the event's index in its user's sequence
        offline = times < self.online_from_time
        online = ~offline & (times < self.next_from_time)
        # each user's last offline event (with a history) is held out: the forgetting split
        last_offline = torch.full((corpus.num_users,), -1, dtype=torch.int64)
        last_offline.scatter_reduce_(0, users[offline], torch.arange(times.numel())[offline], reduce="amax")
        held_out = torch.zeros_like(offline)
        held_out[last_offline[last_offline >= 0]] = True
        held_out &= position >= 1
        trainable = (position >= 1) & ~held_out
        chosen = {"offline": offline, "online": online, "before_next": offline | online}[period] & trainable
        events = chosen.nonzero().squeeze(1)
        if period == "online":
            events = events[torch.sort(times[events], stable=True).indices]  # time order; ties keep file order
        self.example_user, self.example_k = users[events], position[events]
        self.held_out_events = held_out.nonzero().squeeze(1)
        self.next_events = ((times >= self.next_from_time) & (times < self.next_until_time) & (position >= 1)).nonzero().squeeze(1)
        self._users, self._position = users, position
        # the catalogue at an event's time: the items rated before it (the first ``known`` of ``item_order``)
        first_rated = torch.full((corpus.num_items,), math.inf, dtype=torch.float64)
        first_rated.scatter_reduce_(0, corpus.items, times.double(), reduce="amin")
        self.item_order = torch.argsort(first_rated, stable=True)
        self._first_rated = first_rated[self.item_order]
        # popularity negatives follow what this period trains on
        self.train_counts = torch.bincount(corpus.items[events], minlength=corpus.num_items)
        if config.sampler == "popularity":
            self.sampler = NegativeSampler(corpus.num_items, self.owned_keys, "popularity", self.train_counts, config.popularity_power)

    def ranking_examples(self, split: str = "next_period", protocol: str = "sampled", num_negatives: int = 99,
                         seed: int = 0) -> RankingExamples:
        """``next_period`` / ``offline_period`` ranking inputs (see the module docstring). The leave-one-out splits
        ``valid`` / ``test`` are refused: their targets (each user's last two events) are training targets of a
        time split's periods, or lie past its next period."""
        if split in ("valid", "test"):
            raise ValueError(f"a time split evaluates {' or '.join(SPLITS)}, not the leave-one-out {split!r}: its periods "
                             f"train on those targets")
        if split not in SPLITS or protocol not in ("sampled", "full"):
            raise ValueError(f"split must be one of {SPLITS} and protocol 'sampled' or 'full', got {split!r}, {protocol!r}")
        events = self.next_events if split == "next_period" else self.held_out_events
        users, history_length = self._users[events], self._position[events]
        target = self.corpus.items[events]
        known = self.known_items(self.corpus.timestamps[events])
        if protocol == "full":
            candidates = torch.arange(self.corpus.num_items).expand(users.numel(), -1)
            seen_rows, seen_columns = seen_items(self.corpus, users, history_length, target)
            # items not yet rated at the event are left out of its ranking, as the items seen before are
            unknown = self.corpus.num_items - known
            rows = torch.repeat_interleave(torch.arange(users.numel()), unknown)
            items = self.item_order[jagged_index(known, unknown)]
            later = items != target[rows]
            seen = torch.cat([seen_rows, rows[later]]), torch.cat([seen_columns, items[later]])
            return RankingExamples(split, protocol, users, self.history(users, history_length), history_length, candidates, target, *seen)
        # NOTE: the same construction as NextItemDataset.ranking_examples: distinct negatives outside the
        # user's sequence, the target at a seeded random column so that ties cannot favour it; and only items rated
        # before the event (an item that does not exist yet is an easy negative for a model trained before it, and
        # one the online stream has taught a model to rank: forgetting would be measured against the newer model)
        generator = torch.Generator().manual_seed(salt_of(seed, 2 if split == "next_period" else 3))
        negatives = self.sampler.draw_distinct(users, num_negatives, generator, among=(self.item_order, known))
        target_index = torch.randint(num_negatives + 1, (users.numel(),), generator=generator)
        columns = torch.arange(num_negatives + 1)[None, :]
        source = (columns - (columns > target_index[:, None]).long()).clamp(max=num_negatives - 1)
        candidates = torch.where(columns == target_index[:, None], target[:, None], negatives.gather(1, source.clamp(min=0)))
        return RankingExamples(split, protocol, users, self.history(users, history_length), history_length, candidates, target_index)

    def fewest_free_items(self, split: str = "next_period") -> int:
        """The most distinct sampled negatives every query of ``split`` (a period) can get: the fewest items its user
        has not interacted with among those rated before the ranked event."""
        if split not in SPLITS:
            return super().fewest_free_items(split)
        events = self.next_events if split == "next_period" else self.held_out_events
        if not events.numel():
            return self.corpus.num_items
        known = self.known_items(self.corpus.timestamps[events])
        return int(self.sampler.free_items(self._users[events], (self.item_order, known)).min())

    def known_items(self, times: torch.Tensor) -> torch.Tensor:
        """How many items had been rated before each of ``times``: the first that many of ``item_order``."""
        return torch.searchsorted(self._first_rated, times.double(), right=False)

    def describe(self) -> dict[str, float]:
        """Sizes of the split, for reports: cut-off times (days since the first event) and event counts."""
        until = {} if math.isinf(self.next_until_time) else {"next_until_day": self.next_until_time / 86400}
        return {
            "online_from_day": self.online_from_time / 86400, "next_from_day": self.next_from_time / 86400, **until,
            "training_examples": float(self.example_user.numel()), "next_period_events": float(self.next_events.numel()),
            "offline_held_out": float(self.held_out_events.numel()),
        }
