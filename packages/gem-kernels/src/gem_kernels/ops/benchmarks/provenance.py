"""Where a result came from: the commit of the code that produced it, for every table and benchmark to record
(gem-kernels' own and, through ``gem_trainer.provenance``, the trainer's)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit(root: Path | None = None) -> str:
    """The HEAD commit of the checkout at ``root`` (None: the working directory), with ``+dirty`` when files
    differ from it (untracked ones included: a new module changes the code as much as an edit), except result
    files under ``benchmarks/results`` (a benchmark's output is not its code). ``$GEM_COMMIT``, when set, names
    the commit instead: a tree copied to another machine may carry a repository that is not the one it was
    copied from (seen: a copy's git reporting an older HEAD). Outside a checkout without it: ``unknown``."""
    if os.environ.get("GEM_COMMIT"):
        return os.environ["GEM_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", ":/", ":(exclude,top)benchmarks/results"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")
