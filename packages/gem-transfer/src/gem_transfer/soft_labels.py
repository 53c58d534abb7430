"""Offline distillation's store: a teacher's logits for every example of a training stream, in Parquet.

A finished teacher runs once over the student's training stream (``gem-trainer posttrain``) and its logits
are written per global batch (``step``), each row keyed by a fingerprint of its example. The student then
trains on true labels plus these stored labels (``gem-trainer distill``) without loading the teacher: the
teacher's cost is paid once, not in every student step of every student.

Rows are looked up by step and fingerprint, not by position, so any layout of a global batch over ranks
(slices, length balancing, mixing) finds its labels; an example the store does not hold for that step is
an error that names the step (the data, its order or the batch size changed since the store was written).

An example holds one query (pointwise: one logit per task) or several (retrieval with a query per history
event), each with ``width`` logits (retrieval: the positive and the sampled negatives); its row stores them
all, so the lookup of a batch returns one row of logits per query, in the batch's query order.

A retrieval teacher that scores the whole catalogue would store ``num_items`` logits per query (Amazon Beauty:
12,101 per query, ~6.3 GB for each pass over its 131k queries): a **top-k store** keeps, per query, the teacher's
``k`` best items other than the true next item and ``1 + k`` logits (the next item's, then theirs), where the
teacher's distribution carries nearly all of its mass; its lookup returns ``TopKLogits``. A top-k store with a
**tail** also keeps ``m`` items drawn uniformly from the rest of the catalogue per query, each standing for
``(num_items - 1 - k) / m`` items (its log in ``log_weights``): a softmax over the stored columns so weighted
estimates the teacher's softmax over the whole catalogue, where one over the top k alone sees only rivals the
teacher ranks above everything else (a model fitted to it learns nothing of the items far down the list, and a
fit of the teacher's sharpness against it comes out too flat).

Layout of a store folder: ``part-00000.parquet`` ... (columns ``step`` int64, ``fingerprint`` int64,
``logits`` list of float32, queries x ``width`` values, and in a top-k store ``items`` list of int32,
queries x ``top_k`` ids; each part holds whole steps, in order) and ``meta.json``, written last, which lists
the parts with their step ranges and row counts (and ``top_k``: null, or the items per query, k plus the tail;
``log_weights``: null, or one per logit column). A folder without ``meta.json`` is
incomplete. The writer fills a temporary sibling folder and renames it into place, so a
pass cut short leaves no store that looks complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils import _pytree as pytree
from torchrec import KeyedJaggedTensor

from gem_kunlun import Batch, segment_ids

from gem_transfer.durable import sync_file, sync_folder, write_json

# 2 added top-k stores (``items``, ``meta["top_k"]``), 3 their tails (``meta["log_weights"]``); older formats read
# as before (a reader of format 2 would take a tail for top items, so it refuses format 3)
FORMAT = 3
READABLE = (1, 2, 3)
META = "meta.json"


class SoftLabelError(ValueError):
    """A soft-label store is missing, incomplete, damaged or written for other examples; one line naming it."""


# -- example fingerprints ----------------------------------------------------------------------------------

def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_M1, _M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_K_VALUE, _K_POSITION, _K_FIELD = _signed(0x9E3779B97F4A7C15), _signed(0xC2B2AE3D27D4EB4F), _signed(0x165667B19E3779F9)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic): nearby inputs give unrelated outputs."""
    x = x ^ (x >> 30)
    x = x * _M1
    x = x ^ (x >> 27)
    x = x * _M2
    return x ^ (x >> 31)


def _fold_jagged(h: torch.Tensor, kjt: KeyedJaggedTensor, field: int) -> int:
    """Adds every key's bag (ids in order, and its length) of each row into ``h``; returns the next field number."""
    b, keys = h.numel(), len(kjt.keys())
    if not keys:
        return field
    values, lengths = kjt.values().long(), kjt.lengths().long()
    owner = segment_ids(lengths, values.numel())  # key-major bags: bag s is key s // b of row s % b
    position = torch.arange(values.numel()) - kjt.offsets()[owner]
    key = torch.div(owner, b, rounding_mode="floor")
    h.index_add_(0, owner % b, _mix(values * _K_VALUE + position * _K_POSITION + (key + field) * _K_FIELD))
    per_key = torch.arange(field, field + keys).unsqueeze(1)
    h += _mix(lengths.view(keys, b) * _K_VALUE + per_key * _K_FIELD + 1).sum(0)
    return field + keys


