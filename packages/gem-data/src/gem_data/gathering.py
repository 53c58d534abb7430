"""Joining row ranges of several sources' batches into one batch of a union spec, in one pass.

The mixer asks for rows ``[lo, hi)`` of a few source batches (one per source per step, two where a read
straddles a buffered batch) and the alignment says how each source's keys map to the union's. Slicing each
piece and then concatenating would build a KeyedJaggedTensor per piece; here every key set is built once:
the wanted values of every piece and key are one contiguous range each (a view, not a copy), concatenated
once in key-major order (only keys whose ids shift are copied before that).

The cost is a fixed number of NumPy calls per field and piece, which at a few hundred rows per batch is what a
mixed batch costs beyond reading its sources (at a thousand rows of long histories, the copy itself): a
source batch's NumPy views and key offsets are made once, in one go (``BatchView.arrays``: the mixer takes a
row range of the batch it holds at each of several steps), and a key set's offsets come from one cumulative
sum, which also places the events' timestamps (the first key of an event type has one id per event).

NOTE: in a running mixed stream the gathering costs about twice what it costs in a loop of its own (the source
reads and the gathering evict each other's code and data from the caches), and fewer NumPy calls do not show
there: reading every key set of a source batch as one list of keys (one cumulative sum, one concatenation of all
values per step) was 6-11 us faster per batch in isolation and no faster in the stream, so it was left out of the
step-by-step join. Joining several steps at once (``gather_steps``, what one process of the mixer does at small
batches) pays each call once for all of them, and there the one list of keys does pay.
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torchrec import KeyedJaggedTensor

from gem_kunlun import Batch, EventSequence, FeatureSpec, NextItemTargets


@dataclass(frozen=True)
class KeyMap:
    """How one source's keys become a union key set: for union key ``k``, source key ``index[k]`` (-1: the
    source lacks it) with ids shifted by ``offset[k]``; a lacking key is an empty bag, or, where ``pad[k] >= 0``,
    one ``pad[k]`` id per event (event features carry exactly one id per event)."""

    index: tuple[int, ...]
    offset: tuple[int, ...]
    pad: tuple[int, ...]
    identity: bool  # the source's keys are the union's, unshifted

    @staticmethod
    def build(index: list[int], offset: list[int], pad: list[int], num_source_keys: int) -> "KeyMap":
        identity = index == list(range(num_source_keys)) and not any(offset) and all(p < 0 for p in pad)
        return KeyMap(tuple(index), tuple(offset), tuple(pad), identity)


@dataclass(frozen=True)
class SourcePlan:
    """Everything needed to put one source's rows into the union batch."""

    dense_offset: int  # first union dense column of the source's dense block
    sparse: KeyMap
    events: dict[str, KeyMap | None]  # union event type -> key map (None: the source lacks the type)
    surface: int | None  # stamped domain id (None: keep the reader's)
    identity: bool  # the source's spec is the union's: nothing to re-key


class JaggedView:
    """NumPy views of one KeyedJaggedTensor of a batch of ``rows`` rows: key ``k``'s values of rows ``[lo, hi)``
    are ``values[bounds[k * rows + lo] : bounds[k * rows + hi]]``. An event type's ids also carry the events'
    ``timestamps`` (every key has one id per event, so the first key's bounds are the events')."""

    __slots__ = ("bounds", "lengths", "num_keys", "rows", "timestamps", "values")

    def __init__(self, kjt: KeyedJaggedTensor, rows: int, timestamps: torch.Tensor | None = None) -> None:
        self.num_keys, self.rows = len(kjt.keys()), rows
        self.values = kjt.values().numpy()
        lengths = kjt.lengths().numpy()
        self.lengths = lengths.reshape(self.num_keys, rows)
        self.bounds = np.empty(lengths.size + 1, dtype=np.int64)
        self.bounds[0] = 0
        np.add.accumulate(lengths, dtype=np.int64, out=self.bounds[1:])  # NOTE: np.cumsum's wrapper costs as much as the sum
        self.timestamps = None if timestamps is None else timestamps.numpy()

    def spans(self, lo: int, hi: int) -> tuple[list[int], list[int]]:
        """Where each key's values of rows ``[lo, hi)`` start and stop."""
        if not self.rows:  # a rank's empty share of a short last batch: every key empty
            return [0] * self.num_keys, [0] * self.num_keys
        # NOTE: both ends sliced over num_keys * rows from their row: an exclusive end at num_keys * rows would drop
        # the last key of a range starting at the batch's end (lo == rows)
        end = self.num_keys * self.rows
        return self.bounds[lo : lo + end : self.rows].tolist(), self.bounds[hi : hi + end : self.rows].tolist()


