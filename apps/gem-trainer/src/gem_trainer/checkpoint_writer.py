"""The writer of asynchronous checkpoints: a process of its own beside each rank, so that writing never takes the
training thread's time.

A writer thread shares the interpreter's lock with the training loop, whose step launches its kernels from Python:
every time the thread wants the lock back (after each file write, between DCP's items) the loop hands it over and
waits its turn, which stretched the steps of the H200 benchmark by 8-18% for the ~8 s of a 3.4 GB write. A process
shares nothing but memory.

The training process stages: DCP's own planner flattens the state and lists its write items (what DCP would write
for every tensor, DTensor shard and ShardedTensor shard, and every other value serialised), each tensor's data is
copied into a shared host arena (page-locked on a GPU machine, kept from one save to the next) and the other values
are serialised to bytes. The writer receives the items, their places in the arena and the bytes, and runs
``dcp.save`` with a planner that answers from them: the files are those of a ``dcp.save`` of the state itself.
With several ranks the writers agree on the plan over a Gloo group of their own, joined through the launcher's
store. The writer dies with its training process (``PR_SET_PDEATHSIG``): a killed run never finishes a save behind
the next run's back.

Starting a writer costs seconds (it imports torch). A single-process writer whose manager closed is kept idle for
the next manager of the process (``IDLE_MAX`` at most: a process that builds trainer after trainer, like a test
suite or a sweep, starts one); ``stop_idle_writers`` ends them, as the interpreter's exit does.
"""

from __future__ import annotations

import atexit
import ctypes
import io
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

ALIGNMENT = 64  # bytes: every staged tensor starts at a multiple, so that any dtype's view of it is aligned
IDLE_MAX = 2  # idle single-process writers kept for the next manager


@dataclass
class StagedSave:
    """What the writer needs for one save: the folder, this rank's DCP plan (its write items and the flattening's
    key mapping), where each tensor item's data lies in the arena, and the other items' serialised bytes."""

    folder: str
    step: int
    keep_latest: int
    plan: SavePlan
    tensors: dict[tuple, tuple[int, torch.dtype, tuple[int, ...]]]  # item key -> (arena offset, dtype, shape)
    values: dict[tuple, bytes]  # item key -> torch.save'd bytes


def item_key(index) -> tuple:
    """A write item's data, found again by name and offset: DCP may rewrite an index's position hint between the
    local and the global plan."""
    return (index.fqn, None if index.offset is None else tuple(index.offset))


class Arena:
    """One shared host buffer (a memfd, or a temporary file where there is none: no /dev/shm size limit), mapped
    by the training process and the writer alike; page-locked where the state lives on a GPU, so that the copies
    into it run at full PCIe speed without waiting for each tensor."""

    def __init__(self, fd: int, size: int) -> None:
        """Map the arena of file ``fd`` (the writer maps the one it is handed: it only reads it)."""
        self.fd, self.size, self.pinned = fd, size, False
        self._map = mmap.mmap(fd, max(size, 1))
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    @classmethod
    def create(cls, size: int, pin: bool) -> "Arena":
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("gem-checkpoint-staging")
        else:
            handle = tempfile.TemporaryFile()
            fd = os.dup(handle.fileno())
            handle.close()
        os.ftruncate(fd, max(size, 1))
        arena = cls(fd, size)
        if pin:
            error = int(torch.cuda.cudart().cudaHostRegister(arena.tensor.data_ptr(), arena.tensor.numel(), 0))
            if error != 0:
                arena.close()
                raise RuntimeError(f"could not page-lock {size} bytes of checkpoint staging (cudaError {error})")
            arena.pinned = True
        return arena

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        count = 1
        for n in shape:
            count *= n
        return self.tensor[offset: offset + count * dtype.itemsize].view(dtype).view(shape)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        del self.tensor
        try:
            self._map.close()
        except BufferError:  # a view of it is still alive somewhere: the mapping goes with the last one
            pass
        os.close(self.fd)