def _fold_rows(h: torch.Tensor, bits: torch.Tensor, field: int) -> int:
    """Adds each row of ``bits`` ``[B, C]`` (integers: float bit patterns) into ``h``, column by column."""
    columns = torch.arange(field, field + bits.shape[1])
    h += _mix(bits.long() * _K_VALUE + columns * _K_FIELD).sum(1)
    return field + bits.shape[1]


def queries_per_example(batch: Batch) -> torch.Tensor:
    """``[B]`` int64: the queries each example contributes to a model's output rows (retrieval with a query
    per history event: its events; otherwise one)."""
    targets = batch.next_items
    if targets is None or not targets.every:
        return torch.ones(batch.batch_size, dtype=torch.int64)
    (history,) = batch.sequences.values()
    return history.lengths().long()


def _fold_targets(h: torch.Tensor, batch: Batch, field: int, negatives: bool) -> int:
    """Adds each query's positive and (with ``negatives``) sampled negatives (retrieval) into its example's hash."""
    targets = batch.next_items
    if targets is None:
        return field
    queries = queries_per_example(batch)
    owner = segment_ids(queries, targets.positives.numel())
    position = torch.arange(owner.numel()) - (torch.cumsum(queries, 0) - queries)[owner]
    scored = targets.positives.long().view(-1, 1)
    if negatives and targets.negatives is not None:
        scored = torch.cat([scored, targets.negatives.long()], 1)
    columns = torch.arange(scored.shape[1]) * _K_POSITION
    per_query = _mix(scored * _K_VALUE + columns + torch.tensor(field) * _K_FIELD).sum(1)
    h.index_add_(0, owner, _mix(per_query + position * _K_POSITION))
    return field + 1


def example_fingerprints(batch: Batch, negatives: bool = True) -> torch.Tensor:
    """``[B]`` int64: a 64-bit hash of each example (its dense values, ids, events and their timestamps,
    labels, surface and retrieval candidates), the same wherever the example sits in a batch. CPU tensors.

    ``negatives=False`` leaves a retrieval example's sampled negatives out: the example itself, which each pass
    over the data meets with other negatives."""
    h = torch.zeros(batch.batch_size, dtype=torch.int64)
    field = _fold_rows(h, batch.dense.float().contiguous().view(torch.int32), 0)
    field = _fold_rows(h, batch.labels.float().contiguous().view(torch.int32), field)
    field = _fold_rows(h, batch.surface.long().view(-1, 1), field)
    field = _fold_jagged(h, batch.sparse, field)
    for name in sorted(batch.sequences):
        sequence = batch.sequences[name]
        field = _fold_jagged(h, sequence.ids, field)
        stamps = sequence.timestamps.double().contiguous().view(torch.int64)
        if stamps.numel():
            lengths = sequence.ids.lengths()[: batch.batch_size].long()  # every key of an event type has these
            owner = segment_ids(lengths, stamps.numel())
            h.index_add_(0, owner, _mix(stamps * _K_VALUE + torch.tensor(field) * _K_FIELD))
        field += 1
    _fold_targets(h, batch, field, negatives)
    return h


# -- top-k teacher logits (retrieval against the catalogue) --------------------------------------------------

@dataclass
class TopKLogits:
    """A retrieval teacher's scores, cut to what distillation needs, for ``Q`` queries:

    - ``items [Q, c]`` int64: the teacher's ``k`` highest-scored items other than the query's true next item,
      best first, then (with a tail) ``m = c - k`` items drawn from the rest of the catalogue;
    - ``logits [Q, 1 + c]`` float32: the teacher's logit of the true next item (column 0, as in a batch of
      sampled candidates), then those of ``items``;
    - ``log_weights [1 + c]`` float32 or None (no tail): the log of how many catalogue items each column stands
      for (0 for the next item and the top k), added to any softmax over the columns.
    """

    items: torch.Tensor
    logits: torch.Tensor
    log_weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.items.dim() != 2 or self.logits.shape != (self.items.shape[0], 1 + self.items.shape[1]):
            raise ValueError(f"TopKLogits: items {tuple(self.items.shape)} must be [Q, k] and logits "
                             f"{tuple(self.logits.shape)} [Q, 1 + k]")
        if self.log_weights is not None and tuple(self.log_weights.shape) != (self.logits.shape[1],):
            raise ValueError(f"TopKLogits: log_weights {tuple(self.log_weights.shape)} must be [{self.logits.shape[1]}]")

    @property
    def top_k(self) -> int:
        """Items per query (the top k and the tail)."""
        return self.items.shape[1]

    def to(self, device: torch.device, non_blocking: bool = False) -> "TopKLogits":
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return TopKLogits(move(self.items), move(self.logits), move(self.log_weights))