class BatchArrays:
    """NumPy views of every tensor of a batch, made in one go (see ``BatchView``)."""

    __slots__ = ("dense", "labels", "sequences", "source", "sparse", "surface")

    def __init__(self, batch: Batch) -> None:
        rows = batch.batch_size
        self.dense, self.labels, self.surface = batch.dense.numpy(), batch.labels.numpy(), batch.surface.numpy()
        self.source = None if batch.source is None else batch.source.numpy()
        self.sparse = JaggedView(batch.sparse, rows)
        self.sequences = {name: JaggedView(seq.ids, rows, seq.timestamps) for name, seq in batch.sequences.items()}


class JoinedBatches:
    """The source batches of several steps (one spec) for ``gather_steps``: their lengths and row fields (dense,
    labels, surface, source) each joined into one array by one copy, batch after batch (a batch's key sets one after
    the other, key by key), their ids and timestamps left where they are. Key ``k`` (the key sets' keys counted
    end to end) of rows ``[lo, hi)`` of batch ``j`` has the ids ``[bounds[at[j] + k * rows[j] + lo], ... + hi])``,
    counted over every batch's ids laid end to end: key set ``i`` of batch ``j`` is ``values[j * num_sets + i]``,
    from ``starts[j, i]`` on; event type ``e``'s timestamps (one per id of its first key, set ``e + 1``) are
    ``times[j * num_events + e]``. Batch ``j``'s rows of the row fields start at ``row_at[j]``.

    NOTE: making each batch's NumPy views and key offsets on its own (a dozen views and a few small joins, ~25 us
    a batch of 128 synthetic rows) costs about three times what joining the small fields of 32 such batches at
    once costs a batch. The ids are not copied: at thousands of ids a batch, copying costs more than viewing.
    """

    __slots__ = ("at", "bounds", "dense", "labels", "lengths", "row_at", "rows", "source", "starts", "surface", "times",
                 "values")

    @staticmethod
    def join(batches: list[Batch], events: list[str]) -> "JoinedBatches | None":
        """None where the fields' types differ between batches (joining them would convert them), some batches carry
        their examples' sources and others not, or a key set's ids are not exactly those its lengths count (or an
        event type's timestamps one per event)."""
        values, lengths, times, dense, labels, surface, source, rows = [], [], [], [], [], [], [], []
        for batch in batches:
            sequences = batch.sequences
            for kjt in (batch.sparse, *(sequences[name].ids for name in events)):
                values.append(kjt.values())
                lengths.append(kjt.lengths())
            times += [sequences[name].timestamps for name in events]
            dense.append(batch.dense)
            labels.append(batch.labels)
            surface.append(batch.surface)
            source.append(batch.source)
            rows.append(batch.batch_size)
        has_source = all(t is not None for t in source)
        if not has_source and any(t is not None for t in source):
            return None  # NOTE: a step keeps its pieces' sources where all of them have one (gather_pieces): step by step
        if any(len({t.dtype for t in field}) > 1 for field in (values + lengths, times, dense, labels, surface,
                                                                  source if has_source else ())):
            return None
        joined = JoinedBatches()
        joined.lengths = torch.cat(lengths).numpy()
        joined.bounds = bounds = np.empty(joined.lengths.size + 1, dtype=np.int64)
        bounds[0] = 0
        np.add.accumulate(joined.lengths, dtype=np.int64, out=bounds[1:])
        first = batches[0]
        set_at = [0, *itertools.accumulate(len(kjt.keys()) for kjt in (first.sparse, *(first.sequences[name].ids for name in events)))]
        num_keys = set_at[-1]
        joined.at = [0, *itertools.accumulate(num_keys * r for r in rows)][:-1]
        at, counted = np.array(joined.at)[:, None], np.array(rows)[:, None]
        joined.starts = starts = bounds[at + np.array(set_at) * counted]  # [batches, key sets + 1]
        event_counts = bounds[at + (np.array(set_at[1:-1]) + 1) * counted] - starts[:, 1:-1]  # [batches, event types]
        if (not np.array_equal(np.diff(starts, axis=1).reshape(-1), np.array([v.numel() for v in values]))
                or not np.array_equal(event_counts.reshape(-1), np.array([t.numel() for t in times], dtype=np.int64))):
            return None
        joined.values, joined.times = [v.numpy() for v in values], [t.numpy() for t in times]
        joined.dense, joined.labels = torch.cat(dense).numpy(), torch.cat(labels).numpy()
        joined.surface = torch.cat(surface).numpy()
        joined.source = torch.cat(source).numpy() if has_source else None
        joined.rows, joined.row_at = rows, [0, *itertools.accumulate(rows)][:-1]
        return joined


