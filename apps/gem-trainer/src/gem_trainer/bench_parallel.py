"""Multi-GPU benchmark of the trainer: parity against one GPU, weak scaling per parallel layout, copy-engine
against NCCL collectives.

    python -m gem_trainer.bench_parallel --config apps/gem-trainer/configs/bench-h200.toml \
        --gpus 2 --out benchmarks/results/parallel-h200.json

Every measurement runs the trainer itself (``Trainer.train_step``) under torchrun, one launch per row:

- **parity**: 1 GPU with the global batch against ``--gpus`` GPUs with a slice each, ``--parity-steps``
  steps, in float32 and in bf16 autocast; the largest loss difference per step.
- **scaling**: the config at a fixed per-GPU batch on 1 GPU, then on ``--gpus`` GPUs in each layout
  (FSDP, HSDP, FSDP + expert parallel, exact or padded, FSDP + copy-engine all-gathers, 2-D sparse);
  examples/s after ``--warmup`` steps over ``--steps`` steps, model TFLOP/s, peak memory. ``scaling_ratio`` = per-GPU
  examples/s at N over 1 GPU; ``mfu_local`` is the 1-GPU MFU, ``mfu_e2e`` = achieved TFLOP/s over N peaks
  (= ``mfu_local x scaling_ratio``, FLOPs per step being equal).
- **collectives**: ``gem_parallel.bench_collectives`` (bandwidth and GPU footprint in isolation).
- every scaling row profiles one more step (``step_footprint``): its wall time, the GPU time of compute
  kernels and of collectives (NCCL kernels, peer copies) and what is left, the GPU waiting.

Writes one JSON with the provenance of ``gem_trainer.bench`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gem_trainer.bench import device_peak

LAYOUTS = {  # name -> (trainer overrides, what the row reports)
    "fsdp": ([], {"dense": "fsdp", "expert": 1, "sparse": "table_wise", "collectives": "nccl"}),
    "hsdp": (["--parallelism.dense_replicate=-1", "--parallelism.dense_shard=1"],
             {"dense": "hsdp (replicate)", "expert": 1, "sparse": "table_wise", "collectives": "nccl"}),
    "expert": (["--parallelism.expert=2"], {"dense": "fsdp", "expert": 2, "sparse": "table_wise", "collectives": "nccl"}),
    "expert_padded": (["--parallelism.expert=2", "--parallelism.expert_padded=true"],
                      {"dense": "fsdp", "expert": "2 (padded)", "sparse": "table_wise", "collectives": "nccl"}),
    "copy_engine": (["--parallelism.collectives=copy_engine"],
                    {"dense": "fsdp", "expert": 1, "sparse": "table_wise", "collectives": "copy_engine"}),
    "fsdp_dedup": (["--parallelism.sparse_index_dedup=true"],
                   {"dense": "fsdp", "expert": 1, "sparse": "table_wise, index dedup", "collectives": "nccl"}),
    "sparse_2d": (["--parallelism.sparse_group=1"],
                  {"dense": "fsdp", "expert": 1, "sparse": "2-D (1 x replicas)", "collectives": "nccl"}),
}


# --- one torchrun child ----------------------------------------------------------------------------------------

def worker(args) -> None:
    """Train ``args.steps`` steps of the config under this torchrun job; rank 0 writes the result to ``args.result``."""
    import torch.distributed as dist

    from gem_trainer.config import load_config
    from gem_trainer.distributed import init_distributed, shutdown_distributed
    from gem_trainer.metrics import memory_gib
    from gem_trainer.trainer import Trainer

    config = load_config(args.config, args.overrides)
    env = init_distributed(config.device, config.parallelism.collectives)
    trainer = Trainer(config, env)
    device = env.device
    losses, flops = [], 0.0
    for _ in range(args.warmup):
        losses.append(float(trainer.train_step()["loss"]))
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        metrics = trainer.train_step()
        losses.append(metrics["loss"])
        flops += metrics["flops"]
    _sync(device)
    elapsed = time.perf_counter() - start
    totals = torch.tensor([flops, memory_gib(device)], device=device, dtype=torch.float64)
    dist.all_reduce(totals[:1])
    peak_memory = totals[1:].clone()
    dist.all_reduce(peak_memory, op=dist.ReduceOp.MAX)
    footprint = _step_footprint(trainer, device) if args.profile and device.type == "cuda" else None
    if env.rank == 0:
        examples = args.steps * config.data.batch_size * env.world_size
        result = {
            "gpus": env.world_size, "losses": [float(v) for v in losses], "seconds": elapsed,
            "examples_per_s": examples / elapsed, "tflops": float(totals[0]) / elapsed / 1e12,
            "peak_memory_gb": float(peak_memory[0]) * 2**30 / 1e9, "collectives_used": env.collectives.__dict__,
            "layout": trainer.dims.describe(), "step_footprint": footprint,
        }
        Path(args.result).write_text(json.dumps(result))
    trainer.close()
    shutdown_distributed()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_footprint(trainer, device) -> dict:
    """One profiled training step: its wall time, the GPU time of compute kernels and of collectives (NCCL
    kernels, peer copies), so that a row shows whether the GPU computes, communicates or waits."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        trainer.train_step()
        torch.cuda.synchronize(device)
    wall_ms = (time.perf_counter() - start) * 1e3
    collectives: dict[str, dict[str, float]] = {}
    compute_ms = 0.0
    for event in prof.key_averages():  # CUDA activity only: kernels and copies, each once
        name, ms = event.key, getattr(event, "device_time_total", 0.0) / 1e3
        if "nccl" in name.lower() or "Memcpy PtoP" in name:
            collectives[name[:70]] = {"count": event.count, "ms": ms}
        else:
            compute_ms += ms
    collective_ms = sum(v["ms"] for v in collectives.values())
    return {"step_wall_ms": wall_ms, "compute_kernels_ms": compute_ms, "collectives_ms": collective_ms,
            "gpu_idle_ms": max(0.0, wall_ms - compute_ms - collective_ms), "collectives": collectives}


