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

from gem_trainer.bench_runs import ROOT, evaluate, mean_std, provenance, train, write_section

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


BEAUTY_CONFIG = ROOT / "apps/gem-trainer/configs/beauty-kunlun.toml"
BEAUTY_ARMS = ("bfloat16", "fp8")  # the emulation costs 4x the time of a run and answers no Hopper question


def arms_for(device: str, beauty: bool) -> tuple[dict, str]:
    """The arms and their baseline."""
    if device == "cpu":
        return ARMS, "float32"
    return ({a: GPU_ARMS[a] for a in BEAUTY_ARMS} if beauty else GPU_ARMS), "bfloat16"


def run_arms(seeds: list[int], work: Path, device: str, beauty: Path | None = None, only: list[str] | None = None) -> list[dict]:
    """Each arm (or those in ``only``) once per seed on the synthetic default, or on the Beauty Kunlun config
    reading ``beauty`` (HR and NDCG at 10, sampled and full ranking)."""
    rows = []
    arms, _ = arms_for(device, beauty is not None)
    common = ["--device=cpu", "--precision.autocast=off"] if device == "cpu" else [f"--device={device}", "--precision.autocast=bf16"]
    common = [*common, "--metrics.tensorboard=false", "--metrics.progress_bar=false"]
    config_file = None
    if beauty is not None:
        config_file = BEAUTY_CONFIG
        common += [f"--data.path={beauty}", '--data.sequential.eval_protocols=["sampled","full"]']
    for seed in seeds:
        for arm, extra in arms.items():
            if only and arm not in only:
                continue
            overrides = [*common, *extra, f"--seed={seed}"]
            run_dir = work / f"{'beauty-' if beauty else ''}{arm}-seed{seed}"
            wall = train(config_file, overrides, run_dir)
            result = evaluate(config_file, overrides, run_dir)
            metrics = METRICS if beauty is None else sorted(m for m in result if m.endswith(("hr@10", "ndcg@10")) and "/seed" not in m)
            rows.append({"arm": arm, "seed": seed, "train_s": round(wall, 1), **{m: result[m] for m in metrics}})
            print(f"seed {seed} {arm}: " + "  ".join(f"{m} {rows[-1][m]:.4f}" for m in metrics[:4]), flush=True)
    return rows


def run_parallel(seeds: list[int], work: Path, device: str, jobs: int, beauty: Path | None) -> list[dict]:
    """One process per seed and arm (at most ``jobs`` at once), each writing its rows to a file read back here."""
    arms, _ = arms_for(device, beauty is not None)
    rows, pending = [], [(seed, arm) for seed in seeds for arm in arms]
    with tempfile.TemporaryDirectory() as tmp:
        running = []
        while pending or running:
            while pending and len(running) < jobs:
                seed, arm = pending.pop(0)
                out = Path(tmp) / f"{arm}-seed{seed}.json"
                cmd = [sys.executable, "-m", "gem_trainer.bench_lowprec", "--device", device, "--seeds", str(seed),
                       "--arms", arm, "--work", str(work), "--rows-only", str(out)]
                if beauty is not None:
                    cmd += ["--beauty", str(beauty)]
                running.append((subprocess.Popen(cmd), out))
            proc, out = running.pop(0)
            if proc.wait() != 0:
                raise RuntimeError(f"bench_lowprec: the run {out.stem} failed (exit {proc.returncode})")
            rows += json.loads(out.read_text())
    return sorted(rows, key=lambda r: (r["seed"], list(arms).index(r["arm"])))


def summarise(rows: list[dict], device: str, beauty: bool) -> dict:
    arms, baseline = arms_for(device, beauty)
    metrics = [m for m in rows[0] if m not in ("arm", "seed", "train_s")]
    summary = {arm: {m: mean_std([r for r in rows if r["arm"] == arm], m) for m in metrics} for arm in arms}
    # per seed, each arm against the baseline on the same data and initialisation: NE relative, the rest absolute
    differences = {}
    for arm in arms:
        if arm == baseline:
            continue
        pairs = [(r, next(f for f in rows if f["arm"] == baseline and f["seed"] == r["seed"])) for r in rows if r["arm"] == arm]
        differences[arm] = {
            m: mean_std([{"d": (r[m] - f[m]) / f[m] if m.endswith("/ne") else r[m] - f[m]} for r, f in pairs], "d") for m in metrics
        }
    precision = "autocast off" if device == "cpu" else "bfloat16 autocast in every arm"
    config = ("apps/gem-trainer/configs/beauty-kunlun.toml on Amazon Beauty, test split" if beauty
              else "embedded default (Kunlun tiny, synthetic data, 600 steps)")
    return {"config": f"{config}, {precision}", "arms": arms,
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
    parser.add_argument("--beauty", type=Path, help="the Beauty folder: the Beauty Kunlun config instead of the synthetic default")
    parser.add_argument("--arms", nargs="+", help=argparse.SUPPRESS)  # a --jobs worker: its arm
    parser.add_argument("--rows-only", type=Path, help=argparse.SUPPRESS)  # a --jobs worker: its rows, no section
    args = parser.parse_args(argv)
    if args.out is None and args.rows_only is None:
        parser.error("--out is required")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if args.rows_only is not None:
        args.rows_only.write_text(json.dumps(run_arms(args.seeds, args.work, args.device, args.beauty, args.arms)))
        return 0
    started, meta = time.perf_counter(), provenance("gem_trainer.bench_lowprec", argv)
    if args.device == "cuda":
        meta["device"] = torch.cuda.get_device_name()
    rows = (run_parallel(args.seeds, args.work, args.device, args.jobs, args.beauty) if args.jobs > 1
            else run_arms(args.seeds, args.work, args.device, args.beauty))
    section = ("beauty" if args.beauty else "synthetic") + ("-gpu" if args.device == "cuda" else "")
    write_section(args.out, section, meta, started, summarise(rows, args.device, args.beauty is not None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
