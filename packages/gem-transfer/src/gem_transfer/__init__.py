"""gem-transfer: knowledge transfer from a foundation model to serving models."""

from gem_transfer.distillation import (
    DistillationOutput,
    DistilledStudent,
    ListwiseAdapter,
    StudentAdapter,
    listwise_soft_label_loss,
    soft_label_loss,
)
from gem_transfer.representation_join import RepresentationJoin, without_sparse_feature, without_sparse_key
from gem_transfer.representation_store import (
    RepresentationError,
    RepresentationStore,
    RepresentationWriter,
    example_times,
    example_users,
    random_projection,
)
from gem_transfer.representation_tap import RepresentationTap
from gem_transfer.soft_labels import (
    SoftLabelError,
    SoftLabelStore,
    SoftLabelWriter,
    TopKLogits,
    example_fingerprints,
    queries_per_example,
    top_k_logits,
)

__all__ = [
    "DistillationOutput",
    "DistilledStudent",
    "ListwiseAdapter",
    "RepresentationError",
    "RepresentationJoin",
    "RepresentationStore",
    "RepresentationTap",
    "RepresentationWriter",
    "SoftLabelError",
    "SoftLabelStore",
    "SoftLabelWriter",
    "StudentAdapter",
    "TopKLogits",
    "example_fingerprints",
    "example_times",
    "example_users",
    "listwise_soft_label_loss",
    "queries_per_example",
    "random_projection",
    "soft_label_loss",
    "top_k_logits",
    "without_sparse_feature",
    "without_sparse_key",
]
