"""How the ranks of a job divide the work, and the named device meshes that carry it out.

Three independent layouts share the same ``world_size`` ranks:

- **dense** (FSDP2): ``dense_replicate x dense_shard``. Parameters are sharded over a shard group and
  replicated across shard groups (HSDP). Shard groups are runs of consecutive ranks, i.e. inside a node
  when ``dense_shard`` divides the ranks per node; replication goes across nodes.
- **expert** (expert parallelism for the MoE): each dense shard group splits into groups of ``expert``
  consecutive ranks; the experts of every MoE are divided among the ranks of such a group, and examples
  travel to their experts' owners by all-to-all. The same experts then repeat across the
  ``world_size / expert`` other groups, which hold them FSDP-style like any dense parameter.
- **sparse** (TorchRec): tables are sharded over ``sparse_group`` consecutive ranks and replicated across
  the ``world_size / sparse_group`` groups (2-D sparse parallelism; one group: plain model parallelism).

A ``-1`` asks for the natural default: ``dense_shard`` the ranks of one node (``local_world_size``),
``dense_replicate`` what is left, ``sparse_group`` every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class LayoutError(ValueError):
    """A parallel layout that does not fit the job or the model; ``str(error)`` is one line naming the
    field as the trainer's ``[parallelism]`` section spells it."""


@dataclass(frozen=True)
class ParallelMeshes:
    """The named meshes of a ``ParallelDims``: ``dense`` (``dense_replicate``, ``dense_shard``), ``expert``
    (``dense_replicate``, ``expert_shard``, ``expert``; None without expert parallelism) and ``sparse``
    (``sparse_replica``, ``sparse_group``; None without 2-D sparse parallelism)."""

    dense: DeviceMesh
    expert: DeviceMesh | None
    sparse: DeviceMesh | None


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of each layout (see the module docstring); validated against ``world_size`` on creation.

    Errors name the field as the trainer's ``[parallelism]`` section spells it.
    """

    world_size: int
    local_world_size: int = 0  # ranks per node (0: world_size, one node)
    dense_replicate: int = -1
    dense_shard: int = -1
    expert: int = 1
    sparse_group: int = -1

    def __post_init__(self) -> None:
        w = self.world_size
        if w < 1:
            raise LayoutError(f"world size must be >= 1, got {w}")
        local = self.local_world_size or w
        if local < 1 or w % local:
            raise LayoutError(f"local_world_size ({self.local_world_size}) must be >= 1 and divide the world size ({w}): "
                              f"the ranks of one host")
        for name in ("dense_replicate", "dense_shard", "sparse_group"):
            value = getattr(self, name)
            if value == 0 or value < -1:
                raise LayoutError(f"{name} must be >= 1 or -1 (automatic), got {value}")
        replicate, shard = self.dense_replicate, self.dense_shard
        for name, value in (("dense_replicate", replicate), ("dense_shard", shard)):
            if value != -1 and w % value:
                raise LayoutError(f"{name} ({value}) must divide the world size ({w})")
        if shard == -1:
            shard = w // replicate if replicate != -1 else _largest_divisor(w, local)
        if replicate == -1:
            replicate = w // shard if w % shard == 0 else 0
        if replicate * shard != w:
            raise LayoutError(f"dense_replicate ({replicate}) x dense_shard ({shard}) must equal the world size ({w})")
        if self.expert < 1 or shard % self.expert:
            raise LayoutError(f"expert ({self.expert}) must divide dense_shard ({shard}): expert groups sit inside a "
                             f"dense shard group")
        group = w if self.sparse_group == -1 else self.sparse_group
        if w % group:
            raise LayoutError(f"sparse_group ({group}) must divide the world size ({w})")
        object.__setattr__(self, "local_world_size", local)
        object.__setattr__(self, "dense_replicate", replicate)
        object.__setattr__(self, "dense_shard", shard)
        object.__setattr__(self, "sparse_group", group)

    @property
    def expert_shard(self) -> int:
        """Ranks of a dense shard group that hold the same experts (they shard them FSDP-style)."""
        return self.dense_shard // self.expert

    @property
    def sparse_replicas(self) -> int:
        return self.world_size // self.sparse_group

    @property
    def expert_enabled(self) -> bool:
        return self.expert > 1

    @property
    def sparse_2d(self) -> bool:
        return self.sparse_replicas > 1

    def describe(self) -> str:
        """One line for the log: the layout of every part."""
        parts = [f"dense {self.dense_replicate} replicas x {self.dense_shard} shards"]
        if self.expert_enabled:
            parts.append(f"experts over groups of {self.expert}")
        parts.append(f"tables over groups of {self.sparse_group}" + (f" x {self.sparse_replicas} replicas" if self.sparse_2d else ""))
        return ", ".join(parts)

    def build_meshes(self, device_type: str) -> ParallelMeshes:
        """Create the process groups of every layout (a collective call: every rank must make it)."""
        dense = init_device_mesh(device_type, (self.dense_replicate, self.dense_shard),
                                 mesh_dim_names=("dense_replicate", "dense_shard"))
        expert = None
        if self.expert_enabled:
            expert = init_device_mesh(device_type, (self.dense_replicate, self.expert_shard, self.expert),
                                      mesh_dim_names=("dense_replicate", "expert_shard", "expert"))
        sparse = None
        if self.sparse_2d:
            sparse = init_device_mesh(device_type, (self.sparse_replicas, self.sparse_group),
                                      mesh_dim_names=("sparse_replica", "sparse_group"))
        return ParallelMeshes(dense=dense, expert=expert, sparse=sparse)


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is <= ``at_most`` (the ranks of one node, when they divide ``n``)."""
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)
