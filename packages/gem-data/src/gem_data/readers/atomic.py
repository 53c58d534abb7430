"""RecBole atomic files: ``<name>.inter`` (required), ``<name>.user`` and ``<name>.item`` (optional).

Tab-separated, first line a typed header ``field:type`` with ``type`` one of ``token`` (one id),
``token_seq`` (space-separated ids), ``float``, ``float_seq``. The ``.inter`` file needs the user and item
fields; a ``timestamp`` float field orders each user's events (file order otherwise, and for ties).
Text is UTF-8; a cell's surrounding whitespace is not part of its value.
``.user`` / ``.item`` token and token_seq fields become id bags, float fields dense features; float_seq fields
have no place in the batch schema and are listed in ``ignored_fields``, as are the ``.inter`` fields other than the
user, the item and the time (a rating, say). A line repeating the header is a bad row; a row repeated whole is an
event twice (a repeat consumption).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from gem_kunlun import lengths_to_offsets, segment_positions

from gem_data.errors import BadRows, DataError
from gem_data.readers.text import text_lines
from gem_data.sequential.corpus import Bags, SequenceCorpus, vocabulary

TYPES = ("token", "token_seq", "float", "float_seq")


def read_atomic(
    directory: str | Path,
    name: str | None = None,
    user_field: str = "user_id",
    item_field: str = "item_id",
    time_field: str | None = None,
    skip_bad_rows: bool = False,
) -> SequenceCorpus:
    """Read ``directory/<name>.{inter,user,item}`` (``name`` defaults to the folder name) into a corpus.

    Users and items are those of the ``.inter`` file; ``.user``/``.item`` rows of others are ignored and
    entities without a row get empty bags and zero floats (an empty float cell of a row, a missing value, reads as
    zero too). ``time_field`` orders the events: by default ``timestamp`` where the header has it, file order where
    not; a field named here must be there. Bad rows (wrong column count, a float that is not a finite number, empty
    user, item or time) raise ``DataError`` naming file and line, or are counted with ``skip_bad_rows=True``; a bad
    header, a time field that is not float and bytes that are not UTF-8 always raise.
    """
    directory = Path(directory)
    name = name or directory.name
    bad = BadRows(skip=skip_bad_rows)
    inter_path = directory / f"{name}.inter"
    if not inter_path.is_file():
        raise DataError(inter_path, None, "interaction file not found")
    header, rows = _read_table(inter_path, bad)
    for required in (user_field, item_field):
        if header.get(required) != "token":
            raise DataError(inter_path, 1, f"header needs a {required}:token field, has {_describe(header)}")
    columns = list(header)
    u_col, i_col = columns.index(user_field), columns.index(item_field)
    if time_field is None:
        time_field = "timestamp" if "timestamp" in header else None
    elif time_field not in header:  # a misspelt name would quietly leave the events in file order
        raise DataError(inter_path, 1, f"header has no {time_field} field, has {_describe(header)}")
    if time_field is not None and header[time_field] != "float":
        kind = header[time_field]
        raise DataError(inter_path, 1, f"field {time_field!r} orders the events, so must be float, is {kind}")
    t_col = columns.index(time_field) if time_field is not None else None
    kept, kept_lines = [], []
    for number, row in rows:
        if not row[u_col] or not row[i_col]:
            bad.report(inter_path, number, f"empty {user_field} or {item_field}")
            continue
        if t_col is not None and not row[t_col]:
            bad.report(inter_path, number, f"empty {time_field}")
            continue
        kept.append(row)
        kept_lines.append(number)
    if not kept:
        raise DataError(inter_path, None, "no interactions" + (f" ({bad.count} bad rows skipped)" if bad.count else ""))
    user_tokens = vocabulary(r[u_col] for r in kept)
    item_tokens = vocabulary(r[i_col] for r in kept)
    user_index = {t: i for i, t in enumerate(user_tokens)}
    item_index = {t: i for i, t in enumerate(item_tokens)}
    users = torch.tensor([user_index[r[u_col]] for r in kept], dtype=torch.int64)
    items = torch.tensor([item_index[r[i_col]] for r in kept], dtype=torch.int64)
    times = torch.tensor([float(r[t_col]) for r in kept], dtype=torch.float64) if t_col is not None else None
    # by user, then time, then file order: two stable sorts
    order = torch.arange(len(kept))
    if times is not None:
        order = order[torch.sort(times[order], stable=True).indices]
    order = order[torch.sort(users[order], stable=True).indices]
    lengths = torch.bincount(users, minlength=len(user_tokens))
    if times is not None:
        timestamps = times[order] - times.min()
        # NOTE: the batches carry times as float32 (relative to the first event): a span past its range would be inf
        if float(timestamps.max()) > _FLOAT32_MAX:
            latest = int(times.argmax())
            raise DataError(inter_path, kept_lines[latest], f"{time_field} {kept[latest][t_col]} lies more than float32's "
                                                            f"largest value after the first event's")
    else:
        timestamps = segment_positions(lengths, len(kept)).double()
    corpus = SequenceCorpus(
        name=name,
        user_tokens=user_tokens,
        item_tokens=item_tokens,
        items=items[order],
        offsets=lengths_to_offsets(lengths),
        timestamps=timestamps,
        timed=times is not None,
    )
    # every .inter field but the user, the item and the time: the batch schema has no place for them
    ignored = [f"{inter_path.name}:{f}" for f in header if f not in (user_field, item_field, time_field)]
    for suffix, key, index, fields_attr, dense_attr in (
        ("user", user_field, user_index, "user_fields", "user_dense"),
        ("item", item_field, item_index, "item_fields", "item_dense"),
    ):
        path = directory / f"{name}.{suffix}"
        if path.is_file():
            fields, dense, skipped = _read_features(path, key, index, bad)
            setattr(corpus, fields_attr, fields)
            setattr(corpus, dense_attr, dense)
            ignored += skipped
    corpus.ignored_fields = ignored
    corpus.bad_rows, corpus.bad_row_examples = bad.count, bad.examples
    return corpus


def _describe(header: dict[str, str]) -> str:
    return " ".join(f"{k}:{v}" for k, v in header.items())


def _read_table(path: Path, bad: BadRows) -> tuple[dict[str, str], list[tuple[int, list[str]]]]:
    """The typed header and the ``(line number, cells)`` of every well-formed row."""
    lines = text_lines(path) or [""]
    header: dict[str, str] = {}
    for cell in lines[0].split("\t"):
        field, _, kind = cell.strip().partition(":")
        if kind not in TYPES or not field:
            raise DataError(path, 1, f"header cell {cell!r} is not field:type with type in {TYPES}")
        if field in header:
            raise DataError(path, 1, f"header names field {field!r} twice")
        header[field] = kind
    floats = [i for i, kind in enumerate(header.values()) if kind == "float"]
    header_cells = [cell.strip() for cell in lines[0].split("\t")]
    rows = []
    for number, line in enumerate(lines[1:], 2):
        if not line:
            continue
        # " 1" and "1" would be two users
        cells = [cell.strip() for cell in line.split("\t")]
        if cells == header_cells:  # files joined together: without a float field it would read as an interaction
            bad.report(path, number, "the header line is repeated")
            continue
        if len(cells) != len(header):
            bad.report(path, number, f"{len(cells)} columns, the header has {len(header)}")
            continue
        # float() takes "nan" and "inf": one NaN time would make every time NaN (times.min())
        wrong = next((i for i in floats if cells[i] and not _finite(cells[i])), None)
        if wrong is not None:
            bad.report(path, number, f"{cells[wrong]!r} in float field {list(header)[wrong]!r} is not a finite number")
            continue
        rows.append((number, cells))
    return header, rows


# a float cell in ASCII decimal notation: float() also takes "1_000" and other scripts' digits, which a mangled cell
# would be read as silently (the text reader refuses non-ASCII digits too)
_NUMBER = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?")
_FLOAT32_MAX = torch.finfo(torch.float32).max


def _finite(cell: str) -> bool:
    return _NUMBER.fullmatch(cell) is not None and math.isfinite(float(cell))


def _read_features(path: Path, key: str, index: dict[str, int], bad: BadRows):
    header, rows = _read_table(path, bad)
    if header.get(key) != "token":
        raise DataError(path, 1, f"header needs a {key}:token field, has {_describe(header)}")
    columns = list(header)
    k = columns.index(key)
    by_entity: dict[int, list[str]] = {}
    floats = [c for c, kind in enumerate(header.values()) if kind == "float"]
    for number, row in rows:
        if not row[k]:
            bad.report(path, number, f"empty {key}")
            continue
        entity = index.get(row[k])
        if entity is None:
            continue  # an entity without interactions has no place in the corpus
        # the features are float32 (the times of .inter float64)
        large = next((c for c in floats if row[c] and abs(float(row[c])) > _FLOAT32_MAX), None)
        if large is not None:
            bad.report(path, number, f"{row[large]!r} in float field {columns[large]!r} is out of float32 range")
            continue
        if entity in by_entity:
            bad.report(path, number, f"{key} {row[k]} appears on an earlier line too")
            continue
        by_entity[entity] = row
    if rows and not by_entity:
        # NOTE: its fields would be empty bags and zero floats for every entity, read as features without a word
        raise DataError(path, None, f"no row names a {key} of the interactions (e.g. {next(iter(index))!r}; this file's "
                                    f"first is {rows[0][1][k]!r})")
    n = len(index)
    fields, dense_columns, ignored = {}, [], []
    for c, (field, kind) in enumerate(header.items()):
        if c == k:
            continue
        if kind == "float":
            column = torch.zeros(n, 1)
            for entity, row in by_entity.items():
                column[entity, 0] = float(row[c]) if row[c] else 0.0
            dense_columns.append(column)
        elif kind == "float_seq":
            ignored.append(f"{path.name}:{field}")
        else:
            bags = {e: (row[c].split() if kind == "token_seq" else [row[c]] if row[c] else []) for e, row in by_entity.items()}
            tokens = vocabulary(t for bag in bags.values() for t in bag)
            if not tokens:
                ignored.append(f"{path.name}:{field}")
                continue
            token_index = {t: i for i, t in enumerate(tokens)}
            fields[field] = Bags.from_lists([[token_index[t] for t in bags.get(e, [])] for e in range(n)], len(tokens), tokens)
    dense = torch.cat(dense_columns, 1) if dense_columns else torch.zeros(n, 0)
    return fields, dense, ignored
