import dataclasses
import gc
import itertools
import os
import signal

import pytest
import torch
from torchrec import KeyedJaggedTensor

from gem_data import (
    NextItemConfig,
    NextItemDataset,
    ProcessReadAhead,
    ReadAhead,
    SyntheticConfig,
    SyntheticGenerator,
    SyntheticStream,
    TableStream,
)
from gem_data.packing import Shared, describe, pack_into, unpack
from gem_data.testing import FailingSource, small_corpus


@pytest.fixture(scope="module")
def generator():
    return SyntheticGenerator(SyntheticConfig(num_ads=2000, max_events=16, num_users=50))


@pytest.fixture(scope="module")
def corpus_table(tmp_path_factory):
    """A next-item training table whose batches carry an item catalogue (one object in every batch)."""
    corpus = small_corpus(tmp_path_factory.mktemp("corpus"), "shop", 40, 30, attributes=True)
    return NextItemDataset(corpus, NextItemConfig(num_negatives=2, objective="retrieval")).training_table()


def assert_same(a, b) -> None:
    """Every tensor equal in dtype, shape and values, and everything else equal (host lengths, ids per key)."""
    (da, ta, _), (db, tb, _) = describe(a), describe(b)
    assert da.tree == db.tree
    assert len(ta) == len(tb)
    for x, y in zip(ta, tb):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def test_packing_round_trips_every_part_of_a_batch(generator, corpus_table):
    stream = TableStream(corpus_table, 8)
    batches = [*itertools.islice(SyntheticStream(generator, 16), 3), *itertools.islice(stream, 3)]
    batches[0].sequences[next(iter(batches[0].sequences))].host_lengths()  # a host fact that must travel too
    assert batches[-1].next_items.catalogue is not None
    shared, received = Shared(), {}
    for batch in batches:
        description, tensors, new = describe(batch, shared)
        received.update(new)
        buffer = torch.full((description.nbytes + 64,), 0xAB, dtype=torch.uint8)  # not zeros: gaps must not matter
        pack_into(buffer, description, tensors)
        rebuilt = unpack(buffer, description, received)
        assert_same(rebuilt, batch)
        # every tensor starts where a tensor of its own would: kernels read aligned inputs with vector loads
        assert all(t.data_ptr() % 16 == 0 for t in describe(rebuilt)[1])
        if batch.next_items is not None:
            assert rebuilt.next_items.catalogue is batch.next_items.catalogue  # shared, not copied
    assert len(received) == 1  # the catalogue went once, with the first batch that held it


def test_packing_refuses_a_short_buffer_and_an_unknown_shared_object(corpus_table):
    batch = next(iter(TableStream(corpus_table, 4)))
    description, tensors, new = describe(batch, Shared())
    with pytest.raises(ValueError, match=f"at least {description.nbytes} bytes"):
        pack_into(torch.empty(description.nbytes - 1, dtype=torch.uint8), description, tensors)
    buffer = torch.empty(description.nbytes, dtype=torch.uint8)
    pack_into(buffer, description, tensors)
    with pytest.raises(KeyError, match="never received"):
        unpack(buffer, description, {})


def test_batches_and_states_equal_the_threads(generator, corpus_table):
    for make in (lambda: SyntheticStream(generator, 8, rank=1, world_size=2), lambda: TableStream(corpus_table, 8, shuffle=True, seed=3)):
        expected_reader = ReadAhead(make(), depth=0)
        expected, states = [], []
        for batch in itertools.islice(iter(expected_reader), 7):  # the table stream passes its end (5 batches)
            expected.append(batch.count_on_host())  # as the reading process counts before packing
            states.append(expected_reader.state_dict())
        reader = ProcessReadAhead(make(), depth=2)
        for batch, want, state in zip(iter(reader), expected, states, strict=False):
            assert_same(batch, want)
            assert reader.state_dict() == state
        reader.close()


