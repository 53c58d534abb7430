"""Sparse parallelism: shard a model's embedding tables with TorchRec and fuse the sparse optimizer into
their backward pass.

Tables are sharded over a group of ``sparse_group`` consecutive ranks with the sharding type the config
names (the planner is constrained to it). With several groups (2-D sparse parallelism) every group holds
a full copy of the tables, sharded the same way inside it; each group trains its replica on its own
examples and ``SparseReplicas.sync`` averages the replicas (weights and optimizer state) every
``sync_every`` steps. On CUDA that is TorchRec's ``DMPCollection``; on CPU, where DMPCollection refuses
to run, the same layout is built from a plain ``DistributedModelParallel`` over a ``ShardingEnv2D`` and
averaged here.

The dense remainder is left alone (no DDP wrapper, nothing materialised): ``gem_parallel.parallelize``
initialises and shards it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torchrec import EmbeddingBagCollection, EmbeddingCollection

from gem_parallel.init import init_table_rows
from gem_parallel.parallel_dims import LayoutError

SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise")
# NOTE: TorchRec's CPU kernels shard pooled tables (EmbeddingBagCollection) only these ways; sequence
# tables (EmbeddingCollection) also row-wise. Row-wise pooled sharding needs a GPU.
CPU_SHARDING_TYPES = ("table_wise", "column_wise", "table_column_wise")
# TorchRec shards sequence tables only these ways, on any device (its EmbeddingCollectionSharder)
SEQUENCE_SHARDING_TYPES = ("table_wise", "column_wise", "row_wise")
# the sequence tables' lookup dtypes (``shard_embeddings``' sequence_dtype) and TorchRec's names for them
SEQUENCE_DTYPES = {None: None, torch.bfloat16: "BF16", torch.float16: "FP16"}
RECATS_KEPT = 64  # all-to-all reorder indices kept by memoize_recat, the oldest dropped first


def embedding_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]


# NOTE: TorchRec's sharded kernels (FBGEMM's, on the CPU too) take tables whose (local) width is a multiple of 4
TABLE_WIDTH_MULTIPLE = 4


class TableWidthError(ValueError):
    """Embedding tables TorchRec cannot shard for their width; ``str(error)`` names them and their widths."""


def table_configs(model: nn.Module) -> dict[str, Any]:
    """TorchRec table configs of every (unsharded) embedding module, by table name."""
    configs = {}
    for module in embedding_modules(model):
        found = module.embedding_bag_configs() if isinstance(module, EmbeddingBagCollection) else module.embedding_configs()
        configs.update({c.name: c for c in found})
    return configs


def table_names(model: nn.Module) -> list[str]:
    return list(table_configs(model))


class _NoDataParallel:
    """A DMP data-parallel wrapper that leaves the dense part alone (FSDP2 takes it over afterwards)."""

    def wrap(self, dmp, env, device) -> None:
        return None


def shard_embeddings(
    model: nn.Module,
    device: torch.device,
    sharding_type: str = "table_wise",
    sparse_optimizer: type[torch.optim.Optimizer] | None = None,
    sparse_optimizer_kwargs: dict[str, Any] | None = None,
    mesh: DeviceMesh | None = None,
    seed: int = 0,
    index_dedup: bool = False,
    sequence_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Shard every embedding table of ``model`` (built on the meta device) and return TorchRec's
    DistributedModelParallel around it.

    ``mesh`` (``sparse_replica`` x ``sparse_group``) selects 2-D sparse parallelism; None shards over every
    rank. ``sparse_optimizer`` (TorchRec's row-wise Adagrad by default) is fused into the embedding backward,
    so sparse gradients are never materialised. Table rows are initialised from ``seed`` independently of
    the layout (``gem_parallel.init``). Dense parameters stay on the meta device for ``parallelize``.

    ``index_dedup``: sequence tables (EmbeddingCollection) send each distinct id of a batch once through
    the all-to-all and expand the looked-up rows afterwards (TorchRec's index dedup; CUDA only): histories
    repeat items, and their rows are the largest message of a sharded step.

    ``sequence_dtype``: the dtype the sequence tables' lookups return and their all-to-all carries (the tables and
    their optimizer stay float32): ``torch.bfloat16`` or ``torch.float16`` halve the bytes of the largest outputs
    of a step where every reader of them computes in that dtype anyway; None returns float32. CUDA only (fbgemm's
    CPU lookup without pooling writes float32 only).
    """
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.model_parallel import DMPCollection
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torch.distributed.remote_device import _remote_device
    from torchrec.distributed.types import ShardingEnv2D
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    if sharding_type not in SHARDING_TYPES:
        raise LayoutError(f"sparse_sharding must be one of {SHARDING_TYPES}, got {sharding_type!r}")
    memoize_recat()
    if device.type == "cpu" and sharding_type not in CPU_SHARDING_TYPES and any(
        isinstance(m, EmbeddingBagCollection) for m in embedding_modules(model)
    ):
        raise LayoutError(f"sparse_sharding = {sharding_type!r} needs GPUs (TorchRec's CPU kernels shard pooled tables "
                         f"only {CPU_SHARDING_TYPES})")
    if sharding_type not in SEQUENCE_SHARDING_TYPES and any(
        isinstance(m, EmbeddingCollection) for m in embedding_modules(model)
    ):
        raise LayoutError(f"sparse_sharding = {sharding_type!r} cannot shard the model's sequence tables (TorchRec "
                          f"shards them {SEQUENCE_SHARDING_TYPES} only)")
    if index_dedup and device.type != "cuda":
        raise LayoutError("sparse_index_dedup needs GPUs (fbgemm's unique-index kernel has no CPU version)")
    if sequence_dtype not in SEQUENCE_DTYPES:
        raise LayoutError(f"the sequence tables' lookup dtype must be one of {list(SEQUENCE_DTYPES)}, got {sequence_dtype}")
    if sequence_dtype is not None and device.type != "cuda":
        raise LayoutError(f"sequence lookups in {sequence_dtype} need GPUs (fbgemm's CPU lookup without pooling "
                          "writes float32 only)")
    configs = table_configs(model)
    narrow = [(name, c.embedding_dim) for name, c in configs.items() if c.embedding_dim % TABLE_WIDTH_MULTIPLE]
    if narrow:
        more = f" (and {len(narrow) - 1} more)" if len(narrow) > 1 else ""
        raise TableWidthError(f"embedding table {narrow[0][0]!r} is {narrow[0][1]} wide{more}; TorchRec's sharded lookups "
                              f"need widths that are a multiple of {TABLE_WIDTH_MULTIPLE}")
    apply_optimizer_in_backward(
        sparse_optimizer or RowWiseAdagrad,
        [p for module in embedding_modules(model) for p in module.parameters()],
        sparse_optimizer_kwargs or {"lr": 0.01},
    )
    group = mesh.get_group("sparse_group") if mesh is not None else dist.GroupMember.WORLD
    constraints = {name: ParameterConstraints(sharding_types=[sharding_type]) for name in configs}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(group), compute_device=device.type), constraints=constraints
    )
    sharders = None
    if index_dedup or sequence_dtype is not None:
        from torchrec.distributed.embedding import EmbeddingCollectionSharder
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

        sharders = [EmbeddingBagCollectionSharder(),
                    EmbeddingCollectionSharder(fused_params=sequence_fused_params(sequence_dtype), use_index_dedup=index_dedup)]
    # planned once for a group of ranks 0..G-1 (on rank 0, broadcast to all), then placed on each group
    plan = planner.collective_plan(model, sharders, pg=dist.GroupMember.WORLD)
    keep = dict(init_data_parallel=False, init_parameters=False, data_parallel_wrapper=_NoDataParallel(), sharders=sharders)
    if mesh is None:
        sharded = DistributedModelParallel(model, device=device, plan=plan, **keep)
    elif device.type == "cuda":
        # NOTE: use_inter_host_allreduce puts each sharding group on consecutive ranks (inside a node) and
        # the replicas across groups, the layout ParallelDims describes.
        sharded = DMPCollection(model, device=device, plan=plan, world_size=dist.get_world_size(),
                                sharding_group_size=mesh.size(1), global_pg=dist.GroupMember.WORLD,
                                use_inter_host_allreduce=True, **keep)
    else:
        # the plan names ranks 0..G-1: move it onto this rank's group (what DMPCollection does on CUDA)
        first = mesh.get_local_rank("sparse_replica") * mesh.size(1)
        for module_plan in plan.plan.values():
            for sharding in module_plan.values():
                sharding.ranks = [r + first for r in sharding.ranks]
                for shard in sharding.sharding_spec.shards if sharding.sharding_spec is not None else ():
                    shard.placement = _remote_device(f"rank:{shard.placement.rank() + first}/{device.type}")
        env = ShardingEnv2D(global_pg=dist.GroupMember.WORLD, sharding_pg=group, replica_pg=mesh.get_group("sparse_replica"),
                            device_mesh=mesh, use_inter_host_allreduce=True)
        sharded = DistributedModelParallel(model, env=env, device=device, plan=plan, **keep)
    init_tables(sharded, configs, seed)
    return sharded


