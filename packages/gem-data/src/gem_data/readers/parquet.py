"""Parquet for users' own data, read in place one row group at a time.

Schema (one row = one example; column names carry the role):

| column | Arrow type | meaning |
|---|---|---|
| ``dense`` (optional) | ``list<float>`` or ``fixed_size_list<float>``, same length every row | non-sequence dense floats |
| ``sparse.<feature>`` | ``list<int64>`` (a bag) or ``int64`` (one id) | non-sequence sparse ids |
| ``event.<type>.<feature>`` | ``list<int64>`` | one id per event of ``<type>``; every feature of a type has the same length per row |
| ``event.<type>.timestamp`` | ``list<double>`` | event times (finite), non-decreasing within the row, same length |
| ``label.<task>`` | numeric or bool scalar in {0, 1} | one column per task, in file order |
| ``surface`` (optional) | integer scalar | surface / domain id (0 when absent) |

Vocabulary sizes are ``max id + 1`` over the file(s) unless ``vocab_sizes`` gives them or the file's
schema metadata ``gem.vocab_sizes`` (a JSON object, written by ``write_parquet``) does; ``num_surfaces``
is ``max + 1`` unless given. Batches' event times are seconds since ``time_base``, one value for all the
files, so float32 keeps their resolution: the earliest event time unless ``time_base`` or the schema
metadata ``gem.time_base`` (0 from ``write_parquet``, whose batches' times are float32 already) gives it.
Bad rows (nulls, negative ids, event features of unequal length, times unsorted or not finite, labels outside
{0, 1}, dense of the wrong width or not finite) raise ``DataError`` naming the file and 0-based row, or are counted and
skipped with ``skip_bad_rows=True``; a file that is not Parquet raises ``DataError`` naming it.
``write_parquet`` writes batches in this schema.
"""

from __future__ import annotations

import json
import math
from collections import Counter, OrderedDict
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torchrec import KeyedJaggedTensor

from gem_kunlun import Batch, EventSequence, EventType, FeatureSpec, SparseFeature, segment_ids

from gem_data.batch_ops import gather_jagged, select_examples
from gem_data.errors import BadRows, DataError


