"""The train loop: steps, gradient clipping, LR schedule, mixed precision, checkpoints, metrics, evaluation."""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gem_data import ProcessReadAhead, ReadAhead, rank_imbalance
from gem_kunlun import Batch, MixtureOfExperts
from gem_trainer import builders
from gem_trainer.checkpoint import CheckpointError, CheckpointManager
from gem_trainer.compile_cache import share_compiled_code
from gem_trainer.config import ConfigError, TrainerConfig
from gem_trainer.distributed import DistributedEnv
from gem_trainer.evaluators import Evaluator
from gem_trainer.step import autocast, autocast_dtype, training_loss
from gem_transfer import example_fingerprints
from gem_parallel import (
    SparseReplicas,
    apply_copy_engine_all_gather,
    clip_grad_norm_,
    gathered_parameters,
    mfu,
    peak_tflops,
    scaling_ratio,
)
from gem_trainer.console import quiet_library_notices
from gem_trainer.metrics import MetricLogger, memory_gib


quiet_library_notices()


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the run stops and keeps its last good checkpoint."""


@dataclass(frozen=True)
class ReadReport:
    """What the trainer notes of each batch where it is read (``Trainer._read_report``), handed out with it."""

    data: dict[str, float]  # per mixed source: examples read so far, scheduled share; the balancer's last report
    flops: float  # model FLOPs of the batch's training step (forward and backward; the teacher's forward)


def set_determinism(seed: int, deterministic: bool) -> tuple[bool, bool, bool] | None:
    """Seed the generators; ``deterministic``: deterministic algorithms on, returning the process's settings before
    (deterministic, warn only, cuDNN benchmark) for ``restore_determinism`` (the trainer restores them at close:
    other work of the process, another trainer or a test, would otherwise run under them)."""
    random.seed(seed)
    torch.manual_seed(seed)
    if not deterministic:
        return None
    import os

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    return before


def restore_determinism(before: tuple[bool, bool, bool] | None) -> None:
    if before is not None:
        enabled, warn_only, benchmark = before
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark


class Trainer:
    """Owns the sharded model, its optimizers, the data position and the step counter.

    ``state_dict`` splits into the distributed part (model and optimizer tensors, saved through DCP) and the
    local part (step, data position, RNG and LR schedule), which is what a restarted run needs to continue
    exactly where the last checkpoint left off.
    """

    def __init__(self, config: TrainerConfig, env: DistributedEnv, data: builders.DataSetup | None = None,
                 training: bool = True) -> None:
        """``data``: what to train on instead of what ``config.data`` describes (the training benchmark's batches);
        ``training`` false: a trainer that only evaluates, without the teacher or soft labels of distillation."""
        created = time.perf_counter()
        self.config, self.env = config, env
        self._determinism_before = set_determinism(config.seed, config.deterministic)
        if config.parallelism.compile_cache_dir is not None:  # before anything compiles
            try:
                share_compiled_code(config.parallelism.compile_cache_dir)
            except OSError as error:
                raise ConfigError(f"parallelism.compile_cache_dir: {error}") from None
        self.data = data if data is not None else builders.build_data(config, env)
        # NOTE: from here on every part (loop, LR schedule, logging, checkpoints, soft labels) sees the resolved steps
        config = self.config = builders.resolve_schedule(config, self.data, env)
        if config.schedule.epochs is not None:
            self._print(f"schedule.epochs {config.schedule.epochs:g} = {config.schedule.steps:,} steps of "
                        f"{config.data.batch_size * env.world_size:,} examples ({self.data.rows_per_epoch:,} rows per epoch)")
        self.spec = self.data.spec
        self.stream = self.data.train
        self._switch_interval_before: float | None = None
        self._unchecked_loss: tuple[int, torch.Tensor, torch.cuda.Event | None] | None = None
        self._check_ranking_is_possible()
        self.dims = builders.build_parallel_dims(config, env)
        self.meshes = self.dims.build_meshes(env.device.type)
        # NOTE: FLOPs are read off a second, unsharded meta copy: parallelising changes the model in place
        self.flop_model = builders.build_model(config, self.spec, device=torch.device("meta"))
        # offline distillation reads the teacher's stored logits; online, the teacher runs in every step
        self.soft_labels = builders.build_soft_labels(config, self.spec, env) if training else None
        # NOTE: loading the teacher leaves the random state alone, so the student draws the same dropout masks
        # whether its teacher runs online or was stored
        online_teacher = training and self.soft_labels is None and config.distillation.teacher_run_dir is not None
        if online_teacher:
            config = self.config = builders.with_teacher_step(config)
        with torch.random.fork_rng(devices=[env.device] if env.device.type == "cuda" else []):
            teacher = builders.build_teacher(config, self.spec, env) if online_teacher else None
        self.teacher, self.teacher_flop_model = teacher or (None, None)
        # NOTE: batches are read (and, for a GPU, page-locked) on a background thread one step ahead, so that
        # neither the reader nor the copy to the device holds up the training thread; or, with
        # data.read_ahead = false, in the step (depth 0: the same batches, without a thread); with
        # data.read_ahead_process, in a forked process (the same batches again, none of its Python in this process,
        # each moved to the device in one copy). The reader hands them out on the device, except under offline
        # distillation, whose lookup reads the host batch's examples. ``_read_report`` runs where they are read.
        reader = ProcessReadAhead if config.data.read_ahead_process else ReadAhead
        self.input = reader(self.stream, depth=2 if config.data.read_ahead else 0, pin=env.device.type == "cuda",
                            observe=self._read_report, device=env.device if self.soft_labels is None else None)
        self._batches = iter(self.input)
        model = builders.build_student(config, builders.build_model(config, self.spec, device=torch.device("meta")))
        self.low_precision_modules = builders.apply_low_precision(config, model)
        self.model = builders.parallelize_model(config, model, self.dims, self.meshes, env)
        if env.world_size > 1:
            # NOTE: every rank built the same weights from one seed; from here on each draws its own random numbers
            # (dropout), or the examples at one position of the ranks' slices would share their masks
            torch.manual_seed(config.seed + env.rank)
        self._modules = list(self.model.modules())
        self.sparse_replicas = SparseReplicas(self.model, self.meshes.sparse, config.parallelism.sparse_sync_every)
        self.optimizer, self.dense_optimizer, self._dense_adamw = builders.build_optimizers(config, self.model)
        self.scheduler = builders.build_lr_scheduler(config, self.dense_optimizer)
        # expert-parallel experts differ across their group: their norm is summed over it when clipping
        owned = {id(p) for m in self.model.modules() if isinstance(m, MixtureOfExperts) and self.dims.expert_enabled
                 for p in m.experts.parameters()}
        params = [p for group in self.dense_optimizer.param_groups for p in group["params"]]
        self.dense_params = [p for p in params if id(p) not in owned]
        self.expert_params = [p for p in params if id(p) in owned]
        self.expert_group = self.meshes.expert.get_group("expert") if self.dims.expert_enabled else None
        if env.collectives.copy_engine:
            apply_copy_engine_all_gather(self.model, env.device)
        elif env.collectives.fallback:
            self._print(f"parallelism.collectives: copy_engine unavailable ({env.collectives.fallback}); using nccl")
        if env.world_size > 1:
            self._print(f"parallelism: {env.world_size} ranks, {self.dims.describe()}, collectives "
                        f"{'copy_engine' if env.collectives.copy_engine else env.collectives.backend}")
        # on the device once: from pageable host memory, a copy every step would wait for the GPU's queue
        self.task_weights = builders.task_weights(config, self.spec).to(env.device)
        self.step = self.first_step = 0
        self._saved_step: int | None = None  # of the newest checkpoint this run wrote or resumed from
        self.stop_signal: int | None = None  # the run stops early, asked by this signal (request_stop; agreed by the ranks)
        self._asked: int | None = None  # the signal this rank was asked to stop by
        self.finishing = False  # past the last decision to stop early: the run ends as it would have
        self.checkpoints = CheckpointManager(Path(config.run_dir) / "checkpoints", config.checkpoint.keep_latest)
        if config.checkpoint.enable and config.checkpoint.asynchronous and env.device.type == "cuda":
            # NOTE: its start (seconds of imports) then overlaps the first steps instead of delaying the first save;
            # on a CPU, where short runs and evaluations build trainers that may never save, the first save starts it
            self.checkpoints.start_writer()
        self.logger = MetricLogger(config.run_dir, env.rank, tensorboard=config.metrics.tensorboard)
        skipped, examples = _skipped_rows(self.data)
        if skipped:
            self._print(f"data: skipped {skipped} bad rows (data.skip_bad_rows = true), e.g. {examples[0]}")
            self.logger.log(0, {"bad_rows": float(skipped)}, phase="data", echo=False)
        if self.data.mixer is not None:
            self._note_surfaces(self.data.mixer.alignment)
        self.peak = peak_tflops(env.device, config.metrics.peak_tflops)
        self.autocast_dtype = autocast_dtype(config.precision.autocast, env.device)
        self.cuda_graphs = builders.cuda_graphs(config, env.device, env.world_size)
        # what delays a job's first step: set-up (data readers, model, sharding plan, optimizers) here, then the
        # first step itself (first batch, kernel compilation and autotuning), timed in ``train``
        self.startup = {"setup_s": time.perf_counter() - created}
        # NOTE: last, so that a failed set-up leaves Python's setting alone (close() restores it)
        interval = switch_interval(config)
        if interval is not None:
            self._switch_interval_before = sys.getswitchinterval()
            sys.setswitchinterval(interval)

    def _check_ranking_is_possible(self) -> None:
        """Sampled ranking needs ``eval_negatives`` items outside every user's sequence: checked before training
        rather than found out after it."""
        s, ranking = self.config.data.sequential, self.data.ranking
        if ranking is None or "sampled" not in s.eval_protocols:
            return
        fewest = ranking.fewest_free_items(s.eval_split)
        if fewest < s.eval_negatives:
            before = " among the items rated before the ranked event" if s.eval_split in ("next_period", "offline_period") else ""
            raise ConfigError(f"data.sequential.eval_negatives ({s.eval_negatives}) exceeds the {fewest} items some user of "
                              f"{self.config.data.path} has not interacted with{before} ({s.eval_split} split): set it to "
                              f"at most {fewest}")

    # -- state -----------------------------------------------------------------------------------------------
    def distributed_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "world_size": self.env.world_size,
            "data": self.input.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    # dropout on a GPU draws from the device's generator, not the host's
                    **({"cuda": torch.cuda.get_rng_state(self.env.device)} if self.env.device.type == "cuda" else {})},
        }

    def load_state_dict(self, state: dict[str, Any], training: bool = True) -> None:
        """``training``: the run goes on, so its data stream continues at the saved position (an evaluation reads no
        training data: a global batch of another size, as another number of ranks gives, is no obstacle)."""
        self.step = state["step"]
        if training:
            self.input.load_state_dict(state["data"])
            self._batches = iter(self.input)
        # the scheduler's state holds the base learning rates it was built with: this config's take their place (a
        # changed optimizer.lr applies from the resumed step on, as the resume note says), and the rate it sets is
        # its factor at the resumed step times them (the state does not carry the rate last set on the optimizer)
        base_lrs = list(self.scheduler.base_lrs)
        self.scheduler.load_state_dict(state["scheduler"])
        self.scheduler.base_lrs = base_lrs
        last = self.scheduler.last_epoch
        self.scheduler._last_lr = [base * factor(last) for base, factor in zip(base_lrs, self.scheduler.lr_lambdas)]
        for group, lr in zip(self.dense_optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if "cuda" in state["rng"] and self.env.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.env.device)

    def save_checkpoint(self) -> None:
        self.check_divergence()  # never save the update of a step whose loss was not finite
        # NOTE: a checkpoint keeps one copy of each table shard: 2-D sparse replicas that drifted apart since their
        # last average (sparse_sync_every > 1) are averaged first, so that a resumed run continues as this one does
        self.sparse_replicas.sync()
        path = self.checkpoints.save(self.step, self.distributed_state(), self.state_dict(),
                                     asynchronous=self.config.checkpoint.asynchronous)
        self._saved_step = self.step
        self._print(f"checkpoint {path}" + (" (written in the background)" if self.config.checkpoint.asynchronous else ""))

    def resume(self, step: int | None = None, training: bool = True) -> bool:
        """Load checkpoint ``step`` (None: the newest intact one, skipping damaged newer ones with a line each);
        False when there is none. A damaged or missing ``step`` is a ``CheckpointError``. ``training``: the run
        continues from there, so the log's records of later steps go (it writes them again); an evaluation of an
        earlier checkpoint leaves the log as it is."""
        self.checkpoints.wait()
        if step is None:
            step, skipped = self.checkpoints.newest_intact()
            for line in skipped:
                self._print(f"warning: {line}")
            if step is None:
                return False
        else:
            self.checkpoints.require(step)
        # NOTE: optimizer state is created lazily on the first step; a dummy step materialises it so that DCP
        # can load into it in place. The weights it touches are overwritten by the load.
        self.optimizer.init_state()
        state = self.distributed_state()
        local = self.checkpoints.load(step, state)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        try:
            self.load_state_dict(local, training)
        except ValueError as error:
            raise ConfigError(f"checkpoint.resume: {self.checkpoints.path(step)}: {error}, or start a new run_dir") from None
        saved_world = local.get("world_size", self.env.world_size)
        resharded = f" (written by {saved_world} ranks, resharded to {self.env.world_size})" if saved_world != self.env.world_size else ""
        if resharded and self.env.world_size > 1:
            # NOTE: ranks the checkpoint has no random state of load rank 0's; each draws its own numbers again (as at
            # a start), from the seed, its rank and the step, or ranks would share their dropout masks
            torch.manual_seed(self.config.seed * 1_000_003 + self.step * 1_009 + self.env.rank)
        if training:
            self._drop_log_after(self.step)
        self._saved_step = self.step
        self._print(f"resumed from {self.checkpoints.path(step)} at step {self.step}{resharded}")
        return True

    # -- training ----------------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float | torch.Tensor]:
        """One step; ``loss`` (of the global batch) and ``grad_norm`` stay device tensors: reading either would
        make the host wait for the GPU, which then idles while the host prepares the next launches."""
        batch = next(self._batches)
        report: ReadReport = self.input.observed
        stored = None
        if self.soft_labels is not None:  # global batch `step`'s rows, found by example (the reader's are host batches)
            stored = self.soft_labels.lookup(self.step, example_fingerprints(batch)).to(self.env.device)
            batch = batch.to(self.env.device, non_blocking=True)
        # NOTE: ``train()`` sets a flag on every module through ``nn.Module.__setattr__``, a cost per step that
        # grows with the model; reading the flags is cheaper, and they change only when something (``evaluate``)
        # switched some module to eval mode
        if not all(m.training for m in self._modules):
            self.model.train()
        with self._autocast():
            if self.teacher is not None:
                with torch.no_grad():
                    teacher_logits = self.teacher(batch).logits.float()
                output = self.model(batch, teacher_logits)
            elif stored is not None:
                output = self.model(batch, stored)
            else:
                output = self.model(batch)
        loss = training_loss(output, batch, self.task_weights)
        # the loss of the global batch: with several ranks, the mean over all of their terms (see _weighted_by_share)
        global_loss = loss.detach().clone()
        if self.env.world_size > 1:
            loss, global_loss = self._weighted_by_share(loss, batch)
        # NOTE: the previous step's loss is read now, long computed, rather than this one's, which would stall the
        # host until this forward pass finished; on the reduced loss, so that every rank stops together
        self.check_divergence()
        self._unchecked_loss = (self.step + 1, *_copy_to_host(global_loss))
        loss.backward()
        clip = self.config.optimizer.grad_clip
        grad_norm = self.clip_gradients(clip if clip is not None else math.inf)
        self.dense_optimizer.step()
        self.dense_optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step used (stepping the scheduler sets the next one's)
        self.scheduler.step()
        self.step += 1
        self.sparse_replicas.maybe_sync(self.step)
        self._last_batch = batch
        return {
            "loss": global_loss,
            "grad_norm": grad_norm.detach(),
            "lr": lr,
            "examples": batch.batch_size,
            "flops": report.flops,
        }

    def _weighted_by_share(self, loss: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss x world_size x this rank's share of the global batch's loss terms, the global batch's loss)``;
        terms: examples, or retrieval queries.

        NOTE: a rank's loss is the mean over its own terms, and the ranks' gradients are averaged with equal weights:
        right only where every rank holds as many terms. They need not: a surface filter's slices differ by one
        example, every-position retrieval has one query per history event. Weighted by its share, each rank's loss
        makes the average the mean over the global batch, as one process computes it (a factor 1 where shares are
        equal). One all-reduce of two numbers per step, queued on the device."""
        terms = batch.next_items.num_queries if batch.next_items is not None else batch.batch_size
        # the loss's sum over this rank's terms and their count; filled on the device: no copy that waits for the GPU.
        # A rank without terms (its loss, a mean over none, is NaN) adds 0; its backward still runs (zero gradients)
        total = loss.detach() * terms if terms else torch.zeros((), device=loss.device)
        sums = torch.stack([total, torch.full((), float(terms), device=loss.device)])
        dist.all_reduce(sums)
        return loss * (terms * self.env.world_size / sums[1]), sums[0] / sums[1]

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Scale the dense gradients to a global norm of at most ``max_norm`` (inf: none); that norm, on the device."""
        return clip_grad_norm_(self.dense_params, max_norm, self.expert_params, self.expert_group,
                               optimizer=self._dense_adamw)

    def train(self, on_start: Callable[[], None] | None = None) -> dict[str, float]:
        """Train to ``schedule.steps`` from the newest intact checkpoint (or from the start); ``on_start``: called
        once resumed (or started over), before the first step (the CLI records the run there: a resume that fails
        leaves the record as it was)."""
        cfg = self.config
        if not (cfg.checkpoint.enable and cfg.checkpoint.resume and self.resume()):
            self._drop_log_after(self.step)  # nothing resumed: the run starts over, an earlier attempt's lines go
        # NOTE: from the resumed position: the examples the saved run read are the checkpoint's, whatever this run's
        # weights or ramp would have drawn (training only: evaluating a run reads no training stream)
        builders.check_mixture_reads(cfg, self.data)
        if on_start is not None:
            on_start()
        self.first_step = self.step  # where this process started (a resumed run counts from there)
        if self.step < cfg.schedule.steps:
            self._print(self._start_line())
        window_start, window_examples, window_flops = time.perf_counter(), 0, 0.0
        window_loss, window_steps = 0.0, 0  # summed on the device: read at the logged step only
        metrics: dict[str, float] = {}
        while self.step < cfg.schedule.steps:
            metrics = self.train_step()
            examples, flops = metrics.pop("examples"), metrics.pop("flops")
            window_loss, window_steps = window_loss + metrics["loss"].detach(), window_steps + 1
            logged = self.step % cfg.metrics.log_every == 0 or self.step == cfg.schedule.steps
            if self.step == self.first_step + 1:
                self._report_first_step(window_start)
                if not logged:
                    # NOTE: the first step's compilation and warm-up are reported apart (first_step_s): the first
                    # window's rates (examples/s, TFLOP/s, MFU) start after it, as every later window's do
                    window_start, examples, flops = time.perf_counter(), 0, 0.0
            window_examples += examples
            window_flops += flops
            if logged:
                if self.env.world_size > 1:  # every rank's: their slices may differ (a surface filter, balancing)
                    totals = torch.tensor([window_examples, window_flops], dtype=torch.float64, device=self.env.device)
                    dist.all_reduce(totals)
                    window_examples, window_flops = totals.tolist()
                elapsed = time.perf_counter() - window_start
                tflops = window_flops / elapsed / 1e12
                values = {k: float(v) for k, v in metrics.items()}
                line = {
                    "loss": values.pop("loss"),  # the logged step's
                    "loss_mean": float(window_loss) / window_steps,  # the steps' since the last logged one
                    **values,
                    "examples": window_examples,  # trained on since the last logged step, by every rank
                    "examples_per_s": window_examples / elapsed,
                    "tflops": tflops,
                    "memory_gib": memory_gib(self.env.device),
                }
                if self.peak is not None:
                    # end to end: model FLOPs of all ranks over all their peaks = local MFU x scaling ratio
                    line["mfu"] = mfu(tflops, self.peak, self.env.world_size)
                    single = cfg.metrics.single_device_examples_per_s
                    if single is not None:
                        line["scaling_ratio"] = scaling_ratio(line["examples_per_s"], single, self.env.world_size)
                        line["mfu_local"] = line["mfu"] / line["scaling_ratio"]
                line.update(self._data_metrics())
                self.logger.log(self.step, line)
                window_start, window_examples, window_flops = time.perf_counter(), 0, 0.0
                window_loss, window_steps = 0.0, 0
            paused = time.perf_counter()
            if cfg.checkpoint.enable and self.step % cfg.checkpoint.every_steps == 0:
                self.save_checkpoint()
            if cfg.eval.every_steps and self.step % cfg.eval.every_steps == 0 and self.step < cfg.schedule.steps:
                self.evaluate()
            # a save or an evaluation is not training: the window's rate (examples/s, TFLOP/s, MFU) leaves it out
            window_start += time.perf_counter() - paused
            if self._stopping():
                break
        # NOTE: the last decision, taken by every rank (a request that came after the last logged step counts too);
        # a request after it changes nothing: one rank alone must not leave its collectives to the others
        self._stopping(agree=True)
        self.finishing = True
        self.check_divergence()
        self.sparse_replicas.sync()  # the trained model is the replicas' average, checkpointed or not
        self.checkpoints.wait()
        # NOTE: not the newest folder's step: a damaged newest checkpoint, skipped by the resume, must be written anew
        if cfg.checkpoint.enable and self._saved_step != self.step:
            self.save_checkpoint()
            self.checkpoints.wait()
        return {k: float(v) for k, v in metrics.items()}

    def request_stop(self, signum: int) -> None:
        """Stop training after the current step (a checkpoint is written there, as at the end): what a preempted
        job's SIGTERM or a Ctrl-C asks (``gem-trainer train`` installs the handler). Once ``finishing``, too late."""
        self._asked = signum

    def _stopping(self, agree: bool = False) -> bool:
        """Whether to stop after this step (``stop_signal`` then names why). Several ranks decide together, at a
        logged step (``agree``: now): each says whether it was asked (an all-reduce of one number, where the host
        reads the step's metrics anyway), and a request to any rank stops them all."""
        if self.env.world_size > 1 and (agree or self.step % self.config.metrics.log_every == 0):
            asked = torch.tensor([self._asked or 0], device=self.env.device)
            dist.all_reduce(asked, op=dist.ReduceOp.MAX)
            self.stop_signal = int(asked.item()) or None
        elif self.env.world_size == 1:
            self.stop_signal = self._asked
        return self.stop_signal is not None

    def _start_line(self) -> str:
        """What this run trains, on what, and where it writes: the line it starts training with."""
        cfg = self.config
        sources = cfg.data.mixture.sources
        data = (f"a mixture of {', '.join(s.name for s in sources)}" if sources else
                "synthetic data" if cfg.data.source == "synthetic" else f"{cfg.data.source} {cfg.data.path}")
        start = f"from step {self.step} " if self.step else ""
        kept = (f"a checkpoint every {cfg.checkpoint.every_steps} steps" if cfg.checkpoint.enable else
                "no checkpoints (checkpoint.enable = false)")
        return (f"training {cfg.model.name} on {data} {start}to step {cfg.schedule.steps} ({self.env.world_size} "
                f"process{'es' if self.env.world_size > 1 else ''} on {self.env.device.type}); writing to "
                f"{cfg.run_dir}: metrics.jsonl, {kept}")

    def _report_first_step(self, started: float) -> None:
        """Time the first step (once: the host waits for the device here) and log the start-up times."""
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)
        self.startup["first_step_s"] = time.perf_counter() - started
        self.startup["time_to_first_step_s"] = self.startup["setup_s"] + self.startup["first_step_s"]
        self.logger.log(self.step, dict(self.startup), phase="startup", echo=False)
        self._print(f"first step done {self.startup['time_to_first_step_s']:.1f} s after the trainer was created "
                    f"(set-up {self.startup['setup_s']:.1f} s, first step {self.startup['first_step_s']:.1f} s)")

    def check_divergence(self) -> None:
        """Raise ``TrainingDiverged`` if the newest step not yet checked had a NaN or infinite loss.

        Checked one step late (see ``train_step``): the diverged step's update is applied in memory, but the run
        stops at the next step, before any checkpoint can hold it."""
        if self._unchecked_loss is None:
            return
        step, host, copied = self._unchecked_loss
        if copied is not None:
            copied.synchronize()
        value = float(host)
        if math.isfinite(value):
            self._unchecked_loss = None
        else:  # kept: every later check (a checkpoint, the next step) stops again
            failed = ""
            try:
                # a checkpoint still being written holds a step before this one: it is the good one to keep
                self.checkpoints.wait(agree=False)
            except CheckpointError as error:
                failed = f" (the checkpoint being written failed: {error})"
            last = self.checkpoints.latest_step()
            kept = f"the last good checkpoint is {self.checkpoints.path(last)}" if last is not None else "no checkpoint was written"
            raise TrainingDiverged(f"loss is {value} at step {step}; stopping, {kept}{failed}")

    def data_report(self) -> dict[str, float]:
        """What the readers skipped under ``data.skip_bad_rows`` (nothing when none were skipped)."""
        count, examples = _skipped_rows(self.data)
        return {"data/bad_rows": float(count)} if count else {}

    def _read_report(self, batch: Batch) -> ReadReport:
        """What is noted of ``batch`` (a host batch) where it is read: on the reading thread, to which the readers
        belong, under ``ReadAhead``; in the reading process under ``ProcessReadAhead``, off this process's
        interpreter. Delivered with the batch as ``self.input.observed``."""
        # NOTE: a surface (domain) id out of range would index past the heads' and gates' rows: on a GPU a device-side
        # assert that names nothing. The readers and the mixture check theirs; this catches any other source, for a
        # few microseconds a batch
        surface = batch.surface
        if surface.numel():
            low, high = (int(v) for v in torch.aminmax(surface))
            if low < 0 or high >= self.spec.num_surfaces:
                raise ValueError(f"data: a training batch has surface (domain) ids in [{low}, {high}], outside the data "
                                 f"spec's [0, {self.spec.num_surfaces})")
        data: dict[str, float] = {}
        if self.data.mixer is not None:
            mixer = self.data.mixer
            data.update({f"source_{name}": float(n) for name, n in mixer.counts().items()})
            data.update({f"share_{name}": share for name, share in mixer.shares(mixer.position - 1).items()})
        if self.data.balancer is not None:
            data.update({f"balance_{k}": v for k, v in self.data.balancer.last_report.items()})
        if self.data.surface_filter is not None:  # global batches without this domain's examples, skipped
            data.update({f"surfaces_skipped_{k}": float(v) for k, v in self.data.surface_filter.skipped.items()})
        # NOTE: counted on the host batch: on the device, reading its lengths would stall the host until the GPU
        # caught up, every step
        flops = 3.0 * sum(self.flop_model.flops(batch).values())
        if self.teacher_flop_model is not None:  # the teacher runs forward only
            flops += sum(self.teacher_flop_model.flops(batch).values())
        return ReadReport(data, flops)

    def _drop_log_after(self, step: int) -> None:
        note = self.logger.drop_after(step)
        if note is not None:
            self._print(f"note: {note}")

    def _note_surfaces(self, alignment) -> None:
        """Which surfaces (domains) each mixed source's examples carry, in one line, and a warning for sources of
        different data that share one (one head and one set of domain experts then serve both)."""
        spans = {name: alignment.surfaces_of(name) for name in alignment.names}
        described = ", ".join(f"{name} {r.start}" if len(r) == 1 else f"{name} {r.start}-{r.stop - 1}" for name, r in spans.items())
        self._print(f"data.mixture: surfaces (domains) of the sources: {described}")
        for a, b, common in alignment.shared_surfaces():
            self._print(f"warning: data.mixture.sources {a!r} and {b!r} lie in different id spaces but share surface(s) "
                        f"{common}; give them distinct data.mixture.sources[].surface values to keep their domains apart")

    def _data_metrics(self) -> dict[str, float]:
        """Examples read per mixed source, and sequence-token imbalance across ranks (max / mean)."""
        values: dict[str, float] = dict(self.input.observed.data) if self.input.observed is not None else {}
        if self.data.balancer is None and self.env.world_size > 1:
            values.update({f"rank_{k}": v for k, v in rank_imbalance(self._last_batch).items()})
        return values

    # -- evaluation --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics, identical on every rank: NE, AUC and calibration per task and surface, or, for
        next-item data, HR@K / NDCG@K / MRR for each configured protocol and seed."""
        # NOTE: 2-D sparse replicas drift apart between averages: the evaluated model is their average, as a
        # checkpoint's (every rank evaluates together)
        self.sparse_replicas.sync()
        self.model.eval()
        # NOTE: the dense parameters stay gathered for the whole evaluation: ranking calls model methods
        # other than forward, which FSDP2 does not hook
        evaluator = self.evaluator()
        with gathered_parameters(self.model, self.config.parallelism.reshard_after_forward):
            if self.data.ranking is None:
                result = evaluator.binary(self.data.eval_batches(), self.spec, total=self.config.data.eval_batches)
            else:
                result = evaluator.ranking(self.data.ranking, self.config.data.sequential, self.config.seed)
        self.logger.log(self.step, result, phase="eval", echo=False)
        return result

    def evaluated_split(self) -> str:
        """What ``evaluate`` reads, for its report: the next-item split (``data.sequential.eval_split``) or the
        held-out data, of ``data.mixture.eval_source`` in a mixture."""
        data = self.config.data
        split = f"{data.sequential.eval_split} split" if self.data.ranking is not None else "held-out split"
        evaluated = data.mixture.evaluated
        return split if evaluated is None else f"{split} of source {evaluated!r}"

    def evaluator(self) -> Evaluator:
        """The evaluation loops over this trainer's model (call with the parameters gathered, as ``evaluate``)."""
        return Evaluator(self.model, self.env, self._autocast, self.config.metrics.progress_bar and self.env.rank == 0)

    def close(self) -> None:
        try:
            # a save still being written completes (or says why not), then its writer stops; no barrier: on an
            # error path the other ranks may never get here
            self.checkpoints.close()
        finally:
            self.input.close()
            self.logger.close()
            if self._switch_interval_before is not None:
                sys.setswitchinterval(self._switch_interval_before)
                self._switch_interval_before = None
            restore_determinism(self._determinism_before)
            self._determinism_before = None

    def _autocast(self):
        return autocast(self.env.device, self.autocast_dtype, cache=not self.cuda_graphs)

    def _print(self, message: str) -> None:
        if self.env.rank == 0:
            print(message, flush=True)


