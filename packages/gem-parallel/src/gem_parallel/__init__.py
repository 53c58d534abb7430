"""gem-parallel: every parallelism of a gem-kunlun model (dense HSDP, expert parallel, 1-D/2-D sparse), applied
in one order by ``parallelize_kunlun``; layout-independent initialisation; gradient clipping over sharded
parameters; MFU accounting."""

from gem_parallel.collectives import (
    COLLECTIVES,
    Collectives,
    apply_copy_engine_all_gather,
    process_group_backend,
    process_group_kwargs,
    resolve_collectives,
)
from gem_parallel.dense import DenseOptions, gathered_parameters
from gem_parallel.expert_parallel import ExpertParallel, apply_expert_parallel
from gem_parallel.grad_norm import clip_grad_norm_
from gem_parallel.init import init_dense_parameters
from gem_parallel.mfu import PEAK_TFLOPS, mfu, peak_tflops, scaling_ratio
from gem_parallel.parallel_dims import LayoutError, ParallelDims, ParallelMeshes
from gem_parallel.parallelize import parallelize_kunlun
from gem_parallel.sparse import (
    SparseReplicas,
    TableWidthError,
    dense_parameters,
    shard_embeddings,
    table_names,
    table_placement,
)

__all__ = [
    "COLLECTIVES",
    "Collectives",
    "PEAK_TFLOPS",
    "DenseOptions",
    "ExpertParallel",
    "LayoutError",
    "ParallelDims",
    "ParallelMeshes",
    "SparseReplicas",
    "TableWidthError",
    "apply_copy_engine_all_gather",
    "apply_expert_parallel",
    "clip_grad_norm_",
    "dense_parameters",
    "gathered_parameters",
    "init_dense_parameters",
    "mfu",
    "parallelize_kunlun",
    "peak_tflops",
    "process_group_backend",
    "process_group_kwargs",
    "resolve_collectives",
    "scaling_ratio",
    "shard_embeddings",
    "table_names",
    "table_placement",
]
