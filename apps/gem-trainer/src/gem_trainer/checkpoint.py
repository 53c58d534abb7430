"""Checkpoints: torch.distributed.checkpoint folders ``step-N``, kept to the latest k, found again on restart.

A folder counts only once it holds the ``COMPLETE`` marker, written after every rank finished writing and
its files reached the disk (fsync). The marker is a manifest: the size and SHA-256 of every file of the
folder. Loading verifies it first, so a checkpoint damaged afterwards (a file missing or cut short, a copy
gone wrong) is never read: the run falls back to the newest intact one and says so in one line.

Each rank's local state (step, data position, schedule, RNG) is stored with ``torch.save`` and read back
with ``weights_only=True``: plain containers and tensors, nothing that runs code when loaded.

Asynchronous saves (``save(..., asynchronous=True)``) stop training only while the state is copied to host
memory (``HostStaging``: plain tensors, FSDP's DTensors and TorchRec's ShardedTensors, whose shards DCP's own
stager cannot copy, into page-locked buffers kept between saves); ``dcp.save`` then writes the copy, and the
marker after it, on a background thread that talks over a Gloo group of its own (never the training
collectives). Until the marker exists the folder does not count, so a run killed mid-write resumes from the
previous checkpoint, as with a synchronous save. One save is in flight at a time: the next save, ``wait``
and the end of training wait for it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.utils.serialization.config as serialization_config

STEP_FOLDER = re.compile(r"^step-(\d+)$")
MARKER = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; ``str(error)`` is one line naming the folder."""


class CheckpointManager:
    """Saves and restores ``{"model": ..., "optimizer": ...}`` through DCP plus per-rank local state."""

    def __init__(self, folder: str | Path, keep_latest: int) -> None:
        self.folder = Path(folder)
        self.keep_latest = keep_latest
        self._in_flight: _InFlight | None = None
        self._staging = HostStaging()
        self._background_group: dist.ProcessGroup | None = None

    def complete_steps(self) -> list[int]:
        """Steps whose folder holds the marker (not yet verified: see ``damage``)."""
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
            group = self._group_for_background()
            try:
                path.mkdir(parents=True, exist_ok=True)
                _write_synced(path / f"local-rank{rank}.pt", local_state)
                staged = self._staging.stage(distributed_state)
            except (OSError, RuntimeError) as error:
                # NOTE: no agreement with the other ranks here: their writes may already wait for this one in
                # DCP's collectives; this rank's error ends the job (torchrun stops the others)
                previous = self.latest_step()
                kept = f"step-{previous} is kept" if previous is not None else "no earlier checkpoint exists"
                raise CheckpointError(f"could not stage checkpoint {path} ({_first_line(error)}); {kept}") from None
            alone = not dist.is_initialized() or dist.get_world_size() == 1

            def write() -> None:
                # NOTE: no copy-ahead: the staged tensors are on the host already, and DCP's copy-ahead loader
                # would synchronise the GPU's current stream (the training's) for every 10 MB it writes
                writer = dcp.FileSystemWriter(str(path), per_thread_copy_ahead=0)
                with _without_record_checksums():
                    dcp.save(staged, storage_writer=writer, process_group=group, no_dist=alone)

            self._in_flight = _InFlight(step, write, lambda failure: self._finish(step, failure, group))
            return path
        failure = None
        try:
            with _without_record_checksums():
                dcp.save(distributed_state, checkpoint_id=str(path))
            _write_synced(path / f"local-rank{rank}.pt", local_state)
        except (OSError, RuntimeError) as error:  # a full disk surfaces as OSError, or wrapped by DCP
            failure = error
        self._finish(step, failure, None)
        _barrier()
        return path

    def writing(self) -> bool:
        """Whether an asynchronous save is still being written (``wait`` then blocks until it is marked)."""
        return self._in_flight is not None and self._in_flight.thread.is_alive()

    def wait(self, agree: bool = True) -> None:
        """Wait for the save in flight (if any) to be written and marked; raise its ``CheckpointError``. ``agree``:
        then wait for every rank (a barrier: all ranks must call it), so that they all see the marker."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.join()
            # NOTE: rank 0 writes the marker after every rank's part is written: past this barrier every rank sees
            # it, so that decisions taken from the folder (is the last step saved? which step to resume?) agree
            if agree:
                _barrier()

    def _finish(self, step: int, failure: BaseException | None, group: dist.ProcessGroup | None) -> None:
        """Every rank's part written (or failed): rank 0 writes the marker and prunes, or the folder goes."""
        path = self.path(step)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if _any_rank(failure is not None, group):
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            previous = self.latest_step()
            kept = f"step-{previous} is kept" if previous is not None else "no earlier checkpoint exists"
            reason = _first_line(failure) if failure is not None else "another rank failed to write its part"
            raise CheckpointError(f"could not write checkpoint {path} ({reason}); {kept}")
        if rank == 0:
            manifest = {name: _fingerprint(path / name) for name in sorted(os.listdir(path))}
            _write_text_synced(path / MARKER, json.dumps({"step": step, "files": manifest}, indent=1))
            self._prune()

    def _group_for_background(self) -> dist.ProcessGroup | None:
        # NOTE: the background writes gather their plans and agree on success over a Gloo group of their own, so
        # that they never interleave with the training's collectives (NCCL's, or the default group's)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        if self._background_group is None:
            self._background_group = dist.new_group(backend="gloo")
        return self._background_group

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
        """The newest verified step (at most ``at_most``) and a line per damaged newer one."""
        skipped = []
        for step in reversed(self.complete_steps()):
            if at_most is not None and step > at_most:
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

    def load(self, step: int, distributed_state: dict[str, Any]) -> dict[str, Any]:
        """Load checkpoint ``step`` (verified by ``newest_intact`` or ``require``) in place into
        ``distributed_state`` (DCP fills the given tensors); return this rank's local state."""
        path = self.path(step)
        # NOTE: DCP reshards: the tensors load into whatever layout this run has, on any number of ranks
        dcp.load(distributed_state, checkpoint_id=str(path))
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
                                  f"({_first_line(error)})") from None

    def _prune(self) -> None:
        for step in self.complete_steps()[: -self.keep_latest]:
            shutil.rmtree(self.path(step), ignore_errors=True)