def device_tensors(batch) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a batch on any device, named by where it sits, in walk order (``describe`` packs host batches
    only)."""
    found = []

    def walk(obj, name: str) -> None:
        if isinstance(obj, torch.Tensor):
            found.append((name, obj))
        elif isinstance(obj, KeyedJaggedTensor):
            for part in ("values", "lengths", "weights_or_none"):
                walk(getattr(obj, part)(), f"{name}.{part}")
        elif dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name), f"{name}.{f.name}")
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{name}[{k!r}]")

    walk(batch, "batch")
    return found


def test_batches_handed_out_on_a_device_are_the_host_batches_moved_in_one_copy(generator, corpus_table):
    # on the meta device: where every tensor lands and what it is (nothing to copy); on the host: the values
    for make in (lambda: SyntheticStream(generator, 8), lambda: TableStream(corpus_table, 8, shuffle=True, seed=3)):
        expected = list(itertools.islice(make(), 4))
        for device in ("meta", "cpu"):
            reader = ProcessReadAhead(make(), depth=2, device=device)
            got = list(itertools.islice(iter(reader), 4))
            reader.close()
            for batch, want in zip(got, expected, strict=True):
                moved = want.to(torch.device(device))
                names = [(name, t.dtype, t.shape) for name, t in device_tensors(batch)]
                assert names == [(name, t.dtype, t.shape) for name, t in device_tensors(moved)]
                assert all(t.device.type == device for _, t in device_tensors(batch))
                if device == "cpu":
                    assert_same(batch, want.count_on_host())
                # the host facts travelled: nothing on the device is read back to size the step
                assert batch.sparse.length_per_key() == want.sparse.length_per_key()
                assert all(batch.sequences[k].host_lengths() == want.sequences[k].lengths().tolist() for k in want.sequences)
            catalogues = {id(batch.next_items.catalogue) for batch in got if batch.next_items is not None}
            assert len(catalogues) == (1 if expected[0].next_items is not None else 0)  # moved once, shared by all


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batches_handed_out_on_a_gpu_equal_the_host_batches_moved(generator, corpus_table):
    for make in (lambda: SyntheticStream(generator, 8), lambda: TableStream(corpus_table, 8, shuffle=True, seed=3)):
        expected = [batch.to(torch.device("cuda")) for batch in itertools.islice(make(), 4)]
        for reader in (ProcessReadAhead(make(), depth=2, pin=True, device="cuda"),
                       ReadAhead(make(), depth=2, pin=True, device="cuda")):
            got = list(itertools.islice(iter(reader), 4))
            reader.close()
            for batch, want in zip(got, expected, strict=True):
                pairs = list(zip(device_tensors(batch), device_tensors(want), strict=True))
                assert all(a.is_cuda and name == other and torch.equal(a, b) for (name, a), (other, b) in pairs)


def test_closing_rewinds_to_the_last_delivered_batch_and_resumes_there(generator):
    stream = SyntheticStream(generator, 8)
    # counted on the host as the reading process counts each batch before packing it
    expected = [batch.count_on_host() for batch in itertools.islice(SyntheticStream(generator, 8), 5)]
    reader = ProcessReadAhead(stream, depth=3)
    first = iter(reader)
    got = [next(first), next(first)]
    state = reader.state_dict()
    assert state["position"] == 2
    got += list(itertools.islice(iter(reader), 2))  # a new iteration: a new process, from the delivered batch on
    reader.close()
    assert stream.position == 4
    for a, b in zip(got, expected):
        assert_same(a, b)
    resumed = ProcessReadAhead(SyntheticStream(generator, 8), depth=2)
    resumed.load_state_dict(state)
    assert_same(next(iter(resumed)), expected[2])
    resumed.close()


def test_observe_runs_in_the_reading_process(generator):
    stream = SyntheticStream(generator, 8)
    reader = ProcessReadAhead(stream, depth=2, observe=lambda batch: (os.getpid(), stream.position, batch.dense.sum().item()))
    batches = iter(reader)
    for step in range(1, 4):
        batch = next(batches)
        pid, position, dense_sum = reader.observed
        assert pid != os.getpid() and position == step and dense_sum == batch.dense.sum().item()
    reader.close()


def test_an_error_of_the_source_and_a_dead_process_reach_the_training_process(generator):
    batches = iter(ProcessReadAhead(FailingSource(generator, ValueError("data.path: bad row at batch 2"))))
    next(batches), next(batches)
    with pytest.raises(ValueError, match="bad row at batch 2"):
        next(batches)

    reader = ProcessReadAhead(SyntheticStream(generator, 8), depth=1)
    batches = iter(reader)
    next(batches)
    os.kill(reader._process.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="reading process exited"):
        for _ in range(3):  # one batch may already wait in the pipe
            next(batches)
    reader.close()


def test_an_abandoned_reader_is_collected_quietly_and_its_process_stops(generator, monkeypatch):
    # a trainer that is never closed leaves its reader, iterator and pipe in one cycle of garbage: collected together
    raised = []
    monkeypatch.setattr("sys.unraisablehook", raised.append)
    reader = ProcessReadAhead(SyntheticStream(generator, 8), depth=2)
    batches = iter(reader)
    next(batches)
    process = reader._process
    reader.itself = reader  # the cycle
    del reader, batches
    gc.collect()
    process.join(5.0)
    assert not process.is_alive() and not raised


def test_a_finite_source_ends(corpus_table):
    stream = TableStream(corpus_table, 16, num_epochs=1)
    assert sum(1 for _ in ProcessReadAhead(stream)) == len(list(TableStream(corpus_table, 16, num_epochs=1)))


def test_depth_must_be_positive(generator):
    with pytest.raises(ValueError, match="depth must be >= 1"):
        ProcessReadAhead(SyntheticStream(generator, 8), depth=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_garbage_of_the_training_process_is_never_freed_in_the_reading_one(generator):
    # a forked process aborts where it frees GPU memory: cyclic garbage holding some (a closed trainer's) must be
    # collected before the fork, not by the reading process's collections (here forced after every batch)
    class Cycle:
        pass

    garbage = Cycle()
    garbage.itself, garbage.memory = garbage, torch.ones(1 << 20, device="cuda")
    del garbage
    reader = ProcessReadAhead(SyntheticStream(generator, 8), depth=2, observe=lambda batch: gc.collect())
    batches = iter(reader)
    for _ in range(4):
        next(batches)
    reader.close()


def test_a_data_error_reaches_the_training_process_whole_and_a_stale_iterator_ends(generator):
    """DataError pickles as its class called with its text, which its __init__ does not take: the reader got a
    TypeError in its place (the file and row lost). An iterator kept after a new one once read the new one's pipe."""
    from gem_data import DataError

    batches = iter(ProcessReadAhead(FailingSource(generator, DataError("/data/train.parquet", "row group 3", "negative item id"))))
    next(batches), next(batches)
    with pytest.raises(DataError, match=r"^/data/train.parquet:row group 3: negative item id$") as error:
        next(batches)
    assert (error.value.path, error.value.where) == ("/data/train.parquet", "row group 3")

    def host_batch(index):  # counted on the host, as the reading process counts each batch before packing it
        return generator.batch(index, 8).count_on_host()

    reader = ProcessReadAhead(SyntheticStream(generator, 8), depth=2)
    first = iter(reader)
    next(first)
    second = iter(reader)  # the first iterator's process stops, the source rewinds to batch 1
    assert_same(next(second), host_batch(1))
    with pytest.raises(StopIteration):
        next(first)  # it ends: the batches are the newer iterator's
    assert_same(next(second), host_batch(2))
    reader.close()
