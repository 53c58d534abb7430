"""Example-level surgery on batches: pick rows, concatenate batches. Mixing and balancing are built on these.

All gathers are vectorised (one ``repeat_interleave`` + one index per jagged structure), never a loop over
examples.
"""

from __future__ import annotations

import torch
from torchrec import KeyedJaggedTensor

from gem_kunlun import Batch, EventSequence, JaggedFloats, NextItemTargets, lengths_to_offsets


def jagged_index(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Positions ``[sum(lengths)]`` of the segments ``[starts[i], starts[i] + lengths[i])``, concatenated."""
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    shift = starts - lengths_to_offsets(lengths)[:-1]
    return torch.repeat_interleave(shift, lengths, output_size=total) + torch.arange(total)


def gather_jagged(values: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``rows [R]`` of the jagged ``values [T, ...]`` + ``offsets [N+1]``: returns ``(values, lengths [R])``."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    return values[jagged_index(starts, lengths)], lengths


def select_kjt(kjt: KeyedJaggedTensor, rows: torch.Tensor) -> KeyedJaggedTensor:
    """Examples ``rows [R]`` (any order, repeats allowed) of every key of ``kjt``."""
    keys = kjt.keys()
    stride = kjt.stride()
    flat_rows = (torch.arange(len(keys)).unsqueeze(1) * stride + rows.unsqueeze(0)).reshape(-1)
    values, lengths = gather_jagged(kjt.values(), kjt.offsets(), flat_rows)
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)


def select_examples(batch: Batch, rows: torch.Tensor) -> Batch:
    """A new batch of the examples ``rows [R]`` of ``batch``, in that order."""
    rows = rows.to(torch.int64)
    sequences = {}
    for name, seq in batch.sequences.items():
        timestamps, _ = gather_jagged(seq.timestamps, seq.offsets(), rows)
        sequences[name] = EventSequence(ids=select_kjt(seq.ids, rows), timestamps=timestamps)
    return Batch(
        dense=batch.dense[rows],
        sparse=select_kjt(batch.sparse, rows),
        sequences=sequences,
        labels=batch.labels[rows],
        surface=batch.surface[rows],
        source=None if batch.source is None else batch.source[rows],
        next_items=None if batch.next_items is None else _select_targets(batch, rows),
        representations={name: JaggedFloats(*gather_jagged(r.values, r.offsets(), rows)) for name, r in batch.representations.items()},
    )


def _select_targets(batch: Batch, rows: torch.Tensor) -> NextItemTargets:
    """The next-item targets of examples ``rows``: one query per example, or one per event of the history."""
    t = batch.next_items
    index = rows
    if t.every:
        if len(batch.sequences) != 1:
            raise ValueError("every-event next-item targets need a batch with exactly one event type")
        (seq,) = batch.sequences.values()
        offsets = seq.offsets()
        index = jagged_index(offsets[rows], offsets[rows + 1] - offsets[rows])
    return NextItemTargets(every=t.every, positives=t.positives[index],
                           negatives=None if t.negatives is None else t.negatives[index], loss=t.loss, catalogue=t.catalogue)


def concat_kjts(kjts: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    """Concatenate along the batch axis; every input must have the same keys in the same order."""
    keys = kjts[0].keys()
    for kjt in kjts[1:]:
        if kjt.keys() != keys:
            raise ValueError(f"cannot concatenate KeyedJaggedTensors with keys {kjt.keys()} and {keys}")
    lengths = torch.cat([k.lengths().view(len(keys), -1) for k in kjts], 1).reshape(-1)
    # values are stored key-major: gather every batch's segment of key 0, then of key 1...
    per_key = [torch.split(k.values(), k.length_per_key()) for k in kjts]
    values = torch.cat([part[f] for f in range(len(keys)) for part in per_key]) if keys else torch.zeros(0, dtype=torch.int64)
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)


def concat_batches(batches: list[Batch]) -> Batch:
    """One batch holding the examples of ``batches`` in order. ``source`` is kept only when every batch has it."""
    if len(batches) == 1:
        return batches[0]
    names = list(batches[0].sequences)
    sources = [b.source for b in batches]
    return Batch(
        dense=torch.cat([b.dense for b in batches]),
        sparse=concat_kjts([b.sparse for b in batches]),
        sequences={
            name: EventSequence(
                ids=concat_kjts([b.sequences[name].ids for b in batches]),
                timestamps=torch.cat([b.sequences[name].timestamps for b in batches]),
            )
            for name in names
        },
        labels=torch.cat([b.labels for b in batches]),
        surface=torch.cat([b.surface for b in batches]),
        source=None if any(s is None for s in sources) else torch.cat(sources),
        next_items=_concat_targets([b.next_items for b in batches]),
        representations=_concat_representations(batches),
    )


def _concat_representations(batches: list[Batch]) -> dict[str, JaggedFloats]:
    names = sorted(batches[0].representations)
    if any(sorted(b.representations) != names for b in batches):
        raise ValueError(f"cannot concatenate batches with representation features "
                         f"{sorted({tuple(sorted(b.representations)) for b in batches})}")
    return {name: JaggedFloats(torch.cat([b.representations[name].values for b in batches]),
                               torch.cat([b.representations[name].lengths for b in batches])) for name in names}


def _concat_targets(targets: list[NextItemTargets | None]) -> NextItemTargets | None:
    if all(t is None for t in targets):
        return None
    first = targets[0]
    if any(t is None or t.every != first.every or t.loss != first.loss or (t.negatives is None) != (first.negatives is None)
           for t in targets):
        raise ValueError("cannot concatenate batches whose next-item targets differ in kind")
    return NextItemTargets(
        every=first.every, positives=torch.cat([t.positives for t in targets]),
        negatives=None if first.negatives is None else torch.cat([t.negatives for t in targets]),
        loss=first.loss, catalogue=first.catalogue,
    )
