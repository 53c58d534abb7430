"""Solaris: speculative precompute of the teacher's embeddings for likely (user, item) pairs, and their lookup
with a fallback (the user's recent embeddings in the item's group, similar users, a default)."""

from gem_transfer.solaris.cache import CacheBackend, CacheEntry, CacheError, MemoryCache, load_entries, save_entries
from gem_transfer.solaris.join import SolarisJoin, fresh_embeddings, served_embeddings
from gem_transfer.solaris.keys import PairKeys, behaviour_vectors, pair_keys, request_fingerprints, single_ids
from gem_transfer.solaris.local_redis import LocalRedisServer, find_redis_server
from gem_transfer.solaris.lookup import DefaultEmbedding, FallbackLookup, Served
from gem_transfer.solaris.neighbours import UserIndex
from gem_transfer.solaris.redis_cache import RedisCache
from gem_transfer.solaris.report import LEVELS, LookupStats, format_summary
from gem_transfer.solaris.worker import PrecomputeWorker

__all__ = [
    "LEVELS",
    "CacheBackend",
    "CacheEntry",
    "CacheError",
    "DefaultEmbedding",
    "FallbackLookup",
    "LocalRedisServer",
    "LookupStats",
    "MemoryCache",
    "PairKeys",
    "PrecomputeWorker",
    "RedisCache",
    "Served",
    "SolarisJoin",
    "UserIndex",
    "behaviour_vectors",
    "find_redis_server",
    "format_summary",
    "fresh_embeddings",
    "load_entries",
    "pair_keys",
    "request_fingerprints",
    "save_entries",
    "served_embeddings",
    "single_ids",
]
