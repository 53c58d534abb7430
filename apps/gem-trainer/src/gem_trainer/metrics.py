"""Run metrics: a rank-0 log line, JSONL and TensorBoard in one run folder, and throughput/MFU accounting."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

from gem_data import DataError


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


class MetricLogger:
    """Writes ``metrics.jsonl`` and TensorBoard events under ``run_dir``; prints on rank 0 only."""

    def __init__(self, run_dir: str | Path, rank: int, tensorboard: bool = True) -> None:
        self.rank = rank
        self.run_dir = Path(run_dir)
        self._jsonl = None
        self._writer = None
        if rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.run_dir / "metrics.jsonl", "a")
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(str(self.run_dir / "tensorboard"))

    def log(self, step: int, values: dict[str, float], phase: str = "train", echo: bool = True) -> None:
        if self.rank != 0:
            return
        record = {"phase": phase, "step": step, "time": time.time(), **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(f"{phase}/{key}", value, step)
            self._writer.flush()
        if echo:
            print(format_line(phase, step, values), flush=True)

    def drop_after(self, step: int) -> str | None:
        """Forget the records of steps after ``step`` (a run resumed from there will log them again). A last line cut
        short (a run killed while writing it) goes too: the note saying so is returned (None: nothing torn). Any other
        line that is not a record is a ``DataError`` naming it. The log is rewritten beside itself and then renamed
        over it, so a crash while rewriting leaves the old log whole."""
        if self.rank != 0:
            return None
        path = self.run_dir / "metrics.jsonl"
        self._jsonl.close()
        lines = [(number, line) for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
        kept, note = [], None
        for i, (number, line) in enumerate(lines):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                if i < len(lines) - 1:
                    raise DataError(path, number, f"not a JSON record ({error.msg})") from None
                note = f"{path}:{number}: dropped a record cut short (a run stopped while writing it)"
                continue
            if record["step"] <= step:
                kept.append(line)
        staged = path.with_name(f"{path.name}.rewrite")
        staged.write_text("".join(f"{line}\n" for line in kept))
        os.replace(staged, path)
        self._jsonl = open(path, "a")
        return note

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._writer is not None:
            self._writer.close()


def format_line(phase: str, step: int, values: dict[str, float]) -> str:
    parts = [f"{phase} step {step}"]
    for key, value in values.items():
        if isinstance(value, float):
            parts.append(f"{key} {value:.4g}")
        else:
            parts.append(f"{key} {value}")
    return "  ".join(parts)


def progress(iterable, total: int | None, description: str, enabled: bool):
    """A progress bar on an interactive rank-0 terminal; the plain iterable otherwise."""
    if not enabled or not sys.stderr.isatty():
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=description, leave=False)
