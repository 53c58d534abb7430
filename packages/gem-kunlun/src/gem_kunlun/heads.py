"""Multi-task prediction heads, one logit per task and surface, and the weighted multi-task loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.nn import functional as F


@dataclass
class ModelOutput:
    """What every model returns: ``logits [B, num_tasks]``, an auxiliary loss to add to the task loss (the MoE
    load-balancing term; zero for models without one) and the ``representation [B, R]`` its heads read.

    Retrieval (``batch.next_items`` set): ``logits`` are ``retrieval_logits(representation, item_vectors,
    targets)``: the queries and the vectors of the scored items, which an auxiliary head can score again."""

    logits: torch.Tensor
    aux_loss: torch.Tensor
    representation: torch.Tensor | None = None
    item_vectors: torch.Tensor | None = None


# NOTE: registered as a pytree so that wrappers which hook a module's output tensors (FSDP2, DDP) find them
pytree.register_dataclass(ModelOutput)


class MultiTaskHeads(nn.Module):
    """Maps a ``[B, in_dim]`` representation to ``[B, num_tasks]`` logits with a separate head per surface.

    NOTE: in float32 under autocast too: bfloat16 logits keep 8 bits, so the scores of a ranking tie and swap
    (candidates within ~0.4% of each other tie, and a tie counts against the target) and AUC loses its order; the
    head is one small GEMM, whose float32 costs nothing beside the model."""

    def __init__(self, in_dim: int, num_tasks: int, num_surfaces: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.num_tasks = num_tasks
        self.num_surfaces = num_surfaces
        self.proj = nn.Linear(in_dim, num_tasks * num_surfaces, device=device)

    def forward(self, x: torch.Tensor, surface: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            logits = self.proj(x.float())  # (a module the precision settings convert still runs as converted)
        logits = logits.view(-1, self.num_surfaces, self.num_tasks)
        return logits.gather(1, surface.view(-1, 1, 1).expand(-1, 1, self.num_tasks)).squeeze(1)

    def flops_per_example(self) -> float:
        return 2.0 * self.proj.in_features * self.proj.out_features


def multitask_loss(logits: torch.Tensor, labels: torch.Tensor, task_weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over tasks of the mean binary cross-entropy; computed in float32 for calibration."""
    if task_weights.shape != logits.shape[-1:]:
        raise ValueError(f"task_weights has shape {tuple(task_weights.shape)}: one weight per task, "
                         f"{logits.shape[-1]} tasks")
    per_task = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none").mean(0)
    return (per_task * task_weights.to(per_task.device)).sum()
