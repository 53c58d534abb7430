import itertools

import pytest
import torch
from gem_kunlun.testing import SPEC, random_batch

from gem_data import (BatchSource, BatchTable, NextItemConfig, NextItemDataset, ShardedStream, SyntheticConfig, SyntheticGenerator,
                      SyntheticStream, TableStream, WorkerLoader)
from gem_data.testing import equal_batches, example_fingerprints, small_corpus


@pytest.fixture(scope="module")
def table():
    return BatchTable(random_batch(50, seed=4), SPEC)


def rows_of(batches):
    return [row for b in batches for row in example_fingerprints(b)]


def test_one_epoch_visits_every_row_once_in_a_seeded_order(table):
    first = rows_of(TableStream(table, 8, num_epochs=1, seed=1))
    assert sorted(first) == sorted(example_fingerprints(table.batch)) and len(first) == 50
    assert first == rows_of(TableStream(table, 8, num_epochs=1, seed=1))
    assert first != rows_of(TableStream(table, 8, num_epochs=1, seed=2))
    assert rows_of(TableStream(table, 8, num_epochs=1, shuffle=False)) == example_fingerprints(table.batch)


def test_ranks_split_each_global_batch_into_slices_of_what_one_process_reads(table):
    world = 3
    single = [example_fingerprints(b) for b in TableStream(table, 8 * world, num_epochs=2)]
    per_rank = [[example_fingerprints(b) for b in TableStream(table, 8, rank=r, world_size=world, num_epochs=2)]
                for r in range(world)]
    # step t of rank r is slice r of step t of the single process, the short last batch included
    assert all(len(p) == len(single) for p in per_rank)
    for t, whole in enumerate(single):
        assert [row for r in range(world) for row in per_rank[r][t]] == whole
    assert sum(len(b) for b in single) == 100 and len(single[-1]) == 100 - 4 * 24


