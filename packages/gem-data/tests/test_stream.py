import itertools

import pytest

from gem_data import SyntheticConfig, SyntheticGenerator, SyntheticStream, eval_batches


def fingerprint(batch) -> tuple:
    return tuple(batch.dense[:, 0].tolist())


@pytest.fixture(scope="module")
def generator():
    return SyntheticGenerator(SyntheticConfig(num_ads=2000, max_events=16))


def test_ranks_take_slices_of_the_global_batches_one_process_reads(generator):
    world = 3
    single = [fingerprint(b) for b in itertools.islice(SyntheticStream(generator, 8 * world), 4)]
    per_rank = [[fingerprint(b) for b in itertools.islice(SyntheticStream(generator, 8, r, world), 4)] for r in range(world)]
    assert [sum((per_rank[r][t] for r in range(world)), ()) for t in range(4)] == single
    assert all(len(per_rank[r][t]) == 8 for r in range(world) for t in range(4))


def test_resume_continues_at_the_exact_next_batch(generator):
    stream = SyntheticStream(generator, 8, rank=1, world_size=2)
    batches = iter(stream)
    for _ in range(5):
        next(batches)
    state = stream.state_dict()
    expected = [fingerprint(next(batches)) for _ in range(3)]
    resumed = SyntheticStream(generator, 8, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert [fingerprint(b) for b in itertools.islice(resumed, 3)] == expected


def test_resume_on_other_ranks_needs_the_same_global_batch(generator):
    stream = SyntheticStream(generator, 8, rank=0, world_size=2)
    with pytest.raises(ValueError, match="global batch"):
        SyntheticStream(generator, 8, rank=0, world_size=4).load_state_dict(stream.state_dict())
    SyntheticStream(generator, 4, rank=0, world_size=4).load_state_dict(stream.state_dict())


def test_eval_split_is_the_same_examples_on_any_number_of_ranks(generator):
    whole = [fingerprint(b) for b in eval_batches(generator, 16, 5)]
    parts = [[fingerprint(b) for b in eval_batches(generator, 8, 5, r, 2)] for r in range(2)]
    assert [parts[0][i] + parts[1][i] for i in range(5)] == whole


def test_numbered_streams_are_disjoint_views_of_the_same_data_set(generator):
    first = [fingerprint(b) for b in itertools.islice(SyntheticStream(generator, 8, stream=0), 3)]
    second = [fingerprint(b) for b in itertools.islice(SyntheticStream(generator, 8, stream=1), 3)]
    assert not set(first) & set(second)
    again = [fingerprint(b) for b in itertools.islice(SyntheticStream(generator, 8, stream=1), 3)]
    assert again == second
