"""Low-precision quality: ``benchmarks/results/lowprec-quality-cpu.json`` (CPU) and ``lowprec-quality.json`` (GPU).

    python -m gem_trainer.bench_lowprec --out benchmarks/results/lowprec-quality-cpu.json [--seeds 0 1 2]
        [--work /tmp/bench-lowprec]
    python -m gem_trainer.bench_lowprec --device cuda --jobs 3 --out benchmarks/results/lowprec-quality.json

The embedded default (Kunlun on the synthetic data, 600 steps), same steps, data and seeds per arm; held-out
NE, AUC and calibration per task. On the CPU: float32 against GEMMs in emulated MXFP8 (both scale rules). On a
GPU: bfloat16 autocast against the FP8 recipe and against emulated MXFP8 under the same autocast. The small
model's layers are narrower than the FP8 crossover, so the FP8 arm lowers it to put every aligned layer in FP8:
the quality of the recipe where it is applied, not of a model it leaves alone. ``--jobs`` runs seeds in
parallel processes (the small model leaves a GPU mostly idle). Carries its provenance (machine, device, torch,
commit, date, command).
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

from gem_trainer.bench_runs import evaluate, mean_std, provenance, train, write_section

ARMS = {
    "float32": ["--precision.low_precision=off"],
    "mxfp8_floor": ["--precision.low_precision=mxfp8_emulated", "--precision.mx_rounding=floor"],
    "mxfp8_rceil": ["--precision.low_precision=mxfp8_emulated", "--precision.mx_rounding=rceil"],
}
GPU_ARMS = {
    "bfloat16": ["--precision.low_precision=off"],
    "fp8": ["--precision.low_precision=fp8", "--precision.fp8_min_features=0", "--precision.fp8_min_tokens=0"],
    "mxfp8_rceil": ["--precision.low_precision=mxfp8_emulated", "--precision.mx_rounding=rceil"],
}
METRICS = tuple(f"{task}/all/{m}" for task in ("click", "conversion") for m in ("ne", "auc", "calibration"))


def run_arms(seeds: list[int], work: Path, device: str) -> list[dict]:
    rows = []
    if device == "cpu":
        arms, common = ARMS, ["--device=cpu", "--precision.autocast=off"]
    else:
        arms, common = GPU_ARMS, [f"--device={device}", "--precision.autocast=bf16"]
    common = [*common, "--metrics.tensorboard=false", "--metrics.progress_bar=false"]
    for seed in seeds:
        for arm, extra in arms.items():
            overrides = [*common, *extra, f"--seed={seed}"]
            run_dir = work / f"{arm}-seed{seed}"
            wall = train(None, overrides, run_dir)
            result = evaluate(None, overrides, run_dir)
            rows.append({"arm": arm, "seed": seed, "train_s": round(wall, 1), **{m: result[m] for m in METRICS}})
        print(f"seed {seed}: " + "  ".join(f"{r['arm']} click ne {r['click/all/ne']:.4f} auc {r['click/all/auc']:.4f}"
                                           for r in rows if r["seed"] == seed), flush=True)
    return rows


def run_parallel(seeds: list[int], work: Path, device: str, jobs: int) -> list[dict]:
    """One process per seed (at most ``jobs`` at once), each writing its rows to a file read back here."""
    rows, pending = [], list(seeds)
    with tempfile.TemporaryDirectory() as tmp:
        running = []
        while pending or running:
            while pending and len(running) < jobs:
                seed = pending.pop(0)
                out = Path(tmp) / f"seed{seed}.json"
                cmd = [sys.executable, "-m", "gem_trainer.bench_lowprec", "--device", device, "--seeds", str(seed),
                       "--work", str(work), "--rows-only", str(out)]
                running.append((subprocess.Popen(cmd), out))
            proc, out = running.pop(0)
            if proc.wait() != 0:
                raise RuntimeError(f"bench_lowprec: the run of {out.stem} failed (exit {proc.returncode})")
            rows += json.loads(out.read_text())
    return sorted(rows, key=lambda r: r["seed"])


def summarise(rows: list[dict], device: str) -> dict:
    arms, baseline = (ARMS, "float32") if device == "cpu" else (GPU_ARMS, "bfloat16")
    summary = {arm: {m: mean_std([r for r in rows if r["arm"] == arm], m) for m in METRICS} for arm in arms}
    # per seed, each arm against the baseline on the same data and initialisation: NE relative, the rest absolute
    differences = {}
    for arm in arms:
        if arm == baseline:
            continue
        pairs = [(r, next(f for f in rows if f["arm"] == baseline and f["seed"] == r["seed"])) for r in rows if r["arm"] == arm]
        differences[arm] = {
            m: mean_std([{"d": (r[m] - f[m]) / f[m] if m.endswith("/ne") else r[m] - f[m]} for r, f in pairs], "d") for m in METRICS
        }
    precision = "autocast off" if device == "cpu" else "bfloat16 autocast in every arm"
    return {"config": f"embedded default (Kunlun tiny, synthetic data, 600 steps), {precision}", "arms": arms,
            "rows": rows, "summary": summary, f"minus_{baseline}": differences,
            "note": f"NE differences are relative ((arm - {baseline}) / {baseline}), AUC and calibration absolute; "
                    "per seed, then mean/std"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m gem_trainer.bench_lowprec", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--jobs", type=int, default=1, help="seeds run in parallel processes")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-lowprec"), help="folder for the run folders")
    parser.add_argument("--rows-only", type=Path, help=argparse.SUPPRESS)  # a --jobs worker: its rows, no section
    args = parser.parse_args(argv)
    if args.out is None and args.rows_only is None:
        parser.error("--out is required")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if args.rows_only is not None:
        args.rows_only.write_text(json.dumps(run_arms(args.seeds, args.work, args.device)))
        return 0
    started, meta = time.perf_counter(), provenance("gem_trainer.bench_lowprec", argv)
    if args.device == "cuda":
        meta["device"] = torch.cuda.get_device_name()
    rows = (run_parallel(args.seeds, args.work, args.device, args.jobs) if args.jobs > 1
            else run_arms(args.seeds, args.work, args.device))
    section = "synthetic" if args.device == "cpu" else "synthetic-gpu"
    write_section(args.out, section, meta, started, summarise(rows, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