class BatchView:
    """A batch and, once first needed, the NumPy views of its tensors (``arrays``): the mixer takes a row range
    of the source batch it holds at each of several steps, and making the views (with the offsets of each key
    set) costs as much as cutting a range out of them. A batch taken whole needs none."""

    __slots__ = ("_arrays", "batch", "rows")

    def __init__(self, batch: Batch) -> None:
        self.batch, self.rows, self._arrays = batch, batch.batch_size, None

    @property
    def arrays(self) -> BatchArrays:
        if self._arrays is None:
            self._arrays = BatchArrays(self.batch)
        return self._arrays

    def event_span(self, event: str, lo: int, hi: int) -> tuple[int, int]:
        """The events of rows ``[lo, hi)`` of event type ``event``."""
        bounds = self.arrays.sequences[event].bounds
        return int(bounds[lo]), int(bounds[hi])


class Piece(NamedTuple):  # NOTE: a tuple, not a frozen dataclass: a few are made per batch and that shows
    plan: SourcePlan
    view: BatchView
    lo: int
    hi: int

    @property
    def batch(self) -> Batch:
        return self.view.batch

    @property
    def rows(self) -> int:
        return self.hi - self.lo


def _whole(piece: Piece) -> bool:
    """Whether ``piece`` is its source batch whole, in the union's keys: gathering it copies nothing."""
    return piece.plan.identity and piece.lo == 0 and piece.hi == piece.view.rows


def gather_pieces(pieces: list[Piece], spec: FeatureSpec) -> Batch:
    """One batch of ``spec`` holding the rows of every piece, in order."""
    first = pieces[0]
    if len(pieces) == 1 and _whole(first):
        b = first.batch
        surface = b.surface if first.plan.surface is None else torch.full_like(b.surface, first.plan.surface)
        return Batch(dense=b.dense, sparse=b.sparse, sequences=b.sequences, labels=b.labels, surface=surface, source=b.source,
                     next_items=b.next_items, representations=b.representations)
    if any(p.batch.representations for p in pieces):
        raise ValueError("gathering rows of batches that carry representation features is not supported: join the "
                         "representations after mixing or cutting batches (a RepresentationJoin around the stream)")
    arrays = [p.view.arrays for p in pieces]
    same = all(p.plan.identity for p in pieces)  # every piece has the union's keys, unshifted
    sequences = {}
    for event in spec.events:
        name, keys = event.name, [f.name for f in event.features]
        if same and keys:
            jaggeds = [a.sequences[name] for a in arrays]
            sequences[name] = EventSequence(*_join_same_keys(jaggeds, pieces, keys, events=True))
            continue
        parts = [(a.sequences.get(name) if p.plan.events[name] is not None else None, p.plan.events[name], p)
                 for a, p in zip(arrays, pieces)]
        sequences[name] = EventSequence(*_gather_kjt(parts, keys, events=True))
    keys = [f.name for f in spec.sparse]
    if same and keys:
        sparse, _ = _join_same_keys([a.sparse for a in arrays], pieces, keys, events=False)
    else:
        sparse, _ = _gather_kjt([(a.sparse, p.plan.sparse, p) for a, p in zip(arrays, pieces)], keys, events=False)
    return Batch(
        dense=_gather_dense(pieces, arrays, spec.num_dense),
        sparse=sparse,
        sequences=sequences,
        labels=_cat([a.labels[p.lo : p.hi] for a, p in zip(arrays, pieces)]),
        surface=_cat([a.surface[p.lo : p.hi] if p.plan.surface is None else np.full(p.rows, p.plan.surface, dtype=np.int64)
                      for a, p in zip(arrays, pieces)]),
        source=None if any(a.source is None for a in arrays) else _cat([a.source[p.lo : p.hi] for a, p in zip(arrays, pieces)]),
        next_items=_gather_targets(pieces),
    )