def test_resume_continues_at_the_same_example_across_epochs(table):
    stream = TableStream(table, 16, rank=1, world_size=2)
    batches = iter(stream)
    for _ in range(3):  # 3 steps = rows 16..31, 48..63, 80..95 of the sequence: past the first epoch
        next(batches)
    state = stream.state_dict()
    expected = rows_of(itertools.islice(batches, 3))
    resumed = TableStream(table, 16, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert rows_of(itertools.islice(resumed, 3)) == expected


def test_every_stream_is_a_batch_source(table):
    generator = SyntheticGenerator(SyntheticConfig(num_ads=2000, max_events=16))
    for stream in (TableStream(table, 4), SyntheticStream(generator, 4), WorkerLoader(TableStream(table, 4))):
        assert isinstance(stream, BatchSource)
        next(iter(stream)).validate(stream.spec)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_dataloader_workers_reproduce_the_single_process_sequence_and_resume(table):
    single = rows_of(itertools.islice(TableStream(table, 8, rank=1, world_size=2), 9))
    loader = WorkerLoader(TableStream(table, 8, rank=1, world_size=2), num_workers=2)
    batches = iter(loader)
    first = rows_of(itertools.islice(batches, 5))
    state = loader.state_dict()
    del batches
    assert first == single[: 5 * 8] and state["position"] == 5
    resumed = WorkerLoader(TableStream(table, 8, rank=1, world_size=2), num_workers=3)
    resumed.load_state_dict(state)
    assert rows_of(itertools.islice(resumed, 4)) == single[5 * 8 :]


def test_bad_table_arguments_are_rejected(table):
    with pytest.raises(ValueError, match="rank"):
        TableStream(table, 8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        TableStream(table, 0)
    with pytest.raises(ValueError, match="global batch"):
        TableStream(table, 8, world_size=2).load_state_dict(TableStream(table, 8).state_dict())
    # the same global batch on another number of ranks resumes
    TableStream(table, 8, world_size=2).load_state_dict(TableStream(table, 16).state_dict())
    assert torch.equal(next(iter(TableStream(table, 50, shuffle=False))).dense, table.batch.dense)


def _batches(stream, steps):
    return [b for b in itertools.islice(stream, steps)]


@pytest.mark.parametrize("read_rows", [0, 8, 20, 1024])
def test_reading_several_batches_at_once_gives_the_same_batches(table, read_rows):
    """Batches cut out of a read of several (the default) equal batches read one by one, field by field: on
    every rank, across epochs, with a short last batch and empty rank slices."""
    from gem_data.testing import equal_batches

    for world, batch in ((1, 8), (3, 8), (4, 13)):
        for rank in range(world):
            one_by_one = _batches(TableStream(table, batch, rank, world, num_epochs=3, read_rows=0), 100)
            several = _batches(TableStream(table, batch, rank, world, num_epochs=3, read_rows=read_rows), 100)
            assert len(several) == len(one_by_one) >= 3
            assert all(equal_batches(a, b) for a, b in zip(several, one_by_one))


def test_reading_ahead_serves_random_access_and_resumes_exactly(table):
    from gem_data.testing import equal_batches

    plain, ahead = TableStream(table, 6, read_rows=0), TableStream(table, 6, read_rows=30)
    for index in (4, 5, 3, 20, 9, 9, 0):  # inside, before and after what the last read holds
        assert equal_batches(ahead.rank_batch(index), plain.rank_batch(index))
    stream = TableStream(table, 6, read_rows=30)
    batches = iter(stream)
    for _ in range(7):
        next(batches)
    resumed = TableStream(table, 6, read_rows=30)
    resumed.load_state_dict(stream.state_dict())
    assert all(equal_batches(a, b) for a, b in zip(_batches(resumed, 4), _batches(batches, 4)))
    with pytest.raises(ValueError, match="read_rows must be >= 0"):
        TableStream(table, 6, read_rows=-1)


def test_next_item_tables_read_several_batches_at_once_give_the_same_batches(tmp_path):
    """The real readers' tables (pointwise with sampled negatives, retrieval with targets) read ahead the same."""
    from gem_data import NextItemConfig, NextItemDataset
    from gem_data.testing import equal_batches, small_corpus

    corpus = small_corpus(tmp_path, "tiny", users=60, items=40, attributes=True)
    for config in (NextItemConfig(num_negatives=2), NextItemConfig(objective="retrieval", queries="every")):
        table = NextItemDataset(corpus, config).training_table()
        one_by_one = _batches(TableStream(table, 16, read_rows=0, num_epochs=2), 100)
        several = _batches(TableStream(table, 16, num_epochs=2), 100)
        assert len(several) == len(one_by_one) > 4
        for a, b in zip(several, one_by_one):
            assert equal_batches(a, b)
            if b.next_items is not None:
                assert torch.equal(a.next_items.positives, b.next_items.positives)


def test_a_ranks_empty_share_of_a_short_last_batch_validates():
    """The last global batch of a finite stream may hold fewer rows than ranks: a rank's empty share is a 0-row
    batch, which validates (its key split failed inside torchrec)."""
    stream = TableStream(BatchTable(random_batch(13), SPEC), 4, rank=2, world_size=3, num_epochs=1)
    batches = list(stream)
    assert batches[-1].batch_size == 0
    for batch in batches:
        batch.validate(SPEC)


class _FailingAt(SyntheticStream):
    """A synthetic stream whose reader fails at global batch ``at`` (a bad row's error, or one that cannot be
    pickled)."""

    def __init__(self, generator, at: int, error: Exception) -> None:
        super().__init__(generator, 4)
        self.at, self.error = at, error

    def global_batch(self, index):
        if index == self.at:
            raise self.error
        return super().global_batch(index)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_a_workers_error_reaches_the_reader_as_it_was_raised_after_the_batches_before_it():
    """The DataLoader re-raises a worker's error as its type built from the worker's traceback (many lines), or as
    a RuntimeError where the type takes other arguments (DataError): the reader's one-line error is kept whole."""
    from gem_data import DataError

    generator = SyntheticGenerator(SyntheticConfig())
    bad = DataError("/data/part-3.parquet", 17, "label.click is 0.5, not 0 or 1")
    delivered = []
    with pytest.raises(DataError) as error:
        for batch in WorkerLoader(_FailingAt(generator, 3, bad), num_workers=2):
            delivered.append(batch)
    assert str(error.value) == "/data/part-3.parquet:17: label.click is 0.5, not 0 or 1" and len(delivered) == 3

    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("not picklable")

    with pytest.raises(RuntimeError, match=r"^Unpicklable: held a lock$"):
        list(WorkerLoader(_FailingAt(generator, 1, Unpicklable("held a lock")), num_workers=2))


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_dataloader_workers_hand_over_whole_batches_and_each_its_catalogue_once(tmp_path):
    # a worker's batch crosses packed in one buffer and is rebuilt as views of it: every field as one process reads
    # it, the host-side counts taken, and the item catalogue every batch shares crossing once per worker
    corpus = small_corpus(tmp_path, "shop", 20, 30, True)
    data = NextItemDataset(corpus, NextItemConfig(num_negatives=2, objective="retrieval", queries="every"))
    single = list(itertools.islice(TableStream(data.training_table(), 6), 7))
    delivered = list(itertools.islice(WorkerLoader(TableStream(data.training_table(), 6), num_workers=2), 7))
    assert all(equal_batches(a, b) for a, b in zip(delivered, single, strict=True))
    assert all(b.next_items is not None and b.sparse._length_per_key is not None for b in delivered)
    catalogues = [b.next_items.catalogue for b in delivered]
    assert catalogues[0] is not None and len({id(c) for c in catalogues}) == 2  # one object per worker


class _Growing(ShardedStream):
    """Batch ``i`` holds ``4 + 3 * i`` random rows: each outgrows the buffers a worker packed the earlier ones in."""

    spec = SPEC

    def global_batch(self, index):
        return random_batch(4 + 3 * index, seed=index) if index < 24 else None


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_dataloader_workers_reuse_their_buffers_and_grow_them_with_the_batches():
    # 24 batches through 2 workers of 4 buffers each: every buffer reused, and replaced where a batch outgrows it
    single = list(_Growing(1))
    delivered = list(WorkerLoader(_Growing(1), num_workers=2, prefetch_factor=2))
    assert len(delivered) == len(single) == 24
    assert all(equal_batches(a, b) for a, b in zip(delivered, single, strict=True))
