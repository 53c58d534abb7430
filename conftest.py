"""Loaded before any test module of the workspace.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when its module is first imported, and
any package above gem-kernels imports it. On a host without a GPU the kernels can only run through
Triton's interpreter, so the variable is set here, before the first test module is collected.

The suite runs in parallel workers (pytest-xdist, the README's test command): each worker, and every process its
tests start, computes on one thread, since torch's intra-op threads on top of the workers oversubscribe the cores
(on a busy 2-core machine that slowed tests 10-50x).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    if not os.environ.get("OMP_NUM_THREADS"):  # unset or empty (libgomp rejects an empty value)
        os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
