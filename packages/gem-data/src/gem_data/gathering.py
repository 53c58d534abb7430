"""Joining row ranges of several sources' batches into one batch of a union spec, in one pass.

The mixer asks for rows ``[lo, hi)`` of a few source batches (one per source per step, two where a read
straddles a buffered batch) and the alignment says how each source's keys map to the union's. Slicing each
piece and then concatenating would build a KeyedJaggedTensor per piece; here every key set is built once:
the wanted values of every piece and key are one contiguous range each (a view, not a copy), concatenated
once in key-major order (only keys whose ids shift are copied before that).

The cost is a fixed number of NumPy calls per field and piece, which at a few hundred rows per batch is what a
mixed batch costs beyond reading its sources: a source batch's NumPy views are made once (``BatchView``: the
mixer takes a row range of the batch it holds at each of several steps), and an event type's ids, whose keys
all have the same lengths, are cut as one ``[keys, events]`` matrix rather than key by key.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property
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
    are ``values[bounds[k * rows + lo] : bounds[k * rows + hi]]``.

    ``table``: for an event type's ids, whose keys all have the same lengths (one id per event), the values as a
    ``[keys, events]`` matrix, so that the values of every key for a row range are one slice, not one per key
    (None for other key sets, and for event ids that break that rule, which ``Batch.validate`` would refuse)."""

    __slots__ = ("num_keys", "rows", "values", "lengths", "bounds", "table")

    def __init__(self, kjt: KeyedJaggedTensor, rows: int, events: bool = False) -> None:
        self.num_keys, self.rows = len(kjt.keys()), rows
        self.values = kjt.values().numpy()
        self.lengths = kjt.lengths().numpy().reshape(self.num_keys, rows)
        self.bounds = np.zeros(self.lengths.size + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.bounds[1:])
        rectangular = events and self.num_keys and bool((self.lengths == self.lengths[0]).all())
        self.table = self.values.reshape(self.num_keys, -1) if rectangular else None

    def spans(self, lo: int, hi: int) -> tuple[list[int], list[int]]:
        """Where each key's values of rows ``[lo, hi)`` start and stop."""
        end = self.num_keys * self.rows
        return self.bounds[lo:end:self.rows].tolist(), self.bounds[hi : end + 1 : self.rows].tolist()


class BatchView:
    """A batch with NumPy views of its tensors, each made when first needed and then kept: the mixer takes a row
    range of the source batch it holds at each of several steps, and making a view (with the offsets of a key
    set) costs as much as cutting the range out of it."""

    def __init__(self, batch: Batch) -> None:
        self.batch, self.rows = batch, batch.batch_size

    @cached_property
    def dense(self) -> np.ndarray:
        return self.batch.dense.numpy()

    @cached_property
    def labels(self) -> np.ndarray:
        return self.batch.labels.numpy()

    @cached_property
    def surface(self) -> np.ndarray:
        return self.batch.surface.numpy()

    @cached_property
    def source(self) -> np.ndarray | None:
        return None if self.batch.source is None else self.batch.source.numpy()

    @cached_property
    def sparse(self) -> JaggedView:
        return JaggedView(self.batch.sparse, self.rows)

    @cached_property
    def sequences(self) -> dict[str, tuple[JaggedView, np.ndarray]]:
        """Event type -> its ids and timestamps."""
        return {name: (JaggedView(seq.ids, self.rows, events=True), seq.timestamps.numpy())
                for name, seq in self.batch.sequences.items()}

    def event_span(self, event: str, lo: int, hi: int) -> tuple[int, int]:
        """The events of rows ``[lo, hi)`` (every key of an event type has the same lengths: the first key's)."""
        bounds = self.sequences[event][0].bounds
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