pytree.register_dataclass(TopKLogits)  # a model input: data-parallel wrappers move its tensors


def top_k_logits(catalogue_logits: torch.Tensor, positives: torch.Tensor, k: int, tail: int = 0,
                 generator: torch.Generator | None = None) -> TopKLogits:
    """``catalogue_logits [Q, num_items]`` (a teacher's score of every item per query) and ``positives [Q]``
    (each query's true next item) -> the positive's logit and the ``k`` best other items' (``TopKLogits``), and
    with ``tail`` that many more items per query drawn uniformly, without repeats, from the rest (``generator``)."""
    num_items = catalogue_logits.shape[-1]
    if not 1 <= k < num_items:
        raise ValueError(f"k must lie in [1, {num_items - 1}] (the catalogue's items but the next one), got {k}")
    pool = num_items - 1 - k
    if tail and not 1 <= tail <= pool:
        raise ValueError(f"the tail must lie in [1, {pool}] (the catalogue's items but the next one and the top {k}), got {tail}")
    scores = catalogue_logits.float()
    positive = scores.gather(1, positives.long().view(-1, 1))
    others = scores.scatter(1, positives.long().view(-1, 1), float("-inf"))  # the next item is column 0, not a rival
    best, items = others.topk(k, dim=1)
    if not tail:
        return TopKLogits(items, torch.cat([positive, best], 1))
    rest = torch.ones_like(scores).scatter_(1, positives.long().view(-1, 1), 0.0).scatter_(1, items, 0.0)
    drawn = torch.multinomial(rest, tail, replacement=False, generator=generator)
    log_weights = torch.cat([torch.zeros(1 + k), torch.full((tail,), math.log(pool / tail))])
    return TopKLogits(torch.cat([items, drawn], 1), torch.cat([positive, best, scores.gather(1, drawn)], 1), log_weights)


# -- writing -----------------------------------------------------------------------------------------------

