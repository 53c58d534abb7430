"""The end of a test worker: tear Gloo down, then leave without the interpreter's finalization.

After ``destroy_process_group`` a Gloo worker thread can still hold its last work item (tensors with Python
references); releasing it during finalization takes the GIL from a thread that Python then ends, which aborts
the process ("terminate called without an active exception", SIGABRT) after its results were written. The
results are on disk by then, so the worker exits at once."""

import os
import sys

import torch.distributed as dist


def finish() -> None:
    # NOTE: a barrier first, so no rank tears Gloo down while another still talks to it
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
