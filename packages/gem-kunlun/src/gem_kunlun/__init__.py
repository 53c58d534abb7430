"""gem-kunlun: recommendation models over jagged GEM batches, with FLOP accounting."""

from gem_kunlun.baseline import BaselineConfig, BaselineRanker, SeedPooling
from gem_kunlun.batch import Batch, EventSequence, JaggedFloats, NextItemTargets, catalogue_on
from gem_kunlun.candidates import CandidateInput, CandidateScorer
from gem_kunlun.embedding import FeatureEmbedding
from gem_kunlun.features import EventType, FeatureSpec, RepresentationFeature, SparseFeature
from gem_kunlun.heads import ModelOutput, MultiTaskHeads, multitask_loss
from gem_kunlun.event_personalization import EventPersonalization
from gem_kunlun.interformer import InterFormerConfig, InterFormerLayer, InterFormerModel
from gem_kunlun.kunlun import (KUNLUN_SIZES, KunlunConfig, KunlunEncoder, KunlunLayer, KunlunModel, KunlunTrunk,
                               apply_cuda_graphs)
from gem_kunlun.cuda_graphs import GraphedForward
from gem_kunlun.moe import MixtureOfExperts, Routing, WukongBlock, local_dispatch, stand_in_rows
from gem_kunlun.representation_summary import RepresentationSummary
from gem_kunlun.retrieval import CosineScore, dot_scores, next_item_loss, retrieval_logits, scored_item_ids
from gem_kunlun.sasrec import SasrecBlock, SasrecConfig, SasrecModel
from gem_kunlun.summarization import PMA, HierarchicalSeedPooling, SumKronLinear
from gem_kunlun.sequence import (
    jagged_slices,
    jagged_to_padded,
    lengths_to_offsets,
    merge_by_time,
    segment_ids,
    segment_positions,
)

__all__ = [
    "BaselineConfig",
    "BaselineRanker",
    "Batch",
    "CandidateInput",
    "CandidateScorer",
    "CosineScore",
    "NextItemTargets",
    "EventSequence",
    "EventPersonalization",
    "EventType",
    "HierarchicalSeedPooling",
    "InterFormerConfig",
    "InterFormerLayer",
    "InterFormerModel",
    "JaggedFloats",
    "KUNLUN_SIZES",
    "KunlunConfig",
    "KunlunEncoder",
    "KunlunLayer",
    "KunlunModel",
    "KunlunTrunk",
    "GraphedForward",
    "MixtureOfExperts",
    "apply_cuda_graphs",
    "catalogue_on",
    "ModelOutput",
    "PMA",
    "RepresentationFeature",
    "RepresentationSummary",
    "Routing",
    "SumKronLinear",
    "WukongBlock",
    "FeatureEmbedding",
    "FeatureSpec",
    "MultiTaskHeads",
    "SeedPooling",
    "SasrecBlock",
    "SasrecConfig",
    "SasrecModel",
    "SparseFeature",
    "jagged_slices",
    "jagged_to_padded",
    "local_dispatch",
    "lengths_to_offsets",
    "merge_by_time",
    "multitask_loss",
    "next_item_loss",
    "retrieval_logits",
    "dot_scores",
    "scored_item_ids",
    "segment_ids",
    "segment_positions",
    "stand_in_rows",
]