class SoftLabelWriter:
    """Appends the teacher's logits of whole steps, in step order; ``close`` publishes the store.

    ``meta``: what the store was written for (teacher, features, batch size), kept in ``meta.json``.
    ``steps_per_part``: steps per Parquet file (a reader holds one part in memory at a time).
    """

    def __init__(self, folder: str | Path, meta: dict[str, Any], steps_per_part: int = 256) -> None:
        # NOTE: whether the store is a top-k store follows from the first ``append`` (with ``items`` or not)
        self.folder = Path(folder)
        if self.folder.exists():
            raise SoftLabelError(f"{self.folder} already exists: remove it or write the soft labels to another folder")
        self.staging = self.folder.with_name(f"{self.folder.name}.partial-{os.getpid()}")
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True)
        self.meta, self.steps_per_part = meta, steps_per_part
        self.width: int | None = None
        self.top_k: int | None = None
        self.log_weights: list[float] | None = None
        self.parts: list[dict[str, Any]] = []
        self._pending: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]] = []
        self._last_step = -1

    def append(self, step: int, fingerprints: torch.Tensor, logits: torch.Tensor | TopKLogits,
               queries: torch.Tensor | None = None) -> None:
        """Every example of global batch ``step``: ``fingerprints [N]``, ``logits [Q, width]`` (each example's
        queries in turn; a top-k store: ``TopKLogits`` of the Q queries) and ``queries [N]`` per example
        (None: one each)."""
        if step <= self._last_step:
            raise ValueError(f"steps are appended in increasing order: {step} after {self._last_step}")
        items, log_weights = None, None
        if isinstance(logits, TopKLogits):
            items, log_weights, logits = logits.items, logits.log_weights, logits.logits
            log_weights = None if log_weights is None else log_weights.tolist()
        top_k = None if items is None else items.shape[1]
        if self._last_step >= 0 and (top_k, log_weights) != (self.top_k, self.log_weights):
            raise ValueError(f"a store holds one kind of row: top-k {top_k} after {self.top_k}, or another tail")
        self.log_weights = log_weights
        queries = torch.ones(fingerprints.numel(), dtype=torch.int64) if queries is None else queries.long()
        if logits.dim() != 2 or logits.shape[0] != int(queries.sum()) or (self.width not in (None, logits.shape[1])):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {int(queries.sum())} queries x {self.width or 'a'} width")
        self.width, self.top_k = logits.shape[1], top_k
        self._pending.append((step, fingerprints.numpy().astype(np.int64), logits.float().numpy(), queries.numpy(),
                              None if items is None else items.numpy().astype(np.int32)))
        self._last_step = step
        if len(self._pending) >= self.steps_per_part:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        steps = np.concatenate([np.full(len(f), s, dtype=np.int64) for s, f, _, _, _ in self._pending])
        fingerprints = np.concatenate([f for _, f, _, _, _ in self._pending])
        queries = np.concatenate([q for _, _, _, q, _ in self._pending])
        columns = {"step": steps, "fingerprint": fingerprints,
                   "logits": _lists(np.concatenate([x.reshape(-1) for _, _, x, _, _ in self._pending]), queries * self.width,
                                    pa.float32())}
        if self.top_k is not None:
            columns["items"] = _lists(np.concatenate([i.reshape(-1) for *_, i in self._pending]), queries * self.top_k, pa.int32())
        name = f"part-{len(self.parts):05d}.parquet"
        pq.write_table(pa.table(columns), self.staging / name)
        sync_file(self.staging / name)
        self.parts.append({"file": name, "first_step": self._pending[0][0], "last_step": self._pending[-1][0],
                           "rows": len(steps)})
        self._pending = []

    def close(self) -> Path:
        """Writes the last part and ``meta.json`` and moves the store into place; returns its folder."""
        self._flush()
        meta = {"format": FORMAT, "width": self.width, "top_k": self.top_k, "log_weights": self.log_weights,
                "steps": self._last_step + 1,
                "rows": sum(p["rows"] for p in self.parts), "parts": self.parts, **self.meta}
        write_json(self.staging / META, meta)
        # the parts and meta.json are on disk before the store's name is, and the name before the pass returns
        sync_folder(self.staging)
        try:
            self.staging.rename(self.folder)
        except OSError as error:  # another pass into the same folder finished first
            self.abort()
            raise SoftLabelError(f"{self.folder}: could not be put in place ({error.strerror}): another pass wrote it "
                                 f"meanwhile; choose another folder") from None
        sync_folder(self.folder.parent)
        return self.folder

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def _check_listing(meta: dict, meta_path: Path) -> None:
    """A ``SoftLabelError`` naming ``meta_path`` unless its width, steps and parts are a store's listing: a positive
    width, parts (file, first step, rows) whose first steps count up from 0 and cover the recorded steps."""
    def whole(value, low: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= low

    width, steps, parts = meta["width"], meta["steps"], meta["parts"]
    if not whole(width, 1) or not whole(steps, 1):
        raise SoftLabelError(f"{meta_path}: width {width!r} and steps {steps!r} must be positive integers")
    if not isinstance(parts, list) or not parts or not all(
            isinstance(p, dict) and isinstance(p.get("file"), str) and whole(p.get("first_step"), 0) and whole(p.get("rows"), 0)
            for p in parts):
        raise SoftLabelError(f"{meta_path}: parts must list each part's file, first_step and rows")
    firsts = [p["first_step"] for p in parts]
    if firsts[0] != 0 or any(a >= b for a, b in zip(firsts, firsts[1:])) or firsts[-1] >= steps:
        raise SoftLabelError(f"{meta_path}: the parts' first steps {firsts} do not count up from 0 within its {steps} steps")


def _lists(values: np.ndarray, sizes: np.ndarray, kind: pa.DataType) -> pa.ListArray:
    """A Parquet list column: row i holds the next ``sizes[i]`` of ``values``."""
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, kind))


# -- reading -----------------------------------------------------------------------------------------------

