"""Solaris: the in-process cache, the fallback order, expiry and staleness, the worker (each pair once), the keys,
the nearest-neighbour index and the report."""

import threading

import numpy as np
import pytest
import torch
from torchrec import KeyedJaggedTensor

from gem_kunlun.testing import random_batch
from gem_transfer import example_times
from gem_transfer.solaris import (
    LEVELS,
    CacheEntry,
    CacheError,
    DefaultEmbedding,
    FallbackLookup,
    LookupStats,
    MemoryCache,
    PrecomputeWorker,
    UserIndex,
    behaviour_vectors,
    format_summary,
    pair_keys,
)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def entry(user, item, group, timestamp, value):
    return CacheEntry(user, item, group, timestamp, np.full(4, value, np.float32))


def with_shop(batch):
    """``batch`` with a single-id ``shop`` feature (the ad's group: ad // 5) beside its ``ad``."""
    parts = batch.sparse.to_dict()
    ad = parts["ad"]
    shop = KeyedJaggedTensor.from_lengths_sync(keys=["shop"], values=ad.values() // 5, lengths=ad.lengths())
    return batch.__class__(**{**batch.__dict__, "sparse": KeyedJaggedTensor.from_jt_dict({**parts, **shop.to_dict()})})


# -- the in-process cache -------------------------------------------------------------------------------------

def test_memory_cache_answers_pairs_and_a_users_newest_entries_per_group():
    clock = Clock()
    cache = MemoryCache(ttl_s=100, recent=2, clock=clock)
    cache.put([entry(1, 10, 7, clock.now - 3, 1.0), entry(1, 11, 7, clock.now - 2, 2.0), entry(1, 12, 7, clock.now - 1, 3.0),
               entry(2, 10, 7, clock.now, 4.0)])
    a, missing = cache.get([(1, 10), (3, 10)])
    assert a.embedding[0] == 1.0 and a.group == 7 and missing is None
    (newest,) = cache.recent([(1, 7)])
    assert [e.item for e in newest] == [12, 11]  # newest first, at most `recent`
    cache.put([entry(1, 11, 7, clock.now, 5.0)])  # a rewritten pair replaces its older embedding
    assert [(e.item, e.embedding[0]) for e in cache.recent([(1, 7)])[0]] == [(11, 5.0), (12, 3.0)]
    assert cache.get([(1, 11)])[0].embedding[0] == 5.0
    assert cache.recent([(9, 9)]) == [[]]


def test_memory_cache_forgets_expired_entries_and_survives_a_snapshot(tmp_path):
    clock = Clock()
    cache = MemoryCache(ttl_s=10, clock=clock)
    cache.put([entry(1, 10, 7, clock.now, 1.0), entry(2, 10, 7, clock.now - 8, 2.0)])
    path = cache.save(tmp_path / "cache.npz")
    clock.now += 5
    assert [e is None for e in cache.get([(1, 10), (2, 10)])] == [False, True]
    assert len(cache) == 1 and [len(x) for x in cache.recent([(1, 7), (2, 7)])] == [1, 0]
    loaded = MemoryCache.load(path, ttl_s=10, clock=Clock())
    assert sorted((e.user, e.item, float(e.embedding[0])) for e in loaded.entries()) == [(1, 10, 1.0), (2, 10, 2.0)]
    (tmp_path / "bad.npz").write_bytes(b"not a snapshot")
    with pytest.raises(CacheError, match=r"bad.npz: not a Solaris cache snapshot"):
        MemoryCache.load(tmp_path / "bad.npz", ttl_s=10)
    (tmp_path / "cut.npz").write_bytes(path.read_bytes()[:100])  # a snapshot cut short: its zip directory is gone
    with pytest.raises(CacheError, match=r"cut.npz: not a Solaris cache snapshot"):
        MemoryCache.load(tmp_path / "cut.npz", ttl_s=10)


def test_memory_cache_serves_readers_while_a_thread_writes():
    cache = MemoryCache(ttl_s=1e4, recent=4, clock=Clock(2000.0))
    errors = []

    def write():
        try:
            for i in range(2000):
                cache.put([entry(i % 50, i, i % 5, float(i), float(i))])
        except BaseException as error:  # noqa: BLE001 - any failure in a thread must fail the test
            errors.append(error)

    def read():
        try:
            for i in range(2000):
                found = cache.get([(i % 50, i)])[0]
                assert found is None or found.item == i
                assert len(cache.recent([(i % 50, i % 5)])[0]) <= 4
        except BaseException as error:  # noqa: BLE001 - e.g. a dictionary changed size during iteration
            errors.append(error)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(cache) == 2000


# -- the fallback order ------------------------------------------------------------------------------------------

def setup_lookup(clock, ttl_s=100.0):
    cache = MemoryCache(ttl_s=ttl_s, clock=clock)
    index = UserIndex(dim=3)
    default = DefaultEmbedding(4)
    cache.put([entry(1, 10, 7, clock.now - 4, 1.0), entry(1, 11, 7, clock.now - 2, 3.0), entry(2, 20, 8, clock.now - 1, 5.0)])
    index.add(np.array([1, 2]), np.array([[1.0, 0, 0], [0, 1.0, 0]]))
    default.add(np.full((2, 4), 9.0))
    return FallbackLookup(cache, index, default, ttl_s=ttl_s, neighbours=1, clock=clock)


def test_lookup_falls_back_in_order_exact_user_group_neighbours_default():
    clock = Clock()
    lookup = setup_lookup(clock)
    near_user_1 = np.array([0.9, 0.1, 0.0])
    cases = [
        ((1, 10, 7, near_user_1), "exact", 1.0, 4.0),
        ((1, 12, 7, near_user_1), "user_group", 2.0, 4.0),  # mean of the user's two entries in group 7, age of the oldest
        # the user's group comes before similar users: user 2, the nearest to this behaviour, has item 20 (5.0)
        ((1, 20, 7, np.array([0.0, 1.0, 0.0])), "user_group", 2.0, 4.0),
        ((3, 10, 7, near_user_1), "neighbours", 1.0, 4.0),  # user 1 behaves most like user 3 and has item 10
        ((3, 13, 7, near_user_1), "neighbours", 2.0, 4.0),  # ... has not item 13 but has group 7
        ((3, 20, 8, near_user_1), "default", 9.0, None),  # the nearest neighbour (k = 1) has nothing of group 8
        ((3, 10, 7, np.zeros(3)), "default", 9.0, None),  # no behaviour to compare
    ]
    for (user, item, group, behaviour), level, value, age in cases:
        served = lookup.lookup(user, item, group, behaviour)
        assert (served.level, float(served.embedding[0]), served.age_s) == (level, value, age), (user, item, group)
    summary = lookup.stats.summary()
    assert summary["lookups"] == 7
    assert summary["hit_rate"] == {"exact": 1 / 7, "user_group": 2 / 7, "neighbours": 2 / 7, "default": 2 / 7}
    assert summary["levels"]["default"]["staleness_s"]["p50"] is None  # the default has no age
    assert summary["latency_ms"]["p99"] > 0
    table = format_summary(summary, "test")
    assert all(level in table for level in LEVELS)


def test_expired_entries_are_not_served_and_staleness_is_their_age():
    clock = Clock()
    lookup = setup_lookup(clock, ttl_s=3.0)
    served = lookup.lookup(1, 11, 7, None)
    assert (served.level, served.age_s) == ("exact", 2.0)
    # item 10 (age 4) has expired: the group's mean uses item 11 alone
    served = lookup.lookup(1, 10, 7, None)
    assert (served.level, float(served.embedding[0]), served.age_s) == ("user_group", 3.0, 2.0)
    clock.now += 2.5  # now everything of user 1 has expired; user 2's entry (age 3.5) too
    assert lookup.lookup(1, 11, 7, np.array([0.0, 1.0, 0.0])).level == "default"
    ages = lookup.stats.summary()["staleness_s"]
    assert ages["max"] == 2.0


def test_default_embedding_is_the_mean_of_everything_written():
    default = DefaultEmbedding(2)
    assert default.value().tolist() == [0.0, 0.0]
    default.add(np.array([[1.0, 2.0], [3.0, 4.0]]))
    default.add(np.array([[5.0, 6.0]]))
    assert default.value().tolist() == [3.0, 4.0]
    assert DefaultEmbedding.from_state(default.state()).value().tolist() == [3.0, 4.0]


def test_a_loaded_default_embedding_keeps_its_entries_by_time_after_more_are_added():
    saved = DefaultEmbedding(1)
    saved.add(np.ones((4, 1)), np.array([1.0, 2.0, 3.0, 4.0]))
    loaded = DefaultEmbedding.from_state(saved.state())
    loaded.add(np.full((1, 1), 6.0), np.array([10.0]))
    assert loaded.value(5.0).tolist() == [1.0]  # the four loaded entries before time 5
    assert loaded.value(11.0).tolist() == [2.0] and loaded.value().tolist() == [2.0]


# -- the nearest-neighbour index ------------------------------------------------------------------------------

def test_user_index_finds_the_most_similar_users(tmp_path):
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(3000, 16)).astype(np.float32)  # more rows than its starting capacity
    index = UserIndex(16)
    index.add(np.arange(3000) * 7, vectors)
    query = vectors[42] + 0.01 * rng.normal(size=16)
    assert index.query(query, 3)[0] == 42 * 7
    assert 42 * 7 not in index.query(query, 3, exclude=42 * 7)
    cosine = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)) @ (query / np.linalg.norm(query))
    assert index.query(query, 5) == [int(u) * 7 for u in np.argsort(-cosine)[:5]]  # exact search
    index.add(np.array([42 * 7]), -vectors[42:43])  # a user seen again: the newer behaviour replaces the older
    assert len(index) == 3000 and 42 * 7 not in index.query(query, 3)
    assert index.query(np.zeros(16), 3) == [] and UserIndex(16).query(query, 3) == []
    loaded = UserIndex.load(index.save(tmp_path / "users.npz"))
    assert loaded.query(query, 5) == index.query(query, 5)


