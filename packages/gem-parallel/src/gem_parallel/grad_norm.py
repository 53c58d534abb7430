"""Gradient clipping over parameters sharded on several meshes (FSDP2 DTensors, expert-parallel experts)."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm_(
    parameters: list[torch.nn.Parameter],
    max_norm: float,
    expert_parameters: list[torch.nn.Parameter] = (),
    expert_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale gradients in place so that their global 2-norm is at most ``max_norm``; return that norm.

    ``parameters`` may be plain tensors or DTensors on any meshes (one reduction per mesh). Expert
    parameters hold different experts on the ranks of ``expert_group``: their squared norms are summed
    over it, so every rank computes the norm of the whole model and clips by the same factor.
    """
    dense = _squared_norm([p.grad for p in parameters if p.grad is not None])
    experts = _squared_norm([p.grad for p in expert_parameters if p.grad is not None])
    if expert_group is not None and dist.get_world_size(expert_group) > 1:
        dist.all_reduce(experts, group=expert_group)
    total = (dense + experts).sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in [*parameters, *expert_parameters]:
        if p.grad is not None:
            (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(scale.to(p.grad.dtype))
    return total


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squared entries of ``grads`` as a float32 scalar, reduced over each DTensor's shards."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[g.device_mesh if isinstance(g, DTensor) else None].append(g)
    total = torch.zeros((), dtype=torch.float32)
    for mesh, members in groups.items():
        norm = torch.nn.utils.get_total_norm(members, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total = total.to(norm.device) + norm.float().pow(2)
    return total
