"""``gem-trainer precompute``: Solaris's speculative precompute, from config (``[solaris]``).

The finished teacher (``solaris.teacher_run_dir``, else ``distillation.teacher_run_dir``) scores candidate pairs
of this config's data: each row of the training stream is one (user, candidate) pair, as an earlier ranking
stage would hand them over: of the first ``solaris.pairs`` rows (whole batches), those the earlier stage predicted
(each with probability ``solaris.train_share``; all by default) are precomputed. A pair's embedding is the
teacher's representation of that user with that candidate: the hidden state its task heads read
(``ModelOutput.representation``, ``[R]``).
A background worker (``gem_transfer.solaris.PrecomputeWorker``) runs the teacher and writes each pair once,
with its timestamp, to the cache of ``solaris.backend`` (in-process, or a Redis server at ``solaris.redis_url``).

With ``solaris.eval_share`` the earlier stage has also predicted that share of the held-out pairs (drawn per
row from the seed), which are precomputed too.

The lookup is then replayed on up to three kinds of traffic, each at most ``solaris.lookups`` requests, and its
report (hit rate per fallback level, staleness, latency) printed and written:
- ``precomputed``: precomputed pairs (the serving stage asks for what the earlier stage predicted);
- ``unpredicted``: the rows of the stream the earlier stage did not predict, then those after the pass (the
  fallback);
- ``held_out``: the held-out pairs (``eval_share`` of them precomputed), where the data has a held-out split.

``solaris.output`` receives ``report.json``, the user index (``users.npz``), the default embedding
(``default.npz``) and, for the in-process backend, the cache itself (``cache.npz``); with Redis, entries the
server had not taken when the pass ended (it went away and did not come back) go to ``unflushed.npz`` instead of
being lost. ``solaris_lookup(config)`` opens them again for serving. The folder appears only once complete.

``build_solaris_join`` gives a student the pair embeddings as an input (``solaris.student_input``).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from gem_kunlun import Batch, FeatureSpec
from gem_trainer import builders
from gem_trainer.config import ConfigError, TrainerConfig
from gem_trainer.distributed import DistributedEnv
from gem_trainer.metrics import progress
from gem_trainer.step import autocast, autocast_dtype
from gem_transfer.solaris import (
    CacheError,
    DefaultEmbedding,
    FallbackLookup,
    LookupStats,
    MemoryCache,
    PairKeys,
    PrecomputeWorker,
    RedisCache,
    SolarisJoin,
    UserIndex,
    fresh_embeddings,
    load_entries,
    pair_keys,
    save_entries,
    served_embeddings,
)

TRAFFIC = ("precomputed", "unpredicted", "held_out")


def build_cache(config: TrainerConfig, clock=None) -> MemoryCache | RedisCache:
    """The cache of ``solaris.backend``; an unreachable Redis server is a one-line ``ConfigError``."""
    s = config.solaris
    if s.backend == "memory":
        return MemoryCache(s.ttl_s, s.recent, clock)
    try:
        return RedisCache(s.redis_url, s.ttl_s, s.recent, prefix=s.key_prefix, clock=clock)
    except CacheError as error:
        raise ConfigError(f"solaris.redis_url: {error}") from None


def check_features(config: TrainerConfig, spec: FeatureSpec) -> None:
    """The pair's item, group and user features must be sparse features of the data."""
    s, names = config.solaris, [f.name for f in spec.sparse]
    for field in ("item_feature", "group_feature", "user_feature"):
        name = getattr(s, field)
        if name is not None and name not in names:
            raise ConfigError(f"solaris.{field}: {name!r} is not a sparse feature of the data (it has {names})")


def _keys(config: TrainerConfig, batch: Batch) -> PairKeys:
    s = config.solaris
    try:
        return pair_keys(batch, s.item_feature, s.group_feature, s.user_feature, s.behaviour_dim)
    except ValueError as error:
        raise ConfigError(f"solaris: {error}") from None


def teacher_run_dir(config: TrainerConfig) -> str | None:
    return config.solaris.teacher_run_dir or config.distillation.teacher_run_dir


