"""Example tables: indexable collections of examples, split into blocks, that ``TableStream`` reads.

A block is the unit of locality (a Parquet row group, or the whole of an in-memory data set): a shuffled
epoch visits blocks in a random order and rows in a random order within each block, so a reader over
files holds one block in memory at a time. Rows come in groups of ``group_size`` that stay together (a
positive and its sampled negatives), so shuffling permutes groups.
"""

from __future__ import annotations

from typing import Protocol

import torch

from gem_kunlun import Batch, FeatureSpec

from gem_data.batch_ops import select_examples


class ExampleTable(Protocol):
    """``spec``; ``group_size``; ``block_sizes()`` rows per block (multiples of ``group_size``);
    ``take(block, rows [R], epoch)`` -> the batch of those rows (``epoch`` lets sampled parts vary by epoch)."""

    spec: FeatureSpec
    group_size: int

    def block_sizes(self) -> list[int]: ...

    def take(self, block: int, rows: torch.Tensor, epoch: int) -> Batch: ...


class JoinedTable(ExampleTable, Protocol):
    """A table whose reads can be joined with those of the tables it ``joins`` (e.g. two periods of one log):
    ``select(block, rows, epoch)`` says which examples the rows are (a NamedTuple of a few index vectors with a
    ``split(rows)`` into consecutive runs; ``join_selections`` concatenates them), and
    ``take_selected([selection, ...])`` assembles the rows of every selection, in order, as one batch: the batch
    that ``take`` of each selection and their concatenation would give, built in one pass. ``TableStream`` reads
    its rows so, and a mixture of joined tables builds each mixed batch so, without a copy per source."""

    def select(self, block: int, rows: torch.Tensor, epoch: int) -> object: ...

    def take_selected(self, selections: list) -> Batch: ...

    def joins(self, other: object) -> bool: ...


def join_selections(selections: list):
    """One selection of every row of ``selections`` (NamedTuples of one type whose fields are tensors or None),
    in order (one selection: as it is)."""
    if len(selections) == 1:
        return selections[0]
    return type(selections[0])(*(None if parts[0] is None else torch.cat(parts) for parts in zip(*selections)))


def joined(tables: list) -> bool:
    """Whether every table of ``tables`` is a ``JoinedTable`` that the first one ``joins``."""
    first = tables[0]
    return all(callable(getattr(t, "take_selected", None)) for t in tables) and all(first.joins(t) for t in tables[1:])


class BatchTable:
    """An in-memory table holding one big ``Batch`` (one block): for data that already fits in memory."""

    group_size = 1

    def __init__(self, batch: Batch, spec: FeatureSpec) -> None:
        batch.validate(spec)
        self.batch, self.spec = batch, spec

    def block_sizes(self) -> list[int]:
        return [self.batch.batch_size]

    def take(self, block: int, rows: torch.Tensor, epoch: int) -> Batch:
        return select_examples(self.batch, rows)