# -- keys ---------------------------------------------------------------------------------------------------------

def test_pair_keys_share_the_user_across_candidates_of_one_request():
    batch = with_shop(random_batch(6, seed=3))
    keys = pair_keys(batch, "ad", "shop", behaviour_dim=32)
    assert keys.items.tolist() == batch.sparse["ad"].values().tolist()
    assert keys.groups.tolist() == (batch.sparse["ad"].values() // 5).tolist()
    assert len(set(keys.users.tolist())) == 6
    # the same request with another candidate (and another outcome) is the same user
    parts = batch.sparse.to_dict()
    other = KeyedJaggedTensor.from_jt_dict({**parts, **KeyedJaggedTensor.from_lengths_sync(
        keys=["ad", "shop"], values=torch.cat([(parts["ad"].values() + 1) % 50, parts["shop"].values() * 0]),
        lengths=torch.ones(12, dtype=torch.int64)).to_dict()})
    again = pair_keys(batch.__class__(**{**batch.__dict__, "sparse": other, "labels": 1 - batch.labels}), "ad", "shop",
                      behaviour_dim=32)
    assert again.users.tolist() == keys.users.tolist() and again.items.tolist() != keys.items.tolist()
    norms = np.linalg.norm(keys.behaviour, axis=1)
    events = sum(s.lengths() for s in batch.sequences.values()).numpy()
    assert np.allclose(norms[events > 0], 1.0) and np.all(norms[events == 0] == 0)
    assert np.array_equal(behaviour_vectors(batch, 32), keys.behaviour)


def test_pair_keys_refuse_features_that_cannot_key_a_pair():
    batch = with_shop(random_batch(6, seed=3))
    with pytest.raises(ValueError, match=r"no sparse feature 'shop_id' in the batch"):
        pair_keys(batch, "ad", "shop_id")
    with pytest.raises(ValueError, match=r"sparse feature 'tags' must hold exactly one id per row"):
        pair_keys(batch, "tags", "shop")


# -- the worker ------------------------------------------------------------------------------------------------

class CountingCache(MemoryCache):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.written: list[tuple[int, int]] = []

    def put(self, entries):
        self.written += [(e.user, e.item) for e in entries]
        super().put(entries)


def teacher(batch):
    """Any deterministic function of the row stands in for the teacher's representation."""
    return torch.stack([batch.dense.sum(1), batch.dense[:, 0], batch.sparse["ad"].values().float()], 1)


def test_worker_scores_and_writes_each_pair_once():
    clock = Clock()
    cache, index, default = CountingCache(ttl_s=100, clock=clock), UserIndex(16), DefaultEmbedding(3)
    calls = []
    worker = PrecomputeWorker(lambda b: calls.append(b.batch_size) or teacher(b), cache, index, default, clock, queue_size=1)
    batches = [with_shop(random_batch(8, seed=s)) for s in (0, 1)]
    first = pair_keys(batches[0], "ad", "shop", behaviour_dim=16)
    assert worker.submit(batches[0], first) == 8
    assert worker.submit(batches[0], first) == 0  # the same pairs again: nothing to score
    keys = pair_keys(batches[1], "ad", "shop", behaviour_dim=16)
    keys.users[:3], keys.items[:3] = first.users[:3], first.items[:3]  # three rows repeat pairs of the first batch
    keys.users[4], keys.items[4] = keys.users[5], keys.items[5]  # and one repeats a pair of its own batch
    assert worker.submit(batches[1], keys) == 4
    stats = worker.close()
    assert calls == [8, 8]
    assert len(cache.written) == len(set(cache.written)) == 12
    assert stats["written_pairs"] == 12 and stats["duplicate_rows"] == 12 and stats["scored_batches"] == 2
    first_of_two = teacher(batches[1])[4].numpy()  # the pair's first row is the one written
    assert np.allclose(cache.get([(int(keys.users[5]), int(keys.items[5]))])[0].embedding, first_of_two)
    assert len(index) == len({u for u, _ in cache.written})
    assert np.allclose(default.value(), np.mean([e.embedding for e in cache.entries()], 0), atol=1e-5)


def test_a_failing_teacher_stops_the_worker_with_its_error():
    def broken(batch):
        raise RuntimeError("teacher exploded")

    worker = PrecomputeWorker(broken, MemoryCache(ttl_s=10))
    batch = with_shop(random_batch(4, seed=0))
    worker.submit(batch, pair_keys(batch, "ad", "shop"))
    with pytest.raises(RuntimeError, match="worker failed: teacher exploded"):
        worker.close()


def test_a_configuration_error_of_the_teacher_reaches_the_caller_as_it_is():
    class ConfigError(ValueError):
        pass

    def unconfigured(batch):
        raise ConfigError("solaris: the teacher returns no representation to cache")

    worker = PrecomputeWorker(unconfigured, MemoryCache(ttl_s=10))
    batch = with_shop(random_batch(4, seed=0))
    worker.submit(batch, pair_keys(batch, "ad", "shop"))
    with pytest.raises(ConfigError, match=r"^solaris: the teacher returns no representation to cache$"):
        worker.close()


def test_worker_rejects_keys_of_another_batch():
    cache = CountingCache(ttl_s=10)
    worker = PrecomputeWorker(teacher, cache)
    batch = with_shop(random_batch(4, seed=0))
    keys = pair_keys(batch, "ad", "shop")
    with pytest.raises(ValueError, match="3 keys for a batch of 4 rows"):
        worker.submit(batch, keys.select(np.arange(3)))
    stats = worker.close()
    assert cache.written == [] and stats["submitted_rows"] == 0  # refused before anything was queued


def test_stats_are_recorded_from_many_threads():
    stats = LookupStats(sample_size=100)
    threads = [threading.Thread(target=lambda: [stats.record("exact", 1.0, 1e-4) for _ in range(1000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    summary = stats.summary()
    assert summary["lookups"] == 4000 and summary["hit_rate"]["exact"] == 1.0
    assert summary["staleness_s"]["p50"] == 1.0


def test_overall_percentiles_weigh_each_level_by_its_lookups_beyond_its_sample():
    """9,000 fast exact lookups and 1,000 slow default ones, 1,000 kept per level: the overall median is a fast
    lookup's (pooling the two samples unweighted would make it a slow one's)."""
    stats = LookupStats(sample_size=1000)
    for i in range(9000):
        stats.record("exact", 1.0, 0.001 + i * 1e-9)
    for i in range(1000):
        stats.record("default", None, 0.5 + i * 1e-6)
    latency = stats.summary()["latency_ms"]
    assert latency["p50"] == pytest.approx(1.0, abs=0.01) and latency["p99"] > 500
    small = LookupStats(sample_size=1000)  # nothing past a cap: the plain percentiles of every value
    for i in range(10):
        small.record("exact", float(i), 1e-3)
        small.record("user_group", float(10 + i), 1e-3)
    assert small.summary()["staleness_s"]["p50"] == pytest.approx(9.5)


def test_the_join_gives_every_example_its_pair_embedding_and_level_as_one_vector():
    from gem_kunlun.testing import SPEC
    from gem_transfer.solaris import LEVELS, SolarisJoin, fresh_embeddings, served_embeddings

    batches = [with_shop(random_batch(5, seed=s)) for s in (0, 1)]

    class Source:
        spec = SPEC

        def __iter__(self):
            return iter(batches)

        def state_dict(self):
            return {"position": 0}

    join = SolarisJoin(Source(), fresh_embeddings(teacher), width=3)
    assert join.spec.representations[-1].name == "solaris" and join.spec.representations[-1].dim == 3 + len(LEVELS)
    joined = list(join)
    feature = joined[1].representations["solaris"]
    exact = torch.zeros(5, len(LEVELS))
    exact[:, LEVELS.index("exact")] = 1
    assert feature.lengths.tolist() == [1] * 5 and torch.equal(feature.values, torch.cat([teacher(batches[1]), exact], 1))
    assert join.state_dict() == {"position": 0}
    with pytest.raises(ValueError, match=r"\(5, 3\) embeddings for 5 rows of width 4"):
        SolarisJoin(Source(), fresh_embeddings(teacher), width=4).attach(batches[0])
    # served: the lookup's answer per row and its level (an empty cache: the default of what was written before
    # each row, but the exact entry of the one pair cached)
    default = DefaultEmbedding()
    default.add(np.ones((2, 3)), times=np.array([1.0, 2.0]))
    default.add(np.full((1, 3), 7.0), times=np.array([1e9]))  # a later example: no row of the batch sees it
    cache = MemoryCache(ttl_s=10)
    keys = pair_keys(batches[0], "ad", "shop")
    time = float(example_times(batches[0])[2])
    cache.put([CacheEntry(int(keys.users[2]), int(keys.items[2]), int(keys.groups[2]), cache.clock(), np.full(3, 5.0, np.float32), time)])
    lookup = FallbackLookup(cache, None, default, ttl_s=10)
    served = SolarisJoin(Source(), served_embeddings(lookup, lambda b: pair_keys(b, "ad", "shop")), width=3)
    values = served.attach(batches[0]).representations["solaris"].values
    assert torch.equal(values[:, :3], torch.tensor([[1.0] * 3, [1.0] * 3, [5.0] * 3, [1.0] * 3, [1.0] * 3]))
    levels = [LEVELS[i] for i in values[:, 3:].argmax(1).tolist()]
    assert levels == ["default", "default", "exact", "default", "default"] and torch.equal(values[:, 3:].sum(1), torch.ones(5))
    assert lookup.stats.counts["default"] == 4 and lookup.stats.counts["exact"] == 1
    # a rank's empty share of a short last batch (several ranks evaluating): an empty feature of the full width
    none = random_batch(0, seed=2)
    no_ids = torch.zeros(0, dtype=torch.int64)
    none = none.__class__(**{**none.__dict__, "sparse": KeyedJaggedTensor(keys=[*none.sparse.keys(), "shop"], values=no_ids,
                                                                          lengths=no_ids, stride=0)})
    empty = served.attach(none).representations["solaris"]
    assert tuple(empty.values.shape) == (0, 3 + len(LEVELS)) and empty.lengths.numel() == 0


def test_worker_precomputes_only_the_rows_it_is_given():
    cache = CountingCache(ttl_s=100, clock=Clock())
    worker = PrecomputeWorker(teacher, cache)
    batch = with_shop(random_batch(6, seed=2))
    keys = pair_keys(batch, "ad", "shop")
    assert worker.submit(batch, keys, rows=[1, 4]) == 2
    worker.close()
    assert cache.written == [(int(keys.users[1]), int(keys.items[1])), (int(keys.users[4]), int(keys.items[4]))]


def test_a_lookup_bounded_by_the_examples_time_uses_no_later_example():
    """A user's later (held-out) pairs must not reach an earlier (training) row at any level."""
    clock = Clock()
    cache = MemoryCache(ttl_s=100, clock=clock)
    index = UserIndex(dim=3)
    default = DefaultEmbedding(4)
    early, late = [entry(1, 10, 7, clock.now, 1.0), entry(2, 30, 7, clock.now, 4.0)], [entry(1, 11, 7, clock.now, 3.0)]
    early = [CacheEntry(e.user, e.item, e.group, e.timestamp, e.embedding, t) for e, t in zip(early, (10.0, 5.0))]
    late = [CacheEntry(e.user, e.item, e.group, e.timestamp, e.embedding, 20.0) for e in late]
    cache.put(early + late)
    index.add(np.array([1, 2]), np.array([[1.0, 0, 0], [0, 1.0, 0]]), np.array([10.0, 5.0]))
    default.add(np.stack([e.embedding for e in early]), np.array([10.0, 5.0]))
    default.add(np.stack([e.embedding for e in late]), np.array([20.0]))
    lookup = FallbackLookup(cache, index, default, ttl_s=100, neighbours=1, clock=clock)
    near_user_2 = np.array([0.0, 1.0, 0.0])
    cases = [
        ((1, 11, 7, 15.0), "user_group", 1.0),  # the pair's own entry is of a later example: only the earlier one
        ((1, 11, 7, 20.0), "exact", 3.0),  # ... and at its own time, the entry precomputed for it
        ((1, 12, 7, 25.0), "user_group", 2.0),  # later than both: their mean
        ((1, 12, 7, 10.0), "neighbours", 4.0),  # nothing of user 1 strictly before: not even the entry at 10
        ((3, 12, 9, 5.0), "default", 0.0),  # nothing written before 5
        ((3, 12, 9, 15.0), "default", 2.5),  # the mean of the entries at 5 and 10, not the one at 20
    ]
    for (user, item, group, before), level, value in cases:
        served = lookup.lookup(user, item, group, near_user_2, before=before)
        assert (served.level, float(served.embedding[0])) == (level, value), (user, item, before)
    assert float(lookup.lookup(3, 12, 9, near_user_2).embedding[0]) == pytest.approx(8 / 3)  # unbounded: everything
    assert lookup.lookup(1, 11, 7, near_user_2).level == "exact"


def test_a_bounded_lookup_chooses_neighbours_as_they_behaved_before_the_example():
    """User 3 comes to behave like user 1 only later (time 20): a row at time 10 must not take user 3 as a
    neighbour by that later behaviour, but user 2, the nearest then."""
    clock = Clock()
    cache = MemoryCache(ttl_s=100, clock=clock)
    cache.put([CacheEntry(2, 30, 7, clock.now, np.full(4, 4.0, np.float32), 5.0),
               CacheEntry(3, 30, 7, clock.now, np.full(4, 8.0, np.float32), 6.0)])
    index = UserIndex(dim=3)
    index.add(np.array([2, 3]), np.array([[0.0, 1, 0], [1.0, 0, 0]]), np.array([5.0, 6.0]))
    index.add(np.array([3, 2]), np.array([[0.0, 1, 0], [1.0, 0, 0]]), np.array([20.0, 20.0]))
    lookup = FallbackLookup(cache, index, DefaultEmbedding(4), ttl_s=100, neighbours=1, clock=clock)
    like_user_1 = np.array([0.0, 1.0, 0.0])
    bounded = lookup.lookup(1, 30, 9, like_user_1, before=10.0)
    assert (bounded.level, float(bounded.embedding[0])) == ("neighbours", 4.0)
    assert float(lookup.lookup(1, 30, 9, like_user_1).embedding[0]) == 8.0  # unbounded: as they behave now
    assert index.query(like_user_1, 2, before=5.0) == []  # nothing strictly before the first time
    assert index.query(like_user_1, 2, before=float("nan")) == []  # an example without a time: none


def test_bounded_user_index_queries_equal_a_search_over_each_users_newest_vector_before_the_time(tmp_path):
    rng = np.random.default_rng(1)
    rows, dim = 700, 8
    users = rng.integers(0, 60, rows) * 3
    times = rng.integers(0, 200, rows).astype(np.float64)  # repeated times: the row added last wins
    times[::17] = np.nan  # rows without a time answer only unbounded queries
    vectors = rng.normal(size=(rows, dim))
    index = UserIndex(dim)
    for lo in range(0, rows, 64):  # added in batches, out of time order
        index.add(users[lo : lo + 64], vectors[lo : lo + 64], times[lo : lo + 64])
    loaded = UserIndex.load(index.save(tmp_path / "users.npz"))
    for before in [0.0, 1.0, 57.5, 100.0, 150.0, 199.0, 250.0]:
        query = rng.normal(size=dim)
        newest = {}
        for r in range(rows):  # each user's last-added row among those of the newest time before ``before``
            if times[r] < before and (users[r] not in newest or times[r] >= times[newest[users[r]]]):
                newest[users[r]] = r
        unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
        scores = {int(u): float(unit[r] @ (query / np.linalg.norm(query))) for u, r in newest.items()}
        expected = sorted(scores, key=lambda u: -scores[u])[:5]
        assert index.query(query, 5, before=before) == expected, before
        assert loaded.query(query, 5, before=before) == expected, before
        excluded = expected[0] if expected else None
        assert index.query(query, 5, exclude=excluded, before=before) == [u for u in sorted(scores, key=lambda u: -scores[u])
                                                                           if u != excluded][:5]
