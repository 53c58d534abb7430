"""Zero-cost cross-domain mixing: many sources read in place and interleaved by weight, never merged.

The mixture is a function of the *global* step, like every ``ShardedStream``: global batch ``t`` holds
``world_size * batch_size`` examples, and for each of them (or, with ``granularity="batch"``, once for the
whole batch) a source is drawn with probability ``p_i(t)`` from a generator seeded by ``(seed, t)``. The
global batch holds, source after source, the next ``n_i(t)`` unread examples of each source ``i`` drawn
``n_i(t)`` times, so it does not depend on the number of ranks; rank ``r`` keeps rows
``[r * B, (r + 1) * B)`` of it and reads only those rows from the sources. ``W`` ranks therefore see
exactly what one process sees.

NOTE: grouping by source (rather than interleaving in draw order) spares a gather of the whole batch. With
several ranks a rank's slice may hold one or two sources only; the update is the mean over the global
batch, so training is the same, and ``LengthBalancedStream`` evens out per-rank cost where sources differ.

Sources are whole ``ShardedStream``s (rank 0 of 1), addressed by example: example ``e`` of a source is row
``e % C`` of its global batch ``e // C``. Each keeps its own position, implied by the draws, and the reader
holds one batch per source: nothing is merged or copied, memory is bounded per source. One process (a world of
one) gathers small global batches ``GATHER_STEPS`` at a time and holds them until it delivers them: the same
batches as gathered one by one (``FeatureAlignment.gather_steps``), a gather's fixed costs paid once. Sources
that are tables of one assembler (``PlannedTable``) are read straight into a mixed batch that is not gathered with
others: their rows of the step planned, then assembled at once (``PlanReader``, ``MixedStream._assembled_batch``).
One process reads a table source's next rows ahead, several steps' worth in one read; a DataLoader worker, which
delivers every ``num_workers``-th global batch, reads the rows of its own next batches instead (``MixedStream._later``:
the rows in between are the other workers'). Other sources are read a global batch at a time, by every worker whose
batches take rows from it.

``p_i(t)``: the weights, normalised. With an online share schedule, online and offline sources are
normalised separately and scaled by ``share(t)`` and ``1 - share(t)``; the share stays at
``online_share_start`` until ``ramp_start``, moves linearly to ``online_share_end`` over ``ramp_steps``
(0: a switch, as in sequential fine-tuning) and stays there; without an end the share is constant.

Sources may declare other ``FeatureSpec``s when a ``FeatureAlignment`` maps each into one union spec (shared
id spaces where declared, otherwise disjoint ones); without one they must share a spec. ``batch.source``
holds each example's source index, ``counts()`` the examples read per source by the whole job.

Resumption: the position (global batches delivered) determines everything; the state also stores each
source's example position so that loading does not replay the draws: a resume may change the weights, the ramp
or the seed, and the steps from the saved one on are drawn under the new schedule from the saved positions.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import get_worker_info

from gem_kunlun import Batch, FeatureSpec

from gem_data.alignment import FeatureAlignment
from gem_data.gathering import BatchView
from gem_data.source import ShardedStream, spec_difference
from gem_data.stream import SEED_RANGE, SyntheticStream, TableStream

ANCHOR_EVERY = 256  # steps between remembered source positions (backward queries replay at most this many draws)
DRAW_BLOCK = 64  # steps whose compositions are drawn together (see MixedStream._draw)
DRAW_BLOCKS_KEPT = 4  # blocks of compositions kept (a DataLoader worker's read ahead walks past the block it reads)
AHEAD_STEPS = 64  # a DataLoader worker reads a source's rows of at most this many of its next steps at once
GATHER_STEPS = 32  # one process gathers this many of its next global batches at once (see MixedStream._gathered_batch)
GATHER_MAX_ROWS = 256  # ... when they are this small (at larger ones a gather's fixed costs are small beside its copying)


@dataclass(frozen=True)
class MixSource:
    name: str
    weight: float = 1.0
    online: bool = False  # a near-real-time stream (as opposed to an offline log)


@dataclass(frozen=True)
class MixingConfig:
    sources: tuple[MixSource, ...]
    batch_size: int = 256  # per rank: a global batch holds world_size * batch_size examples
    granularity: Literal["example", "batch"] = "example"
    online_share_start: float | None = None  # None: the weights alone decide
    online_share_end: float | None = None  # None: the share stays at online_share_start (constant mode)
    ramp_start: int = 0  # steps at online_share_start before the ramp
    ramp_steps: int = 0  # 0: switch to online_share_end at ramp_start
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.sources:
            raise ValueError("MixingConfig.sources must name at least one source")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"MixingConfig.sources has repeated names: {names}")
        if any(not math.isfinite(s.weight) or s.weight < 0 for s in self.sources) or sum(s.weight for s in self.sources) <= 0:
            raise ValueError(f"MixingConfig.sources: weights must be finite and >= 0 with a positive sum, got "
                             f"{[s.weight for s in self.sources]}")
        if self.granularity not in ("example", "batch"):
            raise ValueError(f"MixingConfig.granularity must be 'example' or 'batch', got {self.granularity!r}")
        if self.online_share_start is None and self.online_share_end is not None:
            raise ValueError("MixingConfig: online_share_end needs online_share_start")
        if self.online_share_start is not None:
            for value in (self.online_share_start, self.online_share_end):
                if value is not None and not 0.0 <= value <= 1.0:
                    raise ValueError(f"MixingConfig: online shares must lie in [0, 1], got {value}")
            for online in (True, False):
                if sum(s.weight for s in self.sources if s.online == online) <= 0:
                    raise ValueError(f"MixingConfig: an online share schedule needs {'online' if online else 'offline'} sources with weight")
        for field, least in (("ramp_start", 0), ("ramp_steps", 0), ("batch_size", 1)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"MixingConfig.{field} must be an integer >= {least}, got {value!r}")
        if self.online_share_end is None and (self.ramp_start or self.ramp_steps):
            raise ValueError(f"MixingConfig: ramp_start ({self.ramp_start}) and ramp_steps ({self.ramp_steps}) schedule a "
                             f"move to online_share_end, which is not set (a constant share or no schedule)")

    def online_share(self, step: int) -> float | None:
        """The scheduled share of online examples at ``step`` (None without a schedule)."""
        start, end = self.online_share_start, self.online_share_end
        if start is None:
            return None
        if end is None or step < self.ramp_start:
            return start
        progress = 1.0 if self.ramp_steps == 0 else min(1.0, (step - self.ramp_start) / self.ramp_steps)
        return start + (end - start) * progress

    def probabilities(self, step: int) -> torch.Tensor:
        """``[S]`` float64: the probability of each source at ``step``."""
        weights = [s.weight for s in self.sources]
        share = self.online_share(step)
        if share is None:
            total = sum(weights)
            return torch.tensor([w / total for w in weights], dtype=torch.float64)
        online = sum(w for w, s in zip(weights, self.sources) if s.online)
        offline = sum(weights) - online
        return torch.tensor([share * w / online if s.online else (1 - share) * w / offline
                             for w, s in zip(weights, self.sources)], dtype=torch.float64)


class MixedStream(ShardedStream):
    """Interleaves ``sources`` (name -> whole ``ShardedStream``, names as in ``config.sources``) and gives
    rank ``rank`` of ``world_size`` its slice of every global mixed batch; see the module docstring.

    Ends (every rank at the same step) when a source a step draws from has no more examples.
    """

    def __init__(self, sources: Mapping[str, ShardedStream], config: MixingConfig, rank: int = 0, world_size: int = 1,
                 alignment: FeatureAlignment | None = None) -> None:
        super().__init__(config.batch_size, rank, world_size)
        missing = [s.name for s in config.sources if s.name not in sources]
        if missing:
            raise ValueError(f"MixedStream: no stream given for sources {missing}")
        unknown = [name for name in sources if name not in {s.name for s in config.sources}]
        if unknown:
            raise ValueError(f"MixedStream: streams {unknown} are not among the mixture's sources {[s.name for s in config.sources]}")
        self.config = config
        self.names = [s.name for s in config.sources]
        self.sources = [sources[n] for n in self.names]
        for name, source in zip(self.names, self.sources):
            if not isinstance(source, ShardedStream) or source.world_size != 1:
                raise ValueError(f"MixedStream: source {name!r} must be a whole ShardedStream (rank 0 of 1): the mixer "
                                 f"slices the mixture for each rank itself")
        if alignment is None:
            first = self.sources[0].spec
            for name, source in zip(self.names[1:], self.sources[1:]):
                difference = spec_difference(first, source.spec)
                if difference:
                    raise ValueError(f"MixedStream: source {name!r} has another FeatureSpec than {self.names[0]!r} ({difference}); "
                                     f"give a FeatureAlignment to mix different specs")
            # one id space: the union is the common spec and gathering only slices
            alignment = FeatureAlignment({n: s.spec for n, s in zip(self.names, self.sources)}, dict.fromkeys(self.names, ""))
        elif sorted(alignment.names) != sorted(self.names):
            raise ValueError(f"MixedStream: the alignment covers sources {alignment.names}, the mixture {self.names}")
        else:
            for name, source in zip(self.names, self.sources):
                alignment.check_source(name, source.spec)
        self.alignment = alignment
        # NOTE: one process reads each source's next rows step after step, so reading ahead pays; a rank of
        # several would discard the rows read ahead, its next rows of a source lying other ranks' rows further on
        read_ahead = self.batch_size if world_size == 1 else 0
        self._readers = [ExampleReader(source, read_ahead) for source in self.sources]
        self._anchors: dict[int, tuple[int, ...]] = {0: (0,) * len(self.sources)}  # step -> source positions
        self._latest = 0  # the newest anchor that is not a multiple of ANCHOR_EVERY
        self._resumed = 0  # the step a loaded state put the stream at: its anchor is the state's, kept for good
        self._compositions: dict[int, list[tuple[int, ...]]] = {}  # block of DRAW_BLOCK steps -> theirs, the newest last
        self._generator = torch.Generator()  # reseeded for every step's draws
        # NOTE: like reading ahead, only one process gathers several of its next batches at once (a rank of several
        # takes its slice of each global batch); and only small batches: at 512 rows and more a gather's fixed
        # costs are small beside its copying, and several steps' rows copied at once were slower than one by one
        # (the working set outgrows the caches)
        small = world_size == 1 and self.global_batch_size <= GATHER_MAX_ROWS
        self._steps_per_gather = GATHER_STEPS if small else 1
        # NOTE: tables of one assembler (a time split's periods: one corpus, one config) have the rows of a step read
        # straight into the mixed batch, their rows planned and assembled once, where a step is not gathered with
        # others: a gather copies every id of the rows the tables read (3.2 MB a batch of 1024 rows of ML-100K's
        # histories), and at small batches the sources' reads ahead and a gather of many steps cost less
        self._assembler, self._planners = None, []
        tables = [s.table for s in self.sources if isinstance(s, TableStream)]
        if (self._steps_per_gather == 1 and len(tables) == len(self.sources)
                and all(callable(getattr(t, "plan", None)) and getattr(t, "assembler", None) is not None for t in tables)
                and all(t.assembler == tables[0].assembler for t in tables) and all(map(alignment.keeps_rows, self.names))):
            self._assembler = tables[0]
            self._planners = [PlanReader(reader) for reader in self._readers]
        self._gathered: tuple[int, int, list[Batch | None]] | None = None  # first step gathered together, stride, batches
        self._stride = 1  # between the steps this reader delivers (DataLoader workers take turns)

    @property
    def spec(self) -> FeatureSpec:
        return self.alignment.spec

    # -- the composition of a global batch ------------------------------------------------------------------
    def composition(self, step: int) -> tuple[int, ...]:
        """Examples of each source in global batch ``step`` (the draws of ``(seed, step)``, counted)."""
        block, row = divmod(step, DRAW_BLOCK)
        counts = self._compositions.get(block)
        if counts is None:
            counts = self._compositions[block] = self._draw(step - row, step - row + DRAW_BLOCK)
            if len(self._compositions) > DRAW_BLOCKS_KEPT:
                del self._compositions[next(iter(self._compositions))]
        return counts[row]

    def _draw(self, start: int, stop: int) -> list[tuple[int, ...]]:
        """The compositions of global batches ``[start, stop)``.

        NOTE: each step's draws come from a generator seeded by ``(seed, step)``, so drawing a block of steps in one
        go gives exactly the per-step draws; it spares each step the set-up of a draw, which costs as much as the
        draw itself at the batch sizes that matter (a few ops of a few microseconds each). The probabilities
        change only during a ramp (they are a function of the online share), so they are rebuilt only then.
        """
        generator, config, size = self._generator, self.config, self.global_batch_size
        num_sources = len(self.sources)
        draws, share, probabilities = [], object(), None
        for step in range(start, stop):
            if config.online_share(step) != share:
                share, probabilities = config.online_share(step), config.probabilities(step)
            generator.manual_seed((config.seed * 1_000_003 + step) % SEED_RANGE)  # (as TableStream's orders)
            if config.granularity == "batch":
                draws.append(torch.multinomial(probabilities, 1, generator=generator))
            else:
                draws.append(torch.multinomial(probabilities, size, replacement=True, generator=generator))
        if config.granularity == "batch":
            counts = torch.zeros(stop - start, num_sources, dtype=torch.int64)
            counts.scatter_(1, torch.stack(draws), size)
        else:  # each step's draws counted per source, every step's in one count
            offsets = torch.arange(stop - start)[:, None] * num_sources
            counts = torch.bincount((torch.stack(draws) + offsets).view(-1), minlength=(stop - start) * num_sources)
        return [tuple(c) for c in counts.view(stop - start, num_sources).tolist()]

    def positions(self, step: int) -> tuple[int, ...]:
        """Examples of each source read by global batches ``0 .. step - 1`` (from a loaded state's step on: the steps
        before it were read under the schedule of the run that saved it, which a resume may have changed)."""
        if step < self._resumed:
            raise ValueError(f"MixedStream: the stream resumed at global batch {self._resumed}; the positions of batch "
                             f"{step} before it are the saved run's, not replayed under this schedule")
        start = step - step % ANCHOR_EVERY  # anchors hold every multiple reached so far, and 0
        while start not in self._anchors:
            start -= ANCHOR_EVERY
        # NOTE: the loaded state's anchor is never replaced by a replay from 0: with weights, a ramp or a seed
        # changed on resume, that replay would contradict the examples the saved run read
        for anchor in (self._resumed, self._latest):
            if start < anchor <= step:
                start = anchor
        position = self._anchors[start]
        for t in range(start, step):
            position = tuple(p + n for p, n in zip(position, self.composition(t)))
            if (t + 1) % ANCHOR_EVERY == 0:
                self._anchors[t + 1] = position
        # NOTE: the newest position makes sequential reading O(1) per step; anchors every ANCHOR_EVERY steps bound
        # the replay of a backward query (the draws are a pure function of the step, so replay is exact)
        if step % ANCHOR_EVERY and step != self._latest:
            if self._latest % ANCHOR_EVERY and self._latest != self._resumed:
                del self._anchors[self._latest]
            self._anchors[step], self._latest = position, step
        return position

    def global_batch(self, index: int) -> Batch | None:
        return self._rows(index, 0, self.global_batch_size)

    def rank_batch(self, index: int) -> Batch | None:
        # rank r's rows as torch.tensor_split(rows, world_size)[r] lays them out: the first (n mod W) ranks one more
        share, extra = divmod(self.global_batch_size, self.world_size)
        lo = self.rank * share + min(self.rank, extra)
        return self._rows(index, lo, lo + share + (self.rank < extra))

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        self._stride = 1 if info is None else info.num_workers
        return super().__iter__()

    def _rows(self, index: int, lo: int, hi: int) -> Batch | None:
        """Rows ``[lo, hi)`` of global batch ``index`` (its examples grouped by source, in source order),
        reading only those rows from the sources."""
        if self._steps_per_gather > 1:
            return self._gathered_batch(index)
        if self._assembler is not None:
            return self._assembled_batch(index, lo, hi)
        segments = self._segments(index, lo, hi)
        if segments is None:
            return None
        batch = self.alignment.gather(segments)
        batch.source = self._source_ids(index, lo, hi)
        return batch

    def _assembled_batch(self, index: int, lo: int, hi: int) -> Batch | None:
        """Rows ``[lo, hi)`` of global batch ``index``, each source's rows planned and all assembled at once (the
        same batch as gathered from the sources' batches)."""
        start = self.positions(index)
        ranges = self._source_ranges(index, lo, hi, start)
        if not ranges:
            return None
        plans = [plan for i, a, b in ranges for plan in self._planners[i].read(a, b, self._later(i, index, start))]
        batch = self._assembler.assemble(plans)
        batch.source = self._source_ids(index, lo, hi)
        return batch

    def _gathered_batch(self, index: int) -> Batch | None:
        """Global batch ``index``, gathered with the next ``_steps_per_gather - 1`` batches this reader will deliver
        (the same batches as gathered one by one: ``FeatureAlignment.gather_steps``)."""
        if self._gathered is not None:
            first, stride, batches = self._gathered
            offset, remainder = divmod(index - first, stride)
            if stride == self._stride and not remainder and 0 <= offset < len(batches) and batches[offset] is not None:
                batch, batches[offset] = batches[offset], None  # handed out once: asked again, it is gathered again
                return batch
        steps, totals = [], []
        step, start = index, self.positions(index)
        for ahead in range(self._steps_per_gather):
            if ahead:  # past the steps in between (other workers' steps, where DataLoader workers take turns)
                for t in range(step, step + self._stride):
                    start = tuple(p + n for p, n in zip(start, self.composition(t)))
                step += self._stride
            total = self.composition(step)
            read = self._segments(step, 0, self.global_batch_size, start, total)
            if read is None:  # the end of a source: the batches before it are delivered, then the mixture ends
                break
            steps.append(read)
            totals.append(total)
        if not steps:
            return None
        batches: list[Batch | None] = list(self.alignment.gather_steps(steps))
        # each example's source index, every step's at once
        sources = np.repeat(np.tile(np.arange(len(self.sources), dtype=np.int64), len(steps)), np.array(totals).reshape(-1))
        for batch, source in zip(batches, torch.from_numpy(sources).split(self.global_batch_size)):
            batch.source = source
        batch, batches[0] = batches[0], None
        self._gathered = (index, self._stride, batches)
        return batch

    def _segments(self, index: int, lo: int, hi: int, start: tuple[int, ...] | None = None,
                  total: tuple[int, ...] | None = None) -> list[tuple[str, BatchView, int, int]] | None:
        """The source row ranges of rows ``[lo, hi)`` of global batch ``index``; None past the end (or for a rank's
        empty share). ``start`` and ``total``: as ``_source_ranges`` takes them."""
        start = self.positions(index) if start is None else start
        ranges = self._source_ranges(index, lo, hi, start, total)
        if not ranges:
            return None
        return [(self.names[i], view, x, y) for i, a, b in ranges
                for view, x, y in self._readers[i].read(a, b, self._later(i, index, start))]

    def _later(self, source: int, index: int, start: tuple[int, ...]) -> Iterator[tuple[int, int]] | None:
        """Source ``source``'s examples in each of the next ``AHEAD_STEPS`` global batches this reader delivers after
        ``index`` (every ``_stride``-th: a DataLoader worker's), ``(first, end)`` each, in order, from its position
        ``start[source]`` before batch ``index``; None where the reader delivers every batch (its next rows of a source
        are the next batches') or reads no more than it is asked for (a rank of several).

        NOTE: a worker that read a source's next rows would read every worker's: the rows of its own next batches are
        one table read, as ``TableStream`` reads a worker's own next batches. A generator: walked only on a read."""
        if self._stride == 1 or not self._readers[source].read_ahead:
            return None
        return self._later_ranges(source, index, start[source])

    def _later_ranges(self, source: int, step: int, position: int) -> Iterator[tuple[int, int]]:
        for _ in range(AHEAD_STEPS):
            for t in range(step, step + self._stride):
                position += self.composition(t)[source]
            step += self._stride
            yield position, position + self.composition(step)[source]

    def _source_ranges(self, index: int, lo: int, hi: int, start: tuple[int, ...] | None = None,
                       total: tuple[int, ...] | None = None) -> list[tuple[int, int, int]] | None:
        """``(source, first example, end)`` of each source's examples in rows ``[lo, hi)`` of global batch ``index``
        (its examples grouped by source); None past the end, empty for a rank's empty share of a global batch
        smaller than the number of ranks. ``start`` and ``total``: the sources' positions before the batch and its
        composition, where the caller knows them."""
        start = self.positions(index) if start is None else start
        total = self.composition(index) if total is None else total
        for reader, first, n in zip(self._readers, start, total):
            # every rank checks the whole global batch, so that all ranks end at the same step; and a source the
            # batch draws nothing from too: once a step found a source spent, every later step does (positions only
            # grow), so that DataLoader workers, each checking only its own steps, all end where one process ends
            if not reader.available(first + n):
                return None
        ranges, first_row = [], 0  # first_row: of source i in the global batch
        for i, (first, n) in enumerate(zip(start, total)):
            a, b = max(lo, first_row), min(hi, first_row + n)
            if a < b:
                ranges.append((i, a + first - first_row, b + first - first_row))
            first_row += n
        return ranges

    def _source_ids(self, index: int, lo: int, hi: int) -> torch.Tensor:
        """Each example's source index, rows ``[lo, hi)`` of global batch ``index`` (its examples grouped by source)."""
        ids = np.repeat(np.arange(len(self.sources), dtype=np.int64), self.composition(index))
        return torch.from_numpy(ids[lo:hi])

    def short_sources(self, steps: int) -> list[tuple[str, int, int, int]]:
        """The sources of known finite length that ``steps`` global batches would read past their end:
        ``(name, examples read, examples held, first step that finds it spent)`` each (the draws are a pure function
        of the step, so this is exact before a batch is read)."""
        finite = [i for i, reader in enumerate(self._readers) if reader.length is not None and not math.isinf(reader.length)]
        if not finite or steps <= self._resumed:
            return []  # (replaying every step's draws: only when needed; a resumed stream reads from its step on)
        short, read = [], self.positions(steps)
        for i in finite:
            name, held = self.names[i], self._readers[i].length
            if read[i] <= held:
                continue
            lo, hi = self._resumed, steps  # the first step whose batch would read past the end: positions(step + 1) > held
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (mid + 1, hi) if self.positions(mid + 1)[i] <= held else (lo, mid)
            short.append((name, read[i], int(held), lo))
        return short

    # -- reporting and state --------------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """Examples read so far per source by the whole job (every rank), name -> count."""
        return dict(zip(self.names, self.positions(self.position)))

    def shares(self, step: int | None = None) -> dict[str, float]:
        """The scheduled share of each source at global batch ``step`` (None: the next), name -> probability."""
        return dict(zip(self.names, self.config.probabilities(self.position if step is None else step).tolist()))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "examples": self.counts()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "position" not in state:
            raise ValueError("the data state was written by the per-rank mixer of an older gem-data; it cannot be resumed")
        if "examples" not in state:
            raise ValueError("the data state is not a mixture's (it has no examples per source): it was written by another "
                             "kind of stream")
        if list(state["examples"]) != self.names:
            raise ValueError(f"mixing state has sources {list(state['examples'])}, this stream has {self.names}")
        super().load_state_dict(state)
        self._anchors, self._latest = {0: (0,) * len(self.sources)}, 0
        self._resumed = self.position
        if self.position:
            self._anchors[self.position] = tuple(int(state["examples"][n]) for n in self.names)
            self._latest = self.position
        self._compositions = {}
        self._gathered = None


