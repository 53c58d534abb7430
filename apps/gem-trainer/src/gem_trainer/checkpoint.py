"""Checkpoints: torch.distributed.checkpoint folders ``step-N``, kept to the latest k, found again on restart.

A folder counts only once it holds the ``COMPLETE`` marker, written after every rank finished writing:
a run killed in the middle of a save resumes from the previous complete checkpoint.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

STEP_FOLDER = re.compile(r"^step-(\d+)$")
MARKER = "COMPLETE"


class CheckpointManager:
    """Saves and restores ``{"model": ..., "optimizer": ...}`` through DCP plus per-rank local state
    (step, data position, RNG) through ``torch.save``."""

    def __init__(self, folder: str | Path, keep_latest: int) -> None:
        self.folder = Path(folder)
        self.keep_latest = keep_latest

    def complete_steps(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        steps = []
        for child in self.folder.iterdir():
            match = STEP_FOLDER.match(child.name)
            if match and (child / MARKER).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest_step(self) -> int | None:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def save(self, step: int, distributed_state: dict[str, Any], local_state: dict[str, Any]) -> Path:
        path = self.path(step)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0 and path.exists():
            shutil.rmtree(path)  # an incomplete leftover of a killed run
        _barrier()
        dcp.save(distributed_state, checkpoint_id=str(path))
        torch.save(local_state, path / f"local-rank{rank}.pt")
        _barrier()
        if rank == 0:
            (path / MARKER).write_text(f"{step}\n")
            self._prune()
        _barrier()
        return path

    def load(self, step: int, distributed_state: dict[str, Any]) -> dict[str, Any]:
        """Load in place into ``distributed_state`` (DCP fills the given tensors); return this rank's local state."""
        path = self.path(step)
        if not (path / MARKER).is_file():
            raise FileNotFoundError(f"no complete checkpoint at {path}")
        # NOTE: DCP reshards: the tensors load into whatever layout this run has, on any number of ranks
        dcp.load(distributed_state, checkpoint_id=str(path))
        rank = dist.get_rank() if dist.is_initialized() else 0
        local = path / f"local-rank{rank}.pt"
        if not local.is_file():
            # written by fewer ranks; the local state (step, data position in global batches, schedule, RNG)
            # is the same on every rank
            local = path / "local-rank0.pt"
        return torch.load(local, weights_only=False)

    def _prune(self) -> None:
        for step in self.complete_steps()[: -self.keep_latest]:
            shutil.rmtree(self.path(step), ignore_errors=True)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