def gather_pieces(pieces: list[Piece], spec: FeatureSpec) -> Batch:
    """One batch of ``spec`` holding the rows of every piece, in order."""
    if len(pieces) == 1 and pieces[0].plan.identity and pieces[0].lo == 0 and pieces[0].hi == pieces[0].batch.batch_size:
        p = pieces[0]
        surface = p.batch.surface if p.plan.surface is None else torch.full_like(p.batch.surface, p.plan.surface)
        return Batch(dense=p.batch.dense, sparse=p.batch.sparse, sequences=p.batch.sequences, labels=p.batch.labels,
                     surface=surface, source=p.batch.source, next_items=p.batch.next_items)
    sequences = {}
    for event in spec.events:
        parts, timestamps = [], []
        for p in pieces:
            keys = p.plan.events[event.name]
            ids, times = p.view.sequences.get(event.name, (None, None)) if keys is not None else (None, None)
            parts.append((ids, keys, p))
            if ids is not None:
                timestamps.append(times[ids.bounds[p.lo] : ids.bounds[p.hi]])  # the first key's bounds: the events'
        names = [f.name for f in event.features]
        if all(ids is not None and ids.table is not None and keys.identity for ids, keys, _ in parts):
            gathered = _gather_table(parts, names)
        else:
            gathered = _gather_kjt(parts, names, events=True)
        sequences[event.name] = EventSequence(gathered, _cat(timestamps) if timestamps else torch.zeros(0))
    return Batch(
        dense=_gather_dense(pieces, spec.num_dense),
        sparse=_gather_kjt([(p.view.sparse, p.plan.sparse, p) for p in pieces], [f.name for f in spec.sparse], events=False),
        sequences=sequences,
        labels=_cat([p.view.labels[p.lo : p.hi] for p in pieces]),
        surface=_cat([p.view.surface[p.lo : p.hi] if p.plan.surface is None
                      else np.full(p.rows, p.plan.surface, dtype=np.int64) for p in pieces]),
        source=None if any(p.view.source is None for p in pieces) else _cat([p.view.source[p.lo : p.hi] for p in pieces]),
        next_items=_gather_targets(pieces),
    )


# NOTE: slicing and joining happen on NumPy views of the (CPU) tensors: a batch is a few dozen small row ranges,
# where a tensor slice costs several times a NumPy one, and the joined arrays become tensors without a copy.
def _cat(arrays: list[np.ndarray], axis: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(arrays, axis=axis))


def _gather_dense(pieces: list[Piece], num_dense: int) -> torch.Tensor:
    if all(p.view.dense.shape[1] == num_dense for p in pieces):
        return _cat([p.view.dense[p.lo : p.hi] for p in pieces])
    dense = torch.zeros(sum(p.rows for p in pieces), num_dense)
    row = 0
    for p in pieces:
        width = p.batch.dense.shape[1]
        dense[row : row + p.rows, p.plan.dense_offset : p.plan.dense_offset + width] = p.batch.dense[p.lo : p.hi]
        row += p.rows
    return dense


def _gather_table(parts: list[tuple[JaggedView, KeyMap, Piece]], keys: list[str]) -> KeyedJaggedTensor:
    """``_gather_kjt`` for event ids of the union's keys (``JaggedView.table``): each part's events are one
    ``[keys, events]`` slice, and joining them along the events lays the values out key after key."""
    values = np.concatenate([ids.table[:, ids.bounds[p.lo] : ids.bounds[p.hi]] for ids, _, p in parts], axis=1)
    lengths = np.concatenate([ids.lengths[:, p.lo : p.hi] for ids, _, p in parts], axis=1)
    events = values.shape[1]
    return KeyedJaggedTensor(keys=keys, values=torch.from_numpy(values.reshape(-1)), lengths=torch.from_numpy(lengths.reshape(-1)),
                             stride=lengths.shape[1], length_per_key=[events] * len(keys),
                             offset_per_key=[events * k for k in range(len(keys) + 1)])


def _gather_kjt(parts: list[tuple[JaggedView | None, KeyMap | None, Piece]], keys: list[str], events: bool) -> KeyedJaggedTensor:
    """The union keys ``keys`` over the rows of every part: ``(source key set or None, key map or None, piece)``."""
    num_keys = len(keys)
    per_part: list[list[np.ndarray]] = []  # per part, per union key: the key's values for the part's rows
    lengths, sizes = [], [0] * num_keys  # sizes: values per union key
    for jagged, keymap, p in parts:
        n = p.rows
        if jagged is None or keymap is None or not jagged.num_keys:
            lengths.append(np.zeros((num_keys, n), dtype=np.int64))
            per_part.append([_EMPTY] * num_keys)
            continue
        first, last = jagged.spans(p.lo, p.hi)
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
    # NOTE: the per-key sizes are known here; handing them over spares the constructor a pass over the lengths
    return KeyedJaggedTensor(keys=keys, values=_cat(pieces) if pieces else torch.from_numpy(_EMPTY),
                             lengths=torch.from_numpy(np.concatenate(lengths, axis=1).reshape(-1)), stride=sum(p.rows for _, _, p in parts),
                             length_per_key=sizes, offset_per_key=[0, *itertools.accumulate(sizes)])


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
            (event,) = p.view.sequences
            lo, hi = p.view.event_span(event, lo, hi)
        positives.append(t.positives[lo:hi])
        if t.negatives is not None:
            negatives.append(t.negatives[lo:hi])
    return NextItemTargets(every=first.every, positives=torch.cat(positives),
                           negatives=torch.cat(negatives) if negatives else None, loss=first.loss, catalogue=first.catalogue)
