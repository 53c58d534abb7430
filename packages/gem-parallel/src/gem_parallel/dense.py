"""Dense parallelism: FSDP2 (HSDP on a 2-D mesh) per block and at the root, activation checkpointing and
per-block ``torch.compile``, each an ``apply_*`` that changes the model in place.

Parameters updated inside backward (the embedding tables, with their fused optimizer) are left to TorchRec.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


COMPILE_MODES = ("off", "default", "reduce-overhead")


@dataclass(frozen=True)
class DenseOptions:
    """How the dense part is parallelised (the trainer's ``[parallelism]`` fields of the same names).

    - ``param_dtype`` / ``reduce_dtype``: FSDP2 mixed precision of the blocks (None: the parameters' own
      float32); a block computes in ``param_dtype`` and returns float32. The root keeps float32 parameters:
      it holds the input projections, norms and heads, whose precision calibration depends on.
    - ``reshard_after_forward``: free each block's gathered parameters after its forward (gather again in
      backward): less memory, one more all-gather per block.
    - ``activation_checkpointing``: recompute each block's activations in backward instead of keeping them.
    - ``compile``: ``torch.compile`` each block ("off", or the mode: "default" fuses each block's pointwise ops;
      "reduce-overhead" also replays each block's forward and backward as CUDA graphs, which is what a small model
      whose step waits on the host needs; it needs fixed shapes (SASRec's padded layout), the blocks chained in one
      ``nn.Sequential`` (see ``compile_units``) and one process: CUDA graphs cannot hold FSDP's collectives).
    - ``compile_experts``: ``torch.compile`` each MixtureOfExperts on its own (fixed shapes: a batch's examples,
      tokens and width; its routing, slot dispatch and batched experts are a few hundred small kernels a step
      eagerly). Blocks not compiled (a compiled block holds its MoE), one process without FSDP (the experts would
      be an FSDP unit inside the compiled region).
    - ``cuda_graphs``: replay the fixed-shape parts of each Kunlun layer and trunk (the per-example side: compression,
      MoE; the head) in training as CUDA graphs, one forward and one backward graph per batch shape
      (``gem_kunlun.apply_cuda_graphs``): a few hundred small kernels a step become a few graph launches, without a
      compiler's own host time per call. One process without FSDP (no collective may sit in a graph); excludes
      ``compile`` and ``compile_experts``.
    - ``history_bucket``: with ``cuda_graphs``, > 0 pads Kunlun's history to multiples of this many tokens and replays
      each trunk whole (``apply_cuda_graphs(history_bucket=)``); 0 keeps the history eager.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    compile: str = "off"
    compile_experts: bool = False
    cuda_graphs: bool = False
    history_bucket: int = 0

    def __post_init__(self) -> None:
        if self.history_bucket < 0:
            raise ValueError(f"history_bucket must be >= 0, got {self.history_bucket}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if self.compile_experts and self.compile != "off":
            raise ValueError(f"compile_experts compiles the MoEs of blocks left eager; with compile = {self.compile!r} "
                             "every block, its MoE with it, is compiled already")
        if self.cuda_graphs and (self.compile_experts or self.compile != "off" or self.activation_checkpointing):
            raise ValueError("cuda_graphs replays eager layers' parts as CUDA graphs: it excludes compile, compile_experts "
                             "and activation_checkpointing (a recomputed forward cannot replay a graph)")


Slot = tuple[nn.Module, str]  # where a block sits: (parent module, attribute name or ModuleList index)


def block_at(slot: Slot) -> nn.Module:
    parent, name = slot
    return parent[int(name)] if isinstance(parent, (nn.ModuleList, nn.Sequential)) else getattr(parent, name)


def apply_activation_checkpointing(slots: list[Slot]) -> None:
    """Wrap the block at every slot in a non-reentrant checkpoint wrapper (state-dict names are unchanged)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for parent, name in slots:
        wrapped = checkpoint_wrapper(block_at((parent, name)), preserve_rng_state=True)
        if isinstance(parent, (nn.ModuleList, nn.Sequential)):
            parent[int(name)] = wrapped
        else:
            setattr(parent, name, wrapped)


def compile_units(slots: list[Slot]) -> list[nn.Module]:
    """What ``apply_compile`` compiles: each block, except that blocks chained in an ``nn.Sequential`` are one
    unit, the Sequential itself.

    NOTE: with CUDA graphs ("reduce-overhead") a model's blocks must be one unit: in inference every call of a
    compiled unit starts a new generation of graph memory, which would overwrite one block's output before the
    next block read it."""
    units = []
    for parent, name in slots:
        unit = parent if isinstance(parent, nn.Sequential) else block_at((parent, name))
        if not any(unit is seen for seen in units):
            units.append(unit)
    return units


def apply_compile(slots: list[Slot], mode: str = "default") -> None:
    """``torch.compile`` each of ``compile_units(slots)`` in ``mode``, in place (parameters and state-dict names
    are unchanged)."""
    for unit in compile_units(slots):
        unit.compile(mode=mode)


def apply_fsdp(
    root: nn.Module,
    blocks: list[nn.Module],
    mesh: DeviceMesh,
    options: DenseOptions,
    ignored_params: set[nn.Parameter],
    experts: list[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
    world_size: int = 1,
) -> None:
    """FSDP2 over ``mesh`` (1-D: FSDP; 2-D replicate x shard: HSDP): each of ``experts`` (on ``expert_mesh``:
    the local experts of one MoE each), then each block, then the root with everything left;
    ``ignored_params`` are left alone.

    Expert gradients arrive summed over the expert-parallel group by the all-to-all, so their reduction
    divides by the whole ``world_size`` rather than by the ranks of ``expert_mesh``: every parameter ends
    up with the gradient of the mean loss over the global batch.
    """
    # NOTE: blocks hand float32 back: the root between them (and after them) computes in float32
    block_policy = MixedPrecisionPolicy(param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype,
                                        output_dtype=torch.float32 if options.param_dtype is not None else None)
    for expert in experts:
        fully_shard(expert, mesh=expert_mesh, mp_policy=block_policy, reshard_after_forward=options.reshard_after_forward,
                    ignored_params=ignored_params)
        expert.set_gradient_divide_factor(float(world_size))
        if _gloo(expert_mesh) and expert_mesh.size(expert_mesh.ndim - 1) > 1:
            # NOTE: a factor other than the reduce-scatter's ranks makes FSDP reduce-scatter with ReduceOp.PREMUL_SUM,
            # which Gloo lacks; summing and then dividing gives the same gradient. Not over one rank: FSDP then copies
            # the gradient divided by the factor and would divide it again
            expert.set_force_sum_reduction_for_comms(True)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=block_policy, reshard_after_forward=options.reshard_after_forward,
                    ignored_params=ignored_params)
    # NOTE: the root's parameters are used first in forward and last in backward: resharding them after
    # forward would only gather them again at once.
    fully_shard(root, mesh=mesh, reshard_after_forward=False, ignored_params=ignored_params)


def _gloo(mesh: DeviceMesh) -> bool:
    """Whether ``mesh``'s collectives go through Gloo."""
    return any("gloo" in str(dist.get_backend(group)) for group in mesh.get_all_groups())


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class gathered_parameters:
    """Context manager: every FSDP2 module of ``model`` keeps its parameters gathered, so that the forward
    passes inside run without collectives (evaluation, where ranks may run different numbers of batches).
    On exit the parameters are sharded again and blocks return to ``reshard_after_forward``."""

    def __init__(self, model: nn.Module, reshard_after_forward: bool) -> None:
        self.modules, self.reshard_after_forward = fsdp_modules(model), reshard_after_forward

    def __enter__(self) -> None:
        for module in self.modules:
            module.unshard()
            module.set_reshard_after_forward(False, recurse=False)

    def __exit__(self, *exc) -> None:
        for i, module in enumerate(self.modules):
            module.reshard()
            # the root (first in module order) never reshards after forward, see apply_fsdp
            module.set_reshard_after_forward(self.reshard_after_forward and i > 0, recurse=False)
