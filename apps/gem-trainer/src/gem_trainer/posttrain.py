"""``gem-trainer posttrain``: the teacher's pass of offline distillation and LoopFM.

The finished teacher (``distillation.teacher_run_dir``) runs once, forward only, over this config's training
stream (the global batches the student will read, ``schedule.steps`` of them, resolved from ``schedule.epochs``
as the student's training resolves them). From that one forward pass its logits go to the soft-label store
``distillation.soft_labels`` (see ``gem_transfer.soft_labels``) and, with ``loopfm.store``, a compact
representation of every example to the representation store (see ``gem_transfer.representation_store``); either
may be written alone. Each rank scores its rows; rank 0 gathers every rank's rows of a step and writes them, so
each example of each step is written once.

A retrieval teacher's scores of every sampled candidate are stored as they are; with ``distillation.top_k`` it
scores the whole catalogue instead and only its ``top_k`` best items other than the true next item are stored,
with the next item's logit (``gem_transfer.TopKLogits``): a store of catalogue-wide logits would hold ``num_items``
values per query. ``distillation.tail_samples`` adds that many items per query drawn uniformly from the rest of the
catalogue (a function of the seed and the step), weighted by how many items each stands for.

A pass cut short leaves no soft-label store, but the representation store keeps every finished part: run
again with the same config, it continues at the first step it lacks (the teacher reruns the earlier steps
only when soft labels are being written too). Each example is stored once, also where ``schedule.steps``
covers a finite data set more than once (the repeats of later epochs are left out).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
import torch.distributed as dist

from gem_trainer import builders
from gem_trainer.config import ConfigError, TrainerConfig
from gem_trainer.distributed import DistributedEnv
from gem_trainer.metrics import progress
from gem_trainer.run_folder import spec_record
from gem_trainer.step import autocast, autocast_dtype
from gem_transfer import (
    RepresentationError,
    RepresentationTap,
    RepresentationWriter,
    SoftLabelWriter,
    TopKLogits,
    example_fingerprints,
    example_times,
    example_users,
    queries_per_example,
    top_k_logits,
    without_sparse_key,
)


def tail_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """The generator of a top-k store's tail draws at ``step`` on ``rank``: a function of (seed, step, rank), so that a
    pass resumed or run again on as many ranks stores the same tails, and each rank draws its own (one stream for all
    drew nearly the same tail for the i-th query of every rank)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 65_537 + rank)


def posttrain(config: TrainerConfig, env: DistributedEnv) -> dict:
    """Writes the stores; returns what was written (folders, steps, rows)."""
    d, loop = config.distillation, config.loopfm
    top_k = d.top_k  # a retrieval teacher ranks the catalogue (the config checked the objective)
    if d.teacher_run_dir is None or (d.soft_labels is None and loop.store is None):
        raise ConfigError("posttrain needs distillation.teacher_run_dir (the finished teacher) and a folder to write: "
                          "distillation.soft_labels (its logits) and/or loopfm.store (its representations)")
    if d.soft_labels is not None and Path(d.soft_labels).exists():
        raise ConfigError(f"distillation.soft_labels: {d.soft_labels} already exists: remove it or choose another folder")
    data = builders.build_data(config, env, representations=False)
    config = builders.resolve_schedule(config, data, env)  # the steps the student's training will resolve to
    if loop.store is not None and loop.user_feature not in {f.name for f in data.spec.sparse}:
        raise ConfigError(f"loopfm.user_feature: {builders.user_feature_missing(loop.user_feature, data.spec)}")
    # what the teacher and the stores see: the data without the user feature where it is a key only
    key_only = loop.store is not None and loop.key_only
    try:
        spec = builders.model_spec(config, data.spec)
    except RepresentationError as error:
        raise ConfigError(f"loopfm.key_only: {error}") from None
    config = builders.pin_teacher_step(config)  # the checkpoint loaded is the one recorded
    teacher_step = config.distillation.teacher_step
    teacher, _ = builders.build_teacher(config, spec, env)
    global_batch = config.data.batch_size * env.world_size
    meta = {"teacher": {"run_dir": str(d.teacher_run_dir), "step": teacher_step}, "spec": spec_record(spec),
            "global_batch_size": global_batch, "seed": config.seed,
            # the whole data section: a resumed pass must read the same stream (surfaces, balance, mixture, ...)
            "data": config.data.model_dump(mode="json")}
    memory, tap, first_missing = None, None, 0
    if loop.store is not None:
        memory, problem = _representation_writer(config, env, meta)
        # every rank learns where the store stands (or why it cannot be written), so none waits on the others
        first_missing = _shared(env, problem or (memory.next_step if memory is not None else None))
        if isinstance(first_missing, str):
            raise ConfigError(first_missing)
        try:
            tap = RepresentationTap(teacher, loop.layer, loop.dim, loop.projection_seed)
        except ValueError as error:
            raise ConfigError(f"loopfm.layer: {error}") from None
    labels = SoftLabelWriter(d.soft_labels, meta) if env.rank == 0 and d.soft_labels is not None else None
    precision = autocast_dtype(config.precision.autocast, env.device)
    batches = iter(data.train)
    steps = rows = represented = 0
    # NOTE: a finite stream (Parquet, sequence files) starts again after its last batch; a user's history must
    # hold each example once, so an example already stored, by this pass or the one cut short, is not stored again
    stored: set[tuple[int, float, int]] = set()
    try:
        show = config.metrics.progress_bar and env.rank == 0
        for step in progress(range(config.schedule.steps), config.schedule.steps, "posttrain", show):
            batch = next(batches, None)
            if batch is None:
                break  # the stream ended (a finite source): the stores hold the steps it had
            steps = step + 1
            represent = tap is not None and step >= first_missing
            users = example_users(batch, loop.user_feature) if tap is not None else None
            if key_only:
                batch = without_sparse_key(batch, loop.user_feature)
            if tap is not None and not represent:
                _example_keys(env, users, batch, stored)  # stored by the pass cut short
            if d.soft_labels is None and not represent:
                continue  # stored by the pass that was cut short: the data moves on, the teacher rests
            fingerprints, queries = example_fingerprints(batch), queries_per_example(batch)
            scored = batch if top_k is None else _against_catalogue(batch)
            with torch.no_grad(), autocast(env.device, precision):
                output = teacher(scored.to(env.device))
            logits, items, log_weights = output.logits.float().cpu(), torch.empty(0, dtype=torch.int64), None
            if top_k is not None:
                try:
                    tail = tail_generator(config.seed, step, env.rank)
                    best = top_k_logits(logits, batch.next_items.positives, top_k, d.tail_samples, tail)
                except ValueError as error:
                    raise ConfigError(f"distillation.top_k / tail_samples: {error}") from None
                logits, items, log_weights = best.logits, best.items, best.log_weights
            rank_rows = [fingerprints, logits, queries, items]
            if represent:
                rank_rows += [users, example_times(batch), _vectors(tap, output, batch), _event_keys(batch, fingerprints)]
            if env.world_size > 1:
                gathered: list = [None] * env.world_size
                dist.all_gather_object(gathered, tuple(rank_rows))
                rank_rows = [torch.cat(parts) for parts in zip(*gathered)]
            fingerprints, logits, queries, items = rank_rows[:4]
            if labels is not None:
                labels.append(step, fingerprints, logits if top_k is None else TopKLogits(items, logits, log_weights), queries)
            if represent and memory is not None:
                users, times, vectors, events = rank_rows[4:]
                memory.append(step, users, _first_times(users, times, events, stored), vectors)
            rows += fingerprints.numel()
            represented += fingerprints.numel() if represent else 0
        folder = labels.close() if labels is not None else d.soft_labels
        if memory is not None:
            memory.close()
        if env.world_size > 1:
            dist.barrier()  # every rank returns once the stores are in place
    except BaseException:
        if labels is not None:
            labels.abort()
        if memory is not None:
            _keep_finished_steps(memory)
        raise
    finally:
        if tap is not None:
            tap.close()
    written = {"folder": None if folder is None else str(folder), "steps": steps, "rows": rows, "teacher_step": teacher_step}
    if loop.store is not None:
        written["representations"] = {"folder": str(loop.store), "resumed_at": first_missing, "rows": represented}
    return written


