"""gem-transfer: knowledge transfer from a foundation model to serving models."""

from gem_transfer.distillation import (
    DistillationOutput,
    DistilledStudent,
    ListwiseAdapter,
    StudentAdapter,
    listwise_soft_label_loss,
    soft_label_loss,
)
from gem_transfer.soft_labels import SoftLabelError, SoftLabelStore, SoftLabelWriter, example_fingerprints, queries_per_example

__all__ = [
    "DistillationOutput",
    "DistilledStudent",
    "ListwiseAdapter",
    "SoftLabelError",
    "SoftLabelStore",
    "SoftLabelWriter",
    "StudentAdapter",
    "example_fingerprints",
    "listwise_soft_label_loss",
    "queries_per_example",
    "soft_label_loss",
]