def build_scorer(config: TrainerConfig, spec: FeatureSpec, env: DistributedEnv) -> tuple[Callable[[Batch], torch.Tensor], int, int]:
    """The teacher of Solaris as ``score(batch) -> [B, R]`` (its representation of each row, on the CPU), its
    width ``R`` and its checkpoint step; a teacher trained on other features than ``spec`` is a one-line
    ``ConfigError``."""
    folder = teacher_run_dir(config)
    if folder is None:
        raise ConfigError("solaris: needs a teacher: solaris.teacher_run_dir or distillation.teacher_run_dir (a finished run)")
    as_teacher = config.model_copy(update={"distillation": config.distillation.model_copy(update={"teacher_run_dir": folder})})
    as_teacher = builders.pin_teacher_step(as_teacher)  # the checkpoint loaded is the one recorded
    step = as_teacher.distillation.teacher_step
    teacher, unsharded = builders.build_teacher(as_teacher, spec, env)
    precision = autocast_dtype(config.precision.autocast, env.device)

    def score(batch: Batch) -> torch.Tensor:
        with torch.no_grad(), autocast(env.device, precision):
            representation = teacher(batch.to(env.device)).representation
        if representation is None:
            raise ConfigError(f"solaris: the teacher at {folder} returns no representation to cache")
        return representation.float().cpu()

    return score, unsharded.representation_dim, step


def precompute(config: TrainerConfig, env: DistributedEnv) -> dict:
    """Runs the pass and the report; returns the report (also written to ``solaris.output/report.json``)."""
    s = config.solaris
    if env.world_size > 1:
        raise ConfigError("precompute runs in one process (its worker is a thread): run it without torchrun")
    if teacher_run_dir(config) is None:
        raise ConfigError("precompute needs solaris.teacher_run_dir or distillation.teacher_run_dir (the finished "
                          "teacher that scores the pairs)")
    if s.output is None:
        raise ConfigError("precompute needs solaris.output (a folder for its report, user index and cache)")
    output = Path(s.output)
    if output.exists():
        raise ConfigError(f"solaris.output: {output} already exists: remove it or choose another folder")
    if config.data.source in ("sequence_text", "atomic") and config.data.sequential.objective == "retrieval":
        raise ConfigError("solaris: precompute scores (user, candidate) rows: use data.sequential.objective = \"pointwise\"")
    data = builders.build_data(config, env, representations=False)  # the teacher reads the data as it trained
    check_features(config, data.spec)
    score, _, teacher_step = build_scorer(config, data.spec, env)
    cache = build_cache(config)
    if s.backend == "redis":
        try:
            earlier = cache.holds_entries()
        except CacheError as error:
            raise ConfigError(f"solaris.redis_url: {error}") from None
        if earlier:  # they would be served, and counted, as this pass's
            cache.close()
            raise ConfigError(f"solaris.key_prefix: the Redis server at {s.redis_url} already holds keys under "
                              f"{s.key_prefix!r} (an earlier precompute's): use another key_prefix, or delete them")
    index, default = UserIndex(s.behaviour_dim), DefaultEmbedding()
    worker = PrecomputeWorker(score, cache, index, default, queue_size=s.queue_batches)
    started = time.perf_counter()
    try:
        batches = iter(data.train)
        steps = math.ceil(s.pairs / config.data.batch_size)
        traffic: dict[str, list[PairKeys]] = {name: [] for name in TRAFFIC}
        predicted_rows = _predicted(s.train_share, config.seed + 13)
        for _ in progress(range(steps), steps, "precompute", config.metrics.progress_bar):
            batch = next(batches, None)
            if batch is None:
                break  # a finite source ended: its rows are all there is
            keys = _keys(config, batch)
            predicted = predicted_rows(batch.batch_size)
            worker.submit(batch, keys, predicted)
            traffic["precomputed"].append(keys.select(predicted))
            if len(predicted) < len(keys):
                traffic["unpredicted"].append(keys.select(np.setdiff1d(np.arange(len(keys)), predicted)))
        if not sum(map(len, traffic["precomputed"])):
            raise ConfigError("data: the training stream holds no rows to precompute")
        rows = sum(map(len, traffic["unpredicted"]))
        while rows < s.lookups and (batch := next(batches, None)) is not None:
            traffic["unpredicted"].append(_keys(config, batch))
            rows += batch.batch_size
        if data.eval_batches is not None:
            # the earlier stage's predictions of the serving traffic: each held-out row with probability eval_share
            predicted_rows = _predicted(s.eval_share, config.seed + 17)
            for batch in data.eval_batches():
                keys = _keys(config, batch)
                predicted = predicted_rows(batch.batch_size)
                if len(predicted):
                    worker.submit(batch, keys, predicted)
                traffic["held_out"].append(keys)
        counts = worker.close()
        pass_s = time.perf_counter() - started
        finished_at = time.time()  # every entry is written: the fixed clock of served student inputs
        lookup = FallbackLookup(cache, index, default, s.ttl_s, s.neighbours)
        report = {"teacher": {"run_dir": str(teacher_run_dir(config)), "step": teacher_step}, "backend": s.backend,
                  "keys": pair_key_settings(config),
                  # the data the pairs are rows of: a student reading other data would be served fallbacks
                  "seed": config.seed, "data": config.data.model_dump(mode="json"),
                  "global_batch_size": config.data.batch_size * env.world_size,
                  "train_share": s.train_share, "eval_share": s.eval_share, "finished_at": finished_at,
                  "worker": {**counts, "users": len(index), "pass_s": round(pass_s, 2),
                             "pairs_per_s": round(counts["written_pairs"] / max(pass_s, 1e-9), 1)},
                  "lookup": {name: replay(lookup, PairKeys.concat(keys).head(s.lookups))
                             for name, keys in traffic.items() if keys}}
        _publish(output, report, cache, index, default)
    except BaseException:
        worker.abort()
        raise
    finally:
        cache.close()
    return report


