"""gem-data: readers, mixing and batching that produce gem-kunlun batches."""

from gem_data.stream import SyntheticStream, eval_batches
from gem_data.synthetic import SyntheticConfig, SyntheticGenerator

__all__ = ["SyntheticConfig", "SyntheticGenerator", "SyntheticStream", "eval_batches"]
