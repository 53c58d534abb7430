"""LoopFM's representation store: the teacher's compact representation of every event it scored, per user.

In the teacher pass of ``gem-trainer posttrain`` every scored example (an event of its user) leaves a small
vector: a layer of the teacher (by default the representation its heads read) multiplied by a fixed random
projection to ``dim`` values (``random_projection``). Each row of the store is ``(user, time, step, row,
vector)``: the example's user id, its time (``example_times``), the global batch and the row within it
that produced it. A student later reads, for each of its examples, the representations of the same user
strictly before the example's time (``RepresentationStore.history``): a deep history memory of what the
foundation model made of the user's earlier events.

Writing is append-only and resumable. ``meta.json`` (what the pass is for: teacher, data, projection) is
written when the store is created; the rows go to Parquet parts of whole steps, each staged under a
temporary name and renamed into place; ``progress.json``, replaced atomically after every part, lists the
parts and the next step to write. A pass cut short at any point and run again with the same config keeps
the parts listed, removes anything else (a part that landed without its listing), and continues at the
next step: every example is written exactly once. ``progress.json`` says ``complete`` once the pass ended;
only a complete store can be read.

Memory bound: the history of an example is what a memory keeping the newest ``max_events`` representations
per user held just before the example's time, i.e. the user's newest ``max_events`` representations
strictly earlier. Reading it depends only on (user, time), never on the order or the batches in which the
student meets its examples, so a resumed student reads exactly what it would have read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from gem_kunlun import Batch, JaggedFloats

from gem_transfer.durable import replace_synced, write_json

FORMAT = 1
META, PROGRESS = "meta.json", "progress.json"


class RepresentationError(ValueError):
    """A representation store is missing, incomplete, damaged or written for another pass; one line naming it."""


def random_projection(in_width: int, out_width: int, seed: int) -> torch.Tensor:
    """``[in_width, out_width]`` float32: a Gaussian random projection with entries N(0, 1 / out_width), drawn
    from torch's CPU generator seeded with ``seed``, so every rank, machine and rerun gets the same matrix.
    It keeps distances between representations within a small factor (Johnson-Lindenstrauss) without
    training anything, and a store records its seed and widths."""
    if in_width < 1 or out_width < 1:
        raise ValueError(f"a projection needs positive widths, got {in_width} -> {out_width}")
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(in_width, out_width, generator=g, dtype=torch.float64) / math.sqrt(out_width)).float()


def example_times(batch: Batch) -> torch.Tensor:
    """``[B]`` float64: each example's time, the timestamp of its newest history event over every event type
    (the example happens right after it); NaN for an example without events, which has no time and
    neither writes nor reads representations. CPU tensors."""
    newest = torch.full((batch.batch_size,), float("nan"), dtype=torch.float64)
    for sequence in batch.sequences.values():
        lengths = sequence.lengths().cpu()
        has = lengths > 0
        last = sequence.timestamps.cpu().double()[(sequence.offsets().cpu()[1:] - 1)[has]]
        newest[has] = torch.fmax(newest[has], last)  # fmax: NaN (no time yet) loses to a number
    return newest


def example_users(batch: Batch, user_feature: str) -> torch.Tensor:
    """``[B]`` int64: the id of sparse feature ``user_feature``, which must hold exactly one id per example."""
    keys = batch.sparse.keys()
    if user_feature not in keys:
        raise RepresentationError(f"user feature {user_feature!r} is not among the batch's sparse features {keys}")
    jagged = batch.sparse[user_feature]
    lengths = jagged.lengths()
    if lengths.numel() and not bool((lengths == 1).all()):
        bad = int((lengths != 1).nonzero()[0])
        raise RepresentationError(f"user feature {user_feature!r} must hold one id per example; example {bad} has {int(lengths[bad])}")
    return jagged.values().cpu().long()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise RepresentationError(f"{path}: not readable as JSON ({error})") from None
    if not isinstance(value, dict):
        raise RepresentationError(f"{path}: expected a JSON object")
    return value


def _entry(record: dict[str, Any], key: str, path: Path) -> Any:
    """``record[key]`` of the JSON file at ``path``; a missing key is a one-line ``RepresentationError``."""
    try:
        return record[key]
    except (KeyError, TypeError):
        raise RepresentationError(f"{path}: no {key!r} entry (a damaged or foreign file)") from None


def _count(record: dict[str, Any], key: str, path: Path, low: int) -> int:
    """``record[key]``, an integer of at least ``low``; anything else is a one-line ``RepresentationError``."""
    value = _entry(record, key, path)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise RepresentationError(f"{path}: {key} is {value!r}, not an integer >= {low} (a damaged or foreign file)")
    return value


def _parts(progress: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    """The parts ``progress.json`` at ``path`` lists, each a record with its ``file`` name and ``rows`` count; any
    other shape is a one-line ``RepresentationError``."""
    parts = _entry(progress, "parts", path)
    if not isinstance(parts, list) or not all(isinstance(part, dict) for part in parts):
        raise RepresentationError(f"{path}: parts is {parts!r}, not a list of records (a damaged or foreign file)")
    for part in parts:
        if not isinstance(_entry(part, "file", path), str):
            raise RepresentationError(f"{path}: a part's file is {part['file']!r}, not a name (a damaged or foreign file)")
        _count(part, "rows", path, 0)
    return parts


def _differing(stored: dict[str, Any], meta: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two metadata records (nested records compared key by key)."""
    found = []
    for key in sorted(set(stored) | set(meta)):
        a, b = stored.get(key), meta.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found += _differing(a, b, f"{prefix}{key}.")
        elif a != b:
            found.append(f"{prefix}{key}")
    return found


