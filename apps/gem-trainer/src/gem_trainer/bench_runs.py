"""Running the trainer for benchmarks that compare training setups (bench_mixing, bench_transfer): every run
goes through ``Trainer.train`` from a config plus overrides and every metric through ``Trainer.evaluate`` on a
trainer resumed from the run's last checkpoint, so the numbers are what ``gem-trainer train`` / ``eval`` give."""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import io
import json
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

import torch

from gem_trainer.config import load_config
from gem_trainer.provenance import git_commit

ROOT = Path(__file__).resolve().parents[4]
# data.synthetic.seed of every run of a synthetic comparison: every seed trains on the one data set, so that the
# seeds vary the models' initialisation and their spread is the training's, not that of several data draws
DATA_SEED = 0


def train(config_file: Path | None, overrides: list[str], run_dir: Path) -> float:
    """Train ``config_file`` (None: the embedded default) + ``overrides`` into ``run_dir`` (from scratch); returns
    the wall time."""
    from gem_trainer.distributed import init_distributed
    from gem_trainer.run_folder import write_run_record
    from gem_trainer.trainer import Trainer

    config = load_config(config_file, [*overrides, f"--run_dir={run_dir}", "--checkpoint.resume=false"])
    # NOTE: an earlier run's checkpoints here would outrank this run's when pruned, and be what ``evaluate`` loads
    shutil.rmtree(Path(run_dir) / "checkpoints", ignore_errors=True)
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(config, init_distributed(config.device, config.parallelism.collectives))
        write_run_record(trainer.config, trainer.spec)  # as `gem-trainer train` does: the run can teach another
        try:
            trainer.train()
        finally:
            trainer.close()
    return time.perf_counter() - started


def evaluate(config_file: Path | None, overrides: list[str], run_dir: Path) -> dict[str, float]:
    """``Trainer.evaluate`` of ``run_dir``'s last checkpoint under ``config_file`` + ``overrides`` (another
    evaluation split or source than the one it trained with)."""
    from gem_trainer.distributed import init_distributed
    from gem_trainer.trainer import Trainer

    config = load_config(config_file, [*overrides, f"--run_dir={run_dir}"])
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(config, init_distributed(config.device, config.parallelism.collectives), training=False)
        try:
            if not trainer.resume(training=False):
                raise RuntimeError(f"no checkpoint under {run_dir}")
            return trainer.evaluate()
        finally:
            trainer.close()


def mean_std(rows: list[dict], key: str) -> dict[str, float]:
    values = [r[key] for r in rows]
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values)}


def paired_gains(rows: list[dict], arms: list[str], metrics: tuple[str, ...], base: str = "student_alone") -> dict:
    """Each seed's gain of every arm over arm ``base`` of the same seed, per metric, in the order of the arm's rows;
    positive is better (lower NE, higher AUC / HR / NDCG)."""
    reference = {r["seed"]: r for r in rows if r["arm"] == base}
    return {arm: {m: [round((r[m] - reference[r["seed"]][m]) * (-1 if m.endswith("/ne") else 1), 5)
                      for r in rows if r["arm"] == arm] for m in metrics} for arm in arms}


def _triton_version() -> str | None:
    """The installed Triton's version (read from its metadata: the trainer does not import Triton itself)."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def provenance(program: str, argv: list[str]) -> dict:
    """Where and from what a benchmark section was produced."""
    return {
        "machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
        "cpu_count": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__, "triton": _triton_version(), "python": platform.python_version(),
        "commit": git_commit(ROOT), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": f"python -m {program} " + " ".join(argv),
    }


def write_section(out: Path, section: str, meta: dict, started: float, result: dict) -> None:
    """Put ``result`` as ``section`` of the JSON file ``out`` (its other sections kept), with its provenance and
    wall time since ``started``."""
    # NOTE: read just before writing, so that sections run by concurrent invocations all land in the file
    results = json.loads(out.read_text()) if out.is_file() else {}
    results[section] = {"meta": {**meta, "wall_s": round(time.perf_counter() - started, 1)}, **result}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
