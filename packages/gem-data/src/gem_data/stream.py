"""Batch streams: rank-sharded, worker-sharded, exactly resumable sequences of batches.

``SyntheticStream`` draws the synthetic data set; ``TableStream`` reads any ``ExampleTable`` (real files)
epoch after epoch. Both number global batches and shard them as ``ShardedStream`` describes.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch.utils.data import get_worker_info

from gem_kunlun import Batch, FeatureSpec, lengths_to_offsets

from gem_data.alignment import FeatureAlignment
from gem_data.batch_ops import concat_batches, select_examples
from gem_data.gathering import BatchView
from gem_data.source import ShardedStream
from gem_data.synthetic import SyntheticGenerator
from gem_data.table import ExampleTable


# rows a TableStream reads from its table at a time (several batches of a small batch size): a table read has a
# fixed cost (a few dozen small tensor operations assembling the batch) that these rows share; more rows per read
# gain little and, with long histories, cost more per row
READ_ROWS = 1024
# a torch.Generator's seeds: derived seeds are taken modulo this (a negative one seeds as its two's complement anyway)
SEED_RANGE = 1 << 64



class SyntheticStream(ShardedStream):
    """An endless stream of training batches for one rank.

    Rank ``r`` of ``world_size`` takes slice ``r`` of every global batch (see ``ShardedStream``): no two ranks
    see the same example and none is skipped. ``state_dict`` holds the position, so a restarted run
    continues at exactly the next batch. ``stream`` selects one of many disjoint streams of the same data set
    (same hidden ground truth, other examples): separate sources to mix, such as offline logs and a live stream.
    """

    def __init__(
        self, generator: SyntheticGenerator, batch_size: int, rank: int = 0, world_size: int = 1, stream: int = 0
    ) -> None:
        super().__init__(batch_size, rank, world_size)
        self.generator, self.stream = generator, stream  # the generator checks the stream's range

    @property
    def spec(self) -> FeatureSpec:
        return self.generator.spec

    def global_batch(self, index: int) -> Batch:
        # NOTE: a synthetic batch is one draw, so every rank draws the whole global batch and keeps its slice.
        return self.generator.batch(index, self.global_batch_size, split="train", stream=self.stream)


def eval_batches(generator: SyntheticGenerator, batch_size: int, num_batches: int, rank: int = 0, world_size: int = 1):
    """The held-out split: ``num_batches`` global batches of ``world_size * batch_size`` examples, this rank's
    slice of each. The examples are those of the global batch size: the same however it is split over ranks (the
    generator draws a batch whole, so another global batch size draws other examples)."""
    rows = torch.arange(batch_size * world_size).tensor_split(world_size)[rank]
    for index in range(num_batches):
        batch = generator.batch(index, batch_size * world_size, split="eval")
        yield batch if world_size == 1 else select_examples(batch, rows)


class _Read(NamedTuple):
    """One table read of several batches: whose (rank part, parts, stride between the batch indices), the first
    batch index, each batch's row span in the read, and the read."""

    whose: tuple[int, int, int]
    first: int
    spans: list[tuple[int, int]]
    view: BatchView


