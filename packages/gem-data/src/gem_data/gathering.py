"""Joining row ranges of several sources' batches into one batch of a union spec, in one pass.

The mixer asks for rows ``[lo, hi)`` of a few source batches (one per source per step, two where a read
straddles a buffered batch) and the alignment says how each source's keys map to the union's. Slicing each
piece and then concatenating would build a KeyedJaggedTensor per piece; here every key set is built once:
the wanted values of every piece and key are one contiguous range each (a view, not a copy), concatenated
once in key-major order (only keys whose ids shift are copied before that).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Piece:
    plan: SourcePlan
    batch: Batch
    lo: int
    hi: int

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
            seq = p.batch.sequences.get(event.name) if keys is not None else None
            parts.append((None if seq is None else seq.ids, keys, p))
            if seq is not None:
                first, last = _event_span(seq, p.lo, p.hi)
                timestamps.append(seq.timestamps.numpy()[first:last])
        ids = _gather_kjt(parts, [f.name for f in event.features], events=True)
        sequences[event.name] = EventSequence(ids, _cat(timestamps) if timestamps else torch.zeros(0))
    return Batch(
        dense=_gather_dense(pieces, spec.num_dense),
        sparse=_gather_kjt([(p.batch.sparse, p.plan.sparse, p) for p in pieces], [f.name for f in spec.sparse], events=False),
        sequences=sequences,
        labels=_cat([p.batch.labels.numpy()[p.lo : p.hi] for p in pieces]),
        surface=_cat([p.batch.surface.numpy()[p.lo : p.hi] if p.plan.surface is None
                      else np.full(p.rows, p.plan.surface, dtype=np.int64) for p in pieces]),
        source=None if any(p.batch.source is None for p in pieces) else _cat([p.batch.source.numpy()[p.lo : p.hi] for p in pieces]),
        next_items=_gather_targets(pieces),
    )


# NOTE: slicing and joining happen on NumPy views of the (CPU) tensors: a batch is a few dozen small row ranges,
# where a tensor slice costs several times a NumPy one, and the joined arrays become tensors without a copy.
def _cat(arrays: list[np.ndarray], axis: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(arrays, axis=axis))


def _gather_dense(pieces: list[Piece], num_dense: int) -> torch.Tensor:
    if all(p.batch.dense.shape[1] == num_dense for p in pieces):
        return _cat([p.batch.dense.numpy()[p.lo : p.hi] for p in pieces])
    dense = torch.zeros(sum(p.rows for p in pieces), num_dense)
    row = 0
    for p in pieces:
        width = p.batch.dense.shape[1]
        dense[row : row + p.rows, p.plan.dense_offset : p.plan.dense_offset + width] = p.batch.dense[p.lo : p.hi]
        row += p.rows
    return dense


def _event_span(seq: EventSequence, lo: int, hi: int) -> tuple[int, int]:
    """The events of rows ``[lo, hi)``: the first key's offsets (every key of an event type has the same lengths)."""
    offsets = seq.ids.offsets().numpy()
    return int(offsets[lo]), int(offsets[hi])


def _gather_kjt(parts: list[tuple[KeyedJaggedTensor | None, KeyMap | None, Piece]], keys: list[str], events: bool) -> KeyedJaggedTensor:
    """The union keys ``keys`` over the rows of every part: ``(source kjt or None, key map or None, piece)``."""
    num_keys = len(keys)
    per_part: list[list[np.ndarray]] = []  # per part, per union key: the key's values for the part's rows
    lengths = []
    for kjt, keymap, p in parts:
        n = p.rows
        if kjt is None or keymap is None or not len(kjt.keys()):
            lengths.append(np.zeros((num_keys, n), dtype=np.int64))
            per_part.append([_EMPTY] * num_keys)
            continue
        m, b = len(kjt.keys()), p.batch.batch_size
        # NOTE: the KeyedJaggedTensor's offsets (kept once computed) locate key k's values of rows [lo, hi) directly
        bounds = kjt.offsets().numpy()
        first = bounds[p.lo : m * b : b].tolist()
        last = bounds[p.hi : m * b + 1 : b].tolist()
        wanted = kjt.lengths().numpy().reshape(m, b)[:, p.lo : p.hi]
        values = kjt.values().numpy()
        if keymap.identity:
            per_part.append([values[a:z] for a, z in zip(first, last)])
            lengths.append(wanted)
            continue
        cut, rows = [], []
        events_total = last[0] - first[0] if m else 0
        for index, offset, pad in zip(keymap.index, keymap.offset, keymap.pad):
            if index >= 0:
                v = values[first[index] : last[index]]
                cut.append(v + offset if offset else v)  # NOTE: only shifted keys are copied here; the rest once, by cat
                rows.append(wanted[index])
            elif pad >= 0 and events:
                cut.append(np.full(events_total, pad, dtype=np.int64))  # one padding id per event
                rows.append(wanted[0])
            else:
                cut.append(_EMPTY)
                rows.append(np.zeros(n, dtype=np.int64))
        per_part.append(cut)
        lengths.append(np.stack(rows) if rows else np.zeros((0, n), dtype=np.int64))
    # key-major order: key 0 of every part, then key 1 of every part, ...
    pieces = [per_part[i][k] for k in range(num_keys) for i in range(len(parts))]
    per_key = [sum(len(per_part[i][k]) for i in range(len(parts))) for k in range(num_keys)]
    # NOTE: the per-key sizes are known here; handing them over spares the constructor a pass over the lengths
    return KeyedJaggedTensor(keys=keys, values=_cat(pieces) if pieces else torch.from_numpy(_EMPTY),
                             lengths=_cat(lengths, axis=1).reshape(-1), stride=sum(p.rows for _, _, p in parts),
                             length_per_key=per_key, offset_per_key=[0, *itertools.accumulate(per_key)])


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
            (seq,) = p.batch.sequences.values()
            lo, hi = _event_span(seq, lo, hi)
        positives.append(t.positives[lo:hi])
        if t.negatives is not None:
            negatives.append(t.negatives[lo:hi])
    return NextItemTargets(every=first.every, positives=torch.cat(positives),
                           negatives=torch.cat(negatives) if negatives else None, loss=first.loss, catalogue=first.catalogue)
