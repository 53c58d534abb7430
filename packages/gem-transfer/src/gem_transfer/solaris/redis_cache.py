"""Solaris's Redis backend: the cache on a Redis (or Valkey) server, shared by every process that serves.

Layout, under ``prefix``: ``{prefix}:e:{user}:{item}`` holds one entry (timestamp, event time, group, embedding
bytes); ``{prefix}:g:{user}:{group}`` is a list of the user's newest entries in that group (timestamp, event time,
item, embedding),
newest first, trimmed to ``recent``. Both expire on the server ``ttl_s`` after the entry's timestamp.

The server may go away mid-run (a restart, a network cut). Then nothing raises: a read answers from the entries
written since the outage (held in-process) or not at all, so the lookup falls back to its next level; a write is
kept in-process, in order; a warning is logged once per outage. At most every ``retry_s`` seconds a call tries
the server again, and the first that reaches it writes the kept entries before anything else, so nothing is lost
(an entry whose time to live ran out while it waited is dropped, as the server would have dropped it). Entries
still kept when the cache is closed are returned by ``unflushed()`` for the caller to save.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable

import numpy as np

from gem_transfer.solaris.cache import CacheEntry, CacheError, MemoryCache

logger = logging.getLogger("gem_transfer.solaris")
_HEAD = struct.Struct("<ddq")  # timestamp, event time, then the group (exact entries) or the item (group lists)


class RedisCache:
    """``url``: ``redis://host:port/db``. ``timeout_s`` bounds every call to the server; the first connection is
    checked at once (an unreachable server is a ``CacheError`` naming the url), later outages are survived."""

    def __init__(self, url: str, ttl_s: float, recent: int = 8, prefix: str = "solaris", retry_s: float = 1.0,
                 timeout_s: float = 0.5, clock: Callable[[], float] | None = None) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        if ttl_s <= 0 or recent < 1:
            raise ValueError(f"RedisCache needs ttl_s > 0 and recent >= 1, got {ttl_s}, {recent}")
        self.url, self.ttl_s, self.recent_size, self.prefix, self.retry_s = url, ttl_s, recent, prefix, retry_s
        self.clock = clock or time.time
        try:
            # NOTE: no retries inside the client: a dead server must cost one refused connection, not a backoff
            self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                               retry=Retry(NoBackoff(), 0))
            self.client.ping()
        except (redis.exceptions.RedisError, OSError, ValueError) as error:
            raise CacheError(f"{url}: cannot reach the Redis server ({error})") from None
        self._down_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self.pending = MemoryCache(ttl_s, recent, self.clock)  # entries written while the server was away
        self._log: list[CacheEntry] = []  # the same, in the order written
        self._down_until: float | None = None  # monotonic time of the next try while the server is away
        self._lock = threading.Lock()
        self.outages = 0

    # -- the server's availability ----------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self._down_until is None

    def _went_away(self, error: Exception) -> None:
        if self._down_until is None:
            self.outages += 1
            logger.warning("Solaris cache: the Redis server at %s is unreachable (%s): lookups fall back to the next "
                           "level and writes are kept in-process until it returns", self.url, error)
        self._down_until = time.monotonic() + self.retry_s

    def _usable(self) -> bool:
        """Whether to talk to the server now; after an outage, the first call past ``retry_s`` tries it and, if it
        answers, writes the kept entries first."""
        if self._down_until is None:
            return True
        if time.monotonic() < self._down_until:
            return False
        with self._lock:
            if self._down_until is None:
                return True
            if time.monotonic() < self._down_until:
                return False
            try:
                self.client.ping()
                kept = self._flush()
            except self._down_errors as error:
                self._went_away(error)
                return False
            self._down_until = None
            logger.warning("Solaris cache: the Redis server at %s is back; wrote the %d entries kept meanwhile", self.url, kept)
            return True

    def _flush(self) -> int:
        """Writes the kept entries (the caller holds the lock); returns how many."""
        kept = len(self._log)
        if kept:
            self._write(self._log)
            self._log = []
            self.pending.clear()
        return kept

    # -- the backend interface --------------------------------------------------------------------------------

    def put(self, entries: list[CacheEntry]) -> None:
        self._usable()  # after an outage: try the server again when due
        # NOTE: writing or keeping is decided in one critical section: decided outside it, another thread could
        # bring the server back and flush in between, and entries kept after that flush would wait unseen
        with self._lock:
            if self._down_until is None:
                try:
                    self._flush()  # entries kept by a concurrent outage go first: the server sees the write order
                    self._write(entries)
                    return
                except self._down_errors as error:
                    self._went_away(error)
            self._log.extend(entries)
            self.pending.put(entries)

    def get(self, pairs: list[tuple[int, int]]) -> list[CacheEntry | None]:
        if self._usable():
            try:
                values = self.client.mget([self._entry_key(u, i) for u, i in pairs]) if pairs else []
                return [None if v is None else self._entry(u, i, v) for (u, i), v in zip(pairs, values)]
            except self._down_errors as error:
                self._went_away(error)
        return self.pending.get(pairs)

    def recent(self, user_groups: list[tuple[int, int]]) -> list[list[CacheEntry]]:
        if self._usable():
            try:
                pipe = self.client.pipeline(transaction=False)
                for user, group in user_groups:
                    pipe.lrange(self._group_key(user, group), 0, self.recent_size - 1)
                lists = pipe.execute() if user_groups else []
                return [self._group_entries(u, g, values) for (u, g), values in zip(user_groups, lists)]
            except self._down_errors as error:
                self._went_away(error)
        return self.pending.recent(user_groups)

    def flush(self) -> int:
        """Try the server now and write the kept entries; returns how many are still kept."""
        with self._lock:
            was_down = self._down_until is not None
            try:
                if was_down:
                    self.client.ping()
                kept = self._flush()
            except self._down_errors as error:
                self._went_away(error)
            else:
                self._down_until = None
                if was_down:
                    logger.warning("Solaris cache: the Redis server at %s is back; wrote the %d entries kept meanwhile",
                                   self.url, kept)
            return len(self._log)

    def unflushed(self) -> list[CacheEntry]:
        with self._lock:
            return list(self._log)

    def close(self) -> None:
        self.flush()
        self.client.close()

    # -- encoding ---------------------------------------------------------------------------------------------

    def holds_entries(self) -> bool:
        """Whether the server holds any key under this cache's prefix (an earlier pass's entries, which a new pass
        would be served as its own); a server it cannot ask is a ``CacheError``."""
        import redis

        try:
            return next(iter(self.client.scan_iter(match=f"{self.prefix}:*", count=100)), None) is not None
        except redis.RedisError as error:
            raise CacheError(f"Redis at {self.url}: {error}") from None

    def _entry_key(self, user: int, item: int) -> str:
        return f"{self.prefix}:e:{user}:{item}"

    def _group_key(self, user: int, group: int) -> str:
        return f"{self.prefix}:g:{user}:{group}"

    def _write(self, entries: list[CacheEntry]) -> None:
        now = self.clock()
        # a pair written twice in one call: its last entry stands, as after two puts in the in-process cache
        last = {(e.user, e.item): e for e in entries}
        entries = [e for e in entries if last[(e.user, e.item)] is e]
        live = [(e, int((e.timestamp + self.ttl_s - now) * 1000)) for e in entries]
        live = [(e, left_ms) for e, left_ms in live if left_ms > 0]  # past their time to live: the server drops them
        # NOTE: a rewritten pair's older value leaves its group's list first (the in-process cache replaces it too):
        # left there, it counted twice against `recent` and the list kept fewer items than the in-process one
        older = self.client.mget([self._entry_key(e.user, e.item) for e, _ in live]) if live else []
        pipe = self.client.pipeline(transaction=False)
        touched: dict[str, int] = {}
        for (e, left_ms), old in zip(live, older):
            if old is not None:
                timestamp, event_time, group = _HEAD.unpack_from(old)
                pipe.lrem(self._group_key(e.user, group), 0, _HEAD.pack(timestamp, event_time, e.item) + old[_HEAD.size:])
            vector = np.ascontiguousarray(e.embedding, dtype=np.float32).tobytes()
            pipe.set(self._entry_key(e.user, e.item), _HEAD.pack(e.timestamp, e.event_time, e.group) + vector, px=left_ms)
            key = self._group_key(e.user, e.group)
            pipe.lpush(key, _HEAD.pack(e.timestamp, e.event_time, e.item) + vector)
            touched[key] = max(touched.get(key, 0), left_ms)
        for key, left_ms in touched.items():
            pipe.ltrim(key, 0, self.recent_size - 1)
            pipe.pexpire(key, left_ms)
        pipe.execute()

    @staticmethod
    def _entry(user: int, item: int, value: bytes) -> CacheEntry:
        timestamp, event_time, group = _HEAD.unpack_from(value)
        return CacheEntry(user, item, group, timestamp, np.frombuffer(value, np.float32, offset=_HEAD.size), event_time)

    @staticmethod
    def _group_entries(user: int, group: int, values: list[bytes]) -> list[CacheEntry]:
        entries, seen = [], set()
        for value in values:
            timestamp, event_time, item = _HEAD.unpack_from(value)
            if item in seen:
                continue  # a rewritten pair: its newest embedding (earlier in the list) stands
            seen.add(item)
            entries.append(CacheEntry(user, item, group, timestamp, np.frombuffer(value, np.float32, offset=_HEAD.size),
                                      event_time))
        return entries
