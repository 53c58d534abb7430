"""What the trainer keeps off its console: the libraries' notices that say nothing about the run.

Each was checked to say nothing about the run: a deprecation inside TorchRec's or PyTorch's own code, advice for a
mode the trainer does not use (a dry run of the planner), or a push to build an input another way (the planner's
topology, which the trainer builds with what the planner reads). Any other warning or log record shows.
"""

from __future__ import annotations

import logging
import warnings

# Python warnings, by the start of their message
WARNINGS = (
    # FSDP2 warns whenever a wrapped block returns a view, in case the caller then changes it in place (which would
    # bypass its backward hook); no gem-kunlun model changes a block's output in place
    r"FSDP2-wrapped module \(.*\) returned a view tensor",
    # TorchRec's planner on its default storage reservation: the over-estimate it warns of is a dry run's (planning
    # without the tensors), and the trainer plans with them
    r"HeuristicalStorageReservation is known to cause issues",
    # TorchRec's optimizers and PyTorch's checkpoint planner reading TorchRec's sharded tables
    r"Please use DTensor instead and we are deprecating ShardedTensor",
    # a checkpoint of a process without a process group: one process, as intended
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to save in a single process",
)
# log records, by logger and the start of their message
LOG_RECORDS = {
    # the planner's topology, made from the world size and the device type (the planner's inputs here)
    "torchrec.distributed.planner.types": "The topology was constructed directly",
    # the same dry-run advice as the storage reservation's warning above
    "torchrec.distributed.planner.storage_reservations": "There is a known issue with TorchRec's dense tensor size",
    # TorchRec's jagged tensors asking whether they are traced (the trainer neither traces nor exports them)
    "torch.fx._symbolic_trace": "is_fx_tracing will return true",
}


class DropRecords(logging.Filter):
    """Drops a logger's records whose message starts with ``start``."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def quiet_library_notices() -> None:
    """Keep ``WARNINGS`` and ``LOG_RECORDS`` off the console (once per process)."""
    for message in WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name, start in LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropRecords) and f.start == start for f in logger.filters):
            logger.addFilter(DropRecords(start))
