"""Where a result came from: the commit of the code that produced it (one definition for every benchmark, in the
lowest package they all reach)."""

from gem_kernels.ops.benchmarks.provenance import git_commit

__all__ = ["git_commit"]
