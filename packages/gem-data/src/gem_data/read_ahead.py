"""``ReadAhead``: a ``BatchSource`` whose batches are produced on a background thread, ahead of the trainer.

The training thread then never waits for a reader, and with ``pin=True`` the batches arrive in page-locked
host memory, so that ``batch.to(cuda, non_blocking=True)`` is queued behind the GPU's work instead of
stalling the host until the GPU has drained (a pageable copy does, and the GPU then idles while the host
launches the next forward pass). Pinning costs a host copy per batch; on the background thread it overlaps
the step, which is why it is not done where the batch is used.

The thread runs at most ``depth`` batches ahead. Its source advances ahead of the trainer, so the state
that counts is the one recorded right after each *delivered* batch: ``state_dict`` returns it, and a new
``iter`` (or ``load_state_dict``) stops the thread and rewinds the source there, so nothing read ahead is
lost or repeated on resume. For the same reason, what the trainer notes of each batch (examples per mixed
source, the step's FLOPs) is taken by ``observe(batch)`` on the reading thread right after the batch is read, the
only thread that touches the readers, and handed out with the batch as ``observed``.

With ``device``, batches are handed out on that device (the copy queued where the batch is handed out, on the
caller's thread and stream); without, on the host, where the source made them.

``depth=0`` reads each batch in the caller's thread when it is asked for (``data.read_ahead = false``): the same
batches, states and observations without a thread, the thread's reference. It is not a faster path: the training
thread then pays for every read in full, where a reading thread overlaps most of it with the step.
"""

from __future__ import annotations

import abc
import atexit
import copy
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gem_kunlun import Batch, FeatureSpec

_END = object()
# NOTE: a reading thread still inside a torch op when the interpreter exits (a run stopped by an error) aborts the
# process; every live reader is stopped first
_live: weakref.WeakSet = weakref.WeakSet()
atexit.register(lambda: [reader.stop_reading() for reader in list(_live)])


class _Failed:
    """An exception raised by the source on the background thread, re-raised where the batch was wanted."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class ReaderAhead(abc.ABC):
    """What every reader ahead of the trainer shares: ``source`` (any ``BatchSource``), its state right after the last
    *delivered* batch (``state_dict``; the reader's own copy of the source may be further on), ``close`` stopping the
    reader and rewinding the source there, ``observed`` (what ``observe`` returned for that batch) and ``device``
    (where batches are handed out; None: on the host). A subclass reads in ``_batches`` (the iterator ``iter`` hands
    out, started after the rewind) and stops in ``stop_reading``."""

    def __init__(self, source, observe: Callable[[Batch], Any] | None, device: torch.device | None) -> None:
        self.source, self.observe = source, observe
        self.device = None if device is None else torch.device(device)
        self._delivered: dict[str, Any] | None = None  # the source's state after the last delivered batch
        self.observed: Any = None

    @property
    def spec(self) -> FeatureSpec:
        return self.source.spec

    def __iter__(self) -> Iterator[Batch]:
        self.close()
        self._delivered = copy.deepcopy(self.source.state_dict())
        return self._batches()

    @abc.abstractmethod
    def _batches(self) -> Iterator[Batch]: ...

    @abc.abstractmethod
    def stop_reading(self) -> None:
        """Stop reading (what was read ahead is dropped)."""

    def close(self) -> None:
        """Stop reading and rewind the source to the last delivered batch."""
        self.stop_reading()
        if self._delivered is not None:
            self.source.load_state_dict(self._delivered)

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._delivered) if self._delivered is not None else self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()
        self.source.load_state_dict(state)
        self._delivered = None


class ReadAhead(ReaderAhead):
    """Read ``source`` (any ``BatchSource``) ``depth`` batches ahead on one background thread (0: no thread, each
    batch read when asked for); ``pin``: read batches into page-locked memory (needs a CUDA build and device);
    ``observe``: called with each batch on the reading thread, its value for the last delivered batch is
    ``observed``; ``device``: hand batches out there (``Batch.to``, not waiting for the device), None: on the host."""

    def __init__(self, source, depth: int = 2, pin: bool = False, observe: Callable[[Batch], Any] | None = None,
                 device: torch.device | None = None) -> None:
        if depth < 0:
            raise ValueError(f"ReadAhead depth must be >= 0, got {depth}")
        super().__init__(source, observe, device)
        self.depth, self.pin = depth, pin
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._inline: Iterator[Batch] | None = None  # depth 0: the batches being handed out

    def _batches(self) -> Iterator[Batch]:
        if self.depth == 0:
            self._inline = self._read_inline()
            return self._inline
        return self._deliver()

    def _read_inline(self) -> Iterator[Batch]:
        batches = iter(self.source)
        try:
            for batch in batches:
                # NOTE: the state is the delivered batch's only once observed: an observation that raises leaves the
                # state at the batch before (as the thread's and the process's), and a rewind reads this one again
                state = copy.deepcopy(self.source.state_dict())
                observed = self.observe(batch) if self.observe is not None else None
                self._delivered, self.observed = state, observed
                yield self._handed_out(batch.pin_memory() if self.pin else batch)
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def _deliver(self) -> Iterator[Batch]:
        # the thread starts with the first batch asked for, not when the iterator is made
        ready: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        thread = threading.Thread(target=self._produce, args=(ready, stop), name="gem-read-ahead", daemon=True)
        self._stop, self._thread = stop, thread
        _live.add(self)
        thread.start()
        while not stop.is_set():
            item = ready.get()
            if item is _END:
                return
            if isinstance(item, _Failed):
                raise item.error
            batch, state, self.observed = item
            self._delivered = state
            yield self._handed_out(batch)

    def _produce(self, ready: queue.Queue, stop: threading.Event) -> None:
        def put(item) -> bool:
            # NOTE: a bounded wait, so that a stopped reader never stays blocked on a full queue
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        batches = iter(self.source)
        try:
            for batch in batches:
                state = copy.deepcopy(self.source.state_dict())
                observed = self.observe(batch) if self.observe is not None else None
                if not put((batch.pin_memory() if self.pin else batch, state, observed)):
                    return
            put(_END)
        except BaseException as error:  # handed to the training thread, which raises it
            put(_Failed(error))
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def _handed_out(self, batch: Batch) -> Batch:
        return batch if self.device is None else batch.to(self.device, non_blocking=True)

    def stop_reading(self) -> None:
        """Stop the background thread (what was read ahead is dropped; the source stays where the thread left it)."""
        if self._inline is not None:
            self._inline.close()
            self._inline = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = self._stop = None