def _against_catalogue(batch):
    """``batch`` with each query scored against every item (the teacher's view for its top-k)."""
    targets = dataclasses.replace(batch.next_items, negatives=None, loss="softmax")
    return dataclasses.replace(batch, next_items=targets)


def _representation_writer(config: TrainerConfig, env: DistributedEnv, meta: dict) -> tuple[RepresentationWriter | None, str | None]:
    """Rank 0's writer of ``loopfm.store`` (new, or resumed where a pass cut short left it; None on the other
    ranks), or the one-line reason it cannot be written."""
    loop = config.loopfm
    if env.rank != 0:
        return None, None
    store_meta = {**meta, "dim": loop.dim, "layer": loop.layer, "projection": "gaussian", "projection_seed": loop.projection_seed,
                  "user_feature": loop.user_feature}
    try:
        return RepresentationWriter(loop.store, store_meta), None
    except RepresentationError as error:
        return None, f"loopfm.store: {error}"


def _vectors(tap: RepresentationTap, output, batch) -> torch.Tensor:
    try:
        return tap.vectors(output, batch.batch_size)
    except ValueError as error:
        raise ConfigError(f"loopfm.layer: {error}") from None


def _event_keys(batch, fingerprints: torch.Tensor) -> torch.Tensor:
    """What makes an example one event of its user: its fingerprint, without the negatives a retrieval example
    is sampled with (a later pass over the data draws others for the same event); ``fingerprints`` (with them)
    where there are none."""
    return fingerprints if batch.next_items is None else example_fingerprints(batch, negatives=False)


def _example_keys(env: DistributedEnv, users: torch.Tensor, batch, stored: set) -> None:
    """Add the (user, time, event key) of every example of this global batch to ``stored`` (on rank 0)."""
    keys = (users, example_times(batch), example_fingerprints(batch, negatives=False))
    if env.world_size > 1:
        gathered: list = [None] * env.world_size
        dist.all_gather_object(gathered, keys)
        keys = tuple(torch.cat(parts) for parts in zip(*gathered))
    if env.rank == 0:
        _first_times(*keys, stored)


def _first_times(users: torch.Tensor, times: torch.Tensor, events: torch.Tensor, stored: set) -> torch.Tensor:
    """``times`` with NaN (not stored) for the examples already in ``stored``, which then holds every example."""
    times = times.clone()
    for row, key in enumerate(zip(users.tolist(), times.tolist(), events.tolist())):
        if key in stored:
            times[row] = float("nan")
        elif not math.isnan(key[1]):  # an example without events has no time and is never stored
            stored.add(key)
    return times


def _shared(env: DistributedEnv, value: int | str | None) -> int | str:
    """Rank 0's ``value`` on every rank."""
    if env.world_size > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    return value


def _keep_finished_steps(memory: RepresentationWriter) -> None:
    """A pass stopping (an error, Ctrl-C): the steps already scored become a part, so a rerun does not redo them."""
    try:
        memory.flush()
    except Exception:  # noqa: BLE001 - the original error is the one to report; the rerun redoes these steps
        pass
