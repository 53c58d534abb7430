"""Checkpoints: torch.distributed.checkpoint folders ``step-N``, kept to the latest k, found again on restart.

A folder counts only once it holds the ``COMPLETE`` marker, written after every rank finished writing and
its files reached the disk (fsync). The marker is a manifest: the size and SHA-256 of every file of the
folder. Loading verifies it first, so a checkpoint damaged afterwards (a file missing or cut short, a copy
gone wrong) is never read: the run falls back to the newest intact one and says so in one line.

Each rank's local state (step, data position, schedule, RNG) is stored with ``torch.save`` and read back
with ``weights_only=True``: plain containers and tensors, nothing that runs code when loaded.

Asynchronous saves (``save(..., asynchronous=True)``) stop training only while the state is copied to host
memory (``checkpoint_writer.SharedStaging``: into a shared, page-locked arena kept between saves); a writer
process beside the rank (``checkpoint_writer.WriterProcess``) then runs ``dcp.save`` on the copy and writes the
marker after it, its collectives on a Gloo group of the writers' own (never the training's). Until the marker
exists the folder does not count, so a run killed mid-write resumes from the previous checkpoint, as with a
synchronous save. One save is in flight at a time: the next save, ``wait`` and the end of training wait for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.utils.serialization.config as serialization_config
from torch.distributed.checkpoint.api import CheckpointException

from gem_trainer.checkpoint_writer import SharedStaging, WriterProcess

STEP_FOLDER = re.compile(r"^step-(\d+)$")
MARKER = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; ``str(error)`` is one line naming the folder."""


