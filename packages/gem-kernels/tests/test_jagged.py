"""The jagged index helpers against a loop over sequences."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gem_kernels.jagged import segment_ids, segment_positions


@settings(max_examples=40, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(0, 6), min_size=0, max_size=8))
def test_segment_ids_name_the_sequence_of_every_row(lengths):
    expected = torch.tensor([b for b, n in enumerate(lengths) for _ in range(n)], dtype=torch.int64)
    lengths = torch.tensor(lengths, dtype=torch.int64)
    assert torch.equal(segment_ids(lengths), expected)
    assert torch.equal(segment_ids(lengths, int(lengths.sum())), expected)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(0, 6), min_size=0, max_size=8))
def test_segment_positions_count_within_every_sequence(lengths):
    expected = torch.tensor([i for n in lengths for i in range(n)], dtype=torch.int64)
    lengths = torch.tensor(lengths, dtype=torch.int64)
    assert torch.equal(segment_positions(lengths), expected)
    assert torch.equal(segment_positions(lengths, int(lengths.sum())), expected)
