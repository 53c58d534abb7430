import torch
from gem_kunlun.testing import SPEC, random_batch

from gem_data import concat_batches, select_examples
from gem_data.testing import equal_batches, example_fingerprints


def test_select_then_concat_rebuilds_the_batch():
    batch = random_batch(9, seed=1)
    parts = [select_examples(batch, torch.arange(0, 4)), select_examples(batch, torch.arange(4, 9))]
    whole = concat_batches(parts)
    whole.validate(SPEC)
    assert equal_batches(whole, batch)


def test_select_reorders_and_repeats_examples():
    batch = random_batch(6, seed=2)
    rows = torch.tensor([5, 0, 0, 3])
    picked = select_examples(batch, rows)
    picked.validate(SPEC)
    every = example_fingerprints(batch)
    assert example_fingerprints(picked) == [every[i] for i in rows.tolist()]
    assert torch.equal(picked.sequences["buy"].lengths(), batch.sequences["buy"].lengths()[rows])
