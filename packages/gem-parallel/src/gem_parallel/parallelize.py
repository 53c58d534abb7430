"""``parallelize_kunlun``: every parallelism of a gem-kunlun model, applied in one fixed order.

The order, and why:

1. **Expert parallelism** (``expert`` > 1): each MoE keeps only its rank's experts and dispatches by
   all-to-all. First, on the meta device, so that no rank ever materialises experts it does not own.
2. **Sparse** (TorchRec): tables are sharded (1-D or 2-D) and initialised shard by shard.
3. **Initialisation** of the dense part, the same on every rank (``gem_parallel.init``): after 1, before
   any wrapper renames a module.
4. **Activation checkpointing** of each block, then 5. **``torch.compile``** of each block (the compiled
   region includes the recomputation) or of each MoE alone, or CUDA graphs of the layers' fixed-shape parts (one process), then 6. **FSDP2**: experts on the expert mesh, blocks, then the
   root (HSDP when the dense mesh is 2-D). FSDP goes last because it replaces parameters by DTensor shards
   and hooks the modules the earlier steps produced. On one rank without a mixed-precision policy FSDP is
   left out: it would shard and reduce nothing, yet copy every parameter into and out of its all-gather
   buffers at every use (on the H200, SASRec on Beauty spent ~20 ms of a ~75 ms step there).
7. The MoE batch group: the whole world, so that capacity, drops and the balance loss count over the
   global batch (capacity per rank with padded expert parallelism, see ``gem_parallel.expert_parallel``),
   with the data's bound on the global batch size, which lets experts run on fixed shapes.

A block is a ``KunlunLayer`` (also inside domain-expert trunks), a ``SasrecBlock`` or an
``InterFormerLayer``; everything else (input embedding, event encoders, summaries, heads) belongs to the
root unit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gem_kunlun import InterFormerLayer, KunlunLayer, MixtureOfExperts, SasrecBlock, apply_cuda_graphs

from gem_parallel.dense import (DenseOptions, Slot, apply_activation_checkpointing, apply_compile, apply_fsdp, block_at,
                                compile_units)
from gem_parallel.expert_parallel import apply_expert_parallel
from gem_parallel.init import init_dense_parameters
from gem_parallel.parallel_dims import LayoutError, ParallelDims, ParallelMeshes
from gem_parallel.sparse import shard_embeddings

BLOCK_TYPES = (KunlunLayer, SasrecBlock, InterFormerLayer)


def block_slots(model: nn.Module) -> list[Slot]:
    """Where every block of ``model`` sits, outermost first."""
    return [(parent, name) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, BLOCK_TYPES)]


def parallelize_kunlun(
    model: nn.Module,
    dims: ParallelDims,
    meshes: ParallelMeshes,
    device: torch.device,
    *,
    seed: int,
    dense: DenseOptions = DenseOptions(),
    sparse_sharding: str = "table_wise",
    sparse_optimizer: type[torch.optim.Optimizer] | None = None,
    sparse_optimizer_kwargs: dict[str, Any] | None = None,
    expert_padded: bool = False,
    global_batch_bound: int | None = None,
    rank_batch_bound: int | None = None,
    sparse_index_dedup: bool = False,
    sparse_sequence_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Parallelise ``model`` (built on the meta device) as ``dims`` says; returns TorchRec's
    DistributedModelParallel around it (``.module`` is the model, now FSDP2-wrapped). See the module
    docstring for the order of the steps. ``global_batch_bound``: the most examples a training step's
    global batch can hold (None: unknown), see ``MixtureOfExperts``; ``rank_batch_bound``: the most one rank's
    share of it can hold (it sizes ``expert_padded``'s messages, which need it). ``sparse_sequence_dtype``: the
    sequence tables' lookup dtype (``shard_embeddings``' sequence_dtype)."""
    moes = [m for m in model.modules() if isinstance(m, MixtureOfExperts)]
    if dims.expert_enabled:
        for moe in moes:
            if moe.num_experts % dims.expert:
                raise LayoutError(f"expert ({dims.expert}) must divide the number of experts of every MoE ({moe.num_experts})")
        apply_expert_parallel(model, meshes.expert.get_group("expert"), padded=expert_padded,
                              rank_batch_bound=rank_batch_bound)
    sharded = shard_embeddings(model, device, sparse_sharding, sparse_optimizer, sparse_optimizer_kwargs,
                               mesh=meshes.sparse, seed=seed, index_dedup=sparse_index_dedup,
                               sequence_dtype=sparse_sequence_dtype)
    init_dense_parameters(model, seed, device)
    slots = block_slots(model)
    fsdp = dims.world_size > 1 or dense.param_dtype is not None or dense.reduce_dtype is not None
    if dense.activation_checkpointing:
        apply_activation_checkpointing(slots)
    if dense.compile_experts:
        if fsdp:
            raise LayoutError("compile_experts needs one process without param_dtype / reduce_dtype: FSDP's experts "
                              "unit would sit inside the compiled MoE")
        for moe in moes:
            moe.compile(dynamic=False)  # in place: parameters and state-dict names unchanged
    if dense.cuda_graphs:
        if fsdp:
            raise LayoutError("cuda_graphs needs one process without param_dtype / reduce_dtype: a CUDA graph cannot "
                              "hold FSDP's or the routing's collectives")
        apply_cuda_graphs(model, history_bucket=dense.history_bucket)
    if dense.compile != "off":
        if dense.compile == "reduce-overhead" and fsdp:
            raise LayoutError("compile = 'reduce-overhead' replays each block as CUDA graphs, which cannot hold FSDP's "
                              "collectives: use it in one process without param_dtype / reduce_dtype, or 'default'")
        if dense.compile == "reduce-overhead" and len(compile_units(slots)) > 1:
            raise LayoutError("compile = 'reduce-overhead' needs the model's blocks chained in one nn.Sequential "
                              f"(SASRec's); {type(model).__name__} calls its blocks one by one: use 'default'")
        apply_compile(slots, dense.compile)
    # a MoE's local experts are one FSDP unit (one all-gather and one reduce-scatter each, not one per expert)
    experts = [moe.experts for moe in moes] if dims.expert_enabled else []
    expert_mesh = meshes.expert["dense_replicate", "expert_shard"] if dims.expert_enabled else None
    # NOTE: tables are TorchRec's (updated in backward); empty parameters (a projection of zero dense
    # features) have nothing to shard and FSDP2 cannot reduce them
    ignored = {p for p in model.parameters() if hasattr(p, "_in_backward_optimizers") or p.numel() == 0}
    if fsdp:
        apply_fsdp(model, [block_at(s) for s in slots], meshes.dense, dense, ignored, experts, expert_mesh, dims.world_size)
    if dims.world_size > 1:
        for moe in moes:
            moe.batch_group = dist.group.WORLD
            moe.capacity_per_rank = dims.expert_enabled and expert_padded
            moe.global_batch_bound = global_batch_bound
    return sharded
