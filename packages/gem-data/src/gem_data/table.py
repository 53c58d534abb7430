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


class PlannedTable(ExampleTable, Protocol):
    """A table whose ``take`` is two parts: ``plan(block, rows, epoch)`` finds the rows (cheap: indices, sampled
    parts; a plan has a ``len`` and is cut by row slices), ``assemble(plans)`` gathers the features of the rows of
    several plans into one batch, in order. Tables with the same ``assembler`` assemble each other's plans:
    ``MixedStream`` reads such sources' rows for a step straight into the mixed batch, with no copy of the rows."""

    assembler: object

    def plan(self, block: int, rows: torch.Tensor, epoch: int) -> object: ...

    def assemble(self, plans: list) -> Batch: ...


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
