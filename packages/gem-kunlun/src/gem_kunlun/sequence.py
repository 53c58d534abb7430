"""Jagged sequence plumbing: merging event types in time order (OneSeq), truncating, slicing, padding for dense
math. ``segment_ids`` (which sequence owns each row) and ``segment_positions`` (each row's place in it) come from
gem-kernels, the lowest package that needs them, and are re-exported here for the packages above."""

from __future__ import annotations

import torch

from gem_kernels.jagged import segment_ids, segment_positions  # noqa: F401 - segment_positions: re-exported


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, index):
        ctx.save_for_backward(index)
        ctx.rows = values.shape[0]
        return values.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        # every index names a row once: a whole permutation leaves no row unwritten, so nothing needs zeroing
        whole = index.numel() == ctx.rows
        out = (grad.new_empty if whole else grad.new_zeros)((ctx.rows, *grad.shape[1:]))
        return out.index_copy_(0, index, grad), None


def take_rows(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` for an ``index`` that names each row at most once (a permutation, a truncation): its
    backward copies each row's gradient to its one source row, where autograd's gather backward accumulates
    (sorting the index and adding atomically) into a zeroed buffer. A repeated index is not checked (that would
    read it back from the device): its rows' gradients would overwrite one another."""
    return _TakeRows.apply(values, index)


def merge_by_time(
    values: list[torch.Tensor], lengths: list[torch.Tensor], timestamps: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge several jagged event sequences into one, ordered by time within each example.

    ``values[e]`` is ``[T_e, D]``, ``lengths[e]`` is ``[B]``, ``timestamps[e]`` is ``[T_e]``. Returns the
    merged ``values [T, D]``, ``offsets [B+1]``, ``timestamps [T]`` and the event type index ``[T]`` of each
    merged event. Ties in time keep the order of the inputs. Runs as two stable sorts, no loop over examples.
    """
    device = values[0].device
    example = torch.cat([segment_ids(n, v.shape[0]) for n, v in zip(lengths, values)])
    event_type = torch.cat([torch.full((v.shape[0],), i, dtype=torch.int64, device=device) for i, v in enumerate(values)])
    time = torch.cat(timestamps)
    # NOTE: sort by time first, then stably by example: events end up grouped per example, in time order.
    by_time = torch.sort(time, stable=True).indices
    by_example = torch.sort(example[by_time], stable=True).indices
    order = by_time[by_example]
    merged_lengths = torch.stack(lengths, 0).sum(0)
    return take_rows(torch.cat(values), order), lengths_to_offsets(merged_lengths), time[order], event_type[order]


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values [T, ...]`` -> ``padded [B, max_len, ...]`` (zeros past each length) and ``mask [B, max_len]``.

    Sequences longer than ``max_len`` keep their most recent (last) ``max_len`` entries.
    """
    batch_size = offsets.numel() - 1
    lengths = offsets[1:] - offsets[:-1]
    kept = lengths.clamp(max=max_len)
    position = torch.arange(max_len, device=values.device)
    mask = position[None, :] < kept[:, None]
    # index of each padded slot in values: the last `kept` events of the example
    source = (offsets[1:] - kept)[:, None] + position[None, :]
    padded = values.new_zeros((batch_size, max_len) + values.shape[1:])
    padded[mask] = values[source[mask]]
    return padded, mask


def keep_latest(offsets: torch.Tensor, max_len: int, total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a jagged batch that keep each sequence's last ``max_len`` entries, and the new offsets.

    Returns ``(index [T'], offsets [B+1])`` so that ``values[index]`` is the truncated jagged tensor.
    ``total``: ``T'`` where the host knows it (see ``jagged_slices``).
    """
    kept = (offsets[1:] - offsets[:-1]).clamp(max=max_len)
    return jagged_slices(offsets[1:] - kept, kept, total)


def jagged_slices(starts: torch.Tensor, lengths: torch.Tensor, total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a jagged tensor that make sequence ``b`` of a new one from ``lengths[b]`` rows starting at row
    ``starts[b]`` (``starts``, ``lengths``: ``[B]``), and the new offsets.

    Returns ``(index [T'], offsets [B+1])`` so that ``values[index]`` is the new jagged tensor. ``total``:
    ``T' = lengths.sum()`` where the host knows it; otherwise it is read from the device, which waits for
    the device's queue (checked on the device when given).
    """
    new_offsets = lengths_to_offsets(lengths)
    if total is None:
        total = int(new_offsets[-1])
    else:
        torch._assert_async(new_offsets[-1] == total, "jagged_slices: the given total is not the lengths' sum")
    example = segment_ids(lengths, total)
    within = torch.arange(total, device=lengths.device) - new_offsets[:-1][example]
    return starts[example] + within, new_offsets
