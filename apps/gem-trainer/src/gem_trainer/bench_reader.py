"""The trainer's training-batch readers on the CPU, per ``data.read_rows``: ``benchmarks/results/reader-cpu.json``.

    python -m gem_trainer.bench_reader --out benchmarks/results/reader-cpu.json \\
        [--configs beauty-sasrec.toml beauty-kunlun.toml] [--read-rows 1024 2048 4096] [--data ../shared/data]

Each config's training stream is built as the trainer builds it (``builders.build_data``), one per ``read_rows``
value, and timed in paired rounds (every stream once per round, one after the other: a shared machine's speed
drifts over seconds); the table gives milliseconds per batch, the median over rounds. The reader runs on the
trainer's reading thread, where its host time competes with the training step's (a small model's step on a GPU
waits on the host). The batches are the same for any ``read_rows`` (``gem_data.TableStream``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gem_trainer import builders
from gem_trainer.bench_runs import ROOT, provenance, write_section
from gem_trainer.config import load_config
from gem_trainer.distributed import init_distributed

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ROUNDS = 5
WARMUP_BATCHES = 20


def reader_rows(configs: list[str], read_rows: list[int], data: Path, batches: int) -> list[dict]:
    env = init_distributed("cpu", "gloo")
    streams = {}
    with tempfile.TemporaryDirectory() as run_dir:
        for name in configs:
            for rows in read_rows:
                config = load_config(CONFIGS / name, [f"--run_dir={run_dir}", f"--data.path={data / 'beauty'}",
                                                      f"--data.read_rows={rows}", "--checkpoint.enable=false",
                                                      "--metrics.tensorboard=false"])
                stream = iter(builders.build_data(config, env).train)
                for _ in range(WARMUP_BATCHES):
                    next(stream)
                streams[(name, rows)] = stream
        rounds: dict[tuple, list[float]] = {key: [] for key in streams}
        for _ in range(ROUNDS):
            for key, stream in streams.items():
                start = time.perf_counter()
                for _ in range(batches):
                    next(stream)
                rounds[key].append(1e3 * (time.perf_counter() - start) / batches)
    return [{"config": name, "read_rows": rows, "ms_per_batch": round(statistics.median(times), 4),
             "rounds_ms_per_batch": [round(t, 4) for t in times]} for (name, rows), times in rounds.items()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m gem_trainer.bench_reader", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--configs", nargs="+", default=["beauty-sasrec.toml", "beauty-kunlun.toml"])
    parser.add_argument("--read-rows", nargs="+", type=int, default=[1024, 2048, 4096])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--batches", type=int, default=200, help="batches timed per stream and round")
    parser.add_argument("--section", default="read_rows", help="the section of --out written (others are kept)")
    args = parser.parse_args(argv)
    if not (args.data / "beauty").is_dir():
        parser.error(f"--data: no beauty folder in {args.data}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    started, meta = time.perf_counter(), provenance("gem_trainer.bench_reader", argv)
    rows = reader_rows(args.configs, args.read_rows, args.data, args.batches)
    print(f"{'config':24s} {'read_rows':>9s} {'ms/batch':>9s}")
    for row in rows:
        print(f"{row['config']:24s} {row['read_rows']:9d} {row['ms_per_batch']:9.3f}")
    write_section(args.out, args.section, meta, started, {"rounds": ROUNDS, "batches_per_round": args.batches, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
