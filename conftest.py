"""Loaded before any test module of the workspace.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when its module is first imported, and
any package above gem-kernels imports it. On a host without a GPU the kernels can only run through
Triton's interpreter, so the variable is set here, before the first test module is collected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
