"""One domain of a stream: the examples a per-domain model trains on."""

import itertools

import torch

from gem_data import SurfaceFilterStream, SyntheticConfig, SyntheticGenerator, SyntheticStream, concat_batches, select_examples
from gem_data.testing import equal_batches


def test_keeps_exactly_the_domains_examples_on_any_number_of_ranks():
    generator = SyntheticGenerator(SyntheticConfig(num_ads=2000, max_events=16))
    whole = list(itertools.islice(SyntheticStream(generator, 64), 5))
    one = list(itertools.islice(SurfaceFilterStream(SyntheticStream(generator, 64), (1,)), 5))
    for batch, kept in zip(whole, one):
        assert equal_batches(kept, select_examples(batch, (batch.surface == 1).nonzero().squeeze(1)))
    ranks = [SurfaceFilterStream(SyntheticStream(generator, 64), (1,), rank, 2) for rank in range(2)]
    for expected, *parts in itertools.islice(zip(one, *ranks), 5):
        assert equal_batches(concat_batches(parts), expected)


def test_resumes_from_the_inner_position():
    generator = SyntheticGenerator(SyntheticConfig(num_ads=2000, max_events=16))
    stream = SurfaceFilterStream(SyntheticStream(generator, 32), (0, 2))
    batches = iter(stream)
    for _ in range(3):
        next(batches)
    state = stream.state_dict()
    expected = next(batches)
    resumed = SurfaceFilterStream(SyntheticStream(generator, 32), (0, 2))
    resumed.load_state_dict(state)
    got = next(iter(resumed))
    assert equal_batches(got, expected) and set(got.surface.tolist()) <= {0, 2}
    assert torch.isin(got.surface, torch.tensor([0, 2])).all()


def test_a_rank_outside_the_world_is_refused_at_construction():
    import pytest

    generator = SyntheticGenerator(SyntheticConfig(seed=0))
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, world_size = 2\)"):
        SurfaceFilterStream(SyntheticStream(generator, 64), (1,), rank=2, world_size=2)


def test_global_batches_without_a_rank_s_share_are_skipped_and_counted():
    """A global batch keeping fewer of the domain's examples than ranks is skipped (no rank gets none): counted in the
    state (batches and the examples they held), which a resumed stream carries on."""
    from gem_data import BatchTable, TableStream

    generator = SyntheticGenerator(SyntheticConfig(num_ads=2000, max_events=16, num_surfaces=3))
    table = BatchTable(generator.batch(0, 60), generator.spec)
    kept_per_batch = [int((b.surface == 2).sum()) for b in TableStream(table, 6, shuffle=False, num_epochs=1)]
    for world in (1, 4):
        streams = [SurfaceFilterStream(TableStream(table, 6, shuffle=False, num_epochs=1), (2,), rank, world)
                   for rank in range(world)]
        steps = [sum(1 for _ in stream) for stream in streams]
        skipped = [k for k in kept_per_batch if k < world]
        assert steps == [len(kept_per_batch) - len(skipped)] * world
        assert all(s.skipped == {"batches": len(skipped), "examples": sum(skipped)} for s in streams)
    stream = SurfaceFilterStream(TableStream(table, 6, shuffle=False, num_epochs=1), (2,), 0, 4)
    batches = iter(stream)
    next(batches)
    state = stream.state_dict()
    resumed = SurfaceFilterStream(TableStream(table, 6, shuffle=False, num_epochs=1), (2,), 0, 4)
    resumed.load_state_dict(state)
    assert resumed.skipped == state["surface_filter_skipped"]
    sum(1 for _ in resumed)
    total = [k for k in kept_per_batch if k < 4]
    assert resumed.skipped == {"batches": len(total), "examples": sum(total)}