def gather_steps(steps: list[list[Piece]], spec: FeatureSpec) -> list[Batch]:
    """``[gather_pieces(pieces, spec) for pieces in steps]``, the same batches field by field, made in one pass where
    every step has the same number of rows and every piece the union's keys (one spec, one id space), without
    retrieval targets or representation features; otherwise step by step.

    NOTE: at a hundred or two rows a batch, gathering a mixed batch costs as much as reading its sources, and most of
    it is a fixed cost per field, key set and piece (NumPy calls, Python lists, the tensors and key sets made).
    Joined together, several steps pay each call once: the source batches' lengths and row fields are one array each
    (``JoinedBatches``), every range of every piece is found with a few array operations, the ranges are cut in one
    pass and joined step after step, and each step's tensors are consecutive ranges of the joined arrays (views, made
    by one ``split`` per field; they keep the joined arrays alive until every batch of the steps is let go)."""
    if len(steps) < 2 or not spec.sparse or not spec.events or not all(event.features for event in spec.events):
        return [gather_pieces(step, spec) for step in steps]
    whole = [len(step) == 1 and _whole(step[0]) for step in steps]
    if any(whole):
        # NOTE: a step that is one source batch taken whole (whole-batch mixing) is that batch, made without copying
        # a row (``gather_pieces``); only the other steps are joined
        others = iter(gather_steps([step for step, w in zip(steps, whole) if not w], spec))
        return [gather_pieces(step, spec) if w else next(others) for step, w in zip(steps, whole)]
    held: dict[int, int] = {}  # id of a source batch's view -> its index in ``views``
    views: list[BatchView] = []
    part_view, part_lo, part_hi, part_step, step_rows, identity = [], [], [], [], [], True
    for s, step in enumerate(steps):
        for p in step:
            j = held.get(id(p.view))
            if j is None:
                j = held[id(p.view)] = len(views)
                views.append(p.view)
            part_view.append(j)
            part_lo.append(p.lo)
            part_hi.append(p.hi)
            part_step.append(s)
            identity = identity and p.plan.identity
        step_rows.append(sum(p.hi - p.lo for p in step))
    rows, events = step_rows[0], [e.name for e in spec.events]
    if (not identity or not rows or any(n != rows for n in step_rows)
            or any(view.batch.next_items is not None or view.batch.representations for view in views)):
        return [gather_pieces(step, spec) for step in steps]
    num_steps, pieces = len(steps), [p for step in steps for p in step]
    parts = list(zip(part_view, part_lo, part_hi))
    key_sets = [[f.name for f in spec.sparse], *([f.name for f in e.features] for e in spec.events)]
    set_sizes = [len(keys) for keys in key_sets]
    num_keys, num_sets = sum(set_sizes), len(key_sets)
    set_at = [0, *itertools.accumulate(set_sizes)][:-1]
    event_keys = set_at[1:]  # each event type's first key
    view_, lo, n = np.array(part_view), np.array(part_lo), np.array(part_hi) - np.array(part_lo)
    joined = JoinedBatches.join([view.batch for view in views], events)
    if joined is None:
        return [gather_pieces(step, spec) for step in steps]
    # every part's range of every key ([parts, keys]), counted over every source batch's ids laid end to end, then
    # within the key set it is cut from (``joined.values[value_from]``); the timestamps of its events likewise
    bound = (np.array(joined.at)[view_] + lo)[:, None] + np.arange(num_keys) * np.array(joined.rows)[view_][:, None]
    key_set = np.repeat(np.arange(num_sets), set_sizes)
    set_start = joined.starts[view_][:, key_set]
    first, last = joined.bounds[bound] - set_start, joined.bounds[bound + n[:, None]] - set_start
    value_from = view_[:, None] * num_sets + key_set
    time_first, time_last = first[:, event_keys], last[:, event_keys]
    time_from = view_[:, None] * len(events) + np.arange(len(events))
    # the values in the output's order: step by step, key by key, part by part (the parts are in step order)
    group = (np.array(part_step)[:, None] * num_keys + np.arange(num_keys)).reshape(-1)
    order = np.argsort(group, kind="stable")
    cuts = [joined.values[i][a:z] for i, a, z in zip(value_from.reshape(-1)[order].tolist(), first.reshape(-1)[order].tolist(),
                                                    last.reshape(-1)[order].tolist())]
    sizes = np.bincount(group, weights=(last - first).reshape(-1), minlength=num_steps * num_keys)
    sizes = sizes.astype(np.int64).reshape(num_steps, num_keys)  # per step, per key
    values = torch.from_numpy(_join_array(cuts, int(sizes.sum())))
    # lengths: [keys, steps * rows] -> [steps, keys, rows], each step's key-major
    view_lengths = [joined.lengths[a : a + num_keys * r].reshape(num_keys, r) for a, r in zip(joined.at, joined.rows)]
    lengths = np.concatenate([view_lengths[j][:, a:z] for j, a, z in parts], axis=1).reshape(num_keys, num_steps, rows)
    lengths = torch.from_numpy(np.ascontiguousarray(lengths.transpose(1, 0, 2)).reshape(-1))
    # timestamps: step by step, event type by event type
    event_group = (np.array(part_step)[:, None] * len(events) + np.arange(len(events))).reshape(-1)
    event_order = np.argsort(event_group, kind="stable")
    times = [joined.times[i][a:z] for i, a, z in zip(time_from.reshape(-1)[event_order].tolist(),
                                                   time_first.reshape(-1)[event_order].tolist(),
                                                   time_last.reshape(-1)[event_order].tolist())]
    times = torch.from_numpy(_join_array(times, int(sizes[:, event_keys].sum())))
    # each step's tensors: consecutive ranges of the joined ones
    set_values = values.split(np.add.reduceat(sizes, set_at, axis=1).reshape(-1).tolist())
    set_lengths = lengths.split([size * rows for size in set_sizes] * num_steps)
    step_times = times.split(sizes[:, event_keys].reshape(-1).tolist())
    sizes = sizes.tolist()

    def rows_of(field: list[np.ndarray]) -> tuple[torch.Tensor, ...]:
        return torch.from_numpy(np.concatenate(field)).split(rows)

    ranges = [(joined.row_at[j] + a, joined.row_at[j] + z) for j, a, z in parts]
    plans = [p.plan for p in pieces]
    dense = rows_of([joined.dense[a:z] for a, z in ranges])
    labels = rows_of([joined.labels[a:z] for a, z in ranges])
    surface = rows_of([joined.surface[a:z] if plan.surface is None else np.full(z - a, plan.surface, dtype=np.int64)
                       for (a, z), plan in zip(ranges, plans)])
    source = None if joined.source is None else rows_of([joined.source[a:z] for a, z in ranges])
    batches = []
    for s in range(num_steps):
        kjts = [_keyed_jagged(list(keys), set_values[s * num_sets + i], set_lengths[s * num_sets + i], rows,
                              sizes[s][at : at + size]) for i, (keys, at, size) in enumerate(zip(key_sets, set_at, set_sizes))]
        sequences = {name: EventSequence(kjt, step_times[s * len(events) + e]) for e, (name, kjt) in enumerate(zip(events, kjts[1:]))}
        batches.append(Batch(dense=dense[s], sparse=kjts[0], sequences=sequences, labels=labels[s], surface=surface[s],
                             source=None if source is None else source[s]))
    return batches


