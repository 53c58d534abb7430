"""Zero-cost cross-domain mixing: many sources read in place and interleaved by weight, never merged.

Every output batch draws, for each of its ``batch_size`` examples (or, with ``granularity="batch"``, once
for the whole batch), a source with probability ``p_i(step)``, then takes the next examples of that source's
own stream. Sources are any ``BatchSource`` (one per surface, per objective, offline log or near-real-time
stream); each keeps its own position, so nothing is copied or re-read.

``p_i(step)``: the weights, normalised. With an online share schedule, online and offline sources are
normalised separately and scaled by ``share(step)`` and ``1 - share(step)``; the share ramps linearly from
``online_share_start`` to ``online_share_end`` over ``ramp_steps`` steps, then stays, so the mix can move
from historical logs towards the live stream.

All sources must declare the same ``FeatureSpec`` (the domain lives in ``batch.surface``; the source index
of every example is ``batch.source``). We do not map differing specs to a union, because a union would need
label masks for tasks a source lacks, which the batch format does not carry; build sources with one spec.

Determinism and resumption: the draws of step ``t`` come from a generator seeded by ``(seed, t)``, so the
RNG position is the step counter. The state holds the step, per-source counts and, per source, the source's
state from *before* its buffered batch was read plus how many of that batch's examples were used: loading
re-reads that batch and skips them, which continues the exact sequence.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from gem_kunlun import Batch, FeatureSpec

from gem_data.batch_ops import concat_batches, select_examples
from gem_data.source import BatchSource, spec_difference


@dataclass(frozen=True)
class MixSource:
    name: str
    weight: float = 1.0
    online: bool = False  # a near-real-time stream (as opposed to an offline log)


@dataclass(frozen=True)
class MixingConfig:
    sources: tuple[MixSource, ...]
    batch_size: int = 256
    granularity: Literal["example", "batch"] = "example"
    online_share_start: float | None = None  # None: the weights alone decide
    online_share_end: float | None = None
    ramp_steps: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("MixingConfig.sources must name at least one source")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"MixingConfig.sources has repeated names: {names}")
        if any(s.weight < 0 for s in self.sources) or sum(s.weight for s in self.sources) <= 0:
            raise ValueError("MixingConfig.sources: weights must be >= 0 with a positive sum")
        if self.granularity not in ("example", "batch"):
            raise ValueError(f"MixingConfig.granularity must be 'example' or 'batch', got {self.granularity!r}")
        if (self.online_share_start is None) != (self.online_share_end is None):
            raise ValueError("MixingConfig: give both online_share_start and online_share_end, or neither")
        if self.online_share_start is not None:
            for value in (self.online_share_start, self.online_share_end):
                if not 0.0 <= value <= 1.0:
                    raise ValueError(f"MixingConfig: online shares must lie in [0, 1], got {value}")
            for online in (True, False):
                if sum(s.weight for s in self.sources if s.online == online) <= 0:
                    raise ValueError(f"MixingConfig: an online share schedule needs {'online' if online else 'offline'} sources with weight")
        if self.ramp_steps < 0 or self.batch_size < 1:
            raise ValueError("MixingConfig: ramp_steps must be >= 0 and batch_size >= 1")

    def online_share(self, step: int) -> float | None:
        if self.online_share_start is None:
            return None
        progress = 1.0 if self.ramp_steps == 0 else min(1.0, step / self.ramp_steps)
        return self.online_share_start + (self.online_share_end - self.online_share_start) * progress

    def probabilities(self, step: int) -> torch.Tensor:
        """``[S]`` float64: the probability of each source at ``step``."""
        weights = torch.tensor([s.weight for s in self.sources], dtype=torch.float64)
        share = self.online_share(step)
        if share is None:
            return weights / weights.sum()
        online = torch.tensor([s.online for s in self.sources])
        return torch.where(online, share * weights / weights[online].sum(), (1 - share) * weights / weights[~online].sum())


class MixedStream:
    """Interleaves ``sources`` (name -> BatchSource, names as in ``config.sources``); a ``BatchSource`` itself.

    Yields batches of ``config.batch_size`` examples (``granularity="example"``; examples grouped by source
    within a batch) or whole source batches (``"batch"``). Ends when a chosen source ends.
    """

    def __init__(self, sources: Mapping[str, BatchSource], config: MixingConfig) -> None:
        missing = [s.name for s in config.sources if s.name not in sources]
        if missing:
            raise ValueError(f"MixedStream: no stream given for sources {missing}")
        self.config = config
        self.names = [s.name for s in config.sources]
        self.sources = [sources[n] for n in self.names]
        first = self.sources[0].spec
        for name, source in zip(self.names[1:], self.sources[1:]):
            difference = spec_difference(first, source.spec)
            if difference:
                raise ValueError(f"MixedStream: source {name!r} has another FeatureSpec than {self.names[0]!r} ({difference})")
        self.step = 0
        self._counts = [0] * len(self.sources)
        self._iters: list[Iterator[Batch] | None] = [None] * len(self.sources)
        self._buffer: list[Batch | None] = [None] * len(self.sources)
        self._offset = [0] * len(self.sources)
        self._state_before: list[dict | None] = [None] * len(self.sources)

    @property
    def spec(self) -> FeatureSpec:
        return self.sources[0].spec

    def counts(self) -> dict[str, int]:
        """Examples delivered so far per source (name -> count)."""
        return dict(zip(self.names, self._counts))

    def __iter__(self) -> Iterator[Batch]:
        while True:
            generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.step)
            probabilities = self.config.probabilities(self.step)
            if self.config.granularity == "batch":
                chosen = int(torch.multinomial(probabilities, 1, generator=generator))
                batch = self._take_batch(chosen)
                if batch is None:
                    return
                parts = [batch]
            else:
                draws = torch.multinomial(probabilities, self.config.batch_size, replacement=True, generator=generator)
                parts = []
                for index, count in enumerate(torch.bincount(draws, minlength=len(self.sources)).tolist()):
                    if count:
                        part = self._take(index, count)
                        if part is None:
                            return
                        parts.append(part)
            self.step += 1
            yield concat_batches(parts)

    def _next_source_batch(self, index: int) -> bool:
        if self._iters[index] is None:
            self._iters[index] = iter(self.sources[index])
        self._state_before[index] = copy.deepcopy(self.sources[index].state_dict())
        try:
            self._buffer[index] = next(self._iters[index])
        except StopIteration:
            return False
        self._offset[index] = 0
        return True

    def _stamp(self, batch: Batch, index: int) -> Batch:
        batch.source = torch.full((batch.batch_size,), index, dtype=torch.int64)
        self._counts[index] += batch.batch_size
        return batch

    def _take_batch(self, index: int) -> Batch | None:
        buffered = self._buffer[index]
        if buffered is not None and self._offset[index] < buffered.batch_size:
            rest = select_examples(buffered, torch.arange(self._offset[index], buffered.batch_size))
            self._offset[index] = buffered.batch_size
            return self._stamp(rest, index)
        if not self._next_source_batch(index):
            return None
        self._offset[index] = self._buffer[index].batch_size
        return self._stamp(self._buffer[index], index)

    def _take(self, index: int, count: int) -> Batch | None:
        parts = []
        while count:
            buffered = self._buffer[index]
            if buffered is None or self._offset[index] >= buffered.batch_size:
                if not self._next_source_batch(index):
                    return None
                buffered = self._buffer[index]
            n = min(count, buffered.batch_size - self._offset[index])
            parts.append(select_examples(buffered, torch.arange(self._offset[index], self._offset[index] + n)))
            self._offset[index] += n
            count -= n
        return self._stamp(concat_batches(parts), index)

    def state_dict(self) -> dict[str, Any]:
        sources = []
        for i, source in enumerate(self.sources):
            if self._buffer[i] is None:
                sources.append({"state": copy.deepcopy(source.state_dict()), "offset": 0, "buffered": False})
            else:
                sources.append({"state": copy.deepcopy(self._state_before[i]), "offset": self._offset[i], "buffered": True})
        return {"step": self.step, "counts": self.counts(), "sources": dict(zip(self.names, sources))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state["sources"]) != self.names:
            raise ValueError(f"mixing state has sources {list(state['sources'])}, this stream has {self.names}")
        self.step = int(state["step"])
        self._counts = [int(state["counts"][n]) for n in self.names]
        for i, name in enumerate(self.names):
            saved = state["sources"][name]
            self.sources[i].load_state_dict(saved["state"])
            self._iters[i], self._buffer[i], self._offset[i] = None, None, 0
            if saved["buffered"]:
                if not self._next_source_batch(i):
                    raise ValueError(f"mixing state: source {name!r} has no batch at its saved position")
                self._offset[i] = int(saved["offset"])
