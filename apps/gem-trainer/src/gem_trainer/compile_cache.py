"""Compiled code shared between jobs: Triton's kernels and Inductor's graphs cached in one folder.

A job's time to its first step is mostly compilation (every Triton kernel of a shape family, the compiled blocks,
their autotuning). Both compilers already cache between runs on one machine (``~/.triton/cache``, Inductor's
folder under the temporary directory); a job restarted on a fresh machine starts cold. ``parallelism.
compile_cache_dir`` names a folder that jobs share (storage every machine mounts): each loads what an earlier
process compiled instead of compiling it again. Both compilers key their entries by source, argument types and
device, so a stale entry is never used.
"""

from __future__ import annotations

import os
from pathlib import Path

# the compilers read these variables each time they look for a cache entry
CACHE_VARIABLES = {"triton": "TRITON_CACHE_DIR", "inductor": "TORCHINDUCTOR_CACHE_DIR"}


def share_compiled_code(folder: str | Path) -> None:
    """Point Triton's and Inductor's caches at ``folder/triton`` and ``folder/inductor``. Set before anything
    compiles; a variable the user set already is replaced (the config names the folder)."""
    for compiler, variable in CACHE_VARIABLES.items():
        path = Path(folder).expanduser().resolve() / compiler
        path.mkdir(parents=True, exist_ok=True)
        os.environ[variable] = str(path)
