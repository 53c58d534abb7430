"""Solaris on the CPU: the lookup under load, and a student's quality on served embeddings
(``benchmarks/results/solaris.json``).

    python -m gem_trainer.bench_solaris --out benchmarks/results/solaris.json [--backends memory redis]
        [--duration 60] [--threads 8] [--users 10000]
    python -m gem_trainer.bench_solaris --out benchmarks/results/solaris.json --quality [--seeds 0 1 2]

Synthetic traffic (``SyntheticTraffic``, fixed by ``--seed``): users fall into behaviour clusters, each cluster
favours a set of item groups; an earlier stage predicted ``CANDIDATES`` items per user for 80% of the users, and
their embeddings were precomputed at times spread over the last 1.5 time-to-live (so a third have expired). A
pair's embedding is a fixed function of the user and the item (this measures the cache and its fallback, not the
teacher). Each request asks for a user (any user: a fifth were never precomputed) and an item: one the earlier
stage predicted for them (60%), another item of a group their cluster favours (25%), or any item (15%).

For each backend (in-process, and a Redis server started here on 127.0.0.1 and a free port), ``--threads`` client
threads look requests up for ``--duration`` seconds while a writer thread keeps precomputing new pairs at
``--write-rate`` pairs per second (a bounded load: every request loop ends by the clock). Reported per backend:
hit rate per fallback level, staleness of what was served (p50 / p99), lookup latency (p50 / p99, overall and
per level) and throughput, with the provenance (machine, torch, commit, date, command) of the run.

``--quality`` (section ``quality``): the embedded default data from ``QUALITY_USERS`` users (so users recur and
the user's-group level can answer), one data set for every seed (``bench_runs.DATA_SEED``). A Kunlun teacher
(``TEACHER_STEPS``) trains on another stream of the same data (mixture source seed 1: the student's examples are
new to it, so its embeddings of them carry no memorised labels); a baseline student (``STUDENT_STEPS``) reads the
teacher's embedding of each example's pair (``solaris.student_input``). Held-out NE / AUC of: the student without
that input (``student_alone``); trained and evaluated on fresh embeddings (the teacher run for every request:
``fresh``); trained on fresh, evaluated on Solaris-served ones where the earlier stage predicted ``EVAL_SHARES`` of
the held-out pairs (``served_<share>``: precomputed, the rest fall back); trained and evaluated on served ones with
``TRAINED_SHARES`` of the pairs precomputed, drawn per row all through training and in the held-out data
(``served_trained_<share>``: the student learns what fallbacks look like, and from the level each input carries, how
far to trust them). Per seed, mean/std, and each seed's gain over its student alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from gem_trainer.bench_runs import DATA_SEED, paired_gains, provenance, write_section
from gem_transfer.solaris import (
    CacheEntry,
    DefaultEmbedding,
    FallbackLookup,
    LocalRedisServer,
    LookupStats,
    MemoryCache,
    RedisCache,
    UserIndex,
    format_summary,
)

BACKENDS = ("memory", "redis")
CANDIDATES = 16  # items the earlier stage predicts per precomputed user
TTL_S = 600.0
WIDTH, BEHAVIOUR_DIM = 64, 64
ITEMS_PER_GROUP, CLUSTERS, GROUPS_PER_CLUSTER = 25, 32, 40
SHARES = {"predicted": 0.60, "favoured_group": 0.25, "any": 0.15}
QUALITY_USERS, TEACHER_STEPS, STUDENT_STEPS = 2000, 600, 600
EVAL_SHARES = (0.0, 0.5, 0.9)
TRAINED_SHARES = (0.5, 0.9)  # served_trained_<share>: the share of training and held-out pairs precomputed
METRICS = ("click/all/ne", "click/all/auc", "conversion/all/ne", "conversion/all/auc")


class SyntheticTraffic:
    """The users, items, predicted pairs and requests of the module docstring."""

    def __init__(self, users: int, items: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.users, self.items, self.rng = users, items, rng
        self.groups = max(1, items // ITEMS_PER_GROUP)
        self.cluster = rng.integers(CLUSTERS, size=users)
        centroids = rng.normal(size=(CLUSTERS, BEHAVIOUR_DIM))
        self.behaviour = (centroids[self.cluster] + 0.5 * rng.normal(size=(users, BEHAVIOUR_DIM))).astype(np.float32)
        self.favoured = np.stack([rng.choice(self.groups, GROUPS_PER_CLUSTER, replace=False) for _ in range(CLUSTERS)])
        self.user_latent = rng.normal(size=(users, WIDTH)).astype(np.float32)
        self.item_latent = rng.normal(size=(items, WIDTH)).astype(np.float32)
        self.precomputed = rng.random(users) < 0.8
        self.predicted = np.stack([self._favoured_items(u, CANDIDATES) for u in range(users)])

    def _favoured_items(self, user: int, n: int) -> np.ndarray:
        groups = self.rng.choice(self.favoured[self.cluster[user]], n)
        return np.minimum(groups * ITEMS_PER_GROUP + self.rng.integers(ITEMS_PER_GROUP, size=n), self.items - 1)

    def group(self, items: np.ndarray) -> np.ndarray:
        return np.minimum(items // ITEMS_PER_GROUP, self.groups - 1)

    def embeddings(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        return np.tanh(self.user_latent[users] + self.item_latent[items])

    def preload(self, now: float) -> list[CacheEntry]:
        """Every predicted pair of the precomputed users, stamped over the last 1.5 TTL (oldest first)."""
        users = np.repeat(np.flatnonzero(self.precomputed), CANDIDATES)
        items = self.predicted[self.precomputed].reshape(-1)
        stamps = now - self.rng.uniform(0, 1.5 * TTL_S, size=len(users))
        order = np.argsort(stamps)
        vectors = self.embeddings(users, items)
        groups = self.group(items)
        return [CacheEntry(int(users[i]), int(items[i]), int(groups[i]), float(stamps[i]), vectors[i]) for i in order]

    def requests(self, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """``n`` (user, item) requests in the shares of ``SHARES``."""
        rng = np.random.default_rng(seed)
        users = rng.integers(self.users, size=n)
        kind = rng.choice(len(SHARES), size=n, p=list(SHARES.values()))
        items = rng.integers(self.items, size=n)
        predicted = self.predicted[users, rng.integers(CANDIDATES, size=n)]
        favoured = self.favoured[self.cluster[users], rng.integers(GROUPS_PER_CLUSTER, size=n)] * ITEMS_PER_GROUP \
            + rng.integers(ITEMS_PER_GROUP, size=n)
        items = np.where(kind == 0, predicted, np.where(kind == 1, np.minimum(favoured, self.items - 1), items))
        return users, items


def run_backend(name: str, traffic: SyntheticTraffic, args) -> dict:
    """Preload, then ``args.threads`` readers and one writer for ``args.duration`` seconds; returns the summary."""
    server = LocalRedisServer().start() if name == "redis" else None
    try:
        cache = RedisCache(server.url, TTL_S, prefix="bench") if server else MemoryCache(TTL_S)
        now = time.time()
        preload = traffic.preload(now)
        started = time.perf_counter()
        for i in range(0, len(preload), 4096):
            cache.put(preload[i: i + 4096])
        preload_s = time.perf_counter() - started
        index, default = UserIndex(BEHAVIOUR_DIM, capacity=traffic.users), DefaultEmbedding(WIDTH)
        live = np.array([e.timestamp >= now - TTL_S for e in preload])
        users = np.array([e.user for e in preload])
        index.add(np.unique(users[live]), traffic.behaviour[np.unique(users[live])])
        default.add(np.stack([e.embedding for e in preload[-10_000:]]))
        stats = LookupStats()
        lookup = FallbackLookup(cache, index, default, TTL_S, neighbours=8, stats=stats)
        deadline = time.perf_counter() + args.duration
        written = [0]

        def reader(seed: int) -> None:
            users, items = traffic.requests(200_000, seed)
            groups = traffic.group(items)
            i = 0
            while time.perf_counter() < deadline:
                j = i % len(users)
                lookup.lookup(users[j], items[j], groups[j], traffic.behaviour[users[j]])
                i += 1

        def writer() -> None:
            # the background precompute: fresh predictions for random precomputed users, at a bounded rate
            rng = np.random.default_rng(args.seed + 99)
            per_tick = max(1, int(args.write_rate / 10))
            while time.perf_counter() < deadline:
                tick = time.perf_counter()
                users = rng.choice(np.flatnonzero(traffic.precomputed), per_tick)
                items = traffic.predicted[users, rng.integers(CANDIDATES, size=per_tick)]
                vectors, groups, stamp = traffic.embeddings(users, items), traffic.group(items), time.time()
                cache.put([CacheEntry(int(u), int(i), int(g), stamp, v) for u, i, g, v in zip(users, items, groups, vectors)])
                index.add(users, traffic.behaviour[users])
                written[0] += per_tick
                time.sleep(max(0.0, 0.1 - (time.perf_counter() - tick)))

        threads = [threading.Thread(target=reader, args=(args.seed * 1000 + t,)) for t in range(args.threads)]
        threads.append(threading.Thread(target=writer))
        load_started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - load_started
        cache.close()
        summary = stats.summary()
        return {"backend": name, "preloaded_pairs": len(preload), "preload_s": round(preload_s, 2),
                "duration_s": round(elapsed, 1), "client_threads": args.threads, "written_during_load": written[0],
                "lookups_per_s": round(summary["lookups"] / elapsed, 1), **summary}
    finally:
        if server is not None:
            server.close()


def config_batch(overrides: list[str]) -> int:
    from gem_trainer.config import load_config

    return load_config(None, overrides).data.batch_size


def quality(seeds: list[int], work: Path, extra_overrides: tuple[str, ...] = ()) -> dict:
    """The ``--quality`` section of the module docstring (``extra_overrides``: for every run, e.g. a smaller batch)."""
    import contextlib
    import io

    from gem_trainer.bench_runs import evaluate, mean_std, train
    from gem_trainer.config import load_config
    from gem_trainer.distributed import init_distributed
    from gem_trainer.precompute import precompute

    def run_precompute(overrides: list[str]) -> dict:
        with contextlib.redirect_stdout(io.StringIO()):
            return precompute(load_config(None, overrides), init_distributed("cpu", "gloo"))

    def metrics(overrides: list[str], run_dir: Path) -> dict:
        result = evaluate(None, overrides, run_dir)
        return {m: result[m] for m in METRICS}

    rows, lookups = [], []
    for seed in seeds:
        folder = work / f"seed{seed}"
        common = ["--device=cpu", "--metrics.tensorboard=false", "--metrics.progress_bar=false", f"--seed={seed}",
                  f"--data.synthetic.num_users={QUALITY_USERS}", f"--data.synthetic.seed={DATA_SEED}", "--solaris.user_feature=user_id",
                  *extra_overrides]
        teacher = folder / "teacher"
        train(None, [*common, f"--schedule.steps={TEACHER_STEPS}", '--data.mixture.sources=[{name="teacher_stream", seed=1}]'],
              teacher)
        student = [*common, "--model.name=baseline", f"--schedule.steps={STUDENT_STEPS}", f"--solaris.teacher_run_dir={teacher}"]
        pairs = STUDENT_STEPS * config_batch(student)
        train(None, student, folder / "student_alone")
        rows.append({"seed": seed, "arm": "student_alone", **metrics(student, folder / "student_alone")})
        fresh = [*student, "--solaris.student_input=fresh"]
        train(None, fresh, folder / "fresh")
        rows.append({"seed": seed, "arm": "fresh", **metrics(fresh, folder / "fresh")})
        for share in EVAL_SHARES:
            output = folder / f"precompute-{share}"
            report = run_precompute([*student, f"--run_dir={folder / 'precompute'}", f"--solaris.output={output}",
                                     f"--solaris.pairs={pairs}", f"--solaris.eval_share={share}"])
            lookups.append({"seed": seed, "arm": f"served_{share}", "worker": report["worker"],
                            "held_out_hit_rate": report["lookup"]["held_out"]["hit_rate"]})
            served = [*student, "--solaris.student_input=served", f"--solaris.output={output}"]
            rows.append({"seed": seed, "arm": f"served_{share}", **metrics(served, folder / "fresh")})
        for share in TRAINED_SHARES:
            output = folder / f"precompute-trained-{share}"
            report = run_precompute([*student, f"--run_dir={folder / 'precompute'}", f"--solaris.output={output}",
                                     f"--solaris.pairs={pairs}", f"--solaris.train_share={share}", f"--solaris.eval_share={share}"])
            lookups.append({"seed": seed, "arm": f"served_trained_{share}", "worker": report["worker"],
                            "held_out_hit_rate": report["lookup"]["held_out"]["hit_rate"]})
            served = [*student, "--solaris.student_input=served", f"--solaris.output={output}"]
            train(None, served, folder / f"served_trained_{share}")
            rows.append({"seed": seed, "arm": f"served_trained_{share}", **metrics(served, folder / f"served_trained_{share}")})
        print(f"quality seed {seed}: " + "  ".join(f"{r['arm']} click ne {r['click/all/ne']:.4f} auc {r['click/all/auc']:.4f}"
                                                    for r in rows if r["seed"] == seed), flush=True)
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    return {"settings": {"users": QUALITY_USERS,
                         "data": f"embedded default with data.synthetic.seed={DATA_SEED}, data.synthetic.num_users={QUALITY_USERS}",
                         "teacher": f"embedded default (Kunlun tiny), {TEACHER_STEPS} steps on a disjoint stream",
                         "student": f"baseline, {STUDENT_STEPS} steps", "eval_shares": list(EVAL_SHARES),
                         "trained_shares": list(TRAINED_SHARES)},
            "rows": rows, "lookups": lookups,
            "summary": {arm: {m: mean_std([r for r in rows if r["arm"] == arm], m) for m in METRICS} for arm in arms},
            "paired_gains": paired_gains(rows, [arm for arm in arms if arm != "student_alone"], METRICS)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m gem_trainer.bench_solaris", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON sections to this file")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per backend")
    parser.add_argument("--threads", type=int, default=8, help="client threads looking up")
    parser.add_argument("--write-rate", type=float, default=2000.0, help="pairs per second the writer precomputes")
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--items", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quality", action="store_true", help="the student's quality on served vs fresh embeddings instead")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="--quality: seeds")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-solaris"), help="--quality: folder for the runs")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.quality:
        started, meta = time.perf_counter(), provenance("gem_trainer.bench_solaris", argv)
        result = quality(args.seeds, args.work)
        if args.out is not None:
            write_section(args.out, "quality", meta, started, result)
        return 0
    traffic = SyntheticTraffic(args.users, args.items, args.seed)
    for name in args.backends:
        started, meta = time.perf_counter(), provenance("gem_trainer.bench_solaris", argv)
        result = run_backend(name, traffic, args)
        print(format_summary(result, f"{name}: {result['lookups_per_s']:.0f} lookups/s over {args.threads} threads"), flush=True)
        if args.out is not None:
            settings = {"users": args.users, "items": args.items, "seed": args.seed, "ttl_s": TTL_S, "shares": SHARES,
                        "candidates_per_user": CANDIDATES, "write_rate": args.write_rate}
            write_section(args.out, name, meta, started, {"settings": settings, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