class ParquetTable:
    """An ``ExampleTable`` over Parquet files: one block per row group, decoded on demand (a few cached).

    Opening reads every row group once, to validate rows and size the vocabularies; ``bad_rows`` and
    ``bad_row_examples`` report what ``skip_bad_rows=True`` skipped.
    """

    group_size = 1

    def __init__(
        self,
        paths: str | Path | list[str | Path],
        skip_bad_rows: bool = False,
        vocab_sizes: dict[str, int] | None = None,
        num_surfaces: int | None = None,
        cache_row_groups: int = 2,
        time_base: float | None = None,
    ) -> None:
        self.paths = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
        if not self.paths:
            raise ValueError("ParquetTable needs at least one file")
        first_file = _open(self.paths[0])
        self.layout = _Layout.of(self.paths[0], first_file.schema_arrow)
        if self.layout.has_dense and self.layout.num_dense is None:
            # NOTE: a plain list column fixes the width by the commonest of its first row group (the first
            # row's would make one bad first row blame every other); rows of another width are bad rows
            widths = Counter()
            if first_file.num_row_groups:
                first = _row_group(first_file, self.paths[0], 0, ["dense"]).column("dense")
                widths.update(pc.list_value_length(first).drop_null().to_pylist())
            self.layout.num_dense = widths.most_common(1)[0][0] if widths else 0
        bad = BadRows(skip=skip_bad_rows)
        self._groups: list[tuple[int, int]] = []  # (file, row group)
        self._valid_rows: list[torch.Tensor] = []  # kept rows of each row group
        maxima: dict[str, int] = {}
        max_surface = 0
        first_time = float("inf")
        for f, path in enumerate(self.paths):
            handle = _open(path)
            if f and not _Layout.of(path, handle.schema_arrow).same_columns(self.layout):
                raise DataError(path, None, f"columns differ from {self.paths[0]}")
            first_row = 0
            for g in range(handle.num_row_groups):
                decoded = self.layout.decode(_row_group(handle, path, g), path, first_row)
                for row, reason in decoded.problems:
                    bad.report(path, f"row {first_row + row}", reason)
                first_row += decoded.num_rows
                first_time = min(first_time, decoded.first_time)
                valid = decoded.valid.nonzero().squeeze(1)
                self._groups.append((f, g))
                self._valid_rows.append(valid)
                if valid.numel():
                    kept = select_examples(decoded.batch, valid)
                    for key, jt in list(kept.sparse.to_dict().items()) + [
                        (k, jt) for s in kept.sequences.values() for k, jt in s.ids.to_dict().items()
                    ]:
                        if jt.values().numel():
                            maxima[key] = max(maxima.get(key, 0), int(jt.values().max()))
                    max_surface = max(max_surface, int(kept.surface.max()))
        self.bad_rows, self.bad_row_examples = bad.count, bad.examples
        # files written by write_parquet carry their spec's vocabulary sizes; explicit arguments win
        metadata = first_file.schema_arrow.metadata or {}
        features = {*self.layout.sparse, *(n for fs in self.layout.events.values() for n in fs)}
        unknown = sorted(set(vocab_sizes or {}) - features)
        if unknown:  # a misspelt name would leave its feature sized by the file's own ids
            raise DataError(self.paths[0], None, f"vocab_sizes names features the files do not hold: {unknown} (they hold "
                                                 f"{sorted(features)})")
        vocab_sizes = {**json.loads(metadata.get(b"gem.vocab_sizes", b"{}")), **(vocab_sizes or {})}
        # one base for every file and row group: times of different examples stay comparable
        if time_base is None:
            time_base = float(metadata[b"gem.time_base"]) if b"gem.time_base" in metadata else first_time
        self.time_base = time_base if math.isfinite(time_base) else 0.0  # inf: the files hold no event

        def size(name: str) -> int:
            found = maxima.get(name, -1) + 1
            given = vocab_sizes.get(name)
            if given is not None and given < found:
                raise DataError(self.paths[0], None, f"{name}: id {found - 1} is past the vocabulary's {given} ids (given by "
                                                     f"vocab_sizes: the training data's, for a held-out file, or the files' "
                                                     f"gem.vocab_sizes metadata)")
            return max(given or found, 1)

        surfaces = max_surface + 1
        if num_surfaces is not None and num_surfaces < surfaces:
            raise DataError(self.paths[0], None, f"surface {max_surface} is past the {num_surfaces} surfaces given (the "
                                                 f"training data's, for a held-out file)")
        self.spec = FeatureSpec(
            num_dense=self.layout.num_dense or 0,
            sparse=tuple(SparseFeature(n, size(n)) for n in self.layout.sparse),
            events=tuple(EventType(t, tuple(SparseFeature(n, size(n)) for n in fs)) for t, fs in self.layout.events.items()),
            tasks=tuple(self.layout.labels),
            num_surfaces=num_surfaces or surfaces,
        )
        self._cache: OrderedDict[int, Batch] = OrderedDict()
        self._cache_size = cache_row_groups

    @property
    def num_rows(self) -> int:
        return sum(v.numel() for v in self._valid_rows)

    def block_sizes(self) -> list[int]:
        return [v.numel() for v in self._valid_rows]

    def rebase(self, time_base: float) -> None:
        """Read event times as seconds since ``time_base`` from now on: tables on one clock (the sources of a
        mixture, whose times a per-user memory compares across them)."""
        self.time_base = time_base
        self._cache.clear()

    def take(self, block: int, rows: torch.Tensor, epoch: int) -> Batch:
        if block not in self._cache:
            f, g = self._groups[block]
            table = _row_group(pq.ParquetFile(self.paths[f]), self.paths[f], g)  # (opened and checked at construction)
            decoded = self.layout.decode(table, self.paths[f], 0, self.time_base)
            self._cache[block] = select_examples(decoded.batch, self._valid_rows[block])
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(block)
        return select_examples(self._cache[block], rows)