def memoize_recat() -> None:
    """Make TorchRec's all-to-all reorder index once per argument set and device (idempotent).

    NOTE: TorchRec 1.6 builds that index (``dist_data._get_recat``) from a Python list at every lookup:
    ``torch.tensor(list, device=cuda)``, a blocking copy that waits for everything queued on the GPU. Two such
    waits a step (the pooled and the sequence lookups) drain the queue, and the GPU then idles while the host
    launches the step's first kernels. The index is a pure function of the arguments, read only (TorchRec 1.8
    makes it once per module). Inside a compiled region the original runs (a cached tensor would be a constant).
    """
    from torchrec.distributed import dist_data

    original = dist_data._get_recat
    if getattr(original, "memoized", False):
        return
    made: dict[tuple, torch.Tensor | None] = {}

    def get_recat(local_split, num_splits, stagger=1, device=None, batch_size_per_rank=None):
        if torch.compiler.is_compiling():
            return original(local_split, num_splits, stagger, device, batch_size_per_rank)
        # NOTE: the same batch size on every rank (always so on one rank) makes the index of no batch size (TorchRec's
        # own condition): keyed by it, a batch size that changes every batch (SASRec's lookup of every scored item)
        # would make a new index, and a blocking copy, at every step
        uniform = batch_size_per_rank is None or len(set(batch_size_per_rank)) <= 1
        key = (local_split, num_splits, stagger, None if device is None else torch.device(device),
               None if uniform else tuple(batch_size_per_rank))
        if key not in made:
            if len(made) >= RECATS_KEPT:  # per-rank batch sizes that vary from batch to batch make new keys
                del made[next(iter(made))]
            made[key] = original(local_split, num_splits, stagger, device, batch_size_per_rank)
        return made[key]

    get_recat.memoized = True
    get_recat.original = original
    dist_data._get_recat = get_recat


