"""Sequential-recommendation text files: one user per line, ``user item item ...`` (items in time order),
with an optional ``item2attributes.json`` (``{"item": [attribute ids]}``), as in the SASRec / S3-Rec Beauty data.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import torch

from gem_kunlun import lengths_to_offsets, segment_positions

from gem_data.errors import BadRows, DataError
from gem_data.sequential.corpus import Bags, SequenceCorpus, vocabulary


def read_sequence_text(
    path: str | Path, attributes_path: str | Path | None = None, skip_bad_rows: bool = False
) -> SequenceCorpus:
    """Read ``path`` (and the attribute file) into a ``SequenceCorpus``.

    Ids must be non-negative integers, written in decimal; leading zeros do not matter (``01`` is ``1``).
    Blank lines are ignored. A bad line (a non-integer token, a user without items, a user seen twice)
    raises ``DataError`` naming file and line, or is counted and skipped with ``skip_bad_rows=True``; bytes
    that are not UTF-8 always raise. Items are those appearing in the sequences; attribute entries of other items
    are ignored. Timestamps are the positions ``0, 1, ...`` since the file has none.
    """
    path = Path(path)
    bad = BadRows(skip=skip_bad_rows)
    users: list[str] = []
    sequences: list[list[str]] = []
    seen: set[str] = set()
    for number, line in enumerate(text_lines(path), 1):
        tokens = line.split()
        if not tokens:
            continue
        # NOTE: isdecimal alone accepts other scripts' digits (and isdigit superscripts), which int() refuses
        wrong = next((t for t in tokens if not (t.isascii() and t.isdecimal())), None)
        if wrong is not None:
            bad.report(path, number, f"{wrong!r} is not a non-negative integer id")
            continue
        tokens = [_canonical(t) for t in tokens]
        if len(tokens) < 2:
            bad.report(path, number, f"user {tokens[0]} has no items")
            continue
        if tokens[0] in seen:
            bad.report(path, number, f"user {tokens[0]} appears on an earlier line too")
            continue
        seen.add(tokens[0])
        users.append(tokens[0])
        sequences.append(tokens[1:])
    if not users:
        raise DataError(path, None, "no users" + (f" ({bad.count} bad rows skipped)" if bad.count else ""))
    item_tokens = vocabulary(t for seq in sequences for t in seq)
    item_index = {t: i for i, t in enumerate(item_tokens)}
    items = torch.tensor([item_index[t] for seq in sequences for t in seq], dtype=torch.int64)
    lengths = torch.tensor([len(seq) for seq in sequences], dtype=torch.int64)
    offsets = lengths_to_offsets(lengths)
    positions = segment_positions(lengths, items.numel())
    item_fields = {}
    if attributes_path is not None:
        item_fields["attributes"] = _read_attributes(Path(attributes_path), item_index, bad)
    return SequenceCorpus(
        name=path.stem,
        user_tokens=users,
        item_tokens=item_tokens,
        items=items,
        offsets=offsets,
        timestamps=positions.double(),
        timed=False,
        item_fields=item_fields,
        bad_rows=bad.count,
        bad_row_examples=bad.examples,
    )


def _canonical(token: str) -> str:
    """One spelling per integer id, or ``01`` and ``1`` would be two items (and one user could appear twice)."""
    return token.lstrip("0") or "0"


def text_lines(path: Path) -> list[str]:
    """The lines of ``path`` split as Python's text files split them (``\\n``, ``\\r\\n`` or ``\\r``), decoded
    strictly as UTF-8 after a byte order mark, if any: a byte that is not UTF-8 raises ``DataError`` naming
    its line, where a lenient decode would make distinct ids one."""
    if not path.is_file():
        raise DataError(path, None, "is a directory, not a file" if path.is_dir() else "file not found")
    lines = []
    for number, raw in enumerate(path.read_bytes().removeprefix(codecs.BOM_UTF8).splitlines(), 1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as error:
            where = f"byte {raw[error.start]:#04x} at column {error.start + 1}"
            raise DataError(path, number, f"{where} is not UTF-8 text") from None
    return lines


class _JsonObject(list):
    """A JSON object's (key, value) pairs in file order, told apart from a JSON array (both would be lists)."""


def _read_attributes(path: Path, item_index: dict[str, int], bad: BadRows) -> Bags:
    try:
        # JSON counts lines at "\n" alone, so its line numbers stay those of the file
        # every (key, value) pair in file order: a key written twice would otherwise keep its last value silently
        pairs = json.loads("\n".join(text_lines(path)), object_pairs_hook=_JsonObject)
    except json.JSONDecodeError as error:
        raise DataError(path, error.lineno, f"invalid JSON: {error.msg}") from None
    if not isinstance(pairs, _JsonObject):
        raise DataError(path, None, "expected an object mapping item ids to lists of attribute ids")
    per_item: list[list[str]] = [[] for _ in item_index]
    given: set[str] = set()
    for key, values in pairs:
        # NOTE: JSON's true and false are Python ints too: no attribute id
        if (not isinstance(values, list) or isinstance(values, _JsonObject)
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)):
            bad.report(path, f"item {key}", f"attributes must be a list of non-negative integers, got {values!r}")
            continue
        if not (key.isascii() and key.isdecimal()):  # " 1", "2.0", "item_3" would name no item: its attributes lost
            bad.report(path, f"item {key!r}", "is not an item id (a non-negative integer)")
            continue
        item = _canonical(key)
        if item in given:
            bad.report(path, f"item {key}", f"item {item} is given attributes twice")
            continue
        given.add(item)
        if item in item_index:
            per_item[item_index[item]] = [str(v) for v in values]
    if not given.intersection(item_index):
        # another data set's file (or none of the items): the attribute feature would quietly be left out
        skipped = f"; {bad.count} bad rows skipped" if bad.count else ""
        raise DataError(path, None, f"no entry names an item of the sequences ({len(given)} entries{skipped})")
    attribute_tokens = vocabulary(t for bag in per_item for t in bag)
    attribute_index = {t: i for i, t in enumerate(attribute_tokens)}
    return Bags.from_lists([[attribute_index[t] for t in bag] for bag in per_item], len(attribute_tokens), attribute_tokens)
