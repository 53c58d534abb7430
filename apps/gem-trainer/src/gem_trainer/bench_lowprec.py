"""Low-precision quality, measured on the CPU: ``benchmarks/results/lowprec-quality-cpu.json``.

    python -m gem_trainer.bench_lowprec --out benchmarks/results/lowprec-quality-cpu.json [--seeds 0 1 2]
        [--work /tmp/bench-lowprec]

The embedded default (Kunlun on the synthetic data, 600 steps) trained in float32 and with its GEMMs in
emulated MXFP8 (``precision.low_precision = "mxfp8_emulated"``, both scale rules), same steps, data and seeds;
held-out NE, AUC and calibration per task. The MX path here is an emulation (the numerics of MX tensor cores),
so this measures quality only; speed is a GPU benchmark. Carries its provenance (machine, torch, commit,
date, command).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from gem_trainer.bench_runs import evaluate, mean_std, provenance, train, write_section

ARMS = {
    "float32": ["--precision.low_precision=off"],
    "mxfp8_floor": ["--precision.low_precision=mxfp8_emulated", "--precision.mx_rounding=floor"],
    "mxfp8_rceil": ["--precision.low_precision=mxfp8_emulated", "--precision.mx_rounding=rceil"],
}
METRICS = tuple(f"{task}/all/{m}" for task in ("click", "conversion") for m in ("ne", "auc", "calibration"))


def synthetic(seeds: list[int], work: Path) -> dict:
    rows = []
    common = ["--device=cpu", "--precision.autocast=off", "--metrics.tensorboard=false", "--metrics.progress_bar=false"]
    for seed in seeds:
        for arm, extra in ARMS.items():
            overrides = [*common, *extra, f"--seed={seed}"]
            run_dir = work / f"{arm}-seed{seed}"
            wall = train(None, overrides, run_dir)
            result = evaluate(None, overrides, run_dir)
            rows.append({"arm": arm, "seed": seed, "train_s": round(wall, 1), **{m: result[m] for m in METRICS}})
        print(f"seed {seed}: " + "  ".join(f"{r['arm']} click ne {r['click/all/ne']:.4f} auc {r['click/all/auc']:.4f}"
                                           for r in rows if r["seed"] == seed), flush=True)
    summary = {arm: {m: mean_std([r for r in rows if r["arm"] == arm], m) for m in METRICS} for arm in ARMS}
    # per seed, MX against float32 on the same data and initialisation: NE relative, AUC and calibration absolute
    differences = {}
    for arm in ARMS:
        if arm == "float32":
            continue
        pairs = [(r, next(f for f in rows if f["arm"] == "float32" and f["seed"] == r["seed"])) for r in rows if r["arm"] == arm]
        differences[arm] = {
            m: mean_std([{"d": (r[m] - f[m]) / f[m] if m.endswith("/ne") else r[m] - f[m]} for r, f in pairs], "d") for m in METRICS
        }
    return {"config": "embedded default (Kunlun tiny, synthetic data, 600 steps), autocast off", "arms": ARMS,
            "rows": rows, "summary": summary, "mx_minus_float32": differences,
            "note": "NE differences are relative ((mx - fp32) / fp32), AUC and calibration absolute; per seed, then mean/std"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m gem_trainer.bench_lowprec", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-lowprec"), help="folder for the run folders")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    started, meta = time.perf_counter(), provenance("gem_trainer.bench_lowprec", argv)
    write_section(args.out, "synthetic", meta, started, synthetic(args.seeds, args.work))
    return 0


if __name__ == "__main__":
    sys.exit(main())
