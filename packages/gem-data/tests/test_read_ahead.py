import itertools
import threading
import time

import pytest

from gem_data import ReadAhead, SyntheticConfig, SyntheticGenerator, SyntheticStream
from gem_data.testing import FailingSource, equal_batches


@pytest.fixture(scope="module")
def generator():
    return SyntheticGenerator(SyntheticConfig(num_ads=2000, max_events=16))


def wait_until_read_ahead(stream: SyntheticStream, position: int) -> None:
    deadline = time.monotonic() + 30
    while stream.position < position:
        assert time.monotonic() < deadline, "the reading thread never read ahead"
        time.sleep(0.01)


def test_batches_arrive_in_the_order_of_the_source(generator):
    expected = list(itertools.islice(SyntheticStream(generator, 8, rank=1, world_size=2), 6))
    got = list(itertools.islice(ReadAhead(SyntheticStream(generator, 8, rank=1, world_size=2), depth=2), 6))
    assert all(equal_batches(a, b) for a, b in zip(got, expected, strict=True))


def test_state_is_the_last_delivered_batch_though_the_source_reads_ahead(generator):
    stream = SyntheticStream(generator, 8)
    reader = ReadAhead(stream, depth=3)
    batches = iter(reader)
    for _ in range(2):
        next(batches)
    wait_until_read_ahead(stream, 4)  # the thread fills its queue beyond what was delivered
    state = reader.state_dict()
    assert state["position"] == 2
    following = next(batches)

    resumed = ReadAhead(SyntheticStream(generator, 8), depth=3)
    resumed.load_state_dict(state)
    assert equal_batches(next(iter(resumed)), following)
    reader.close()
    resumed.close()


def test_a_new_iteration_continues_after_the_last_delivered_batch(generator):
    stream = SyntheticStream(generator, 8)
    expected = list(itertools.islice(SyntheticStream(generator, 8), 4))
    reader = ReadAhead(stream, depth=2)
    first = iter(reader)
    got = [next(first), next(first)]
    wait_until_read_ahead(stream, 3)
    got += list(itertools.islice(iter(reader), 2))  # nothing read ahead by the first iteration is skipped
    assert all(equal_batches(a, b) for a, b in zip(got, expected, strict=True))
    reader.close()
    assert stream.position == 4  # closing rewinds the source to what was delivered


def test_a_finite_source_ends_and_an_error_reaches_the_training_thread(generator):
    assert len(list(ReadAhead(FailingSource(generator, None, at=None, length=3)))) == 3
    batches = iter(ReadAhead(FailingSource(generator, ValueError("data.path: bad row at batch 2"))))
    next(batches), next(batches)
    with pytest.raises(ValueError, match="bad row at batch 2"):
        next(batches)


def test_observe_runs_on_the_reading_thread_and_is_delivered_with_its_batch(generator):
    stream = SyntheticStream(generator, 8)
    threads = set()

    def observe(batch):
        threads.add(threading.current_thread().name)
        return stream.position, batch.dense.sum().item()

    reader = ReadAhead(stream, depth=2, observe=observe)
    batches = iter(reader)
    for step in range(1, 4):
        batch = next(batches)
        assert reader.observed == (step, batch.dense.sum().item())  # observed of the batch it comes with
    assert threads == {"gem-read-ahead"}
    reader.close()


def test_depth_must_not_be_negative(generator):
    with pytest.raises(ValueError, match="depth must be >= 0"):
        ReadAhead(SyntheticStream(generator, 8), depth=-1)


@pytest.mark.parametrize("depth", [0, 2])
def test_an_observation_that_raises_leaves_the_state_at_the_batch_before(generator, depth):
    """Without a thread the state once moved to a batch before its observation ran: an observation that raised left
    the state one batch past the last delivered one (a rewind skipped that batch), unlike the thread's."""
    calls = []

    def observe(batch):
        calls.append(batch)
        if len(calls) == 3:
            raise ValueError("data: a bad batch")
        return len(calls)

    reader = ReadAhead(SyntheticStream(generator, 8), depth=depth, observe=observe)
    batches = iter(reader)
    next(batches), next(batches)
    with pytest.raises(ValueError, match="a bad batch"):
        next(batches)
    assert reader.state_dict()["position"] == 2 and reader.observed == 2
    reader.close()
