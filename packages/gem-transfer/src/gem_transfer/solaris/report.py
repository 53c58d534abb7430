"""Solaris's report: per fallback level, how often it answered, how old what it served was, how long it took.

``LookupStats.record(level, age_s, latency_s)`` is called once per lookup, from any thread; ``summary()`` gives
the hit rate of each level (its share of all lookups), the staleness of served entries (their age: p50, p99,
max; the default embedding has none) and the lookup latency (p50, p99, overall and per level). Ages and
latencies are kept as a uniform sample of at most ``sample_size`` values per level (reservoir sampling), so a
long load test holds bounded memory.
"""

from __future__ import annotations

import random
import threading

import numpy as np

LEVELS = ("exact", "user_group", "neighbours", "default")


class _Reservoir:
    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seen, self.values = size, 0, []
        self.random = random.Random(seed)

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.values) < self.size:
            self.values.append(value)
        else:
            slot = self.random.randrange(self.seen)
            if slot < self.size:
                self.values[slot] = value


def _percentiles(values: list[float], scale: float) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    array = np.asarray(values) * scale
    return {"p50": float(np.percentile(array, 50)), "p99": float(np.percentile(array, 99)), "max": float(array.max())}


def _pooled_percentiles(reservoirs: list[_Reservoir], scale: float) -> dict[str, float | None]:
    """Percentiles over every level's lookups from their samples: where a level saw more values than its sample
    holds, each of its sampled values stands for ``seen / kept`` of them (pooled unweighted, a level past its cap
    would count for less than its share)."""
    kept = [r for r in reservoirs if r.values]
    if all(r.seen == len(r.values) for r in kept):
        return _percentiles([v for r in kept for v in r.values], scale)
    values = np.concatenate([np.asarray(r.values) for r in kept]) * scale
    weights = np.concatenate([np.full(len(r.values), r.seen / len(r.values)) for r in kept])
    order = np.argsort(values, kind="stable")
    values, cumulative = values[order], np.cumsum(weights[order])

    def at(q: float) -> float:  # the smallest value with at least q of the weight at or below it
        return float(values[min(np.searchsorted(cumulative, q * cumulative[-1]), values.size - 1)])

    return {"p50": at(0.5), "p99": at(0.99), "max": float(values[-1])}


class LookupStats:
    """Counts, staleness and latency of lookups per level; see the module docstring."""

    def __init__(self, sample_size: int = 100_000) -> None:
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(LEVELS, 0)
        self._ages = {level: _Reservoir(sample_size, i) for i, level in enumerate(LEVELS)}
        self._latencies = {level: _Reservoir(sample_size, 100 + i) for i, level in enumerate(LEVELS)}

    def record(self, level: str, age_s: float | None, latency_s: float) -> None:
        with self._lock:
            self.counts[level] += 1
            if age_s is not None:
                self._ages[level].add(age_s)
            self._latencies[level].add(latency_s)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> dict:
        """``{"lookups", "hit_rate": {level: share}, "staleness_s": {...}, "latency_ms": {...}, "levels": {level:
        {"count", "staleness_s", "latency_ms"}}}``; percentiles are None where nothing was recorded."""
        with self._lock:
            total = self.total
            levels = {level: {"count": self.counts[level],
                              "staleness_s": _percentiles(self._ages[level].values, 1.0),
                              "latency_ms": _percentiles(self._latencies[level].values, 1e3)} for level in LEVELS}
            staleness = _pooled_percentiles([self._ages[level] for level in LEVELS], 1.0)
            latency = _pooled_percentiles([self._latencies[level] for level in LEVELS], 1e3)
        return {"lookups": total, "hit_rate": {level: self.counts[level] / total if total else 0.0 for level in LEVELS},
                "staleness_s": staleness, "latency_ms": latency, "levels": levels}


def format_summary(summary: dict, title: str) -> str:
    """A summary as a table: one row per level (share, staleness p50/p99, latency p50/p99), then all lookups."""
    def cell(value, digits):
        return f"{value:.{digits}f}" if value is not None else "-"

    lines = [f"{title}: {summary['lookups']} lookups",
             f"{'level':<12}{'share':>8}{'age p50 s':>11}{'age p99 s':>11}{'lat p50 ms':>12}{'lat p99 ms':>12}"]
    for level in LEVELS:
        row = summary["levels"][level]
        lines.append(f"{level:<12}{summary['hit_rate'][level]:>8.3f}{cell(row['staleness_s']['p50'], 1):>11}"
                     f"{cell(row['staleness_s']['p99'], 1):>11}{cell(row['latency_ms']['p50'], 3):>12}"
                     f"{cell(row['latency_ms']['p99'], 3):>12}")
    lines.append(f"{'all':<12}{1.0 if summary['lookups'] else 0.0:>8.3f}{cell(summary['staleness_s']['p50'], 1):>11}"
                 f"{cell(summary['staleness_s']['p99'], 1):>11}{cell(summary['latency_ms']['p50'], 3):>12}"
                 f"{cell(summary['latency_ms']['p99'], 3):>12}")
    return "\n".join(lines)
