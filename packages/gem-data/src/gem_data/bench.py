"""Reader throughput: examples/s and event tokens/s per CPU core for every reader and for the mixer.

    python -m gem_data.bench --out benchmarks/results/data-cpu.json [--seconds 2] [--data ../shared/data]

Each row runs one stream on one thread (``torch.set_num_threads(1)``), so its rate is per core; real-data rows
are skipped (and say so) when the shared data is absent. Prints a table and writes
``{"meta": {...}, "rows": [...]}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gem_data.balancing import LengthBalancedStream
from gem_data.mixing import MixedStream, MixingConfig, MixSource
from gem_data.readers.atomic import read_atomic
from gem_data.readers.parquet import ParquetTable, write_parquet
from gem_data.readers.text import read_sequence_text
from gem_data.sequential.examples import NextItemConfig, NextItemDataset
from gem_data.stream import READ_ROWS, SyntheticStream, TableStream
from gem_data.synthetic import SyntheticConfig, SyntheticGenerator
from gem_data.testing import find_repo_root, shared_data_dir


def measure(name: str, stream, seconds: float, batch_size: int, note: str = "", started: Callable[[], None] | None = None) -> dict:
    """Run ``stream`` for about ``seconds`` after one warm-up batch; rates per core (one thread). ``started``, if
    given, is called when the timing starts (after the warm-up)."""
    batches = iter(stream)
    next(batches)
    if started is not None:
        started()
    examples = tokens = steps = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        batch = next(batches)
        examples += batch.batch_size
        tokens += int(batch.num_events().sum())
        steps += 1
    elapsed = time.perf_counter() - start
    return {
        "reader": name,
        "batch_size": batch_size,
        "batches": steps,
        "seconds": round(elapsed, 3),
        "examples_per_s_per_core": round(examples / elapsed, 1),
        "tokens_per_s_per_core": round(tokens / elapsed, 1),
        "mean_events_per_example": round(tokens / max(examples, 1), 2),
        "note": note,
    }


def measure_table(name: str, table, seconds: float, batch_size: int, note: str) -> list[dict]:
    """A table read as the trainer reads it (``READ_ROWS`` rows at a time: several batches), then one batch per
    read, measured one after the other."""
    return [measure(name, TableStream(table, batch_size), seconds, batch_size, f"{note}; {READ_ROWS} rows per read"),
            measure(f"{name}, one batch per read", TableStream(table, batch_size, read_rows=0), seconds, batch_size, note)]


def run(seconds: float, data_dir: Path, batch_size: int = 256) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    generator = SyntheticGenerator(SyntheticConfig())
    synthetic = SyntheticStream(generator, batch_size)
    rows.append(measure("synthetic", synthetic, seconds, batch_size, "default SyntheticConfig"))
    sequential = []
    beauty = data_dir / "beauty"
    if (beauty / "Beauty.txt").is_file():
        start = time.perf_counter()
        corpus = read_sequence_text(beauty / "Beauty.txt", beauty / "Beauty_item2attributes.json")
        load = time.perf_counter() - start
        dataset = NextItemDataset(corpus, NextItemConfig(num_negatives=1))
        rows += measure_table("beauty_text", dataset.training_table(), seconds, batch_size,
                              f"next-item, 1 uniform negative; file read {load:.2f}s")
        sequential.append(("beauty", dataset))
    else:
        rows.append({"reader": "beauty_text", "note": f"skipped: {beauty} absent"})
    ml = data_dir / "ml-100k"
    if (ml / "ml-100k.inter").is_file():
        start = time.perf_counter()
        corpus = read_atomic(ml)
        load = time.perf_counter() - start
        dataset = NextItemDataset(corpus, NextItemConfig(num_negatives=1, sampler="popularity", max_history=200))
        rows += measure_table("ml100k_atomic", dataset.training_table(), seconds, batch_size,
                              f"next-item, 1 popularity negative, max_history 200; file read {load:.2f}s")
    else:
        rows.append({"reader": "ml100k_atomic", "note": f"skipped: {ml} absent"})
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "synthetic.parquet"
        written = write_parquet((generator.batch(i, 1024) for i in range(16)), generator.spec, path, row_group_size=4096)
        rows += measure_table("parquet", ParquetTable(path), seconds, batch_size,
                              f"{written} synthetic rows, row groups of 4096, block shuffle")
    sources = {"feed": SyntheticStream(generator, batch_size), "video": SyntheticStream(SyntheticGenerator(SyntheticConfig(seed=1)), batch_size)}
    mix = MixingConfig((MixSource("feed", 3.0), MixSource("video", 1.0, online=True)), batch_size, online_share_start=0.1, online_share_end=0.5, ramp_steps=100)
    rows.append(measure("mixer", MixedStream(sources, mix), seconds, batch_size, "2 synthetic sources, example-level mixing, online ramp"))
    world = 8
    balanced = LengthBalancedStream(SyntheticStream(generator, batch_size * world), rank=0, world_size=world)
    row = measure("balanced_synthetic", balanced, seconds, batch_size, f"rank 0 of {world}: each rank reads the global window")
    row["note"] += f"; token imbalance {balanced.last_report['tokens_before']:.3f} -> {balanced.last_report['tokens_after']:.3f}"
    rows.append(row)
    return rows


def meta(command: str) -> dict:
    try:
        root = find_repo_root(Path.cwd())
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout.strip()
        commit = commit + ("+dirty" if dirty else "")
    except (FileNotFoundError, OSError):
        commit = "unknown"
    return {
        "machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip(),
        "cpu_count": os.cpu_count(),
        "threads_per_row": 1,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }


def format_table(rows: list[dict]) -> str:
    lines = [f"{'reader':<34} {'examples/s/core':>16} {'tokens/s/core':>14} {'events/ex':>10}  note"]
    for r in rows:
        if "examples_per_s_per_core" in r:
            lines.append(f"{r['reader']:<34} {r['examples_per_s_per_core']:>16,.0f} {r['tokens_per_s_per_core']:>14,.0f} {r['mean_events_per_example']:>10.1f}  {r['note']}")
        else:
            lines.append(f"{r['reader']:<34} {'-':>16} {'-':>14} {'-':>10}  {r['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gem_data.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where to write the JSON results")
    parser.add_argument("--seconds", type=float, default=2.0, help="measuring time per reader")
    parser.add_argument("--data", type=Path, default=None, help="the shared data folder (default: ../shared/data beside the repo root)")
    args = parser.parse_args(argv)
    data_dir = args.data
    if data_dir is None:
        try:
            data_dir = shared_data_dir(find_repo_root(Path.cwd()))
        except FileNotFoundError:
            data_dir = Path("../shared/data")
    rows = run(args.seconds, data_dir)
    print(format_table(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = "python -m gem_data.bench " + " ".join(sys.argv[1:] if argv is None else argv)
        args.out.write_text(json.dumps({"meta": meta(command), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
