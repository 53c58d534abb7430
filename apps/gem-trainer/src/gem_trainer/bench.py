"""Training benchmark of the Kunlun model on one GPU: the trainer, a bare loop of the same model, and the same model
written the plain-PyTorch way.

    python -m gem_trainer.bench --config apps/gem-trainer/configs/bench-h200.toml \
        --out benchmarks/results/train-h200.json

The variants train the same model (same config, same batches) in one process:

- ``gem``: ``gem-trainer train``'s own step (``Trainer.train_step``: TorchRec-sharded tables with their fused
  row-wise Adagrad, FSDP2, the read-ahead of page-locked host batches, the divergence check, FLOP counting) on
  gem-kernels' Triton kernels (jagged BlockAttention, GDPA for pFFN and PMA, fused LayerNorm, rotary);
- ``bare``: the trainer's own model and optimizers (its sharded tables, their fused row-wise Adagrad, fused AdamW
  with the configured gradient clipping) in a bare loop over batches already on the device, as many as the trainer
  stepped through; ``gem`` over ``bare`` is the trainer's overhead;
- ``plain``: the model with ``kernel="builtin"`` in a loop of its own: unsharded tables with plain SGD, fused AdamW,
  FlexAttention for BlockAttention, ``varlen_attn`` (FlashAttention-2 varlen) for PMA, padded batched matmuls for
  the pointwise pFFN, unfused ``F.layer_norm``.

All three run with bf16 autocast; ``gem`` and ``bare`` compile each MoE alone where the trainer does
(``parallelism.compile_experts``), ``plain`` runs its per-expert loop eagerly.
Batches are drawn here: ``--sparse-features`` pooled id features, two event types whose merged history per
example has log-normal length (``--mean-len``, clipped to ``[16, --max-len]``). The lengths are drawn once and
kept for every step (ids, timestamps, dense features and labels are fresh), so every step has the same shapes
and the same FLOPs. Model FLOPs come from ``model.flops(batch)`` (forward, real lengths, x3 for training).

Per variant: warm-up steps, timed steps back to back (one device sync at the end: ``step_ms``, the rate
training sees, from which examples/s and MFU follow), for ``plain`` also each step between syncs
(``step_ms_median``), then a few steps under
``torch.profiler`` whose GPU time is attributed to model components (``gem::<component>`` ranges entered by
module hooks; backward kernels are matched to the forward op that created their autograd node by sequence
number). Writes JSON: meta (device, versions, commit, date, command), checks, one entry per variant and the
ratio. Each of ``--trainer-configs`` runs ``gem`` and ``bare`` on its own data, and a config that compiles its
blocks (``parallelism.compile``) runs them again eager, beside it (``uncompiled``, ``compile_speedup``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import platform
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from gem_kernels.ops.triton import _tuning
from gem_kunlun import Batch, EventSequence, EventType, FeatureSpec, KunlunModel, SparseFeature
from gem_kunlun.norm import LayerNorm
from gem_parallel import PEAK_TFLOPS as PEAK_TABLE
from gem_parallel import peak_tflops
from gem_trainer.builders import DataSetup
from gem_trainer.config import load_config
from gem_trainer.provenance import git_commit
from gem_trainer.step import autocast, autocast_dtype, training_loss

VARIANTS = ("gem", "bare", "plain")
KERNELS = {"gem": "auto", "plain": "builtin"}  # the model's kernel choice in each variant
# examples/s the trainer must reach on these configs (their own data), and its overhead over a bare loop
TRAINER_TARGETS = {"beauty-sasrec.toml": {"examples_per_s": 40_000, "trainer_overhead": 1.25},
                   "beauty-kunlun.toml": {"examples_per_s": 15_000}}


def device_peak(device: torch.device) -> float:
    """The MFU denominator: the device's dense bf16 datasheet peak (``gem_parallel``'s table: an H100 PCIe or NVL card
    runs at lower clocks than the SXM parts); the H100 / H200 SXM figure where the table has none (a CPU run, whose
    MFU means nothing)."""
    return peak_tflops(device) or PEAK_TABLE["H200"]


# --- data ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BenchData:
    batch_size: int
    sparse_features: int = 100
    vocab: int = 4096
    ids_per_feature: int = 4
    mean_len: float = 1024.0
    max_len: int = 8192
    min_len: int = 16
    sigma: float = 0.8
    event_vocab: int = 100_000
    num_dense: int = 16
    num_tasks: int = 2
    num_surfaces: int = 3
    seed: int = 0

    def spec(self) -> FeatureSpec:
        sparse = tuple(SparseFeature(f"f{i:03d}", self.vocab) for i in range(self.sparse_features))
        events = (
            EventType("click", (SparseFeature("click_item", self.event_vocab), SparseFeature("click_author", self.event_vocab // 4))),
            EventType("view", (SparseFeature("view_item", self.event_vocab), SparseFeature("view_author", self.event_vocab // 4))),
        )
        tasks = tuple(f"task{i}" for i in range(self.num_tasks))
        return FeatureSpec(num_dense=self.num_dense, sparse=sparse, events=events, tasks=tasks,
                           num_surfaces=self.num_surfaces)


def lognormal_lengths(data: BenchData, generator: torch.Generator) -> torch.Tensor:
    """``[B]`` int64 history lengths: log-normal with arithmetic mean ``mean_len`` before clipping to
    ``[min_len, max_len]``."""
    mu = math.log(data.mean_len) - data.sigma**2 / 2
    z = torch.randn(data.batch_size, generator=generator, dtype=torch.float64)
    return torch.exp(mu + data.sigma * z).round().clamp(data.min_len, data.max_len).long()


class BenchBatches:
    """Fresh random batches of fixed per-example history lengths (see the module docstring)."""

    def __init__(self, data: BenchData) -> None:
        self.data, self.spec = data, data.spec()
        self.generator = torch.Generator().manual_seed(data.seed)
        total = lognormal_lengths(data, self.generator)
        self.click = (total * 0.6).round().long()
        self.view = total - self.click
        self.total = total

    def _kjt(self, features, lengths: torch.Tensor, ids_per_row: torch.Tensor | None = None):
        from torchrec import KeyedJaggedTensor

        g = self.generator
        values, all_lengths = [], []
        for f in features:
            n = lengths if ids_per_row is None else ids_per_row
            values.append(torch.randint(0, f.num_embeddings, (int(n.sum()),), generator=g))
            all_lengths.append(n)
        return KeyedJaggedTensor(keys=[f.name for f in features], values=torch.cat(values),
                                 lengths=torch.cat(all_lengths))

    def next(self) -> Batch:
        d, g, b = self.data, self.generator, self.data.batch_size
        bag_sizes = torch.randint(1, 2 * d.ids_per_feature, (len(self.spec.sparse), b), generator=g)
        from torchrec import KeyedJaggedTensor

        sparse = KeyedJaggedTensor(
            keys=[f.name for f in self.spec.sparse],
            values=torch.randint(0, d.vocab, (int(bag_sizes.sum()),), generator=g),
            lengths=bag_sizes.flatten(),
        )
        sequences = {}
        for event, lengths in zip(self.spec.events, (self.click, self.view)):
            # timestamps increase within each example (seconds over ~30 days), as a log would have them
            n = int(lengths.sum())
            times = torch.rand(n, generator=g, dtype=torch.float64) * 30 * 86400
            example = torch.repeat_interleave(torch.arange(b), lengths)
            times = times[torch.argsort(example * 1e8 + times)].float()
            sequences[event.name] = EventSequence(ids=self._kjt(event.features, lengths), timestamps=times)
        return Batch(
            dense=torch.randn(b, d.num_dense, generator=g),
            sparse=sparse,
            sequences=sequences,
            labels=(torch.rand(b, d.num_tasks, generator=g) < 0.3).float(),
            surface=torch.randint(0, d.num_surfaces, (b,), generator=g),
        )


class CycledBatches:
    """Host batches as a resumable ``BatchSource`` that cycles through them (what the trainer variant reads)."""

    def __init__(self, batches: list[Batch], spec: FeatureSpec) -> None:
        self.batches, self.spec, self.position = batches, spec, 0

    def __iter__(self):
        while True:
            batch = self.batches[self.position % len(self.batches)]
            self.position += 1
            yield batch

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


# --- model and optimizers --------------------------------------------------------------------------------------

def build_variant(config, spec: FeatureSpec, kernel: str, device: torch.device, seed: int) -> KunlunModel:
    """The configured Kunlun model with every op and norm on ``kernel``; equal seeds give equal weights."""
    torch.manual_seed(seed)
    model_config = dataclasses.replace(config.model.kunlun.build(), kernel=kernel)
    model = KunlunModel(spec, model_config, device=torch.device("cpu"))
    return model.to(device)


def embedding_parameters(model: nn.Module) -> list[nn.Parameter]:
    from torchrec import EmbeddingBagCollection, EmbeddingCollection

    return [p for m in model.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
            for p in m.parameters()]


def build_optimizers(model: nn.Module, config, device: torch.device):
    """Fused AdamW for the dense parameters, plain SGD for the embedding tables (the simple sparse update of an
    unsharded model; the trainer's fused row-wise Adagrad needs sharded TorchRec)."""
    sparse = embedding_parameters(model)
    sparse_ids = {id(p) for p in sparse}
    dense = [p for p in model.parameters() if id(p) not in sparse_ids]
    o = config.optimizer
    fused = {"fused": True} if device.type == "cuda" else {}
    return (torch.optim.AdamW(dense, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, **fused),
            torch.optim.SGD(sparse, lr=o.sparse_lr))


def bench_autocast(device: torch.device):
    """bf16 on CUDA (the trainer's ``precision.autocast = "auto"``), none on CPU."""
    return autocast(device, autocast_dtype("auto", device))


def train_step(model, optimizers, batch: Batch, task_weights: torch.Tensor, device) -> torch.Tensor:
    with bench_autocast(device):
        out = model(batch)
    with torch.profiler.record_function("gem::loss"):
        loss = training_loss(out, batch, task_weights)
    loss.backward()
    with torch.profiler.record_function("gem::optimizer"):
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return loss.detach()


# --- component ranges for the profiler -------------------------------------------------------------------------

def component_modules(model: KunlunModel) -> list[tuple[str, nn.Module]]:
    """Modules whose forward gets a ``gem::<name>`` range; the innermost range owns a kernel."""
    encoder, trunk = model.encoder, model.trunk
    named = [("sequence_merge", encoder),  # what the encoder does besides embedding: truncation, time-ordered merge
             ("embedding", encoder.embedding), ("final_summary", trunk.final_summary), ("mlp_heads", trunk.mlp),
             ("mlp_heads", model.heads)]
    for enc in encoder.event_encoders.values():
        named.append(("event_encoders", enc))
    for layer in trunk.layers:
        named.append(("layer_glue", layer))  # token mixing, concatenations, residual adds
        named.append(("compress", layer.compress_mlp))
        for part in ("summary", "moe", "pffn", "attention"):
            module = getattr(layer, part)
            if module is not None:
                named.append((part, module))
    named += [("norm", m) for m in model.modules() if isinstance(m, (LayerNorm, nn.LayerNorm))]
    return named


@contextlib.contextmanager
def component_ranges(model: KunlunModel):
    """Enter ``gem::<component>`` profiler ranges around the forward of each component module, for as long as
    the context is open."""
    stack, handles = [], []

    # NOTE: run eagerly, outside any compiled region: a compiled module (the trainer's MoEs) would otherwise trace
    # its hooks into its graph, where the ranges no longer wrap its kernels
    def enter(name):
        @torch._dynamo.disable
        def hook(module, args):
            rf = torch.profiler.record_function(f"gem::{name}")
            rf.__enter__()
            stack.append(rf)
        return hook

    @torch._dynamo.disable
    def leave(module, args, output):
        stack.pop().__exit__(None, None, None)

    for name, module in component_modules(model):
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _device_time(event) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, attr):
            return float(getattr(event, attr))
    return 0.0


