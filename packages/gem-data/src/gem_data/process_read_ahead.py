"""``ProcessReadAhead``: ``ReadAhead``'s batches, read by a separate process instead of a thread.

A reading thread shares the training process's interpreter: where the step itself waits on the host (a small model on
a GPU, its kernels launched one by one from Python), every millisecond of the reader's Python is a millisecond the
step cannot run. A forked process reads instead, on a core of its own. It writes each batch into one of ``depth``
shared-memory buffers (``gem_data.packing``: every tensor in one flat buffer) and sends a description of a few hundred
bytes through a pipe; the training process copies the buffer out in one piece (into page-locked memory for a GPU),
hands the buffer back (a semaphore, which costs no system call while the reader is busy) and rebuilds the batch as
views of its copy. Handing out a batch then costs the training process one memory copy and a few dozen tensor views,
where receiving a pickled batch (a DataLoader worker's) costs a shared-memory file per tensor. With ``device``, that
copy goes on to the device in one piece too and the batch is rebuilt as views of the device's copy, where
``Batch.to`` would queue a copy per tensor; the host-side facts the step needs without reading the device back (ids
per key, event counts) are taken in the reading process (``Batch.count_on_host``) and travel in the description.

Everything else is ``ReadAhead``'s: the same batches in the same order, ``depth`` batches ahead, the state recorded
right after each delivered batch (the process sends it with the batch), ``observe(batch)`` called in the reading
process with each batch and its value handed out as ``observed``, and ``close`` rewinding the source to the last
delivered batch. The source (and ``observe``) must not use a GPU: the process is forked from one that may have
initialised CUDA.
"""

from __future__ import annotations

import atexit
import collections
import copy
import gc
import multiprocessing as mp
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from gem_kunlun import Batch, catalogue_on

from gem_data.errors import portable_error
from gem_data.packing import Shared, describe, pack_into, unpack
from gem_data.read_ahead import ReaderAhead

# NOTE: the processes of readers still running when the interpreter exits (a run stopped by an error) are stopped
_live: weakref.WeakSet = weakref.WeakSet()
atexit.register(lambda: [reader.stop_reading() for reader in list(_live)])


def process_reading_available() -> str | None:
    """None where a reading process can be forked here, otherwise why not."""
    if "fork" not in mp.get_all_start_methods():
        return "this platform cannot fork a process (the reading process is forked, so that the source needs no pickling)"
    return None