# NOTE: slicing and joining happen on NumPy views of the (CPU) tensors: a batch is a few dozen small row ranges,
# where a tensor slice costs several times a NumPy one, and the joined arrays become tensors without a copy.
def _cat(arrays: list[np.ndarray], axis: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(arrays, axis=axis))


def _gather_dense(pieces: list[Piece], arrays: list[BatchArrays], num_dense: int) -> torch.Tensor:
    if all(a.dense.shape[1] == num_dense for a in arrays):
        return _cat([a.dense[p.lo : p.hi] for a, p in zip(arrays, pieces)])
    dense = torch.zeros(sum(p.rows for p in pieces), num_dense)
    row = 0
    for p in pieces:
        width = p.batch.dense.shape[1]
        dense[row : row + p.rows, p.plan.dense_offset : p.plan.dense_offset + width] = p.batch.dense[p.lo : p.hi]
        row += p.rows
    return dense


def _join_same_keys(jaggeds: list[JaggedView], pieces: list[Piece], keys: list[str],
                    events: bool) -> tuple[KeyedJaggedTensor, torch.Tensor | None]:
    """``_gather_kjt`` where every part has the union keys ``keys`` (at least one), unshifted: the sources share one
    spec and one id space, the common case (the time-split and the same-spec mixes).

    NOTE: without the key maps a part is a few slices: the synthetic 3:1 mix's gathering at batch 128 took ~17%
    less in a loop of its own and, in the running stream, a median of 182 against 221 us a batch (12 rounds
    interleaved; another run 186 against 200 us). Summing the per-key sizes with NumPy over the joined lengths
    instead (one call) was no faster than the general loop in the stream: a NumPy reduction costs ~4 us there."""
    per_part, lengths, timestamps, sizes = [], [], [], [0] * len(keys)
    for jagged, (_, _, lo, hi) in zip(jaggeds, pieces):
        first, last = jagged.spans(lo, hi)
        values = jagged.values
        per_part.append([values[a:z] for a, z in zip(first, last)])
        sizes = [size + z - a for size, a, z in zip(sizes, first, last)]
        lengths.append(jagged.lengths[:, lo:hi])
        if events:
            timestamps.append(jagged.timestamps[first[0] : last[0]])  # the first key's values: one per event
    joined = np.concatenate(lengths, axis=1)
    # key-major order: key 0 of every part, then key 1 of every part, ...
    values = _join([array for key in zip(*per_part) for array in key], sum(sizes))
    kjt = _keyed_jagged(keys, values, torch.from_numpy(joined.reshape(-1)), joined.shape[1], sizes)
    return kjt, _join(timestamps, sizes[0]) if events else None


