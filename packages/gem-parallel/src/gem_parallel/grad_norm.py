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
    optimizer: torch.optim.Optimizer | None = None,
) -> torch.Tensor:
    """Scale gradients so that their global 2-norm is at most ``max_norm``; return that norm.

    ``parameters`` may be plain tensors or DTensors on any meshes (one reduction per mesh). Expert
    parameters hold different experts on the ranks of ``expert_group``: their squared norms are summed
    over it, so every rank computes the norm of the whole model and clips by the same factor.

    ``optimizer``: the optimizer over these gradients that steps next. Where it is a fused Adam / AdamW and the
    gradients are plain float32 tensors on one device (no experts), the clip factor is handed to it as its
    ``grad_scale`` (its one kernel divides every gradient by ``1 / factor`` as it reads it) rather than multiplied
    into the gradients here: the same update, one pass over every gradient fewer (that multiply took 0.4 ms of the
    H200 benchmark's step, train-h200.json). The factor holds for that one step: the optimizer's next step drops
    it (a step hook), so a step without clipping after it applies none. Otherwise the gradients are scaled here.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    expert_grads = [p.grad for p in expert_parameters if p.grad is not None]
    deferred = optimizer is not None and _takes_grad_scale(optimizer)
    if not expert_grads and _one_float32_group(grads):
        # NOTE: the common case (plain float32 tensors on one device, no experts) takes the norm of the per-tensor
        # norms directly: squaring it, adding zero and taking the root would give the same float (sqrt(x * x) == x
        # in IEEE float32 while x * x neither overflows nor underflows) at four kernel launches and ~0.1 ms of
        # host time more per step
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        factor = (max_norm / (total + 1e-6)).clamp(max=1.0)
        if deferred:
            _hand_over(optimizer, factor)
        else:
            torch._foreach_mul_(grads, factor)
        return total
    dense = _squared_norm(grads)
    experts = _squared_norm(expert_grads)
    if expert_group is not None and dist.get_world_size(expert_group) > 1:
        dist.all_reduce(experts, group=expert_group)
    total = (dense + experts).sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    local = defaultdict(list)  # one multiply per device and dtype rather than two kernels per parameter
    for p in [*parameters, *expert_parameters]:
        if p.grad is not None:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            local[(grad.device, grad.dtype)].append(grad)
    for (device, dtype), grads in local.items():
        torch._foreach_mul_(grads, scale.to(device=device, dtype=dtype))
    return total


def _hand_over(optimizer: torch.optim.Optimizer, factor: torch.Tensor) -> None:
    """``optimizer``'s next step divides every gradient by ``1 / factor``, and only that step."""
    if not getattr(optimizer, "_drops_grad_scale", False):
        optimizer.register_step_post_hook(lambda opt, args, kwargs: setattr(opt, "grad_scale", None))
        optimizer._drops_grad_scale = True
    optimizer.grad_scale = factor.reciprocal()


def _takes_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` divides the gradients by its ``grad_scale`` itself: torch's fused Adam and AdamW (the
    unfused and foreach ones refuse a scale)."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and bool(optimizer.defaults.get("fused"))


def _one_float32_group(grads: list[torch.Tensor]) -> bool:
    """Whether ``grads`` are plain (not DTensor) float32 tensors on one device: one ``_foreach_norm`` covers them."""
    if not grads:
        return False
    device = grads[0].device
    return all(type(g) is torch.Tensor and g.dtype == torch.float32 and g.device == device for g in grads)


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squared entries of ``grads`` as a float32 scalar, reduced over each DTensor's shards."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[g.device_mesh if isinstance(g, DTensor) else None].append(g)
    # NOTE: summed on the gradients' device: starting from a host zero moved there would be a copy from pageable
    # memory, which waits for everything queued before it (on a GPU: the whole backward pass, every step)
    total = None
    for mesh, members in groups.items():
        norm = torch.nn.utils.get_total_norm(members, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared = norm.float().pow(2)
        total = squared if total is None else total + squared
    return total if total is not None else torch.zeros((), dtype=torch.float32)