class CheckpointManager:
    """Saves and restores ``{"model": ..., "optimizer": ...}`` through DCP plus per-rank local state."""

    def __init__(self, folder: str | Path, keep_latest: int) -> None:
        self.folder = Path(folder)
        self.keep_latest = keep_latest
        self._staging = SharedStaging()
        self._writer = WriterProcess()

    def complete_steps(self) -> list[int]:
        """Steps whose folder holds the marker (not yet verified: see ``damage``)."""
        return complete_steps(self.folder)

    def latest_step(self) -> int | None:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> Path:
        return step_path(self.folder, step)

    def save(self, step: int, distributed_state: dict[str, Any], local_state: dict[str, Any],
             asynchronous: bool = False) -> Path:
        """Write checkpoint ``step``; with ``asynchronous`` return once the state is staged in host memory
        (the write finishes in the background: ``wait`` raises its ``CheckpointError``, if any)."""
        self.wait()
        path = self.path(step)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0 and path.exists():
            shutil.rmtree(path)  # an incomplete leftover of a killed run
        _barrier()
        if asynchronous:
            try:
                path.mkdir(parents=True, exist_ok=True)
                _write_synced(path / f"local-rank{rank}.pt", local_state)
                staged, fresh = self._staging.stage(distributed_state, path, step, self.keep_latest, rank == 0)
                self._writer.submit(staged, self._staging.arena, fresh)
            except (OSError, RuntimeError) as error:
                # NOTE: no agreement with the other ranks here: their writers may already wait for this one's in
                # DCP's collectives; this rank's error ends the job (torchrun stops the others)
                raise CheckpointError(f"could not stage checkpoint {path} ({first_line(error)}); "
                                      f"{_what_is_kept(self.folder)}") from None
            return path
        failure = None
        try:
            with without_record_checksums():
                dcp.save(distributed_state, checkpoint_id=str(path))
            _write_synced(path / f"local-rank{rank}.pt", local_state)
        except (OSError, RuntimeError, CheckpointException) as error:  # a full disk: OSError, or wrapped by DCP
            failure = error
        finish_checkpoint(self.folder, self.keep_latest, step, failure, None)
        _barrier()
        return path

    def writing(self) -> bool:
        """Whether an asynchronous save is still being written (``wait`` then blocks until it is marked)."""
        return self._writer.busy()

    def start_writer(self) -> None:
        """Start the asynchronous saves' writer process now (every rank together), so that its start-up overlaps
        training rather than delaying the first save; the first asynchronous save starts it otherwise."""
        self._writer.start()

    @property
    def writer_pid(self) -> int | None:
        """The process id of this rank's checkpoint writer (None before the first asynchronous save)."""
        return self._writer.pid

    def wait(self, agree: bool = True) -> None:
        """Wait for the save in flight (if any) to be written and marked; raise its ``CheckpointError``. ``agree``:
        then wait for every rank (a barrier: all ranks must call it), so that they all see the marker."""
        failure = self._writer.result()
        if failure is not None:
            raise CheckpointError(failure)
        # NOTE: rank 0's writer marks the folder after every rank's part is written: past this barrier every rank
        # sees it, so that decisions taken from the folder (is the last step saved? which step to resume?) agree
        if agree:
            _barrier()

    def close(self) -> None:
        """Wait for the save in flight (no barrier) and stop the writer; its ``CheckpointError``, if any, is raised."""
        try:
            self.wait(agree=False)
        finally:
            self._writer.close()
            self._staging.close()

    def damage(self, step: int) -> str | None:
        """Why checkpoint ``step`` cannot be trusted (a file missing, resized or changed), or None."""
        path = self.path(step)
        try:
            manifest = json.loads((path / MARKER).read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return f"{path / MARKER} is not a manifest"
        for name, expected in manifest.items():
            file = path / name
            if not file.is_file():
                return f"{file} is missing"
            if file.stat().st_size != expected["size"]:
                return f"{file} has {file.stat().st_size} bytes, {expected['size']} were written"
            if _fingerprint(file)["sha256"] != expected["sha256"]:
                return f"{file} changed since it was written"
        return None

    def newest_intact(self, at_most: int | None = None) -> tuple[int | None, list[str]]:
        """The newest verified step (at most ``at_most``) and a line per damaged or unfinished newer one."""
        skipped, complete = [], set(self.complete_steps())
        for step in reversed(step_folders(self.folder)):
            if at_most is not None and step > at_most:
                continue
            if step not in complete:
                skipped.append(f"checkpoint {self.path(step)} is incomplete (its write did not finish: no {MARKER} "
                               f"marker); skipping it")
                continue
            problem = self.damage(step)
            if problem is None:
                return step, skipped
            skipped.append(f"checkpoint {self.path(step)} is damaged ({problem}); skipping it")
        return None, skipped

    def require(self, step: int) -> None:
        """A ``CheckpointError`` unless checkpoint ``step`` is complete and intact."""
        if step not in self.complete_steps():
            raise CheckpointError(f"no complete checkpoint at {self.path(step)} (complete: {self.complete_steps() or 'none'})")
        problem = self.damage(step)
        if problem is not None:
            raise CheckpointError(f"checkpoint {self.path(step)} is damaged ({problem})")

    def local_state(self, step: int) -> dict[str, Any]:
        """Rank 0's local state of checkpoint ``step`` (step, data position, schedule, RNG, number of ranks), read
        without loading the checkpoint."""
        local = self.path(step) / "local-rank0.pt"
        try:
            return torch.load(local, weights_only=True)
        except (OSError, pickle.UnpicklingError, RuntimeError) as error:
            raise CheckpointError(f"{local} cannot be read ({first_line(error)})") from None

    def load(self, step: int, distributed_state: dict[str, Any]) -> dict[str, Any]:
        """Load checkpoint ``step`` (verified by ``newest_intact`` or ``require``) in place into
        ``distributed_state`` (DCP fills the given tensors); return this rank's local state."""
        path = self.path(step)
        # NOTE: DCP reshards: the tensors load into whatever layout this run has, on any number of ranks
        try:
            dcp.load(distributed_state, checkpoint_id=str(path))
        except (RuntimeError, ValueError, CheckpointException) as error:  # a tensor missing or of another shape
            raise CheckpointError(f"checkpoint {path} does not fit this model ({first_line(error)})") from None
        rank = dist.get_rank() if dist.is_initialized() else 0
        local = path / f"local-rank{rank}.pt"
        if not local.is_file():
            # written by fewer ranks; the local state (step, data position in global batches, schedule, RNG)
            # is the same on every rank
            local = path / "local-rank0.pt"
        try:
            return torch.load(local, weights_only=True)
        except pickle.UnpicklingError as error:
            raise CheckpointError(f"{local} holds more than plain training state; refused to load it "
                                  f"({first_line(error)})") from None


def step_path(folder: Path, step: int) -> Path:
    """The folder of checkpoint ``step`` under ``folder``."""
    return folder / f"step-{step}"


def _what_is_kept(folder: Path) -> str:
    """After a failed save: which checkpoint a resume would use."""
    steps = complete_steps(folder)
    return f"step-{steps[-1]} is kept" if steps else "no earlier checkpoint exists"


def step_folders(folder: Path) -> list[int]:
    """Steps of ``folder`` with a checkpoint folder, finished or not."""
    if not folder.is_dir():
        return []
    return sorted(int(match.group(1)) for match in map(STEP_FOLDER.match, (c.name for c in folder.iterdir())) if match)


def complete_steps(folder: Path) -> list[int]:
    """Steps of ``folder`` whose checkpoint holds the marker."""
    return [step for step in step_folders(folder) if (step_path(folder, step) / MARKER).is_file()]


def finish_checkpoint(folder: Path, keep_latest: int, step: int, failure: BaseException | None,
                      group: dist.ProcessGroup | None) -> None:
    """Every rank's part of checkpoint ``step`` written (or failed): rank 0 writes the marker and prunes to the
    latest ``keep_latest``, or the folder goes and a ``CheckpointError`` says why, naming the checkpoint kept."""
    path = step_path(folder, step)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if _any_rank(failure is not None, group):
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        reason = first_line(failure) if failure is not None else "another rank failed to write its part"
        raise CheckpointError(f"could not write checkpoint {path} ({reason}); {_what_is_kept(folder)}")
    if rank == 0:
        manifest = {name: _fingerprint(path / name) for name in sorted(os.listdir(path))}
        _write_text_synced(path / MARKER, json.dumps({"step": step, "files": manifest}, indent=1))
        # NOTE: pruned among the steps up to this one: a complete step above it is one the resume passed over as
        # damaged, and counting it would delete this checkpoint, just written and verified, in its favour
        for old in [s for s in complete_steps(folder) if s <= step][: -keep_latest]:
            shutil.rmtree(step_path(folder, old), ignore_errors=True)


def without_record_checksums():
    """DCP writes each tensor with ``torch.save``, which by default computes a CRC32 of every record (the largest
    piece of DCP's own work in a write). The folder's manifest (SHA-256 of every file, verified before any load)
    already covers every byte, so the records are written without one. (The switch is process-wide while the save
    runs: in the training process, a synchronous save's; in an asynchronous save's writer process, nothing else.)"""
    return serialization_config.patch({"save.compute_crc32": False})


def _fingerprint(file: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return {"size": file.stat().st_size, "sha256": digest.hexdigest()}


def _write_synced(file: Path, state: dict[str, Any]) -> None:
    with file.open("wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _write_text_synced(file: Path, text: str) -> None:
    # NOTE: written under another name and renamed: the marker exists whole or not at all
    temporary = file.with_name(file.name + ".tmp")
    with temporary.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    temporary.replace(file)
    # the rename reaches the disk with the folder's entry: synced before anything else (the pruning of older
    # checkpoints) may reach it first, a crash could otherwise leave the deletions and not the marker
    folder = os.open(file.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def first_line(error: BaseException) -> str:
    """An error in one line (DCP's wrapped failures by their cause)."""
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: rank -> (exception, its stack)
    if isinstance(failures, dict) and failures:
        rank, (inner, _) = next(iter(failures.items()))
        return f"rank {rank}: {first_line(inner)}"
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:300]


def _any_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    on_gpu = group is None and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    value = torch.tensor(int(flag), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