def _predicted(share: float, seed: int) -> Callable[[int], np.ndarray]:
    """The rows of each next batch of ``rows`` rows that the earlier stage predicted: each with probability
    ``share``, drawn from ``seed`` batch after batch (all of them at share 1)."""
    generator = torch.Generator().manual_seed(seed)

    def predicted(rows: int) -> np.ndarray:
        if share >= 1.0:
            return np.arange(rows)
        return torch.nonzero(torch.rand(rows, generator=generator) < share).flatten().numpy()

    return predicted


def replay(lookup: FallbackLookup, keys: PairKeys) -> dict:
    """Look every pair of ``keys`` up once, in order, with fresh statistics; returns their summary."""
    lookup.stats = LookupStats()
    for row in range(len(keys)):
        lookup.lookup(keys.users[row], keys.items[row], keys.groups[row], keys.behaviour[row])
    return lookup.stats.summary()


def _publish(output: Path, report: dict, cache, index: UserIndex, default: DefaultEmbedding) -> None:
    """Write the folder's files into a staging sibling and move it into place, so a pass cut short leaves none."""
    staging = output.with_name(f"{output.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    index.save(staging / "users.npz")
    default.save(staging / "default.npz")
    if isinstance(cache, MemoryCache):
        cache.save(staging / "cache.npz")
        report["cache_entries"] = len(cache)
    else:
        left = cache.flush()
        if left:
            save_entries(cache.unflushed(), staging / "unflushed.npz")
        report["unflushed_entries"] = left
    (staging / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    try:
        staging.rename(output)
    except OSError as error:  # another precompute into the same folder finished first
        shutil.rmtree(staging, ignore_errors=True)
        raise ConfigError(f"solaris.output: {output} could not be put in place ({error.strerror}): another precompute "
                          f"wrote it meanwhile; choose another folder") from None


def pair_key_settings(config: TrainerConfig) -> dict:
    """The settings that key a precompute's entries and user index: a lookup with others would miss every entry
    (or compare behaviour vectors of another width) and serve the default without a word."""
    s = config.solaris
    return {"item_feature": s.item_feature, "group_feature": s.group_feature, "user_feature": s.user_feature,
            "behaviour_dim": s.behaviour_dim, "key_prefix": s.key_prefix}


def solaris_lookup(config: TrainerConfig, clock=None) -> FallbackLookup:
    """The lookup over a finished precompute (``solaris.output``) with ``solaris.backend``: what serving uses."""
    s = config.solaris
    output = _finished_output(config)
    recorded = json.loads((output / "report.json").read_text()).get("keys")
    if recorded is None:
        raise ConfigError(f"solaris.output: {output} records no pair keys (an older precompute): run it again")
    differing = [f"solaris.{k}: {recorded.get(k)!r} there, {v!r} here" for k, v in pair_key_settings(config).items()
                 if recorded.get(k) != v and (k != "key_prefix" or s.backend == "redis")]
    if differing:
        raise ConfigError(f"solaris.output: the precompute at {output} keyed its pairs otherwise ({'; '.join(differing)})")
    try:
        index = UserIndex.load(output / "users.npz")
        default = DefaultEmbedding.load(output / "default.npz")
        if s.backend == "memory":
            cache = MemoryCache.load(output / "cache.npz", s.ttl_s, s.recent, clock)
        else:
            cache = build_cache(config, clock)
            if (output / "unflushed.npz").is_file():  # what the server had not taken when the pass ended
                cache.put(load_entries(output / "unflushed.npz"))
    except CacheError as error:
        raise ConfigError(f"solaris.output: {error}") from None
    return FallbackLookup(cache, index, default, s.ttl_s, s.neighbours, clock)


def _check_served_pass(config: TrainerConfig, global_batch: int) -> None:
    """A ``ConfigError`` unless the precompute at ``solaris.output`` was written by this run's teacher (where it names
    one) over this run's data, read in global batches of ``global_batch``: its pairs are rows of that data, and another
    data set's rows would miss every entry and be served fallbacks without a word."""
    output = _finished_output(config)
    report = json.loads((output / "report.json").read_text())
    teacher, written_by = teacher_run_dir(config), (report.get("teacher") or {}).get("run_dir")
    if teacher is not None and (written_by is None or Path(written_by).resolve() != Path(teacher).resolve()):
        raise ConfigError(f"solaris.output: the precompute at {output} was written by the teacher at {written_by}, this "
                          f"run's is {teacher}")
    if "data" not in report:
        raise ConfigError(f"solaris.output: {output} records no data (an older precompute): run it again")
    difference = builders.pass_difference(config, report, global_batch)
    if difference is not None:
        raise ConfigError(f"solaris.output: the precompute at {output} was written over other data than this run's "
                          f"({difference}): run it with this config")


def _finished_output(config: TrainerConfig) -> Path:
    output = Path(config.solaris.output) if config.solaris.output is not None else None
    if output is None or not (output / "report.json").is_file():
        raise ConfigError(f"solaris.output: {output} holds no finished precompute (run `gem-trainer precompute`)")
    return output


def _finished_at(config: TrainerConfig) -> float:
    """When the precompute at ``solaris.output`` finished writing (seconds since the epoch, from its report)."""
    path = _finished_output(config) / "report.json"
    try:
        return float(json.loads(path.read_text())["finished_at"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"solaris.output: {path} records no finish time ({error!r}): run `gem-trainer precompute` again") from None


def build_solaris_join(config: TrainerConfig, env: DistributedEnv, source) -> SolarisJoin:
    """``source`` whose batches carry the teacher's embedding of each example's pair, with the level that answered
    (``SolarisJoin``), as the representation feature ``solaris`` (``solaris.student_input``): computed by the
    teacher (``fresh``: every row ``exact``) or served by the lookup over the finished precompute at
    ``solaris.output`` (``served``). Served entries are judged fresh against the time the precompute finished
    (``report.json``'s ``finished_at``), so the input is the same however long the run lasts or whenever it
    resumes. The Redis backend still drops entries ``ttl_s`` of wall-clock time after they were written (the
    server expires them): read a long-lived precompute with the in-process backend."""
    s = config.solaris
    if s.student_input == "fresh" and env.world_size > 1:
        # NOTE: the trainer reads its data on a background thread; a sharded teacher there would run its
        # collectives beside the training step's on another thread, in no fixed order across ranks (a hang)
        raise ConfigError(f"solaris.student_input: \"fresh\" runs the teacher inside the data stream, which needs one "
                          f"process ({env.world_size} ranks here): use \"served\" or run without torchrun")
    check_features(config, source.spec)
    if s.student_input == "fresh":
        score, width, _ = build_scorer(config, source.spec, env)
        return SolarisJoin(source, fresh_embeddings(score), width)
    # NOTE: served embeddings are judged fresh against the precompute's finish time, not the wall clock: a run
    # longer than ttl_s, or one resumed later, would otherwise see its input turn into the default mid-run
    finished_at = _finished_at(config)
    _check_served_pass(config, config.data.batch_size * env.world_size)
    lookup = solaris_lookup(config, clock=lambda: finished_at)
    width = lookup.default.value().shape[0]
    if width == 0:  # no embedding was ever written: nothing fixes the input's width
        raise ConfigError(f"solaris.output: the precompute at {s.output} wrote no embeddings: run it again over data with rows")
    return SolarisJoin(source, served_embeddings(lookup, lambda batch: _keys(config, batch)), width)
