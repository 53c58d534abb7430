"""gem-transfer: knowledge transfer from a foundation model to serving models."""

from gem_transfer.distillation import DistillationOutput, DistilledStudent, StudentAdapter, soft_label_loss

__all__ = ["DistillationOutput", "DistilledStudent", "StudentAdapter", "soft_label_loss"]
