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


def test_representation_features_survive_select_concat_and_rank_slicing():
    from gem_kunlun.testing import SPEC_WITH_REPRESENTATIONS

    from gem_data.source import ShardedStream

    batch = random_batch(10, seed=3, spec=SPEC_WITH_REPRESENTATIONS)
    rows = torch.tensor([7, 0, 0, 4])
    picked = select_examples(batch, rows)
    picked.validate(SPEC_WITH_REPRESENTATIONS)
    r, p = batch.representations["loopfm"], picked.representations["loopfm"]
    offsets = r.offsets()
    assert torch.equal(p.lengths, r.lengths[rows])
    assert torch.equal(p.values, torch.cat([r.values[offsets[i] : offsets[i + 1]] for i in rows.tolist()]))

    class Global(ShardedStream):
        spec = SPEC_WITH_REPRESENTATIONS

        def global_batch(self, index):
            return batch if index == 0 else None

    slices = [next(iter(Global(5, rank, 2))) for rank in range(2)]
    for part in slices:
        part.validate(SPEC_WITH_REPRESENTATIONS)
    assert equal_batches(concat_batches(slices), batch)
    assert not equal_batches(concat_batches(slices[::-1]), batch)