def _gather_kjt(parts: list[tuple[JaggedView | None, KeyMap | None, Piece]], keys: list[str],
                events: bool) -> tuple[KeyedJaggedTensor, torch.Tensor | None]:
    """The union keys ``keys`` over the rows of every part: ``(source key set or None, key map or None, piece)``;
    for an event type (``events``) also the events' timestamps."""
    num_keys = len(keys)
    per_part: list[list[np.ndarray]] = []  # per part, per union key: the key's values for the part's rows
    lengths, sizes, timestamps = [], [0] * num_keys, []  # sizes: values per union key
    for jagged, keymap, p in parts:
        n = p.rows
        if jagged is None or keymap is None or not jagged.num_keys:
            lengths.append(np.zeros((num_keys, n), dtype=np.int64))
            per_part.append([_EMPTY] * num_keys)
            continue
        first, last = jagged.spans(p.lo, p.hi)
        if events:
            timestamps.append(jagged.timestamps[first[0] : last[0]])  # the first key's values: one per event
        wanted = jagged.lengths[:, p.lo : p.hi]
        values = jagged.values
        if keymap.identity:
            per_part.append([values[a:z] for a, z in zip(first, last)])
            sizes = [size + z - a for size, a, z in zip(sizes, first, last)]
            lengths.append(wanted)
            continue
        cut, rows = [], []
        events_total = last[0] - first[0]
        for k, (index, offset, pad) in enumerate(zip(keymap.index, keymap.offset, keymap.pad)):
            if index >= 0:
                v = values[first[index] : last[index]]
                cut.append(v + offset if offset else v)  # NOTE: only shifted keys are copied here; the rest once, by cat
                sizes[k] += last[index] - first[index]
                rows.append(wanted[index])
            elif pad >= 0 and events:
                cut.append(np.full(events_total, pad, dtype=np.int64))  # one padding id per event
                sizes[k] += events_total
                rows.append(wanted[0])
            else:
                cut.append(_EMPTY)
                rows.append(np.zeros(n, dtype=np.int64))
        per_part.append(cut)
        lengths.append(np.stack(rows) if rows else np.zeros((0, n), dtype=np.int64))
    # key-major order: key 0 of every part, then key 1 of every part, ...
    pieces = [array for key in zip(*per_part) for array in key]
    kjt = _keyed_jagged(keys, _join(pieces, sum(sizes)) if pieces else torch.from_numpy(_EMPTY),
                        torch.from_numpy(np.concatenate(lengths, axis=1).reshape(-1)), sum(p.rows for _, _, p in parts), sizes)
    if not events:
        return kjt, None
    return kjt, _join(timestamps, sum(len(t) for t in timestamps)) if timestamps else torch.zeros(0)