def _component_of(event) -> str | None:
    e = event
    while e is not None:
        if e.name.startswith("gem::"):
            return e.name.removeprefix("gem::")
        e = e.cpu_parent
    return None


def _cpu_time(event) -> float:
    return float(getattr(event, "self_cpu_time_total", 0.0))


def attribute_device_time(events, steps: int, time_of=_device_time) -> dict[str, dict[str, float]]:
    """Milliseconds of GPU kernel time (``time_of``: of each event's own work) per step, per component, split
    into forward and backward.

    A kernel belongs to the innermost ``gem::`` range around the op that launched it (forward, loss, optimizer);
    a backward kernel belongs to the component whose forward op created its autograd node (same sequence
    number). What matches neither is ``other``. ``ops`` names each component's costliest launching ops (the op
    and the op that called it), so that casts and copies are found where they are made.
    """
    by_sequence: dict[int, str] = {}
    for e in events:
        seq = getattr(e, "sequence_nr", -1)
        if seq is not None and seq >= 0 and not e.name.startswith("autograd::engine"):
            component = _component_of(e)
            if component is not None:
                by_sequence.setdefault(seq, component)
    table: dict[str, dict[str, float]] = defaultdict(lambda: {"fwd_ms": 0.0, "bwd_ms": 0.0})
    ops: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in events:
        # NOTE: only host-side ops: a kernel's time is counted once, as its launching op's own device time (the
        # device-side copies of kernels and of the gem:: ranges would count it again)
        if "CPU" not in str(getattr(e, "device_type", "CPU")):
            continue
        t = time_of(e)
        if t <= 0:
            continue
        component, phase = _component_of(e), "fwd_ms"
        if component is None:
            phase = "bwd_ms"
            node = e
            while node is not None and not node.name.startswith("autograd::engine::evaluate_function"):
                node = node.cpu_parent
            seq = getattr(node, "sequence_nr", -1) if node is not None else -1
            component = by_sequence.get(seq, "other") if node is not None else "other"
            if node is None:
                phase = "fwd_ms"
        table[component][phase] += t / 1000.0 / steps
        caller = e.cpu_parent.name if e.cpu_parent is not None else "-"
        ops[component][f"{phase[:3]} {e.name} < {caller}"] += t / 1000.0 / steps
    out = {}
    for k, v in sorted(table.items(), key=lambda kv: -(kv[1]["fwd_ms"] + kv[1]["bwd_ms"])):
        costliest = sorted(ops[k].items(), key=lambda kv: -kv[1])[:8]
        out[k] = {"fwd_ms": round(v["fwd_ms"], 3), "bwd_ms": round(v["bwd_ms"], 3),
                  "total_ms": round(v["fwd_ms"] + v["bwd_ms"], 3), "ops": {n: round(t, 3) for n, t in costliest}}
    return out