def sequence_fused_params(sequence_dtype: torch.dtype | None) -> dict[str, Any] | None:
    """The sequence tables' sharder parameters for lookups in ``sequence_dtype`` (None: TorchRec's defaults)."""
    from torchrec.modules.embedding_configs import DataType, data_type_to_sparse_type

    if sequence_dtype is None:
        return None
    return {"output_dtype": data_type_to_sparse_type(DataType[SEQUENCE_DTYPES[sequence_dtype]])}


def init_tables(model: nn.Module, configs: dict[str, Any], seed: int) -> None:
    """Fill this rank's shards of every table with their layout-independent initial values."""
    with torch.no_grad():
        for key, value in model.state_dict().items():
            table = _table_of(key, configs)
            if table is None:
                continue
            config = configs[table]
            for tensor, (rows, cols) in local_shards(value):
                init_table_rows(tensor, rows, cols, config.embedding_dim, config.init_fn, seed, key)


def local_shards(value) -> list[tuple[torch.Tensor, tuple[int, int]]]:
    """This rank's pieces of a sharded table (or table-shaped optimizer state) with their (row, column)
    offsets: a ShardedTensor's local shards, or, under 2-D sparse parallelism, the shards a DTensor wraps."""
    if hasattr(value, "local_shards"):
        return [(s.tensor, tuple(s.metadata.shard_offsets)) for s in value.local_shards()]
    local = value.to_local()
    return [(t, tuple(offset)) for t, offset in zip(local.local_shards(), local.local_offsets())]