class ExampleReader:
    """Reads example ranges of a whole ``ShardedStream``, holding one read of it at a time (with its NumPy views,
    made once: one process takes a row range of the held batch at each of several steps).

    A ``TableStream`` is read by row: exactly the rows asked for, or, when fewer are asked, ``read_ahead`` rows or
    the stream's own ``read_rows`` if more (one process asks for the next rows of a source step after step, and a
    table read has a fixed cost worth sharing over several steps, as the stream read alone shares it); where the
    caller names the ranges it will ask for next (``later``: a DataLoader worker's next batches), those ranges'
    rows instead, up to as many. Any other stream is read a global batch at a time.
    """

    def __init__(self, stream: ShardedStream, read_ahead: int = 0) -> None:
        if read_ahead and isinstance(stream, TableStream):
            read_ahead = max(read_ahead, stream.read_rows)
        self.stream, self.chunk, self.read_ahead = stream, stream.global_batch_size, read_ahead
        self.length = known_length(stream)
        self._view = None
        self._spans: list[tuple[int, int, int]] = []  # (first example, end, its row in the held batch) of the held ranges

    def _set(self, spans: list[tuple[int, int, int]], batch: Batch | None) -> None:
        self._spans, self._view = spans, None if batch is None else BatchView(batch)

    def _hold_chunk(self, index: int) -> Batch | None:
        start = index * self.chunk
        if self._view is None or self._spans[0][0] != start:
            batch = self.stream.global_batch(index)
            self._set([(start, start + (0 if batch is None else batch.batch_size), 0)], batch)
        return None if self._view is None else self._view.batch

    def _hold(self, start: int, stop: int, later: Iterator[tuple[int, int]] | None) -> None:
        if isinstance(self.stream, TableStream):
            # NOTE: TableStream._rows reads any rows of the endless shuffled sequence; batches would not fit here
            ranges = read_ranges(start, stop, later, self.read_ahead, self.length)
            rows = itertools.accumulate((b - a for a, b in ranges), initial=0)  # the read's row of each range's first
            self._set([(a, b, row) for (a, b), row in zip(ranges, rows)],
                      self.stream._rows(torch.cat([torch.arange(a, b) for a, b in ranges])))
        else:
            self._hold_chunk(start // self.chunk)

    def available(self, stop: int) -> bool:
        """Whether examples ``[0, stop)`` exist."""
        if stop <= 0:
            return True
        if self.length is not None:
            return stop <= self.length
        batch = self._hold_chunk((stop - 1) // self.chunk)
        return batch is not None and batch.batch_size > (stop - 1) % self.chunk

    def read(self, start: int, stop: int, later: Iterator[tuple[int, int]] | None = None) -> list[tuple[BatchView, int, int]]:
        """Examples ``[start, stop)`` (which must be ``available``) as ``(batch view, lo, hi)`` row ranges. ``later``:
        the example ranges the next reads will ask for, in order, where they are not the next examples."""
        segments = []
        while start < stop:
            for first, end, row in self._spans:  # NOTE: a loop, not a call: one process reads twice a step per source
                if first <= start < end:
                    break
            else:
                self._hold(start, stop, later)
                first, end, row = next(span for span in self._spans if span[0] <= start < span[1])
            end = min(stop, end)
            segments.append((self._view, row + start - first, row + end - first))
            start = end
        return segments


class PlanReader:
    """Reads example ranges of a ``TableStream`` of a ``PlannedTable`` as plans (the rows found, not yet
    assembled), holding as many rows' plans ahead as ``reader`` (the source's ``ExampleReader``) holds rows: a
    plan's fixed cost (a sampler's rounds of draws) is shared by several steps."""

    def __init__(self, reader: ExampleReader) -> None:
        self.stream, self.read_ahead, self.length = reader.stream, reader.read_ahead, reader.length
        self._held: list[tuple[int, Any]] = []  # (first example, plan) of the plans held, in order; a plan's examples follow on

    def read(self, start: int, stop: int, later: Iterator[tuple[int, int]] | None = None) -> list:
        """Plans of examples ``[start, stop)`` (which must exist), in order; ``later`` as ``ExampleReader.read``."""
        plans = []
        while start < stop:
            held = next(((first, plan) for first, plan in self._held if first <= start < first + len(plan)), None)
            if held is None:
                self._hold(start, stop, later)
                continue
            first, plan = held
            end = min(stop, first + len(plan))
            plans.append(plan[start - first : end - first])
            start = end
        return plans

    def _hold(self, start: int, stop: int, later: Iterator[tuple[int, int]] | None) -> None:
        ranges = read_ranges(start, stop, later, self.read_ahead, self.length)
        rows = torch.cat([torch.arange(a, b) for a, b in ranges])
        # a plan covers consecutive rows of the read, which may end one range and begin the next: cut at the ranges' ends
        cuts = list(itertools.accumulate((b - a for a, b in ranges), initial=0))  # the read's row of each range's first
        self._held, row = [], 0
        for plan in self.stream._plans(rows):
            done = 0
            while done < len(plan):
                r = bisect.bisect_right(cuts, row) - 1
                take = min(len(plan) - done, cuts[r + 1] - row)
                self._held.append((ranges[r][0] + row - cuts[r], plan if take == len(plan) else plan[done : done + take]))
                done, row = done + take, row + take


def read_ranges(start: int, stop: int, later: Iterator[tuple[int, int]] | None, read_ahead: int,
                length: float) -> list[tuple[int, int]]:
    """The example ranges one table read holds for a read of ``[start, stop)``: with no ``later`` ranges, the next
    ``read_ahead`` examples from ``start`` (at least ``[start, stop)``); with them, ``[start, stop)`` and the later
    ones in order while fewer than ``read_ahead`` examples are held, adjacent ones merged; never past ``length``."""
    if later is None:
        return [(start, min(max(stop, start + read_ahead), length))]
    ranges, held = [(start, stop)], stop - start
    for a, b in later:
        if held >= read_ahead or b > length:
            break
        if a == ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], b)
        elif a < b:
            ranges.append((a, b))
        held += b - a
    return ranges


def known_length(stream: ShardedStream) -> float | None:
    """Examples in ``stream`` when known without reading it (``math.inf``: endless; None: found by reading)."""
    if isinstance(stream, TableStream):
        return math.inf if stream.num_epochs is None else stream.num_epochs * stream.rows_per_epoch
    if isinstance(stream, SyntheticStream):
        return math.inf
    return None
