"""gem-transfer: knowledge transfer from a foundation model to serving models."""

from gem_transfer.distillation import DistillationOutput, DistilledStudent, StudentAdapter, soft_label_loss
from gem_transfer.soft_labels import SoftLabelError, SoftLabelStore, SoftLabelWriter, example_fingerprints

__all__ = [
    "DistillationOutput",
    "DistilledStudent",
    "SoftLabelError",
    "SoftLabelStore",
    "SoftLabelWriter",
    "StudentAdapter",
    "example_fingerprints",
    "soft_label_loss",
]