class RepresentationWriter:
    """Appends each step's representations in step order; resumes a store cut short (module docstring).

    ``meta``: what the pass is for (teacher, data, projection, ``dim``), compared with a store being resumed.
    ``next_step``: the first step the store does not hold; ``append`` must be called from there on.
    """

    def __init__(self, folder: str | Path, meta: dict[str, Any], steps_per_part: int = 64) -> None:
        self.folder, self.steps_per_part = Path(folder), steps_per_part
        self.dim = int(meta["dim"])
        meta = {"format": FORMAT, **meta}
        if (self.folder / PROGRESS).is_file():
            stored = _read_json(self.folder / META) if (self.folder / META).is_file() else {}
            differing = _differing(stored, meta)
            if differing:
                raise RepresentationError(f"{self.folder} holds representations of another pass (differs in {', '.join(differing)}): "
                                          f"remove it or choose another folder")
            progress = _read_json(self.folder / PROGRESS)
            if progress.get("complete"):
                raise RepresentationError(f"{self.folder} is a complete representation store already: remove it or choose another folder")
            path = self.folder / PROGRESS
            self.parts, self.next_step = list(_parts(progress, path)), _count(progress, "next_step", path, 0)
            listed = {p["file"] for p in self.parts} | {META, PROGRESS}
            for stray in self.folder.iterdir():  # a part renamed into place whose listing never followed, staged files
                if stray.name not in listed:
                    stray.unlink()
            self.resumed = True
        else:
            found = {p.name for p in self.folder.iterdir()} if self.folder.exists() else set()
            # a pass stopped after writing meta.json, before its first progress.json, left this pass's meta (and
            # perhaps a staged file) alone: it starts over there
            started = found and found <= {META, META + ".tmp", PROGRESS + ".tmp"} and (self.folder / META).is_file() \
                and not _differing(_read_json(self.folder / META), meta)
            if found and not started:
                raise RepresentationError(f"{self.folder} exists and is not a representation store: remove it or choose another folder")
            self.folder.mkdir(parents=True, exist_ok=True)
            write_json(self.folder / META, meta)
            self.parts, self.next_step, self.resumed = [], 0, False
            self._publish(complete=False)
        self._pending: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []

    def append(self, step: int, users: torch.Tensor, times: torch.Tensor, vectors: torch.Tensor) -> None:
        """Global batch ``step``: ``users [N]`` int64, ``times [N]`` float64 (NaN: the row is not stored) and
        ``vectors [N, dim]`` of its examples in row order."""
        expected = self.next_step + len(self._pending)
        if step != expected:
            raise ValueError(f"representations are appended step after step: got step {step}, expected {expected}")
        if vectors.shape != (users.numel(), self.dim) or times.shape != users.shape:
            raise ValueError(f"vectors {tuple(vectors.shape)} and times {tuple(times.shape)} do not match "
                             f"{users.numel()} users x {self.dim} values")
        self._pending.append((step, users.cpu().numpy().astype(np.int64), times.cpu().double().numpy(), vectors.detach().float().cpu().numpy()))
        if len(self._pending) >= self.steps_per_part:
            self.flush()

    def flush(self) -> None:
        """Write the pending steps as one part and record it: from here a restarted pass continues after them."""
        if not self._pending:
            return
        steps = np.concatenate([np.full(len(u), s, dtype=np.int64) for s, u, _, _ in self._pending])
        rows = np.concatenate([np.arange(len(u), dtype=np.int64) for _, u, _, _ in self._pending])
        users = np.concatenate([u for _, u, _, _ in self._pending])
        times = np.concatenate([t for _, _, t, _ in self._pending])
        vectors = np.concatenate([v for _, _, _, v in self._pending]).reshape(-1)
        kept = ~np.isnan(times)
        flat = pa.FixedSizeListArray.from_arrays(pa.array(vectors, pa.float32()), self.dim).filter(pa.array(kept))
        table = pa.table({"user": users[kept], "time": times[kept], "step": steps[kept], "row": rows[kept], "vector": flat})
        name = f"part-{len(self.parts):05d}.parquet"
        staged = self.folder / f"{name}.tmp"
        pq.write_table(table, staged)
        replace_synced(staged, self.folder / name)  # on disk before progress.json lists it
        self.parts.append({"file": name, "first_step": self._pending[0][0], "last_step": self._pending[-1][0], "rows": int(kept.sum())})
        self.next_step = self._pending[-1][0] + 1
        self._pending = []
        self._publish(complete=False)

    def close(self) -> Path:
        """Write the last part and mark the store complete; returns its folder."""
        self.flush()
        self._publish(complete=True)
        return self.folder

    def _publish(self, complete: bool) -> None:
        write_json(self.folder / PROGRESS, {"parts": self.parts, "next_step": self.next_step, "complete": complete,
                                             "rows": sum(p["rows"] for p in self.parts)})


