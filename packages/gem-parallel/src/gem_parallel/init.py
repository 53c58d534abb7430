"""Initialisation that does not depend on the parallel layout.

A model built on the meta device is materialised here with values that are a pure function of the seed
and of each tensor's name, never of the rank, the world size or the order in which ranks touch the
random number generator. The same seed therefore gives the same initial model on one process and on any
number of ranks sharded any way, which is what lets a multi-rank run be compared with a single process,
and what keeps replicas identical without a broadcast.

- Dense modules: each module's own parameters are created on the CPU and filled by its
  ``reset_parameters`` under a generator seeded by (seed, module name), then moved to the device.
- Embedding tables: rows are drawn in blocks of ``TABLE_BLOCK_ROWS``, block ``i`` of a table from a
  generator seeded by (seed, table, i), through the table's own ``init_fn``. A rank fills only the blocks
  its shard overlaps, so no rank ever materialises a whole large table.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn

TABLE_BLOCK_ROWS = 4096


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run's seed and a tensor's name (stable across processes and Python runs)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_dense_parameters(model: nn.Module, seed: int, device: torch.device) -> None:
    """Materialise every parameter and buffer of ``model`` still on the meta device (see the module docstring).

    Buffers are zero-filled; a module holding meta parameters without a ``reset_parameters`` is an error
    (it would otherwise train from uninitialised memory).
    """
    # NOTE: children before their parents, as a module built eagerly runs them (its children's constructors run
    # their resets before its own): a parent whose reset sets a child's values (an adapter's zeroed output layer)
    # would otherwise write into the child's meta tensors, and the child's own reset would follow
    for name, module in reversed(list(model.named_modules())):
        params = {k: p for k, p in module._parameters.items() if p is not None and p.is_meta}
        buffers = {k: b for k, b in module._buffers.items() if b is not None and b.is_meta}
        for key, buffer in buffers.items():
            module._buffers[key] = torch.zeros_like(buffer, device=device)
        if not params:
            continue
        if not hasattr(module, "reset_parameters"):
            raise TypeError(f"{name or 'the model'} ({type(module).__name__}) has parameters but no reset_parameters")
        for key, param in params.items():
            module._parameters[key] = nn.Parameter(torch.empty_like(param, device="cpu"), requires_grad=param.requires_grad)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(name_seed(seed, name))
            module.reset_parameters()
        for key in params:
            param = module._parameters[key]
            module._parameters[key] = nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)


def init_table_rows(
    weight: torch.Tensor, row_offset: int, col_offset: int, num_cols: int, init_fn: Callable[[torch.Tensor], object],
    seed: int, table: str,
) -> None:
    """Fill ``weight`` (rows ``[row_offset, row_offset + len)`` and columns ``[col_offset, col_offset + w)`` of
    a table of ``num_cols`` columns) with the values those rows take in the layout-independent initialisation."""
    rows = weight.shape[0]
    if rows == 0:
        return
    first, last = row_offset // TABLE_BLOCK_ROWS, (row_offset + rows - 1) // TABLE_BLOCK_ROWS
    for block in range(first, last + 1):
        start = block * TABLE_BLOCK_ROWS
        values = torch.empty(TABLE_BLOCK_ROWS, num_cols)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(name_seed(seed, f"{table}/{block}"))
            init_fn(values)
        lo, hi = max(start, row_offset), min(start + TABLE_BLOCK_ROWS, row_offset + rows)
        weight[lo - row_offset : hi - row_offset].copy_(
            values[lo - start : hi - start, col_offset : col_offset + weight.shape[1]]
        )
