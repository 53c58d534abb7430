"""GPU benchmarks: ``python -m gem_kernels.ops.benchmarks.run_all --out results.json``."""
