"""``gem-trainer posttrain``: the teacher's pass of offline distillation.

The finished teacher (``distillation.teacher_run_dir``) runs once, forward only, over this config's training
stream (the global batches the student will read, ``schedule.steps`` of them) and its logits go to the
soft-label store ``distillation.soft_labels`` (see ``gem_transfer.soft_labels``). Each rank scores its rows;
rank 0 gathers every rank's rows of a step and writes them, so each example of each step is written once.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from gem_trainer import builders
from gem_trainer.checkpoint import CheckpointManager
from gem_trainer.config import ConfigError, TrainerConfig
from gem_trainer.distributed import DistributedEnv
from gem_trainer.metrics import progress
from gem_trainer.run_folder import spec_record
from gem_trainer.step import autocast, autocast_dtype
from gem_transfer import SoftLabelWriter, example_fingerprints, queries_per_example


def posttrain(config: TrainerConfig, env: DistributedEnv) -> dict:
    """Writes the store; returns what was written (folder, steps, rows)."""
    d = config.distillation
    if d.teacher_run_dir is None or d.soft_labels is None:
        raise ConfigError("posttrain needs distillation.teacher_run_dir (the finished teacher) and "
                          "distillation.soft_labels (the folder to write)")
    if Path(d.soft_labels).exists():
        raise ConfigError(f"distillation.soft_labels: {d.soft_labels} already exists: remove it or choose another folder")
    data = builders.build_data(config, env)
    teacher, _ = builders.build_teacher(config, data.spec, env)
    teacher_step = CheckpointManager(Path(d.teacher_run_dir) / "checkpoints", keep_latest=1).latest_step()
    global_batch = config.data.batch_size * env.world_size
    meta = {"teacher": {"run_dir": str(d.teacher_run_dir), "step": teacher_step}, "spec": spec_record(data.spec),
            "global_batch_size": global_batch, "seed": config.seed, "data_source": config.data.source,
            "data_path": config.data.path}
    writer = SoftLabelWriter(d.soft_labels, meta) if env.rank == 0 else None
    precision = autocast_dtype(config.precision.autocast, env.device)
    batches = iter(data.train)
    steps = rows = 0
    try:
        show = config.metrics.progress_bar and env.rank == 0
        for step in progress(range(config.schedule.steps), config.schedule.steps, "posttrain", show):
            batch = next(batches, None)
            if batch is None:
                break  # the stream ended (a finite source): the store holds the steps it had
            fingerprints, queries = example_fingerprints(batch), queries_per_example(batch)
            with torch.no_grad(), autocast(env.device, precision):
                logits = teacher(batch.to(env.device)).logits.float().cpu()
            if env.world_size > 1:
                gathered: list = [None] * env.world_size
                dist.all_gather_object(gathered, (fingerprints, logits, queries))
                fingerprints, logits, queries = (torch.cat(parts) for parts in zip(*gathered))
            if writer is not None:
                writer.append(step, fingerprints, logits, queries)
            steps, rows = step + 1, rows + fingerprints.numel()
        folder = writer.close() if writer is not None else Path(d.soft_labels)
        if env.world_size > 1:
            dist.barrier()  # every rank returns once the store is in place
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return {"folder": str(folder), "steps": steps, "rows": rows, "teacher_step": teacher_step}