class TableStream(ShardedStream):
    """Batches of ``batch_size`` rows of ``table``, epoch after epoch (``num_epochs=None``: endless).

    The rows form one long sequence (epoch 0, then epoch 1, ...); global batch ``g`` is rows
    ``[g * G, (g + 1) * G)`` of it (``G = world_size * batch_size``) and each rank reads only its slice, so
    every batch is full except possibly the very last one of a finite stream, and batches straddle epochs
    rather than drop rows. With ``shuffle`` each epoch
    visits blocks in a seeded random order and groups in a seeded random order within each block; the order
    is a pure function of ``(seed, epoch)``, which makes the position alone a complete resumable state.

    Reading: a rank reads the rows of ``max(1, read_rows // batch_size)`` of its batches from the table at once
    (the batches it will deliver next: in a DataLoader worker, that worker's) and cuts its batches out of them;
    the batches are the same as read one by one (``read_rows=0``), only the table's fixed cost per read is shared.
    """

    def __init__(
        self,
        table: ExampleTable,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        num_epochs: int | None = None,
        read_rows: int = READ_ROWS,
    ) -> None:
        super().__init__(batch_size, rank, world_size)
        if read_rows < 0:
            raise ValueError(f"read_rows must be >= 0, got {read_rows}")
        self.table, self.shuffle, self.seed, self.num_epochs = table, shuffle, seed, num_epochs
        self.read_rows, self.batches_per_read = read_rows, max(1, read_rows // batch_size)
        self._stride = 1  # between the batch indices this reader delivers (DataLoader workers take turns)
        self._held: _Read | None = None  # the last read
        self._alignment: FeatureAlignment | None = None  # cuts batches out of a read (one id space: slicing only)
        self._sizes = torch.tensor(table.block_sizes(), dtype=torch.int64)
        self.rows_per_epoch = int(self._sizes.sum())
        if self.rows_per_epoch == 0:
            raise ValueError("the table holds no rows")
        if any(int(s) % table.group_size for s in self._sizes):
            raise ValueError(f"every block must hold a multiple of group_size={table.group_size} rows")
        self._orders: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # small LRU of permutations

    @property
    def spec(self) -> FeatureSpec:
        return self.table.spec

    def global_batch(self, index: int) -> Batch | None:
        return self._slice(index, 0, 1)

    def rank_batch(self, index: int) -> Batch | None:
        return self._slice(index, self.rank, self.world_size)

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        self._stride = 1 if info is None else info.num_workers
        return super().__iter__()

    def _positions(self, index: int, part: int, parts: int) -> torch.Tensor | None:
        """The row positions of part ``part`` of ``parts`` of global batch ``index`` (as ``ShardedStream.rank_batch``
        splits it), None past the end."""
        start, end = index * self.global_batch_size, (index + 1) * self.global_batch_size
        if self.num_epochs is not None:
            end = min(end, self.num_epochs * self.rows_per_epoch)
        if start >= end:
            return None
        return torch.arange(start, end).tensor_split(parts)[part]

    def _slice(self, index: int, part: int, parts: int) -> Batch | None:
        """Part ``part`` of ``parts`` of global batch ``index``: from the last read when it holds it, else from a
        read of this and the next batches this reader will deliver."""
        held, whose = self._held, (part, parts, self._stride)
        if held is not None and held.whose == whose:
            offset, remainder = divmod(index - held.first, self._stride)
            if not remainder and 0 <= offset < len(held.spans):
                return self._cut(held.view, *held.spans[offset])
        positions = self._positions(index, part, parts)
        if positions is None or self.batches_per_read == 1 or positions.numel() == 0:
            return None if positions is None else self._rows(positions)
        pieces = [positions]
        for ahead in range(1, self.batches_per_read):
            more = self._positions(index + ahead * self._stride, part, parts)
            if more is None or more.numel() == 0:
                break
            pieces.append(more)
        ends = list(itertools.accumulate(p.numel() for p in pieces))
        self._held = _Read(whose, index, list(zip([0, *ends[:-1]], ends)), BatchView(self._rows(torch.cat(pieces))))
        return self._cut(self._held.view, *self._held.spans[0])

    def _cut(self, view: BatchView, lo: int, hi: int) -> Batch:
        if self._alignment is None:
            self._alignment = FeatureAlignment({"table": self.spec}, {"table": ""})
        return self._alignment.gather([("table", view, lo, hi)])

    def _rows(self, positions: torch.Tensor) -> Batch:
        """The rows at ``positions`` of the endless shuffled row sequence (epoch 0, then epoch 1, ...)."""
        if positions.numel() == 0:  # a rank's empty share of a short final batch
            return self.table.take(0, positions, 0)
        return concat_batches([self.table.take(*read) for read in self._located(positions)])

    def _plans(self, positions: torch.Tensor) -> list:
        """The plans of the rows at ``positions`` (a ``PlannedTable``'s; see ``_rows``), one per table read."""
        return [self.table.plan(*read) for read in self._located(positions)]

    def _located(self, positions: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, int]]:
        """``(block, rows, epoch)`` of the table reads that give the rows at ``positions``, in order."""
        epochs = positions // self.rows_per_epoch
        for epoch in torch.unique_consecutive(epochs).tolist():
            in_epoch = positions[epochs == epoch] - epoch * self.rows_per_epoch
            blocks, block_start = self._block_order(epoch)
            slot = torch.searchsorted(block_start, in_epoch, right=True) - 1
            for s in torch.unique_consecutive(slot).tolist():
                block = int(blocks[s])
                offset = in_epoch[slot == s] - block_start[s]
                group = self.table.group_size
                yield block, self._group_order(epoch, block)[offset // group] * group + offset % group, epoch

    def _block_order(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("blocks", epoch)
        if key not in self._orders:
            n = self._sizes.numel()
            order = torch.randperm(n, generator=self._generator(epoch, -1)) if self.shuffle else torch.arange(n)
            self._remember(key, order)
        order = self._orders[key]
        return order, lengths_to_offsets(self._sizes[order])[:-1]

    def _group_order(self, epoch: int, block: int) -> torch.Tensor:
        key = ("groups", epoch, block)
        if key not in self._orders:
            n = int(self._sizes[block]) // self.table.group_size
            self._remember(key, torch.randperm(n, generator=self._generator(epoch, block)) if self.shuffle else torch.arange(n))
        return self._orders[key]

    def _remember(self, key: tuple, value: torch.Tensor) -> None:
        self._orders[key] = value
        while len(self._orders) > 8:
            self._orders.popitem(last=False)

    def _generator(self, epoch: int, block: int) -> torch.Generator:
        # NOTE: folded into the 64 bits a generator's seed holds (large run seeds overflowed it); every value below
        # 2**64 seeds as before
        return torch.Generator().manual_seed(((self.seed * 1_000_003 + epoch) * 1_000_033 + block + 1) % SEED_RANGE)