# --- driver ------------------------------------------------------------------------------------------------------

def launch(args, gpus: int, overrides: list[str], steps: int, warmup: int, profile: bool = False) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        result = handle.name
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
               "-m", "gem_trainer.bench_parallel", "--worker", "--config", args.config, "--result", result,
               "--steps", str(steps), "--warmup", str(warmup), *(["--profile"] if profile else []),
               *[f"--{o}" for o in args.overrides], *overrides]
    print("running:", " ".join(command[5:]), flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stdout[-1500:] + done.stderr[-3000:])}
    return json.loads(Path(result).read_text())


def parity(args) -> list[dict]:
    rows = []
    per_gpu = args.parity_batch // args.gpus
    for precision in ("off", "bf16"):
        common = ["--checkpoint.enable=false", f"--precision.autocast={precision}", "--metrics.tensorboard=false"]
        one = launch(args, 1, [*common, f"--data.batch_size={args.parity_batch}"], args.parity_steps, 0)
        many = launch(args, args.gpus, [*common, f"--data.batch_size={per_gpu}"], args.parity_steps, 0)
        row = {"precision": "float32" if precision == "off" else "bf16 autocast", "gpus": [1, args.gpus],
               "global_batch": args.parity_batch, "steps": args.parity_steps}
        if "error" in one or "error" in many:
            row["error"] = one.get("error") or many.get("error")
        else:
            a, b = torch.tensor(one["losses"]), torch.tensor(many["losses"])
            row.update(losses_1=one["losses"], losses_n=many["losses"],
                       max_abs_loss_diff=float((a - b).abs().max()), max_rel_loss_diff=float(((a - b).abs() / a.abs()).max()))
        rows.append(row)
    return rows