def top_kernels(prof, steps: int, n: int = 15) -> list[dict]:
    rows = []
    for e in prof.key_averages():
        t = _device_time(e)
        # NOTE: the components' own labels (gem::...) also show as GPU ranges spanning their kernels: not kernels
        if e.key.startswith("gem::"):
            continue
        if t > 0 and getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
            rows.append({"kernel": e.key[:120], "ms_per_step": round(t / 1000.0 / steps, 3), "calls": e.count // steps})
    return sorted(rows, key=lambda r: -r["ms_per_step"])[:n]


# --- one variant ------------------------------------------------------------------------------------------------

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(name: str, kernel: str, config, batches: list[Batch], flops_per_step: float, args, device,
                log) -> dict:
    """``plain``: the model with every op on ``kernel``, unsharded, in a bare loop over batches on the device."""
    spec = args.spec
    result: dict = {"kernel": kernel}
    fresh_peak(device)
    model = build_variant(config, spec, kernel, device, config.seed)
    optimizers = build_optimizers(model, config, device)
    weights = torch.ones(len(spec.tasks), device=device)

    def step(i):
        return train_step(model, optimizers, batches[i % len(batches)], weights, device), flops_per_step

    warm_up(name, step, result, args, device, log)
    step_times = []
    for i in range(args.steps):
        sync(device)
        start = time.perf_counter()
        step(i)
        sync(device)
        step_times.append(time.perf_counter() - start)
    result["step_ms_median"] = round(sorted(step_times)[len(step_times) // 2] * 1e3, 2)
    timed_back_to_back(name, step, result, args.batch_size, args.steps, device, log)
    if args.profile_steps > 0:
        profile_components(name, model, step, result, args, device, log)
    del model, optimizers
    return result


def run_trainer(config_path: str, overrides: list[str], data: DataSetup | None, args, device, log,
                profile: bool) -> dict[str, dict]:
    """``gem`` and ``bare`` for one trainer config (``data``: its batches, or None for the config's own data):

    - ``gem``: ``Trainer.train_step`` back to back, the batches read from host memory as the trainer reads any;
    - ``bare``: the same model and optimizers in a bare loop (forward, loss, backward, the gradient clipping the
      config trains with, optimizer step) over batches already on the device: the same update as the trainer's, none
      of its reading, copying, checks and metrics; ``gem`` over ``bare`` is the trainer's overhead."""
    import tempfile

    from gem_trainer.distributed import init_distributed
    from gem_trainer.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [*overrides, f"run_dir={run_dir}", f"device={device.type}", "checkpoint.enable=false",
                     "metrics.tensorboard=false", "metrics.progress_bar=false"]
        config = load_config(Path(config_path), overrides)
        env = init_distributed(config.device, config.parallelism.collectives)
        fresh_peak(device)
        trainer = Trainer(config, env, data=data)
        if args.checkpoint_every > 0:
            # NOTE: checkpoints are off in this config (the measurement saves by itself), so the trainer did not
            # start its writer; a training run with asynchronous checkpoints does, when it is built
            trainer.checkpoints.start_writer()
        try:
            gem: dict = {"kernel": _kernel_of(config), "step": "Trainer.train_step"}

            def trainer_step(i):
                metrics = trainer.train_step()
                return metrics["loss"], metrics["flops"]

            sync(device)
            started = time.perf_counter()
            trainer_step(0)
            sync(device)
            gem["startup"] = {"setup_s": round(trainer.startup["setup_s"], 2),
                              "first_step_s": round(time.perf_counter() - started, 2)}
            log(f"[gem] trainer set-up {gem['startup']['setup_s']} s, first step {gem['startup']['first_step_s']} s")
            warm_up("gem", trainer_step, gem, args, device, log)
            steps = args.steps if data is not None else args.config_steps
            timed_back_to_back("gem", trainer_step, gem, config.data.batch_size, steps, device, log)
            if profile and args.profile_steps > 0:
                profile_components("gem", trainer.model.module, trainer_step, gem, args, device, log)
            if args.checkpoint_every > 0:
                measure_checkpoints(trainer, trainer_step, gem, args, device, log)

            # NOTE: as many batches as the trainer stepped through its timed steps: on a config's own (jagged) data
            # a few cycled batches would do other work than the trainer's fresh ones
            count = args.batches if data is not None else steps
            batches, flops = [], []
            for _ in range(count):  # each batch's step FLOPs as the trainer's reader counted them
                batches.append(next(trainer._batches).to(device))
                flops.append(trainer.input.observed.flops)
            bare: dict = {"kernel": gem["kernel"], "step": "the trainer's model and optimizers (clipping as configured), "
                                                           "batches on the device"}
            clip = config.optimizer.grad_clip

            def bare_step(i):
                batch = batches[i % len(batches)]
                with trainer._autocast():
                    output = trainer.model(batch)
                loss = training_loss(output, batch, trainer.task_weights)
                loss.backward()
                if clip is not None:
                    trainer.clip_gradients(clip)
                trainer.dense_optimizer.step()
                trainer.dense_optimizer.zero_grad(set_to_none=True)
                return loss.detach(), flops[i % len(batches)]

            warm_up("bare", bare_step, bare, args, device, log)
            timed_back_to_back("bare", bare_step, bare, config.data.batch_size, steps, device, log)
        finally:
            trainer.close()
    del trainer
    return {"gem": gem, "bare": bare, "trainer_overhead": round(gem["step_ms"] / bare["step_ms"], 3)}


def measure_checkpoints(trainer, step, result: dict, args, device, log) -> None:
    """What a checkpoint costs the training. Steps run back to back from the save call on: after a synchronous
    save ``args.checkpoint_steps`` of them, after an asynchronous one as many as run until its write is marked (at
    least ``args.checkpoint_steps``), so that the whole background write falls inside the window. A window's stall
    is its time less as many steps at the pace of the same steps without a save, timed just before it. Each of
    ``args.checkpoint_rounds`` rounds times the pace and both modes; the median round's stall is reported. The stall
    over ``args.checkpoint_every`` steps is the cost share of checkpointing."""
    n = args.checkpoint_steps

    def save(asynchronous: bool) -> float:
        """Seconds the training waits for a save of the current state."""
        start = time.perf_counter()
        trainer.checkpoints.save(trainer.step, trainer.distributed_state(), trainer.state_dict(), asynchronous=asynchronous)
        return time.perf_counter() - start

    def window(mode: str | None) -> tuple[float, int, float]:
        """(seconds, steps, seconds blocked in the save call) from the save to the last step's end."""
        sync(device)
        start = time.perf_counter()
        blocked = save(mode == "asynchronous") if mode is not None else 0.0
        steps = 0
        while steps < n or trainer.checkpoints.writing():
            step(steps)
            steps += 1
        sync(device)
        elapsed = time.perf_counter() - start
        trainer.checkpoints.wait()
        return elapsed, steps, blocked

    # the first asynchronous save also allocates the page-locked staging buffers, once per run: timed apart
    sync(device)
    first_call = save(asynchronous=True)
    trainer.checkpoints.wait()
    rounds = []
    for _ in range(args.checkpoint_rounds):
        pace_s, pace_steps, _ = window(None)
        row = {"pace_ms": round(pace_s / pace_steps * 1e3, 2)}
        for mode in ("synchronous", "asynchronous"):
            elapsed, steps, blocked = window(mode)
            stall = elapsed - steps * pace_s / pace_steps  # kept as timed
            # NOTE: the training waits at least as long as the save call blocks it; a stall timed below that (even
            # below 0: a few noisy steps set the pace) is the steps' own spread, and the cost counts the call
            cost = max(stall, blocked)
            row[mode] = {"save_call_ms": round(blocked * 1e3, 1), "steps": steps, "stall_ms": round(stall * 1e3, 1),
                         "cost_share": round(cost / (args.checkpoint_every * result["step_ms"] / 1e3 + cost), 4),
                         **({"stall_below_save_call": True} if stall < blocked else {})}
        rounds.append(row)
    start = time.perf_counter()
    save(asynchronous=True)
    trainer.checkpoints.wait()
    written = time.perf_counter() - start
    folder = trainer.checkpoints.path(trainer.step)
    median = {mode: sorted((r[mode] for r in rounds), key=lambda m: m["stall_ms"])[len(rounds) // 2]
              for mode in ("synchronous", "asynchronous")}
    result["checkpoint"] = {
        "every_steps": args.checkpoint_every, "min_steps_timed": n,
        "size_gb": round(sum(f.stat().st_size for f in folder.iterdir()) / 1e9, 3),
        "write_s": round(written, 2),  # save to marker, nothing else running: must fit between two saves
        "write_fits_between_saves": written < args.checkpoint_every * result["step_ms"] / 1e3,
        "first_asynchronous_save_call_ms": round(first_call * 1e3, 1),
        **median,
        "rounds": rounds,
    }
    log(f"[checkpoint] {json.dumps(result['checkpoint'])}")


def _kernel_of(config) -> str | None:
    return getattr(getattr(config.model, config.model.name).build(), "kernel", None)


def fresh_peak(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def warm_up(name: str, step, result: dict, args, device, log) -> None:
    t0 = time.perf_counter()
    losses = [float(step(i)[0]) for i in range(args.warmup)]
    sync(device)
    result["warmup_s"] = round(time.perf_counter() - t0, 2)
    log(f"[{name}] warm-up {args.warmup} steps in {result['warmup_s']} s, losses {[round(x, 4) for x in losses]}")


def timed_back_to_back(name: str, step, result: dict, batch_size: int, steps: int, device, log) -> None:
    """Time ``steps`` calls of ``step(i)`` (returning the loss and the step's model FLOPs) with one device sync
    at the end, as training runs; fill ``result`` with the rates."""
    sync(device)
    start = time.perf_counter()
    outputs = [step(i) for i in range(steps)]
    sync(device)
    step_s = (time.perf_counter() - start) / steps
    losses = [float(loss) for loss, _ in outputs]
    tflops = sum(f for _, f in outputs) / steps / step_s / 1e12
    result.update({
        "steps_timed": steps,
        "step_ms": round(step_s * 1e3, 2),
        "examples_per_s": round(batch_size / step_s, 1),
        "tflops": round(tflops, 1),
        "mfu_local": round(tflops / device_peak(device), 4),
        "final_loss": round(losses[-1], 5),
        "loss_finite": all(math.isfinite(x) for x in losses),
    })
    if device.type == "cuda":
        result["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
    log(f"[{name}] {result['step_ms']} ms/step, {result['examples_per_s']} ex/s, {result['tflops']} TFLOP/s, "
        f"MFU {result['mfu_local']:.3f}, peak {result.get('peak_memory_gb')} GB")


def profile_components(name: str, model: KunlunModel, step, result: dict, args, device, log) -> None:
    """``args.profile_steps`` calls of ``step(i)`` under the profiler (after ``timed_back_to_back``): GPU time per
    component, GPU idle time (the timed step not covered by kernels) and the top kernels."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync(device)
    start = time.perf_counter()
    with component_ranges(model), torch.profiler.profile(activities=activities) as prof:
        for i in range(args.profile_steps):
            step(i)
        sync(device)
    wall_ms = (time.perf_counter() - start) * 1e3 / args.profile_steps
    # NOTE: on CPU there are no kernels: the ops' own CPU time stands in (the smoke test's path)
    breakdown = attribute_device_time(prof.events(), args.profile_steps,
                                      _device_time if device.type == "cuda" else _cpu_time)
    # the host's side: each component's ops' own CPU time (inflated by the profiler's own work, so read across
    # components, not against the step): where a step waits on its launches, the components that make it wait
    host = attribute_device_time(prof.events(), args.profile_steps, _cpu_time)
    # per component: its share of the (unprofiled) step and, where the model counts its FLOPs, the rate it reaches
    flops = component_flops(args.flop_table)
    for component, times in breakdown.items():
        times["host_ms"] = host.get(component, {}).get("total_ms", 0.0)
        times["share_of_step"] = round(times["total_ms"] / result["step_ms"], 4)
        if flops.get(component) and times["total_ms"] > 0:
            times["tflops"] = round(3.0 * flops[component] / (times["total_ms"] / 1e3) / 1e12, 1)
    result["components_ms_per_step"] = breakdown
    result["profiled_gpu_ms_per_step"] = round(sum(v["total_ms"] for v in breakdown.values()), 2)
    result["profiled_wall_ms_per_step"] = round(wall_ms, 2)  # slowed by the profiler's own host work
    # idle: the unprofiled step time not covered by the profiled steps' kernels
    result["gpu_idle_ms_per_step"] = round(max(0.0, result["step_ms"] - result["profiled_gpu_ms_per_step"]), 2)
    result["top_kernels"] = top_kernels(prof, args.profile_steps)
    log(f"[{name}] components (ms/step): " + ", ".join(f"{k} {v['total_ms']}" for k, v in breakdown.items()))
    log(f"[{name}] components' host ms/step (profiled): " + ", ".join(
        f"{k} {v['total_ms']}" for k, v in sorted(host.items(), key=lambda kv: -kv[1]["total_ms"])))


def component_flops(table: dict[str, float]) -> dict[str, float]:
    """``model.flops`` (forward FLOPs per ``layerN.<part>`` and top-level key) summed per benchmark component."""
    names = {"mlp": "mlp_heads", "heads": "mlp_heads", "embedding.dense_proj": "embedding"}
    out: dict[str, float] = defaultdict(float)
    for key, value in table.items():
        part = key.split(".", 1)[1] if key.startswith("layer") else key
        out[names.get(part, part)] += value
    return dict(out)


# --- checks on the device ---------------------------------------------------------------------------------------

def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def check_ops(device) -> list[dict]:
    """Our kernels and the builtin route against the fp32 reference on random jagged inputs (fwd and grads)."""
    from gem_kernels import block_attention, gdpa, layer_norm, qkv_rotary, qkv_rotary_attention, rotary

    g = torch.Generator(device="cpu").manual_seed(1)
    lengths = [700, 1, 64, 129, 0, 333, 1500]
    off = torch.tensor([0] + lengths).cumsum(0).to(device)
    T, H, D = int(off[-1]), 4, 128
    checks = []

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device)

    cases = {
        "block_attention": (lambda q, k, v, kern: block_attention(q, k, v, off, block_size=64, window_blocks=8,
                                                                  max_seq_len=1500, kernel=kern, validate=False),
                            (T, H, D), (T, H, D)),
        "pma": (lambda q, k, v, kern: gdpa(q, k, v, None, off, max_seq_len_kv=1500, kernel=kern, validate=False),
                (8, H, D), (T, H, D)),
        "pffn_gelu": (lambda q, k, v, kern: gdpa(q, k, v, off, torch.arange(0, 8 * 8, 8, device=device),
                                                 activation="gelu", max_seq_len_q=1500, max_seq_len_kv=8,
                                                 kernel=kern, validate=False),
                      (T, H, D), (7 * 8, H, D)),
    }
    for name, (fn, q_shape, kv_shape) in cases.items():
        base = [rand(*q_shape) * 0.5, rand(*kv_shape) * 0.5, rand(*kv_shape)]
        ref_in = [x.clone().requires_grad_() for x in base]
        ref = fn(*ref_in, "pytorch")
        do = torch.randn(ref.shape, generator=g).to(device)
        ref_grads = torch.autograd.grad(ref, ref_in, do)
        for kern in ("auto", "builtin"):
            try:
                xs = [x.to(torch.bfloat16).requires_grad_() for x in base]
                out = fn(*xs, kern)
                grads = torch.autograd.grad(out, xs, do.to(out.dtype))
                row = {"op": name, "kernel": kern, "out_rel_err": round(rel_err(out, ref), 5)}
                for n, a, b in zip("qkv", grads, ref_grads):
                    row[f"d{n}_rel_err"] = round(rel_err(a, b), 5)
                row["ok"] = all(v < 3e-2 for k, v in row.items() if k.endswith("rel_err"))
            except Exception as e:  # a route missing on this torch: record it, the benchmark goes on
                row = {"op": name, "kernel": kern, "error": f"{type(e).__name__}: {e}"[:300], "ok": False}
            checks.append(row)
    x, r = rand(4096, 512), rand(4096, 512)
    w, b = rand(512), rand(512)
    ref = layer_norm(x, w, b, kernel="pytorch")
    for kern in ("auto", "builtin"):
        out = layer_norm(x.bfloat16(), w.bfloat16(), b.bfloat16(), kernel=kern)
        checks.append({"op": "layer_norm", "kernel": kern, "out_rel_err": round(rel_err(out, ref), 5),
                       "ok": rel_err(out, ref) < 1e-2})
    # a float32 stream normalised straight into the bf16 its matmul reads (the models' norms under autocast)
    out = layer_norm(x, w, b, kernel="auto", out_dtype=torch.bfloat16)
    err = rel_err(out, ref)
    checks.append({"op": "layer_norm", "kernel": "auto", "out_dtype": "bfloat16", "out_rel_err": round(err, 5),
                   "ok": out.dtype == torch.bfloat16 and err < 1e-2})
    del r
    q, k = rand(T, H, D).requires_grad_(), rand(T, H, D).requires_grad_()
    positions = torch.rand(T, generator=g).to(device) * 15
    ref = rotary(q, k, positions, kernel="pytorch")
    seeds = [torch.randn(T, H, D, generator=g).to(device) for _ in range(2)]
    ref_grads = torch.autograd.grad(ref, (q, k), seeds)
    for kern in ("auto", "builtin"):
        xs = [x.detach().to(torch.bfloat16).requires_grad_() for x in (q, k)]
        out = rotary(*xs, positions, kernel=kern)
        grads = torch.autograd.grad(out, xs, [s.bfloat16() for s in seeds])
        row = {"op": "rotary", "kernel": kern, "out_rel_err": round(max(rel_err(a, b) for a, b in zip(out, ref)), 5),
               "dq_rel_err": round(rel_err(grads[0], ref_grads[0]), 5), "dk_rel_err": round(rel_err(grads[1], ref_grads[1]), 5)}
        row["ok"] = all(v < 1e-2 for key, v in row.items() if key.endswith("rel_err"))
        checks.append(row)
    # the fused projection split: q, k rotated and v copied in one pass, the projection's gradient in one pass
    qkv = torch.stack([q.detach(), k.detach(), rand(T, H, D)], 1).requires_grad_()
    ref = qkv_rotary(qkv, positions, kernel="pytorch")
    seeds.append(rand(T, H, D))
    ref_grad = torch.autograd.grad(ref, qkv, seeds)[0]
    fused_in = qkv.detach().bfloat16().requires_grad_()
    out = qkv_rotary(fused_in, positions, kernel="auto")
    grad = torch.autograd.grad(out, fused_in, [s.bfloat16() for s in seeds])[0]
    row = {"op": "qkv_rotary", "kernel": "auto", "out_rel_err": round(max(rel_err(a, b) for a, b in zip(out, ref)), 5),
           "dqkv_rel_err": round(rel_err(grad, ref_grad), 5)}
    row["ok"] = all(v < 1e-2 for key, v in row.items() if key.endswith("rel_err"))
    checks.append(row)
    # rotary attention on the projection's buffer (rotation in place, the gradient written whole, dq / dk rotated back)
    ref_in = qkv.detach().clone().requires_grad_()
    ref = block_attention(*qkv_rotary(ref_in, positions, kernel="pytorch"), off, block_size=64, window_blocks=8,
                          max_seq_len=1500, kernel="pytorch", validate=False)
    ref_grad = torch.autograd.grad(ref, ref_in, seeds[0])[0]
    fused_in = qkv.detach().bfloat16().requires_grad_()
    out = qkv_rotary_attention(fused_in * 1, positions, off, 1500, block_size=64, window_blocks=8, kernel="auto",
                               validate=False)
    grad = torch.autograd.grad(out, fused_in, seeds[0].bfloat16())[0]
    row = {"op": "qkv_rotary_attention", "kernel": "auto", "out_rel_err": round(rel_err(out, ref), 5),
           "dqkv_rel_err": round(rel_err(grad, ref_grad), 5)}
    row["ok"] = all(v < 3e-2 for key, v in row.items() if key.endswith("rel_err"))
    checks.append(row)
    return checks


# the model check's bounds: bf16 rounding between two correct variants stays well inside them
MODEL_CHECK_BOUNDS = {"logits_rel_err_plain_vs_gem": 3e-2, "grad_rel_err_plain_vs_gem": 5e-2}


def check_model_agreement(config, args, device) -> dict:
    """The two variants' logits and the gradients of their weights on one small batch with equal weights
    (bf16 autocast): they compute one function, forward and backward.

    NOTE: in evaluation mode, where the experts drop nothing. In training mode an expert's capacity drops the
    assignments past it, so one top-k choice flipped by a rounding difference between the variants drops others
    and moves the whole batch's logits far beyond rounding (the H200 runs of 855bf07 read 0.21 so, where
    perturbing the norms' weights by a bf16 rounding on the CPU moved them as far whenever it rerouted). The experts
    each variant chose are compared too: the values are only comparable when they agree."""
    data = BenchData(batch_size=8, sparse_features=args.sparse_features, mean_len=200, max_len=1024, seed=7)
    batch = BenchBatches(data).next().to(device)
    spec = data.spec()
    logits, grads, routing = {}, {}, {}
    for name, kernel in KERNELS.items():
        model = build_variant(config, spec, kernel, device, config.seed).eval()
        with bench_autocast(device):
            logits[name] = model(batch).logits.float()
        logits[name].square().mean().backward()
        grads[name] = {n: p.grad.float().flatten() for n, p in model.named_parameters() if p.grad is not None}
        routing[name] = [layer.moe.last_stats.assigned.tolist() for layer in model.trunk.layers]
        logits[name] = logits[name].detach()
        del model
    shared = sorted(set(grads["gem"]) & set(grads["plain"]))
    gem_grads, plain_grads = (torch.cat([grads[v][n] for n in shared]) for v in ("gem", "plain"))
    check = {"batch_size": 8, "mode": "eval",
             "logits_rel_err_plain_vs_gem": round(rel_err(logits["gem"], logits["plain"]), 5),
             "grad_rel_err_plain_vs_gem": round(rel_err(gem_grads, plain_grads), 5), "parameters_compared": len(shared),
             "routing_equal": routing["gem"] == routing["plain"], "bounds": MODEL_CHECK_BOUNDS}
    check["ok"] = check["routing_equal"] and all(check[k] < bound for k, bound in MODEL_CHECK_BOUNDS.items())
    return check


# --- provenance ---------------------------------------------------------------------------------------------------

def meta(device, argv, program: str = "gem_trainer.bench") -> dict:
    """Provenance of a benchmark run: date, command, commit, versions, device."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": f"python -m {program} " + " ".join(argv),
        "commit": git_commit(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        # small models are host-bound: their rates depend on the host's CPU as much as on the GPU
        "host_cpu": _host_cpu(),
        "peak_tflops_bf16": device_peak(device),
    }
    for pkg in ("triton", "torchrec", "fbgemm_gpu"):
        try:
            info[pkg] = __import__(pkg).__version__
        except Exception:
            info[pkg] = None
    return info


def _host_cpu() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown"
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{names[0]} ({len(names)} logical CPUs)" if names else "unknown"


# --- main ---------------------------------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m gem_trainer.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="trainer config; --section.field=value arguments override it")
    p.add_argument("--out", required=True)
    p.add_argument("--device", default=None, help="cuda or cpu (default: the config's device, cuda when available)")
    p.add_argument("--variants", default="gem,plain",
                   help=f"a comma list of {', '.join(VARIANTS)} (gem also measures bare: the same trainer)")
    p.add_argument("--trainer-configs", default="",
                   help="more trainer configs (a comma list of files) whose gem and bare steps run on their own data")
    p.add_argument("--config-steps", type=int, default=200, help="timed steps of each --trainer-configs run")
    p.add_argument("--trainer-override", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="an override for every --trainer-configs run (e.g. data.path=...); repeatable")
    p.add_argument("--checkpoint-every", type=int, default=200,
                   help="checkpoint interval the gem variant's checkpoint cost is judged at (0: not measured)")
    p.add_argument("--checkpoint-steps", type=int, default=20,
                   help="steps timed after each measured save (after an asynchronous one: until it is written, if longer)")
    p.add_argument("--checkpoint-rounds", type=int, default=3, help="rounds of the checkpoint measurement (median kept)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--batches", type=int, default=4, help="distinct batches drawn up front and cycled")
    p.add_argument("--batch-size", type=int, default=None, help="default: the config's data.batch_size")
    p.add_argument("--sparse-features", type=int, default=100)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--mean-len", type=float, default=1024.0)
    p.add_argument("--max-len", type=int, default=None, help="default: the model's max_seq_len")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--tuned", help="kernel tile configs to launch as they are (JSON, as --save-tuned or gem-kernels' "
                                   "run_all writes them); with GEM_KERNELS_AUTOTUNE=1 every other kernel shape is "
                                   "tuned at its first launch")
    p.add_argument("--save-tuned", help="write the tile configs of every kernel shape the run launched to this JSON")
    args, rest = p.parse_known_args(argv)
    unknown = [a for a in rest if not (a.startswith("--") and "=" in a and "." in a.split("=")[0])]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [a.removeprefix("--") for a in rest]  # --section.field=value, as the trainer's CLI takes them
    args.spec = None
    return args


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    config = load_config(Path(args.config), args.overrides)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and config.device != "cpu" else "cpu"))
    model_config = config.model.kunlun.build()
    args.batch_size = args.batch_size or config.data.batch_size
    data = BenchData(batch_size=args.batch_size, sparse_features=args.sparse_features, vocab=args.vocab,
                     mean_len=args.mean_len, max_len=args.max_len or model_config.max_seq_len, seed=config.seed)
    args.spec = data.spec()
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    doc = {"meta": meta(device, argv), "config": {}, "checks": {}, "variants": {}, "errors": []}
    doc["meta"]["kernel_autotune"] = _tuning.autotune_enabled()
    if args.tuned:
        _tuning.load_tuned(args.tuned)

    def write():
        out_path.write_text(json.dumps(doc, indent=1))

    source = BenchBatches(data)
    host_batches = [source.next() for _ in range(args.batches)]
    batches = [b.to(device) for b in host_batches]
    flops_model = KunlunModel(args.spec, model_config, device=torch.device("meta"))
    table = flops_model.flops(batches[0])
    args.flop_table = table  # every step has these lengths, hence these FLOPs
    del flops_model
    forward = sum(table.values())
    flops_per_step = 3.0 * forward
    lengths = source.total.clamp(max=model_config.max_seq_len).float()
    doc["config"] = {
        "file": args.config,
        "model": {k: v for k, v in dataclasses.asdict(model_config).items() if k != "events"},
        "batch_size": args.batch_size, "sparse_features": args.sparse_features, "sparse_vocab": args.vocab,
        "event_types": [e.name for e in args.spec.events],
        "lengths": {"distribution": f"log-normal, sigma {data.sigma}, mean {data.mean_len} before clipping to "
                                    f"[{data.min_len}, {data.max_len}]; drawn once, fixed for every step",
                    "mean": round(float(lengths.mean()), 1), "median": float(lengths.median()),
                    "max": int(lengths.max()), "tokens_per_batch": int(lengths.sum())},
        "forward_gflop_per_example": round(forward / args.batch_size / 1e9, 3),
        "train_tflop_per_step": round(flops_per_step / 1e12, 3),
        "forward_flop_share": {k: round(v / forward, 4) for k, v in sorted(table.items(), key=lambda kv: -kv[1])},
        "precision": "bf16 autocast" if device.type == "cuda" else "fp32",
        "optimizers": "gem and bare: the trainer's (fused AdamW dense with the configured gradient clipping, fused "
                      "row-wise Adagrad in the sharded tables' backward); plain: fused AdamW (dense), SGD (unsharded "
                      "embedding tables)",
        "timing": "step_ms: steps back to back, one device sync at the end (examples/s, TFLOP/s and MFU follow "
                  "from it); step_ms_median (plain): each step between device syncs",
        "compile": "ROTE: the Triton rotary kernel (gem, bare), PyTorch's ops compiled (plain); FlexAttention compiled "
                   "(plain); the rest runs eagerly (jagged, data-dependent shapes)",
        "moe": "gem and bare: each MoE compiled alone where the trainer compiles it (parallelism.compile_experts); "
               "plain: the per-expert loop, eager",
        "startup": "gem's setup_s and first_step_s are measured after the checks ran in the same process (the CUDA "
                   "context made, shared kernels compiled): a fresh gem-trainer train pays those too",
        "warmup": args.warmup, "steps": args.steps, "profile_steps": args.profile_steps,
    }
    log(f"forward {doc['config']['forward_gflop_per_example']} GFLOP/example, {doc['config']['train_tflop_per_step']} "
        f"TFLOP/step, lengths {doc['config']['lengths']}")
    write()

    if not args.skip_checks and device.type == "cuda":
        # NOTE: the checks' small shapes are not the step's (``untuned``)
        try:
            with _tuning.untuned():
                doc["checks"]["ops"] = check_ops(device)
                doc["checks"]["model"] = check_model_agreement(config, args, device)
            log(f"checks: {json.dumps(doc['checks'])}")
            failed = [c["op"] for c in doc["checks"]["ops"] if not c["ok"]]
            failed += [] if doc["checks"]["model"]["ok"] else ["model"]
            if failed:
                doc["errors"].append(f"checks failed: {failed}")
        except Exception as e:
            doc["errors"].append(f"checks: {type(e).__name__}: {e}"[:500])
            traceback.print_exc()
        write()

    for name in filter(None, args.variants.split(",")):
        if name not in VARIANTS or name == "bare":
            raise SystemExit(f"--variants: {name!r} is not one of gem, plain (bare comes with gem)")
        try:
            if name == "gem":
                bench_data = DataSetup(args.spec, CycledBatches(host_batches, args.spec))
                overrides = [*args.overrides, f"data.batch_size={args.batch_size}"]
                rows = run_trainer(args.config, overrides, bench_data, args, device, log, profile=True)
                doc["variants"]["gem"], doc["variants"]["bare"] = rows["gem"], rows["bare"]
            else:
                doc["variants"][name] = run_variant(name, KERNELS[name], config, batches, flops_per_step, args, device, log)
        except Exception as e:  # out of memory or a missing route: record it and go on with the other variant
            doc["errors"].append(f"{name}: {type(e).__name__}: {e}"[:500])
            traceback.print_exc()
        fresh_peak(device)
        write()

    for path in filter(None, args.trainer_configs.split(",")):
        try:
            rows = run_trainer(path, args.trainer_override, None, args, device, log, profile=False)
            if load_config(Path(path), args.trainer_override).parallelism.compile != "off":
                # what compiling gains, measured beside it: the same config with its blocks eager
                eager = run_trainer(path, [*args.trainer_override, "parallelism.compile=off"], None, args, device, log,
                                    profile=False)
                rows["uncompiled"] = {"gem": eager["gem"], "bare": eager["bare"]}
                rows["compile_speedup"] = {k: round(eager[k]["step_ms"] / rows[k]["step_ms"], 3)
                                           for k in ("gem", "bare")}
                log(f"[{path}] compiled over eager (step time): {rows['compile_speedup']}")
            goals = TRAINER_TARGETS.get(Path(path).name, {})
            rows["targets"] = {f"{k} {'<=' if k == 'trainer_overhead' else '>='} {v}":
                               (rows[k] <= v if k == "trainer_overhead" else rows["gem"][k] >= v) for k, v in goals.items()}
            doc.setdefault("trainer_configs", {})[path] = rows
            log(f"[{path}] trainer overhead {rows['trainer_overhead']}, targets {rows['targets']}")
        except Exception as e:
            doc["errors"].append(f"{path}: {type(e).__name__}: {e}"[:500])
            traceback.print_exc()
        fresh_peak(device)
        write()

    v = doc["variants"]
    targets = {}
    if "gem" in v:
        targets["mfu_local >= 0.30"] = v["gem"]["mfu_local"] >= 0.30
    if "gem" in v and "plain" in v:
        doc["gem_vs_plain"] = {"examples_per_s_ratio": round(v["gem"]["examples_per_s"] / v["plain"]["examples_per_s"], 3)}
        targets["examples_per_s >= 1.5x plain"] = doc["gem_vs_plain"]["examples_per_s_ratio"] >= 1.5
    if "gem" in v and "bare" in v:
        doc["trainer_overhead"] = round(v["gem"]["step_ms"] / v["bare"]["step_ms"], 3)
        targets["trainer_overhead <= 1.10"] = doc["trainer_overhead"] <= 1.10
    if "checkpoint" in v.get("gem", {}):
        c = v["gem"]["checkpoint"]
        targets[f"checkpoint every {c['every_steps']} steps <= 2% of step time"] = c["asynchronous"]["cost_share"] <= 0.02
    doc["targets"] = targets
    doc["meta"]["tuned_configs"] = {repr(k): v for k, v in _tuning.tuned_configs().items()}
    if args.save_tuned:
        _tuning.save_tuned(args.save_tuned)
    doc["log"] = lines
    write()
    print_table(doc)
    return doc


def print_table(doc) -> None:
    v = doc["variants"]
    print(f"\n{'variant':8s} {'ms/step':>9s} {'ex/s':>9s} {'TFLOP/s':>8s} {'MFU':>6s} {'peak GB':>8s}")
    for name, r in v.items():
        print(f"{name:8s} {r['step_ms']:9.1f} {r['examples_per_s']:9.1f} {r['tflops']:8.1f} "
              f"{r['mfu_local']:6.3f} {str(r.get('peak_memory_gb')):>8s}")
    profiled = {n: r["components_ms_per_step"] for n, r in v.items() if "components_ms_per_step" in r}
    comps = sorted({c for table in profiled.values() for c in table})
    if comps:
        print(f"\n{'component: ms/step (share, TFLOP/s)':36s} " + " ".join(f"{n:>22s}" for n in profiled))
        for c in comps:
            cells = []
            for table in profiled.values():
                row = table.get(c, {})
                rate = f", {row['tflops']:.0f}" if "tflops" in row else ""
                cells.append(f"{row.get('total_ms', 0):.2f} ({100 * row.get('share_of_step', 0):.1f}%{rate})")
            print(f"{c:36s} " + " ".join(f"{cell:>22s}" for cell in cells))
    if "gem_vs_plain" in doc:
        print(f"\ngem / plain examples/s: {doc['gem_vs_plain']['examples_per_s_ratio']}")
    if "trainer_overhead" in doc:
        print(f"trainer overhead (gem / bare step): {doc['trainer_overhead']}")
    gem = v.get("gem", {})
    if "startup" in gem:
        print(f"start-up: trainer set-up {gem['startup']['setup_s']} s, first step {gem['startup']['first_step_s']} s")
    if "checkpoint" in gem:
        c = gem["checkpoint"]
        print(f"checkpoint ({c['size_gb']} GB, every {c['every_steps']} steps): " + ", ".join(
            f"{mode} stall {c[mode]['stall_ms']} ms = {100 * c[mode]['cost_share']:.2f}%" for mode in ("synchronous", "asynchronous")))
    print(f"targets: {doc['targets']}")
    if doc["errors"]:
        print("errors:", doc["errors"])


if __name__ == "__main__":
    main()