def _join(arrays: list[np.ndarray], size: int) -> torch.Tensor:
    """``_cat(arrays)`` of 1-d arrays of ``size`` elements in all, into a reused buffer when large (see
    ``BufferPool``)."""
    return torch.from_numpy(_join_array(arrays, size))


def _join_array(arrays: list[np.ndarray], size: int) -> np.ndarray:
    """``np.concatenate(arrays)`` of 1-d arrays of ``size`` elements in all, into a reused buffer when large."""
    dtype = arrays[0].dtype
    # NOTE: pieces of other types are joined by NumPy's promotion: a buffer of the first one's type would narrow them
    pooled = size * dtype.itemsize >= POOLED_BYTES and all(a.dtype == dtype for a in arrays)
    out = _POOL.claim(size, dtype) if pooled else None
    if out is None:
        return np.concatenate(arrays)
    np.concatenate(arrays, out=out)
    return out


class BufferPool:
    """Output buffers of the large joins (a key set's ids at a thousand rows of long histories: megabytes per
    batch), each handed out again only once nothing refers to it any more.

    NOTE: a fresh allocation of a few megabytes per batch faults in part of its pages again (the allocator hands
    memory back to the system and takes it again), about a hundred page faults per batch in the ml-100k time-split
    mix at batch 1024, which made joining its history ids ~1.6x as slow as into a reused buffer (~570 -> ~360 us a
    batch, in the stream). A buffer is free when only the pool refers to it: a batch's tensor made by
    ``torch.from_numpy`` keeps the NumPy view it was made from, which keeps the buffer, as does every tensor or
    array sharing its memory, so memory a consumer can still reach is never written again. At most ``size``
    buffers are kept (each up to 1.25x the largest join seen); when none is free (a consumer holding many batches)
    the join allocates as before."""

    def __init__(self, size: int) -> None:
        self.size, self.buffers, self.lock = size, [], threading.Lock()

    def claim(self, size: int, dtype: np.dtype) -> np.ndarray | None:
        """A ``[size]`` view of a free buffer of ``dtype`` (None: none free and no room for another)."""
        with self.lock:  # the check and the claim (the view, which refers to the buffer) in one step
            buffers, spare = self.buffers, None
            for i in range(len(buffers)):
                if _references(buffers, i) == _FREE:
                    buffer = buffers[i]
                    if buffer.dtype == dtype and buffer.size >= size:
                        return buffer[:size]
                    spare = i
            if spare is None and len(buffers) >= self.size:
                return None
            buffer = np.empty(size + size // 4, dtype=dtype)  # room for the next batches' somewhat larger joins
            if spare is None:
                buffers.append(buffer)
            else:
                buffers[spare] = buffer  # a free buffer too small (or of another type) makes way
            return buffer[:size]


def _references(buffers: list[np.ndarray], i: int) -> int:
    """``sys.getrefcount`` of ``buffers[i]`` as ``BufferPool.claim`` counts it."""
    return sys.getrefcount(buffers[i])


# NOTE: what the count of a buffer nothing else refers to is, measured through the same call rather than assumed:
# the references an interpreter holds while counting differ between Python versions, and a baseline too low by one
# would hand out a buffer a consumer still reads
_FREE = _references([np.empty(1)], 0)
POOLED_BYTES = 1 << 18  # joins of at least this many bytes go to the pool's buffers
_POOL = BufferPool(8)


# NOTE: the per-key sizes are known here; handing them over (with their offsets) spares the constructor a pass
# over the lengths
def _keyed_jagged(keys: list[str], values: torch.Tensor, lengths: torch.Tensor, stride: int, sizes: list[int]) -> KeyedJaggedTensor:
    """``KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, stride=stride, length_per_key=sizes,
    offset_per_key=...)``, the same object made without the constructor's call overhead where that is known to be
    safe (``kjt_defaults``)."""
    offsets = [0, *itertools.accumulate(sizes)]
    defaults = kjt_defaults()
    if defaults is None:
        return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, stride=stride, length_per_key=sizes,
                                 offset_per_key=offsets)
    kjt = _new_object(KeyedJaggedTensor)
    vars(kjt).update(defaults, _keys=keys, _values=values, _lengths=lengths, _stride=stride, _length_per_key=sizes,
                     _offset_per_key=offsets)
    return kjt