class RepresentationStore:
    """A complete store, held in memory sorted by (user, time): ``history`` answers which representations
    each example may read."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise RepresentationError(f"{self.folder}: no representation store there (write one with `gem-trainer posttrain`)")
        if not (self.folder / META).is_file() or not (self.folder / PROGRESS).is_file():
            raise RepresentationError(f"{self.folder}: not a representation store (no {META} or {PROGRESS})")
        self.meta, progress = _read_json(self.folder / META), _read_json(self.folder / PROGRESS)
        if self.meta.get("format") != FORMAT:
            raise RepresentationError(f"{self.folder / META}: store format {self.meta.get('format')!r}, this gem-transfer reads {FORMAT}")
        if not progress.get("complete"):
            raise RepresentationError(f"{self.folder}: incomplete representation store (the pass stopped before step "
                                      f"{progress.get('next_step')}): run `gem-trainer posttrain` again with the same config to finish it")
        self.dim, self.steps = _count(self.meta, "dim", self.folder / META, 1), _count(progress, "next_step", self.folder / PROGRESS, 0)
        users, times, order_keys, vectors = [], [], [], []
        for part in _parts(progress, self.folder / PROGRESS):
            path = self.folder / part["file"]
            try:
                table = pq.read_table(path)
                if table.num_rows != part["rows"]:
                    raise RepresentationError(f"{path}: {table.num_rows} rows where {PROGRESS} records {part['rows']}")
                column = table["vector"].combine_chunks()
                if not pa.types.is_fixed_size_list(column.type) or column.type.list_size != self.dim:
                    raise RepresentationError(f"{path}: vectors of type {column.type}, expected {self.dim} float32 values each")
                users.append(table["user"].to_numpy().astype(np.int64))
                times.append(table["time"].to_numpy().astype(np.float64))
                order_keys.append(table["step"].to_numpy().astype(np.int64) * (1 << 32) + table["row"].to_numpy().astype(np.int64))
                vectors.append(column.values.to_numpy(zero_copy_only=False).reshape(-1, self.dim))
            except (OSError, pa.ArrowException, KeyError, ValueError) as error:
                if isinstance(error, RepresentationError):
                    raise
                raise RepresentationError(f"{path}: unreadable representation part ({error})") from None
        user = np.concatenate(users) if users else np.zeros(0, np.int64)
        time = np.concatenate(times) if times else np.zeros(0)
        written = np.concatenate(order_keys) if order_keys else np.zeros(0, np.int64)
        # time order within a user; ties (one time, several events) in the order the pass met them
        order = np.lexsort((written, time, user))
        self.user, self.time = user[order], time[order]
        self.vectors = torch.from_numpy(np.concatenate(vectors)[order] if vectors else np.zeros((0, self.dim), np.float32))
        self.rows = len(order)
        self._users, self._user_start = np.unique(self.user, return_index=True)
        self._user_start = np.append(self._user_start, self.rows)
        # one sorted int64 key per row, (user rank, time rank): a binary search finds "this user, before t"
        self._times = np.unique(self.time)
        user_rank = np.searchsorted(self._users, self.user)
        self._stride = len(self._times) + 1
        self._keys = user_rank * self._stride + np.searchsorted(self._times, self.time)

    def history(self, users: torch.Tensor, times: torch.Tensor, max_events: int) -> JaggedFloats:
        """For examples ``users [B]`` at ``times [B]`` (float64; NaN: no time): the newest ``max_events``
        representations of each user strictly before its time, oldest first, as ``JaggedFloats`` (values
        ``[T, dim]``)."""
        users, times = users.cpu().numpy().astype(np.int64), times.cpu().double().numpy()
        index = np.minimum(np.searchsorted(self._users, users), max(len(self._users) - 1, 0))
        known = (self._users[index] == users) & ~np.isnan(times) if len(self._users) else np.zeros(len(users), bool)
        first = self._user_start[index]
        before = np.searchsorted(self._keys, index * self._stride + np.searchsorted(self._times, np.nan_to_num(times)), side="left")
        end = np.where(known, before, first)
        start = np.maximum(first, end - max_events)
        lengths = end - start
        # each example's rows [start, end), concatenated: its start repeated over its length, plus 0, 1, ...
        shift = torch.from_numpy(start - (np.cumsum(lengths) - lengths))
        picked = torch.repeat_interleave(shift, torch.from_numpy(lengths)) + torch.arange(int(lengths.sum()))
        return JaggedFloats(self.vectors[picked], torch.from_numpy(lengths).long())