def scaling(args) -> list[dict]:
    common = ["--checkpoint.enable=false", "--metrics.tensorboard=false", f"--data.num_workers={args.num_workers}"]
    # NOTE: an untimed launch first fills the kernel caches (Triton compiles and autotunes per new length
    # bucket): measured on a fresh machine, the first row otherwise paid for it inside its timed steps
    # (1,187 against 1,630 examples/s on the next run of the same command)
    launch(args, 1, common, args.steps, args.warmup)
    base = launch(args, 1, common, args.steps, args.warmup, profile=True)
    peak = device_peak(torch.device("cuda"))
    rows = []
    if "error" in base:
        return [{"gpus": 1, "error": base["error"]}]
    mfu_local = base["tflops"] / peak
    rows.append({"name": "1 GPU", "gpus": 1, "dense": "-", "expert": 1, "sparse": "table_wise", "collectives": "-",
                 "examples_per_s": base["examples_per_s"], "per_gpu_examples_per_s": base["examples_per_s"],
                 "scaling_ratio": 1.0, "mfu_local": mfu_local, "mfu_e2e": mfu_local, "tflops": base["tflops"],
                 "peak_memory_gb": base["peak_memory_gb"], "step_footprint": base["step_footprint"]})
    for name in args.layouts:
        overrides, described = LAYOUTS[name]
        result = launch(args, args.gpus, [*common, *overrides], args.steps, args.warmup, profile=True)
        row = {"name": name, "gpus": args.gpus, **described}
        if "error" in result:
            row["error"] = result["error"]
        else:
            per_gpu = result["examples_per_s"] / args.gpus
            row.update(examples_per_s=result["examples_per_s"], per_gpu_examples_per_s=per_gpu,
                       scaling_ratio=per_gpu / base["examples_per_s"], mfu_local=mfu_local,
                       mfu_e2e=result["tflops"] / (peak * args.gpus), tflops=result["tflops"],
                       peak_memory_gb=result["peak_memory_gb"], layout=result["layout"],
                       collectives_used=result["collectives_used"], step_footprint=result["step_footprint"])
        rows.append(row)
    return rows


def collectives(args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = handle.name
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}",
               "-m", "gem_parallel.bench_collectives", "--out", out]
    done = subprocess.run(command, capture_output=True, text=True)
    print(done.stdout[-3000:], flush=True)
    if done.returncode != 0:
        return {"error": done.stderr[-3000:]}
    return json.loads(Path(out).read_text())


def print_table(doc: dict) -> None:
    print("\nparity (1 GPU vs N GPUs, same global batches):")
    for row in doc.get("parity", []):
        print(f"  {row['precision']:<14} max |loss diff| {row.get('max_abs_loss_diff', float('nan')):.2e}"
              f"  max rel {row.get('max_rel_loss_diff', float('nan')):.2e}  {row.get('error', '')[:200]}")
    print(f"\n{'layout':<14}{'gpus':>5}{'ex/s':>10}{'ex/s/gpu':>10}{'scaling':>9}{'mfu_local':>10}{'mfu_e2e':>9}{'GB':>7}")
    for row in doc.get("scaling", []):
        if "error" in row:
            print(f"{row.get('name', '?'):<14}{row['gpus']:>5}  error: {row['error'][-300:]}")
            continue
        print(f"{row['name']:<14}{row['gpus']:>5}{row['examples_per_s']:>10.0f}{row['per_gpu_examples_per_s']:>10.0f}"
              f"{row['scaling_ratio']:>9.3f}{row['mfu_local']:>10.3f}{row['mfu_e2e']:>9.3f}{row['peak_memory_gb']:>7.1f}")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m gem_trainer.bench_parallel", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="trainer config; --section.field=value arguments override it")
    p.add_argument("--out", default=None)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--num-workers", type=int, default=2, help="data loader workers per rank (scaling rows)")
    p.add_argument("--parity-steps", type=int, default=20)
    p.add_argument("--parity-batch", type=int, default=256, help="global batch of the parity runs")
    p.add_argument("--parts", default="parity,scaling,collectives")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    args.overrides = [a for a in rest if a.startswith("--")] if args.worker else [a.removeprefix("--") for a in rest]
    args.layouts = [name for name in args.layouts.split(",") if name]
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; known: {list(LAYOUTS)}")
    return args


def main(argv=None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return None
    from gem_trainer.bench import meta

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    doc = {"meta": meta(device, argv, program="gem_trainer.bench_parallel")}
    parts = args.parts.split(",")
    if "parity" in parts:
        doc["parity"] = parity(args)
    if "scaling" in parts:
        doc["scaling"] = scaling(args)
    if "collectives" in parts:
        doc["collectives"] = collectives(args)
    print_table(doc)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return doc


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