def _table_of(state_key: str, configs: dict[str, Any]) -> str | None:
    """The table a state-dict key holds (``....embedding_bags.<table>.weight`` / ``....embeddings.<table>.weight``)."""
    parts = state_key.split(".")
    if len(parts) >= 3 and parts[-1] == "weight" and parts[-3] in ("embedding_bags", "embeddings") and parts[-2] in configs:
        return parts[-2]
    return None


class SparseReplicas:
    """Averages the table replicas of 2-D sparse parallelism: weights and fused optimizer state, every
    ``sync_every`` steps (``maybe_sync(step)``), and whenever asked (``sync``: before a checkpoint, which holds one
    copy of each shard); a no-op with one replica."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh | None, sync_every: int = 1) -> None:
        self.model, self.mesh, self.sync_every = model, mesh, sync_every
        self.synced = True  # the replicas are equal (nothing trained since the last average)

    def maybe_sync(self, step: int) -> bool:
        """After training step ``step``: average every ``sync_every`` steps; True when it did."""
        if self.mesh is None:
            return False
        self.synced = False
        if step % self.sync_every:
            return False
        self.sync()
        return True

    def sync(self) -> None:
        """Average the replicas now, unless they are equal already."""
        if self.mesh is None or self.synced:
            return
        self.synced = True
        if hasattr(self.model, "sync"):  # DMPCollection
            self.model.sync()
            return
        group, replicas = self.mesh.get_group("sparse_replica"), self.mesh.size(0)
        with torch.no_grad():
            for tensor in self._local_tensors():
                dist.all_reduce(tensor, group=group)
                tensor.div_(replicas)

    def _local_tensors(self) -> list[torch.Tensor]:
        """This rank's shards of every table and of its optimizer state (views of the live storage)."""
        tensors = []
        for state in (self.model.state_dict(), self.model.fused_optimizer.state_dict()["state"]):
            for value in _sharded_values(state):
                tensors += [tensor for tensor, _ in local_shards(value)]
        return tensors


def _sharded_values(state: dict) -> list:
    found = []
    for value in state.values():
        if isinstance(value, dict):
            found += _sharded_values(value)
        elif hasattr(value, "local_shards") or (isinstance(value, DTensor) and hasattr(value.to_local(), "local_shards")):
            found.append(value)
    return found


def dense_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters not updated inside backward: those the dense optimizer owns, under their state-dict names
    (without the wrapper that activation checkpointing inserts, so that checkpoints do not depend on it)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    return {name.replace(_CHECKPOINT_PREFIX, ""): p
            for name, p in in_backward_optimizer_filter(model.named_parameters(), include=False)}


def table_placement(model: nn.Module) -> dict[str, list[int]]:
    """Ranks holding each table (from the plan DMP applied)."""
    placement: dict[str, list[int]] = {}
    for module_plan in model.plan.plan.values():
        for table, sharding in module_plan.items():
            placement[table] = sorted({int(s.placement.rank()) for s in sharding.sharding_spec.shards}) if sharding.sharding_spec else []
    return placement