class SoftLabelStore:
    """The stored logits of a store folder, looked up per step by example fingerprint."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        meta_path = self.folder / META
        if not self.folder.is_dir():
            raise SoftLabelError(f"{self.folder}: no soft-label store there (write one with `gem-trainer posttrain`)")
        if not meta_path.is_file():
            raise SoftLabelError(f"{self.folder}: incomplete soft-label store (no {META}): write it again with `gem-trainer posttrain`")
        try:
            self.meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as error:
            raise SoftLabelError(f"{meta_path}: not valid JSON ({error})") from None
        if not isinstance(self.meta, dict):
            raise SoftLabelError(f"{meta_path}: not a soft-label store's meta (a JSON object)")
        if self.meta.get("format") not in READABLE:
            raise SoftLabelError(f"{meta_path}: store format {self.meta.get('format')!r}, this gem-transfer reads {READABLE}")
        missing = [key for key in ("width", "steps", "parts") if key not in self.meta]
        if missing:  # (a LoopFM representation store, which posttrain writes beside soft labels, has none of them)
            raise SoftLabelError(f"{meta_path}: not a soft-label store (no {', '.join(missing)}); a LoopFM representation "
                                 f"store is read through loopfm.store")
        _check_listing(self.meta, meta_path)
        self.width, self.steps = int(self.meta["width"] or 0), int(self.meta["steps"])
        self.top_k: int | None = self.meta.get("top_k")
        weights = self.meta.get("log_weights")
        self.log_weights = None if weights is None else torch.tensor(weights, dtype=torch.float32)
        self._first_steps = [p["first_step"] for p in self.meta["parts"]]
        self._held: tuple | None = None  # part index, steps, fingerprints, value offsets, values, item values
        # NOTE: every part's footer is read now (a few KiB each): a part missing or cut short is found before training,
        # not when the run reaches its steps after checkpoints were written
        for part in self.meta["parts"]:
            path = self.folder / part["file"]
            try:
                rows = pq.read_metadata(path).num_rows
            except (OSError, pa.ArrowException) as error:
                raise SoftLabelError(f"{path}: unreadable soft-label part ({error})") from None
            if rows != part["rows"]:
                raise SoftLabelError(f"{path}: {rows} rows where {META} records {part['rows']}")

    def _part(self, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        index = int(np.searchsorted(self._first_steps, step, side="right")) - 1
        if self._held is None or self._held[0] != index:
            part = self.meta["parts"][index]
            path = self.folder / part["file"]
            try:
                table = pq.read_table(path)
                steps = table["step"].to_numpy()
                fingerprints = table["fingerprint"].to_numpy()
                logits = table["logits"].combine_chunks()
                offsets = logits.offsets.to_numpy().astype(np.int64)
                values = logits.values.to_numpy()
                items = None if self.top_k is None else table["items"].combine_chunks().values.to_numpy()
            except (OSError, pa.ArrowException, KeyError, ValueError) as error:
                raise SoftLabelError(f"{path}: unreadable soft-label part ({error})") from None
            if len(steps) != part["rows"]:
                raise SoftLabelError(f"{path}: {len(steps)} rows where {META} records {part['rows']}")
            if (offsets % self.width).any():
                raise SoftLabelError(f"{path}: rows whose logits are not whole queries of the {self.width} {META} records")
            if items is not None and len(items) != len(values) // self.width * self.top_k:
                raise SoftLabelError(f"{path}: {len(items)} top-k items for {len(values) // self.width} queries of {self.top_k}")
            self._held = (index, steps, fingerprints, offsets, values, items)
        return self._held[1:]

    def lookup(self, step: int, fingerprints: torch.Tensor) -> torch.Tensor | TopKLogits:
        """``[Q, width]`` float32: the teacher's logits of the examples ``fingerprints [N]`` of global batch
        ``step``, each example's queries in turn (one row each for pointwise examples); a top-k store returns
        them as ``TopKLogits`` (``logits [Q, 1 + k]``, ``items [Q, k]``, and its tail's ``log_weights``)."""
        if not 0 <= step < self.steps:
            raise SoftLabelError(f"{self.folder}: holds steps 0..{self.steps - 1}, asked for step {step}")
        steps, stored, offsets, values, items = self._part(step)
        lo, hi = np.searchsorted(steps, step, side="left"), np.searchsorted(steps, step, side="right")
        order = np.argsort(stored[lo:hi], kind="stable")
        ranked = stored[lo:hi][order]
        wanted = fingerprints.numpy()
        found = np.minimum(np.searchsorted(ranked, wanted), max(len(ranked) - 1, 0))
        if len(ranked) == 0 or not np.array_equal(ranked[found], wanted):
            missing = int((ranked[found] != wanted).sum()) if len(ranked) else len(wanted)
            raise SoftLabelError(f"{self.folder}: {missing} of step {step}'s {len(wanted)} examples have no stored labels "
                                 f"(the data, its order or the batch size changed since the store was written)")
        rows = lo + order[found]
        starts, sizes = offsets[rows], offsets[rows + 1] - offsets[rows]
        # each wanted row's values, in the order asked: its start repeated over its size, plus 0, 1, ...
        first = np.repeat(starts - (np.cumsum(sizes) - sizes), sizes)
        positions = first + np.arange(int(sizes.sum()))
        logits = torch.from_numpy(values[positions].reshape(-1, self.width).copy())
        if items is None:
            return logits
        # the items of a query sit at the same place as its logits, less its positive's column
        query = positions.reshape(-1, self.width)[:, 0] // self.width
        ids = items[(query[:, None] * self.top_k + np.arange(self.top_k)).reshape(-1)]
        return TopKLogits(torch.from_numpy(ids.reshape(-1, self.top_k).astype(np.int64)), logits, self.log_weights)