_KJT_PASSED = ("_keys", "_values", "_lengths", "_stride", "_length_per_key", "_offset_per_key")


@functools.cache
def kjt_defaults() -> dict | None:
    """The attributes torchrec's KeyedJaggedTensor constructor sets besides those ``_keyed_jagged`` passes, when
    they do not depend on the inputs (all None); otherwise None: the constructor is called.

    NOTE: the constructor only stores its arguments (its docstring promises attributes and input checks only) but
    costs ~4-6 us a call (a metaclass hook for fx tracing, pt2 and dtype checks: the lengths here are always int64),
    and a mixed batch makes one per key set; storing the same attributes directly costs ~1 us (~15 us less per
    batch of the synthetic mix in the stream, ~5-10% of its gathering). Probed at the first use, not at import: a
    KeyedJaggedTensor's first construction prints torch.fx's tracing warning, which a command failing on its
    config before reading any data must not print."""
    one = torch.ones(1, dtype=torch.int64)
    probe = KeyedJaggedTensor(keys=["k"], values=one, lengths=one, stride=1, length_per_key=[1], offset_per_key=[0, 1])
    fields = vars(probe)
    defaults = {name: value for name, value in fields.items() if name not in _KJT_PASSED}
    if not all(name in fields for name in _KJT_PASSED) or any(value is not None for value in defaults.values()):
        return None
    return defaults


_new_object = object.__new__


_EMPTY = np.zeros(0, dtype=np.int64)


def _gather_targets(pieces: list[Piece]) -> NextItemTargets | None:
    """The retrieval targets of the pieces' rows (one query per row, or one per history event), concatenated."""
    targets = [p.batch.next_items for p in pieces]
    if all(t is None for t in targets):
        return None
    first = targets[0]
    if any(t is None or t.every != first.every or t.loss != first.loss or (t.negatives is None) != (first.negatives is None)
           for t in targets):
        raise ValueError("the mixed sources produce different kinds of examples (retrieval targets in some, not in others, "
                         "or of another kind): every source needs the same objective")
    positives, negatives = [], []
    for p, t in zip(pieces, targets):
        lo, hi = p.lo, p.hi
        if t.every:
            (event,) = p.batch.sequences
            lo, hi = p.view.event_span(event, lo, hi)
        positives.append(t.positives[lo:hi])
        if t.negatives is not None:
            negatives.append(t.negatives[lo:hi])
    return NextItemTargets(every=first.every, positives=torch.cat(positives),
                           negatives=torch.cat(negatives) if negatives else None, loss=first.loss, catalogue=first.catalogue)
