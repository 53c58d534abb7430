"""gem-parallel: sharded embeddings with fused sparse optimizers, data-parallel dense parts, MFU accounting."""

from gem_parallel.mfu import PEAK_TFLOPS, mfu, peak_tflops, scaling_ratio
from gem_parallel.sparse import dense_parameters, shard_embeddings, table_names, table_placement

__all__ = [
    "PEAK_TFLOPS",
    "dense_parameters",
    "mfu",
    "peak_tflops",
    "scaling_ratio",
    "shard_embeddings",
    "table_names",
    "table_placement",
]
