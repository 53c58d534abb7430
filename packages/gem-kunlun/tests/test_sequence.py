import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem_kunlun import jagged_slices, jagged_to_padded, lengths_to_offsets, merge_by_time


def merge_reference(values, lengths, timestamps):
    """One example at a time: concatenate its events of every type and sort them by time (stable)."""
    out_values, out_times, out_types, out_lengths = [], [], [], []
    offsets = [lengths_to_offsets(n) for n in lengths]
    for b in range(lengths[0].numel()):
        rows = []
        for e, (v, o, t) in enumerate(zip(values, offsets, timestamps)):
            for i in range(int(o[b]), int(o[b + 1])):
                rows.append((float(t[i]), e, i))
        rows.sort(key=lambda r: r[0])  # stable: ties keep type order, then position
        out_lengths.append(len(rows))
        for time, e, i in rows:
            out_values.append(values[e][i])
            out_times.append(time)
            out_types.append(e)
    dim = values[0].shape[1]
    merged = torch.stack(out_values) if out_values else torch.zeros(0, dim)
    return merged, lengths_to_offsets(torch.tensor(out_lengths)), torch.tensor(out_times), torch.tensor(out_types, dtype=torch.int64)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    batch_size=st.integers(1, 5),
    num_types=st.integers(1, 3),
    max_len=st.integers(0, 6),
    seed=st.integers(0, 10_000),
    integer_times=st.booleans(),
)
def test_merge_by_time_matches_per_example_sort(batch_size, num_types, max_len, seed, integer_times):
    g = torch.Generator().manual_seed(seed)
    lengths = [torch.randint(0, max_len + 1, (batch_size,), generator=g) for _ in range(num_types)]
    values, timestamps = [], []
    for n in lengths:
        total = int(n.sum())
        values.append(torch.randn(total, 3, generator=g))
        t = torch.randint(0, 5, (total,), generator=g).float() if integer_times else torch.rand(total, generator=g)
        # each input sequence is in time order within its example
        o = lengths_to_offsets(n)
        timestamps.append(torch.cat([t[o[i] : o[i + 1]].sort().values for i in range(batch_size)]))
    got = merge_by_time(values, lengths, timestamps)
    want = merge_reference(values, lengths, timestamps)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[2], want[2])
    assert torch.equal(got[3], want[3])
    assert torch.equal(got[0], want[0])


def test_jagged_to_padded_keeps_latest_events():
    values = torch.arange(10.0).view(10, 1)
    offsets = torch.tensor([0, 3, 3, 10])
    padded, mask = jagged_to_padded(values, offsets, max_len=4)
    assert mask.tolist() == [[True] * 3 + [False], [False] * 4, [True] * 4]
    assert padded[0, :3, 0].tolist() == [0.0, 1.0, 2.0]
    assert padded[2, :, 0].tolist() == [6.0, 7.0, 8.0, 9.0]  # the last 4 of 7 events
    assert float(padded[1].abs().sum()) == 0.0


@settings(max_examples=40, deadline=None, derandomize=True)
@given(slices=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 4)), min_size=0, max_size=6))
def test_jagged_slices_take_each_run_of_rows_in_order(slices):
    starts = torch.tensor([s for s, _ in slices], dtype=torch.int64)
    lengths = torch.tensor([n for _, n in slices], dtype=torch.int64)
    index, offsets = jagged_slices(starts, lengths)
    assert torch.equal(index, torch.tensor([s + i for s, n in slices for i in range(n)], dtype=torch.int64))
    assert torch.equal(offsets, lengths_to_offsets(lengths))


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), keep=st.floats(0.0, 1.0), seed=st.integers(0, 10_000))
def test_take_rows_is_indexing_forward_and_backward(rows, keep, seed):
    """A permutation (every row kept) or a truncation (some rows, each once): values and gradients equal those of
    plain indexing, rows not taken get a zero gradient."""
    from gem_kunlun.sequence import take_rows

    g = torch.Generator().manual_seed(seed)
    index = torch.randperm(rows, generator=g)[: max(0, round(keep * rows))]
    values = torch.randn(rows, 3, 2, generator=g, requires_grad=True)
    seed_grad = torch.randn(index.numel(), 3, 2, generator=g)
    got = take_rows(values, index)
    expected = values[index]
    assert torch.equal(got, expected)
    (grad_got,) = torch.autograd.grad(got, values, seed_grad)
    (grad_expected,) = torch.autograd.grad(expected, values, seed_grad)
    assert torch.equal(grad_got, grad_expected)