class ProcessReadAhead(ReaderAhead):
    """Read ``source`` (any ``BatchSource``) ``depth`` (>= 1) batches ahead in a forked process; ``pin``: receive
    batches in page-locked memory (needs a CUDA build and device); ``observe``: called with each batch in the
    reading process, its value for the last delivered batch is ``observed``; ``device``: hand batches out there (one
    copy of the whole batch, not waiting for the device), None: on the host."""

    def __init__(self, source, depth: int = 2, pin: bool = False, observe: Callable[[Batch], Any] | None = None,
                 device: torch.device | None = None) -> None:
        if depth < 1:
            raise ValueError(f"ProcessReadAhead depth must be >= 1, got {depth}")
        why_not = process_reading_available()
        if why_not is not None:
            raise RuntimeError(why_not)
        super().__init__(source, observe, device)
        self.depth, self.pin = depth, pin
        self._process: mp.Process | None = None
        self._ready = self._free = self._stop = None  # the pipe's receiving end, the free-buffer count, the stop flag

    def _batches(self) -> Iterator[Batch]:
        # the process starts with the first batch asked for, not when the iterator is made
        context = mp.get_context("fork")
        ready_receive, ready_send = context.Pipe(duplex=False)
        free, stop = context.Semaphore(0), context.Event()
        process = context.Process(target=_read, args=(self.source, self.observe, self.depth, ready_send, ready_receive,
                                                       free, stop, os.getpid()), name="gem-read-ahead", daemon=True)
        self._process, self._ready, self._free, self._stop = process, ready_receive, free, stop
        del ready_receive  # held by self._ready alone: dropping it closes the pipe's end (see stop_reading)
        _live.add(self)
        # NOTE: garbage of this process (a closed trainer's GPU tensors) must not be collected in the forked one, where
        # freeing GPU memory aborts: collected here first, and what lives is frozen out of the fork's collections
        gc.collect()
        gc.freeze()
        try:
            process.start()
        finally:
            gc.unfreeze()
        ready_send.close()
        buffers: list[np.ndarray | None] = [None] * self.depth
        shared: dict[int, Any] = {}  # token -> shared object, where batches are handed out
        try:
            while True:
                if self._process is not process:
                    return  # a newer iterator reads now: this one's process was stopped, the pipe is the newer one's
                message = self._receive(process)
                if message[0] == "end":
                    return
                if message[0] == "failed":
                    raise message[1]
                _, slot, new_buffer, new_shared, description, state, observed = message
                if new_buffer is not None:
                    buffers[slot] = new_buffer.numpy()
                # NOTE: the shared objects are data sets' item catalogues (packing.SHARED_FIELDS): each goes to the
                # device once, the copy ``Batch.to`` makes of it
                shared.update(new_shared if self.device is None else
                              {token: catalogue_on(obj, self.device, non_blocking=True) for token, obj in new_shared.items()})
                flat = torch.empty(description.nbytes, dtype=torch.uint8, pin_memory=self.pin)
                # NOTE: NumPy's copy is one plain memcpy; torch's splits a copy of this size over its intra-op threads,
                # whose wake-up cost several times the copy on a many-core host
                np.copyto(flat.numpy(), buffers[slot][: description.nbytes])
                free.release()
                self._delivered, self.observed = state, observed
                yield unpack(flat if self.device is None else flat.to(self.device, non_blocking=True), description, shared)
        finally:  # the end, an error, or the iterator dropped: its process goes (a newer iterator's stays)
            if self._process is process:
                self.stop_reading()

    def _receive(self, process: mp.Process) -> tuple:
        # NOTE: a bounded wait, so that a reading process that died without a word (killed, out of memory) is noticed
        while not self._ready.poll(1.0):
            if not process.is_alive():
                raise RuntimeError(f"the data reading process exited with code {process.exitcode} before "
                                   "sending its next batch")
        try:
            return self._ready.recv()
        except EOFError:
            process.join(1.0)
            raise RuntimeError(f"the data reading process exited with code {process.exitcode} before "
                               "sending its next batch") from None

    def stop_reading(self) -> None:
        """Stop the reading process (what it read ahead is dropped; the source here never moved)."""
        if self._process is None:
            return
        self._stop.set()
        self._process.join(1.0)
        if self._process.is_alive():  # still inside a read: nothing of it is wanted
            self._process.terminate()
            self._process.join()
        # NOTE: the pipe's end is dropped, not closed: when an abandoned reader is collected with its iterator, the
        # connection may have closed its descriptor first, and a second close could hit a descriptor reused since
        self._process = self._ready = self._free = self._stop = None


def _read(source, observe, depth: int, ready, reader_end, free, stop, reader_pid: int) -> None:
    """The reading process: each batch of ``source`` packed into a free buffer and described to the reader, until
    the source ends or the reader stops it."""
    reader_end.close()  # the fork's copy of the reader's end
    # NOTE: one intra-op thread: the process is one core's worth of reading beside a training process
    torch.set_num_threads(1)

    def stopped() -> bool:
        return stop.is_set() or os.getppid() != reader_pid

    buffers: list[torch.Tensor | None] = [None] * depth
    idle, in_use = list(range(depth)), collections.deque()  # the reader hands buffers back in the order sent
    shared = Shared()
    batches = iter(source)
    try:
        for batch in batches:
            state = copy.deepcopy(source.state_dict())
            observed = observe(batch) if observe is not None else None
            if isinstance(batch, Batch):
                batch.count_on_host()
            description, tensors, new_shared = describe(batch, shared)
            if not idle:
                while not free.acquire(timeout=0.1):
                    if stopped():
                        return
                idle.append(in_use.popleft())
            slot = idle.pop()
            new_buffer = None
            if buffers[slot] is None or buffers[slot].numel() < description.nbytes:
                # room to grow, so that a slightly larger batch later does not send a new buffer
                size = max(description.nbytes + description.nbytes // 4, 1 << 16)
                buffers[slot] = new_buffer = torch.empty(size, dtype=torch.uint8).share_memory_()
            pack_into(buffers[slot], description, tensors)
            in_use.append(slot)
            if not _send(ready, ("batch", slot, new_buffer, new_shared, description, state, observed)):
                return
        _send(ready, ("end",))
    except BaseException as error:  # raised where the batch was wanted
        _send(ready, ("failed", portable_error(error)))
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
        # NOTE: the buffers and shared objects sent last may still be unpickled, and their memory reaches the reader
        # through this process (a file descriptor it hands out on request): it stays until the reader stops it
        while not stop.wait(1.0) and not stopped():
            pass


def _send(ready, message: tuple) -> bool:
    """Send ``message``; False where the reader has closed its end."""
    try:
        ready.send(message)
        return True
    except (BrokenPipeError, ConnectionResetError):
        return False