class SharedStaging:
    """Copies of a state in one shared arena that training can no longer change: ``stage(state, ...)`` returns the
    ``StagedSave`` and whether the arena is new (the writer must then be given it). The arena is reused while the
    state's tensors keep their sizes; it is overwritten by the next ``stage``, so the write of the previous copy
    must be finished by then (``CheckpointManager.save`` waits for it first)."""

    def __init__(self) -> None:
        self.arena: Arena | None = None

    def stage(self, state: dict[str, Any], folder: Path, step: int, keep_latest: int,
              coordinator: bool) -> tuple[StagedSave, bool]:
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=coordinator)
        plan = planner.create_local_plan()
        sources, tensors, values, size = [], {}, {}, 0
        for item in plan.items:
            data = planner.resolve_data(item)
            key = item_key(item.index)
            if item.type == WriteItemType.BYTE_IO:
                values[key] = bytes(data.getbuffer())
                continue
            tensors[key] = (size, data.dtype, tuple(data.shape))
            sources.append((key, data.detach()))
            size += -(-data.numel() * data.element_size() // ALIGNMENT) * ALIGNMENT
        pin = any(data.is_cuda for _, data in sources)
        fresh = self.arena is None or self.arena.size != size or self.arena.pinned != pin
        if fresh:
            if self.arena is not None:
                self.arena.close()
            self.arena = Arena.create(size, pin)
        for key, data in sources:
            offset, dtype, shape = tensors[key]
            self.arena.view(offset, dtype, shape).copy_(data, non_blocking=data.is_cuda)
        if pin:
            torch.cuda.synchronize()  # the copies from the GPU were queued without waiting
        return StagedSave(str(folder), step, keep_latest, plan, tensors, values), fresh

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
            self.arena = None


class WriterProcess:
    """The writer beside this rank: started on first use (its start-up overlaps training), one save in flight at a
    time. ``submit`` hands it a staged save; ``result`` waits for the outcome: None, or the one-line reason the
    save failed (a ``CheckpointError`` of the writer's, or its death)."""

    def __init__(self) -> None:
        self._process = None
        self._conn = None
        self._pending: int | None = None
        self._outcome: tuple[int, str | None] | None = None
        self._has_arena = False  # whether the running writer was handed the current arena
        self._rendezvous: list | None = None  # how a multi-rank writer joined its group (None: single process)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def submit(self, staged: StagedSave, arena: Arena, fresh_arena: bool) -> None:
        if self._process is not None and self._process.poll() is not None:
            # NOTE: not restarted here: with several ranks a new writer needs every rank's agreement
            raise RuntimeError(f"the checkpoint writer process exited (code {self._process.returncode}) since the "
                               "last save")
        if self._process is None:
            self.start()
        if fresh_arena or not self._has_arena:
            self._conn.send(("arena", arena.size))
            send_handle(self._conn, arena.fd, self._process.pid)
            self._has_arena = True
        self._conn.send(("write", staged))
        self._pending, self._outcome = staged.step, None

    def busy(self) -> bool:
        """Whether a submitted save is still being written."""
        if self._pending is None or self._outcome is not None:
            return False
        if self._conn.poll():  # an answer, or the end of the pipe if the writer died
            self._outcome = self._receive()
            return False
        return True

    def result(self) -> str | None:
        """Wait for the submitted save; None when it was written and marked, else why not (one line)."""
        if self._pending is None:
            return None
        outcome = self._outcome if self._outcome is not None else self._receive()
        self._pending, self._outcome = None, None
        return outcome[1]

    def close(self) -> None:
        """Stop the writer, or keep it idle for the next manager of this process (a single-process writer that is
        healthy, with nothing in flight, told to drop its arena)."""
        if self._process is not None:
            if (self._rendezvous is None and self._pending is None and self._process.poll() is None
                    and len(_IDLE) < IDLE_MAX):
                self._stop.detach()
                try:
                    self._conn.send(("forget", None))
                    _IDLE.append((self._process, self._conn))
                except OSError:
                    _stop_writer(self._process, self._conn)
            else:
                self._stop()
        self._process, self._conn, self._has_arena = None, None, False

    def _receive(self) -> tuple[int, str | None]:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            try:
                code = self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = "none yet"
            self._stop()
            self._process, self._has_arena = None, False  # the next save starts a new writer
            return (self._pending, f"the checkpoint writer process died (exit code {code}) while writing step "
                                   f"{self._pending}")

    def start(self) -> None:
        """Start the writer now (with several ranks every rank must call this together), so that its start-up
        (importing torch: seconds) overlaps the training before the first save. ``submit`` starts it otherwise."""
        if self._process is not None:
            return
        rendezvous = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            # NOTE: the writers meet in the launcher's store (every rank reaches it), under a prefix of this
            # writer's own that rank 0 draws: two managers in one job never share keys
            prefix = [f"gem-checkpoint-writer/{uuid.uuid4().hex}"]
            dist.broadcast_object_list(prefix, src=0)
            rendezvous = [os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), prefix[0],
                          dist.get_rank(), dist.get_world_size()]
        self._rendezvous = rendezvous
        while rendezvous is None and _IDLE:
            process, conn = _IDLE.pop()
            if process.poll() is None:
                self._adopt(process, conn)
                return
            conn.close()
        ours, theirs = socket.socketpair()
        # NOTE: a plain interpreter on this module, not multiprocessing's spawn, which would first import the
        # launching program's own main module (the trainer: TorchRec, FBGEMM, the models) in the writer too
        # (a session of its own: a terminal's Ctrl-C, sent to the trainer's process group, does not reach it)
        process = subprocess.Popen(
            [sys.executable, "-m", "gem_trainer.checkpoint_writer", str(theirs.fileno()), str(os.getpid()),
             json.dumps(rendezvous)], pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self._adopt(process, Connection(ours.detach()))

    def _adopt(self, process: subprocess.Popen, conn: Connection) -> None:
        self._process, self._conn, self._has_arena = process, conn, False
        # a manager dropped without close() (a test, an error path) must not leave its writer behind
        self._stop = weakref.finalize(self, _stop_writer, process, conn)


_IDLE: list[tuple[subprocess.Popen, Connection]] = []  # writers kept by WriterProcess.close


@atexit.register
def stop_idle_writers() -> None:
    """Stop the writers kept idle for this process's next checkpoint manager."""
    while _IDLE:
        _stop_writer(*_IDLE.pop())


def _stop_writer(process, conn) -> None:
    """Ask the writer to stop (it reads the request after answering what it was handed before), then make sure."""
    try:
        conn.send(("stop", None))
    except OSError:
        pass
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    conn.close()


class _StagedPlanner(DefaultSavePlanner):
    """DCP's default planner whose local plan and data come from a ``StagedSave`` instead of a state dict."""

    def __init__(self, staged: StagedSave, arena: Arena) -> None:
        super().__init__()
        self._staged, self._arena = staged, arena

    def create_local_plan(self) -> SavePlan:
        self.plan = self._staged.plan
        return self.plan

    def resolve_data(self, write_item):
        key = item_key(write_item.index)
        if key in self._staged.values:
            return io.BytesIO(self._staged.values[key])
        return self._arena.view(*self._staged.tensors[key])


def serve(conn, parent: int, rendezvous: list | None) -> None:
    """The writer process: write each staged save it is handed, answer ``(step, None | reason)``, until told to
    stop or its training process is gone."""
    _die_with_parent(parent)
    # NOTE: a Ctrl-C or a scheduler's SIGTERM reaches every process of the job: the training process answers it by
    # stopping with a checkpoint, which this process writes; it ends with its parent (above) or when told to
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    torch.set_num_threads(1)  # the copies it makes must not take cores from the training process
    from gem_trainer.checkpoint import CheckpointError, finish_checkpoint, first_line, without_record_checksums

    if rendezvous is not None:
        address, port, prefix, rank, world = rendezvous
        store = dist.PrefixStore(prefix, dist.TCPStore(address, port, is_master=False))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    arena = None
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:
            return
        if kind == "stop":
            return
        if kind == "forget":  # kept idle for another manager: its arena is no longer this writer's business
            if arena is not None:
                arena.close()
            arena = None
            continue
        if kind == "arena":
            if arena is not None:
                arena.close()
            fd = recv_handle(conn)
            arena = Arena(fd, payload)
            continue
        staged: StagedSave = payload
        failure = None
        try:
            # NOTE: no copy-ahead: its loader would start CUDA in this process, and the data is on the host already
            writer = dcp.FileSystemWriter(staged.folder, per_thread_copy_ahead=0)
            with without_record_checksums():
                dcp.save({}, storage_writer=writer, planner=_StagedPlanner(staged, arena),
                         no_dist=rendezvous is None)
        # any failure (DCP's CheckpointException is a BaseException): this rank must still take part in the agreement
        except (Exception, CheckpointException) as error:
            failure = error
        try:
            finish_checkpoint(Path(staged.folder).parent, staged.keep_latest, staged.step, failure, None)
            conn.send((staged.step, None))
        except CheckpointError as error:
            conn.send((staged.step, str(error)))
        except Exception as error:  # the agreement itself failed: say so rather than die silently
            conn.send((staged.step, f"could not write checkpoint {staged.folder} ({first_line(error)})"))


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to kill this process when its parent dies (Linux); elsewhere the closed pipe ends it."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(0)


if __name__ == "__main__":
    # python -m gem_trainer.checkpoint_writer FD PARENT_PID RENDEZVOUS_JSON (started by WriterProcess.start)
    # NOTE: served by the module imported under its own name, whose classes the training process pickles
    from gem_trainer.checkpoint_writer import serve as serve_imported
    from gem_trainer.console import quiet_library_notices

    quiet_library_notices()
    serve_imported(Connection(int(sys.argv[1])), int(sys.argv[2]), json.loads(sys.argv[3]))
