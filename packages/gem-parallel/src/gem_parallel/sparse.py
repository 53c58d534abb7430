"""Sparse parallelism: shard a model's embedding tables with TorchRec and fuse the sparse optimizer into
their backward pass; the dense remainder becomes data parallel."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_column_wise", "data_parallel")


def embedding_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]


def table_names(model: nn.Module) -> list[str]:
    names = []
    for module in embedding_modules(model):
        configs = module.embedding_bag_configs() if isinstance(module, EmbeddingBagCollection) else module.embedding_configs()
        names += [c.name for c in configs]
    return names


def shard_embeddings(
    model: nn.Module,
    device: torch.device,
    sharding_type: str = "table_wise",
    sparse_optimizer: type[torch.optim.Optimizer] | None = None,
    sparse_optimizer_kwargs: dict[str, Any] | None = None,
    pg: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Wrap ``model`` in TorchRec's DistributedModelParallel over the default (or given) process group.

    Every embedding table is sharded with ``sharding_type``; ``sparse_optimizer`` (TorchRec's row-wise
    Adagrad by default) is fused into the embedding backward, so sparse gradients are never materialised.
    Dense parameters stay with the caller's optimizer and are all-reduced as in DDP. The model may be built
    on the meta device: DMP materialises it on ``device``.

    On CPU/Gloo TorchRec shards EmbeddingBagCollections only table-wise, column-wise, table-column-wise or
    data-parallel; row-wise needs GPUs.
    """
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    if sharding_type not in SHARDING_TYPES:
        raise ValueError(f"sharding_type must be one of {SHARDING_TYPES}, got {sharding_type!r}")
    pg = pg or dist.GroupMember.WORLD
    apply_optimizer_in_backward(
        sparse_optimizer or RowWiseAdagrad,
        [p for module in embedding_modules(model) for p in module.parameters()],
        sparse_optimizer_kwargs or {"lr": 0.01},
    )
    constraints = {name: ParameterConstraints(sharding_types=[sharding_type]) for name in table_names(model)}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(pg), compute_device=device.type), constraints=constraints
    )
    plan = planner.collective_plan(model, pg=pg)
    return DistributedModelParallel(model, device=device, plan=plan)


def dense_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters not updated inside backward: those the dense optimizer owns."""
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    return dict(in_backward_optimizer_filter(model.named_parameters(), include=False))


def table_placement(model: nn.Module) -> dict[str, list[int]]:
    """Ranks holding each table (from the plan DMP applied)."""
    placement: dict[str, list[int]] = {}
    for module_plan in model.plan.plan.values():
        for table, sharding in module_plan.items():
            placement[table] = sorted({int(s.placement.rank()) for s in sharding.sharding_spec.shards}) if sharding.sharding_spec else []
    return placement