def switch_interval(config: TrainerConfig) -> float | None:
    """The thread switch interval (seconds) a trainer of ``config`` sets while it lives: None where it leaves Python's
    own (no reader thread, or ``data.read_ahead_switch_ms`` = 0)."""
    data = config.data
    thread = data.read_ahead and not data.read_ahead_process
    return data.read_ahead_switch_ms / 1e3 if thread and data.read_ahead_switch_ms > 0 else None


def _copy_to_host(value: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A host copy of ``value`` queued behind the work that computes it, and the event that marks it done
    (None on the CPU, where the value is ready)."""
    if value.device.type != "cuda":
        return value, None
    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    host.copy_(value, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


def _skipped_rows(data) -> tuple[int, list[str]]:
    """Bad rows skipped by every reader behind ``data`` (a corpus or a table, possibly wrapped by streams)."""
    count, examples, seen = 0, [], set()
    pending = [data]
    while pending:
        item = pending.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(getattr(item, "bad_rows", None), int):
            count += item.bad_rows
            examples += list(getattr(item, "bad_row_examples", []))
        pending += [getattr(item, name, None) for name in ("train", "ranking", "corpus", "stream", "source", "table", "held_out")]
        sources = getattr(item, "sources", None)  # a mixture's streams
        if isinstance(sources, (list, tuple)):
            pending += sources
    return count, examples