class _Decoded:
    def __init__(self, batch: Batch, valid: torch.Tensor, problems: list[tuple[int, str]], first_time: float) -> None:
        self.batch, self.valid, self.problems, self.first_time = batch, valid, problems, first_time
        self.num_rows = valid.numel()


class _Layout:
    """Which columns play which role, read from the Arrow schema."""

    def __init__(self, sparse, events, labels, has_dense, has_surface, num_dense) -> None:
        self.sparse, self.events, self.labels = sparse, events, labels
        self.has_dense, self.has_surface, self.num_dense = has_dense, has_surface, num_dense

    def same_columns(self, other: "_Layout") -> bool:
        return (self.sparse, self.events, self.labels, self.has_dense, self.has_surface) == (
            other.sparse, other.events, other.labels, other.has_dense, other.has_surface)

    @staticmethod
    def of(path: Path, schema: pa.Schema) -> "_Layout":
        sparse, events, labels = [], {}, []
        has_dense = has_surface = False
        num_dense = None
        for field in schema:
            name, kind = field.name, field.type
            if name == "dense":
                if not (pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind)) or not pa.types.is_floating(kind.value_type):
                    raise DataError(path, None, f"column 'dense' must be a list of floats, is {kind}")
                has_dense = True
                num_dense = kind.list_size if pa.types.is_fixed_size_list(kind) else None
            elif name == "surface":
                if not pa.types.is_integer(kind):
                    raise DataError(path, None, f"column 'surface' must be an integer, is {kind}")
                has_surface = True
            elif name.startswith("sparse."):
                if not (pa.types.is_integer(kind) or (pa.types.is_list(kind) and pa.types.is_integer(kind.value_type))):
                    raise DataError(path, None, f"column {name!r} must be an integer or a list of integers, is {kind}")
                sparse.append(name.removeprefix("sparse."))
            elif name.startswith("event."):
                parts = name.split(".")
                if len(parts) != 3 or not pa.types.is_list(kind):
                    raise DataError(path, None, f"column {name!r} must be event.<type>.<feature>, a list column")
                _, event, feature = parts
                events.setdefault(event, [])
                if feature == "timestamp":
                    if not pa.types.is_floating(kind.value_type) and not pa.types.is_integer(kind.value_type):
                        raise DataError(path, None, f"column {name!r} must be a list of numbers, is {kind}")
                else:
                    if not pa.types.is_integer(kind.value_type):
                        raise DataError(path, None, f"column {name!r} must be a list of integers, is {kind}")
                    events[event].append(feature)
            elif name.startswith("label."):
                if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
                    raise DataError(path, None, f"column {name!r} must be a number or bool, is {kind}")
                labels.append(name.removeprefix("label."))
            else:
                raise DataError(path, None, f"column {name!r} is none of dense, surface, sparse.*, event.*.*, label.*")
        names = set(schema.names)
        for event, features in events.items():
            if f"event.{event}.timestamp" not in names:
                raise DataError(path, None, f"event type {event!r} has no column event.{event}.timestamp")
            if not features:
                raise DataError(path, None, f"event type {event!r} has no id feature column")
        if not labels:
            raise DataError(path, None, "no label.<task> column")
        renamed = {e: tuple(f"{e}_{f}" for f in fs) for e, fs in events.items()}  # feature names unique across types
        # a sparse column and an event's feature, or two events' features, may still meet under one name
        columns = {s: f"sparse.{s}" for s in sparse}
        for e, fs in events.items():
            for f, name in zip(fs, renamed[e]):
                if name in columns:
                    raise DataError(path, None, f"columns {columns[name]} and event.{e}.{f} both become feature {name!r}")
                columns[name] = f"event.{e}.{f}"
        events = renamed
        return _Layout(tuple(sparse), events, tuple(labels), has_dense, has_surface, num_dense)

    def decode(self, table: pa.Table, path: Path, first_row: int, time_base: float = 0.0) -> _Decoded:
        """The row group as one batch (bad rows included but marked, times less ``time_base``) plus ``valid [n]``,
        the problems and the earliest event time of the valid rows (inf where none)."""
        n = table.num_rows
        bad = torch.zeros(n, dtype=torch.bool)
        problems: list[tuple[int, str]] = []

        def flag(mask: torch.Tensor, reason: str) -> None:
            for row in (mask & ~bad).nonzero().squeeze(1).tolist():
                problems.append((row, reason))
            bad.logical_or_(mask)

        def ids_column(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            values, lengths, nulls = _jagged(table.column(name), torch.int64)
            flag(nulls, f"null in {name}")
            owner = segment_ids(lengths)
            flag(torch.zeros(n, dtype=torch.bool).index_fill_(0, owner[values < 0], True), f"negative id in {name}")
            return values.clamp(min=0), lengths

        sparse_values, sparse_lengths = [], []
        for feature in self.sparse:
            v, l = ids_column(f"sparse.{feature}")
            sparse_values.append(v)
            sparse_lengths.append(l)
        sequences = {}
        for event, features in self.events.items():
            times, time_lengths, nulls = _jagged(table.column(f"event.{event}.timestamp"), torch.float64)
            flag(nulls, f"null in event.{event}.timestamp")
            values, lengths = [], []
            for feature in features:
                v, l = ids_column(f"event.{event}.{feature.removeprefix(event + '_')}")
                flag(l != time_lengths, f"event.{event}: {feature.removeprefix(event + '_')} and timestamp differ in length")
                values.append(v)
                lengths.append(l)
            owner = segment_ids(time_lengths)
            # NaN compares false, so the order check below would pass it
            flag(torch.zeros(n, dtype=torch.bool).index_fill_(0, owner[~times.isfinite()], True),
                 f"event.{event}.timestamp is not a finite number")
            same_owner = owner[1:] == owner[:-1]
            backwards = same_owner & (times[1:] < times[:-1])
            flag(torch.zeros(n, dtype=torch.bool).index_fill_(0, owner[1:][backwards], True), f"event.{event}.timestamp decreases")
            sequences[event] = (features, values, lengths, times, time_lengths)
        labels = []
        for task in self.labels:
            column = table.column(f"label.{task}")
            if pa.types.is_boolean(column.type):  # (a bool column fills its nulls with a bool only)
                column = column.cast(pa.int8())
            flag(_nulls(column), f"null in label.{task}")
            y = torch.from_numpy(column.fill_null(0).to_numpy(zero_copy_only=False).copy()).to(torch.float32)
            flag((y != 0) & (y != 1), f"label.{task} outside {{0, 1}}")
            labels.append(y)
        if self.has_surface:
            column = table.column("surface")
            flag(_nulls(column), "null in surface")
            surface = torch.from_numpy(column.fill_null(0).to_numpy(zero_copy_only=False).copy()).to(torch.int64)
            flag(surface < 0, "negative surface")
        else:
            surface = torch.zeros(n, dtype=torch.int64)
        if self.has_dense:
            values, lengths, nulls = _jagged(table.column("dense"), torch.float32)
            flag(nulls, "null in dense")
            owner = segment_ids(lengths)
            flag(torch.zeros(n, dtype=torch.bool).index_fill_(0, owner[~values.isfinite()], True), "dense is not a finite number")
            width = self.num_dense or 0
            flag(lengths != width, f"dense has a row width other than {width}")
        else:
            width = 0
        # Build a batch over all rows; bad rows are given harmless stand-ins so the structure stays valid.
        good = ~bad
        if self.has_dense:
            dense = torch.zeros(n, width)
            keep = torch.repeat_interleave(good, lengths)
            if width:
                dense[good] = values[keep].view(-1, width)
        else:
            dense = torch.zeros(n, 0)
        sparse = _kjt([f for f in self.sparse], sparse_values, sparse_lengths, good)
        built, first_time = {}, float("inf")
        for event, (features, values, lengths, times, time_lengths) in sequences.items():
            kept_times = times[torch.repeat_interleave(good, time_lengths)]
            if kept_times.numel():
                first_time = min(first_time, float(kept_times.min()))
            # float64 less the base, then float32: epoch seconds in float32 alone resolve only ~128 s
            built[event] = EventSequence(
                ids=_kjt(list(features), values, lengths, good), timestamps=(kept_times - time_base).float()
            )
        label_tensor = torch.stack(labels, 1) if labels else torch.zeros(n, 0)
        label_tensor[bad] = 0
        surface[bad] = 0
        batch = Batch(dense=dense, sparse=sparse, sequences=built, labels=label_tensor, surface=surface)
        return _Decoded(batch, good, sorted(problems), first_time)


def _open(path: Path) -> pq.ParquetFile:
    if not Path(path).is_file():
        raise DataError(path, None, "is a directory, not a file" if Path(path).is_dir() else "no such file")
    try:
        return pq.ParquetFile(path)
    except pa.ArrowInvalid as error:  # pyarrow's message does not name the file
        raise DataError(path, None, f"not a Parquet file ({str(error).splitlines()[0]})") from None
    except OSError as error:  # a damaged footer
        raise DataError(path, None, f"cannot be read ({str(error).splitlines()[0]})") from None


def _row_group(handle: pq.ParquetFile, path: Path, group: int, columns: list[str] | None = None) -> pa.Table:
    """Row group ``group`` of the file, a corrupt one a ``DataError`` naming the file and the group (pyarrow's
    OSError names neither)."""
    try:
        return handle.read_row_group(group, columns=columns)
    except (OSError, pa.ArrowException) as error:
        raise DataError(path, f"row group {group}", f"cannot be decoded ({str(error).splitlines()[0]})") from None


def _nulls(column: pa.ChunkedArray) -> torch.Tensor:
    return torch.from_numpy(column.is_null().to_numpy(zero_copy_only=False).copy())


def _jagged(column: pa.ChunkedArray, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A list (or scalar) column -> ``(values [T], lengths [n], rows with nulls [n] bool)``; nulls get length 0."""
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    n = len(array)
    row_null = torch.from_numpy(array.is_null().to_numpy(zero_copy_only=False).copy())
    if not (pa.types.is_list(array.type) or pa.types.is_fixed_size_list(array.type)):
        values = torch.from_numpy(array.fill_null(0).to_numpy(zero_copy_only=False).copy()).to(dtype)
        return values, torch.ones(n, dtype=torch.int64), row_null
    if pa.types.is_fixed_size_list(array.type):
        offsets_t = torch.arange(n + 1, dtype=torch.int64) * array.type.list_size
        inner = array.values.slice(array.offset * array.type.list_size, n * array.type.list_size)
    else:
        offsets_t = torch.from_numpy(array.offsets.to_numpy().copy()).to(torch.int64)
        inner = array.values.slice(int(offsets_t[0]), int(offsets_t[-1] - offsets_t[0]))
        offsets_t = offsets_t - offsets_t[0]
    lengths = offsets_t[1:] - offsets_t[:-1]
    value_null = torch.from_numpy(inner.is_null().to_numpy(zero_copy_only=False).copy())
    values = torch.from_numpy(inner.fill_null(0).to_numpy(zero_copy_only=False).copy()).to(dtype)
    owner = segment_ids(lengths)
    null = row_null.clone().index_fill_(0, owner[value_null], True)
    lengths = torch.where(row_null, torch.zeros_like(lengths), lengths)
    if bool(row_null.any()):
        values, _ = gather_jagged(values, offsets_t, torch.arange(n)[~row_null])
        full = torch.zeros(n, dtype=torch.int64)
        full[~row_null] = (offsets_t[1:] - offsets_t[:-1])[~row_null]
        lengths = full
    return values, lengths, null


def _kjt(keys: list[str], values: list[torch.Tensor], lengths: list[torch.Tensor], good: torch.Tensor) -> KeyedJaggedTensor:
    """A KJT over all rows where bad rows are emptied (their ids are dropped)."""
    kept_values, kept_lengths = [], []
    for v, l in zip(values, lengths):
        kept_values.append(v[torch.repeat_interleave(good, l)])
        kept_lengths.append(torch.where(good, l, torch.zeros_like(l)))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.cat(kept_values) if kept_values else torch.zeros(0, dtype=torch.int64),
        lengths=torch.cat(kept_lengths) if kept_lengths else torch.zeros(0, dtype=torch.int64),
    )


def vocab_sizes(spec: FeatureSpec) -> dict[str, int]:
    """Every sparse feature's vocabulary size, the event types' included: what ``gem.vocab_sizes`` records, and what
    ``ParquetTable(vocab_sizes=)`` takes to read held-out files with the training data's vocabularies."""
    return {f.name: f.num_embeddings for f in (*spec.sparse, *(f for e in spec.events for f in e.features))}


def write_parquet(batches: Iterable[Batch], spec: FeatureSpec, path: str | Path, row_group_size: int = 65_536) -> int:
    """Write ``batches`` in the schema above (one row per example, row groups of ``row_group_size`` rows);
    returns the number of rows written.

    Event features are named ``event.<type>.<feature>`` with the ``<type>_`` prefix of the spec's feature
    name removed when present, so the file reads back to the same names; the spec's vocabulary sizes go
    into the schema metadata.
    """
    writer, pending, total = None, [], 0

    def flush(final: bool) -> None:
        nonlocal pending
        table = pa.concat_tables(pending)
        whole = table.num_rows if final else (table.num_rows // row_group_size) * row_group_size
        if whole:
            writer.write_table(table.slice(0, whole), row_group_size=row_group_size)
        pending = [table.slice(whole)] if whole < table.num_rows else []

    try:
        for batch in batches:
            table = _to_arrow(batch, spec)
            if writer is None:
                metadata = {b"gem.vocab_sizes": json.dumps(vocab_sizes(spec)).encode(), b"gem.time_base": b"0"}
                writer = pq.ParquetWriter(str(path), table.schema.with_metadata(metadata))
            pending.append(table.replace_schema_metadata(writer.schema.metadata))
            total += batch.batch_size
            if sum(t.num_rows for t in pending) >= row_group_size:
                flush(final=False)
        if pending:
            flush(final=True)
    finally:
        if writer is not None:
            writer.close()
    return total


def _list_array(values: torch.Tensor, lengths: torch.Tensor) -> pa.ListArray:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets.numpy()), pa.array(values.numpy()))


def _to_arrow(batch: Batch, spec: FeatureSpec) -> pa.Table:
    columns: dict[str, pa.Array] = {}
    if spec.num_dense:
        columns["dense"] = pa.FixedSizeListArray.from_arrays(pa.array(batch.dense.float().reshape(-1).numpy()), spec.num_dense)
    for feature in spec.sparse:
        jt = batch.sparse[feature.name]
        columns[f"sparse.{feature.name}"] = _list_array(jt.values(), jt.lengths())
    for event in spec.events:
        seq = batch.sequences[event.name]
        for feature in event.features:
            jt = seq.ids[feature.name]
            columns[f"event.{event.name}.{feature.name.removeprefix(event.name + '_')}"] = _list_array(jt.values(), jt.lengths())
        columns[f"event.{event.name}.timestamp"] = _list_array(seq.timestamps.double(), seq.lengths())
    for t, task in enumerate(spec.tasks):
        columns[f"label.{task}"] = pa.array(batch.labels[:, t].float().numpy())
    columns["surface"] = pa.array(batch.surface.numpy())
    return pa.table(columns)
