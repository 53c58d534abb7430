"""What one training step computes, shared by the trainer and the benchmarks: the loss a model's output is
trained on, and the precision the forward pass runs in."""

from __future__ import annotations

import contextlib

import torch

from gem_kunlun import Batch, ModelOutput, multitask_loss, next_item_loss


def training_loss(output: ModelOutput, batch: Batch, task_weights: torch.Tensor) -> torch.Tensor:
    """The weighted multi-task loss (pointwise labels) or the next-item loss (retrieval targets), plus the
    model's auxiliary loss (MoE balance, distillation terms); float32 whatever the autocast."""
    if batch.next_items is None:
        return multitask_loss(output.logits, batch.labels, task_weights) + output.aux_loss
    return next_item_loss(output.logits, batch.next_items) + output.aux_loss


def autocast_dtype(choice: str, device: torch.device) -> torch.dtype | None:
    """``precision.autocast``: bf16 where the device runs it fast (CUDA with bf16) for "auto", never for "off"."""
    if choice == "off" or (choice == "auto" and (device.type != "cuda" or not torch.cuda.is_bf16_supported())):
        return None
    return torch.bfloat16


def autocast(device: torch.device, dtype: torch.dtype | None, cache: bool = True):
    """The forward pass's autocast context (none for ``dtype`` None); the losses stay float32. ``cache=False``
    casts a weight at every use: a CUDA graph must not replay a cast cached outside it (``parallelism.cuda_graphs``)."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype, cache_enabled=cache)