def _without_record_checksums():
    """DCP writes each tensor with ``torch.save``, which by default computes a CRC32 of every record while holding
    the GIL (the largest such piece of DCP's write): during an asynchronous save that time is taken from the
    training thread. The folder's manifest (SHA-256 of every file, verified before any load)
    already covers every byte, so the records are written without one. (The switch is process-wide while the save
    runs: a ``torch.save`` elsewhere meanwhile skips the checksum too, which loading tolerates.)"""
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


def _first_line(error: BaseException) -> str:
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


class HostStaging:
    """Copies of a state in host memory that training can no longer change, made into buffers kept from one save
    to the next (page-locked when the state is on a GPU: copied at full PCIe speed, without waiting for each
    tensor). ``stage(state)``: tensors copied, DTensors and ShardedTensors rebuilt around copies of their local
    parts (same global layout), containers rebuilt. A buffer is overwritten by the next ``stage``: the write of
    the previous copy must be finished by then (``CheckpointManager.save`` waits for it first)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, state: Any) -> Any:
        staged = self._stage(state, "")
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies from the GPU were queued without waiting
        return staged

    def _stage(self, state: Any, where: str) -> Any:
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
        from torch.distributed.tensor import DTensor

        if isinstance(state, ShardedTensor):
            metadata = copy.deepcopy(state.metadata())
            for shard in metadata.shards_metadata:  # the copy lives on the host: every shard's placement says so
                shard.placement = dist._remote_device(f"rank:{shard.placement.rank()}/cpu")
            by_offsets = {tuple(m.shard_offsets): m for m in metadata.shards_metadata}
            local = [Shard(self._copy(s.tensor, f"{where}@{tuple(s.metadata.shard_offsets)}"),
                           by_offsets[tuple(s.metadata.shard_offsets)]) for s in state.local_shards()]
            # NOTE: ShardedTensor checks that its shards' page-locking matches the global properties
            metadata.tensor_properties.pin_memory = any(shard.tensor.is_pinned() for shard in local)
            return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata,
                                                                             process_group=state._process_group)
        if isinstance(state, DTensor):
            local = state.to_local()
            if hasattr(local, "local_shards"):  # TorchRec's LocalShardsWrapper (2-D sparse): several shards
                shards = local.local_shards()
                local = type(local)([self._copy(t, f"{where}#{i}") for i, t in enumerate(shards)],
                                    [tuple(o) for o in local.local_offsets()]) if shards else local
            else:
                local = self._copy(local, where)
            return DTensor.from_local(local, state.device_mesh, state.placements, run_check=False,
                                      shape=state.shape, stride=state.stride())
        if isinstance(state, torch.Tensor):
            return self._copy(state, where)
        if isinstance(state, dict):
            return type(state)((key, self._stage(value, f"{where}/{key}")) for key, value in state.items())
        if isinstance(state, (list, tuple)):
            return type(state)(self._stage(value, f"{where}/{i}") for i, value in enumerate(state))
        return copy.deepcopy(state)

    def _copy(self, tensor: torch.Tensor, where: str) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self._buffers.get(where)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._buffers[where] = buffer
        return buffer.copy_(tensor, non_blocking=tensor.is_cuda)


class _InFlight:
    """An asynchronous save: a thread runs ``write()`` (DCP's write of the staged copy), then ``finish(failure)``
    (the agreement of every rank and the marker)."""

    def __init__(self, step: int, write, finish) -> None:
        self.error: BaseException | None = None

        def run() -> None:
            failure = None
            try:
                write()
            except Exception as error:  # any failure: this rank must still take part in the agreement
                failure = error
            try:
                finish(failure)
            except BaseException as error:  # re-raised by join, on the training thread
                self.error = error

        self.thread = threading.Thread(target=run, name=f"gem-checkpoint-{step}")
        self.thread.start()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
