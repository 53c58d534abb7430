"""gem-data: readers, mixing and batching that produce gem-kunlun batches."""

from gem_data.balancing import (
    LengthBalancedStream,
    example_costs,
    imbalance,
    part_loads,
    partition_by_cost,
    rank_imbalance,
)
from gem_data.batch_ops import concat_batches, select_examples
from gem_data.domain_experts import DomainExpertModel
from gem_data.errors import BadRows, DataError
from gem_data.aligned_ranking import AlignedRanking
from gem_data.alignment import AlignmentError, FeatureAlignment
from gem_data.joined_ranking import JoinedRanking
from gem_data.mixing import MixedStream, MixingConfig, MixSource
from gem_data.process_read_ahead import ProcessReadAhead
from gem_data.read_ahead import ReadAhead
from gem_data.readers.atomic import read_atomic
from gem_data.readers.parquet import ParquetTable, vocab_sizes, write_parquet
from gem_data.readers.text import read_sequence_text
from gem_data.sequential.corpus import Bags, SequenceCorpus
from gem_data.sequential.examples import NextItemConfig, NextItemDataset, NextItemTable, RankingExamples
from gem_data.sequential.time_split import TimeSplit, TimeSplitDataset
from gem_data.source import BatchSource, ShardedStream, WorkerLoader, spec_difference
from gem_data.stream import READ_ROWS, SyntheticStream, TableStream, eval_batches
from gem_data.surface_filter import SurfaceFilterStream
from gem_data.synthetic import SyntheticConfig, SyntheticGenerator
from gem_data.table import BatchTable, ExampleTable, PlannedTable

__all__ = [
    "READ_ROWS",
    "AlignedRanking",
    "AlignmentError",
    "Bags",
    "BadRows",
    "BatchSource",
    "BatchTable",
    "DataError",
    "DomainExpertModel",
    "ExampleTable",
    "FeatureAlignment",
    "JoinedRanking",
    "LengthBalancedStream",
    "MixSource",
    "MixedStream",
    "MixingConfig",
    "NextItemConfig",
    "NextItemDataset",
    "NextItemTable",
    "ParquetTable",
    "PlannedTable",
    "RankingExamples",
    "ProcessReadAhead",
    "ReadAhead",
    "SequenceCorpus",
    "ShardedStream",
    "SyntheticConfig",
    "SyntheticGenerator",
    "SurfaceFilterStream",
    "SyntheticStream",
    "TableStream",
    "TimeSplit",
    "TimeSplitDataset",
    "WorkerLoader",
    "concat_batches",
    "eval_batches",
    "example_costs",
    "imbalance",
    "part_loads",
    "partition_by_cost",
    "rank_imbalance",
    "read_atomic",
    "read_sequence_text",
    "select_examples",
    "spec_difference",
    "vocab_sizes",
    "write_parquet",
]
