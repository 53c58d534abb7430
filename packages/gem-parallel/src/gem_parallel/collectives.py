"""Collectives behind one name: ``nccl`` (GPUs), ``copy_engine`` (NCCL with FSDP2's parameter all-gathers on
the GPUs' copy engines, no SM used), ``gloo`` (CPU), ``auto`` (NCCL on GPUs, Gloo on CPU).

How ``copy_engine`` works (NCCL >= 2.28.3): NCCL runs an all-gather or an equal-split all-to-all as
peer-to-peer memory copies instead of a kernel when the communicator's CTA policy is "zero" and both
buffers lie in symmetric memory windows (``ncclCommWindowRegister`` with ``NCCL_WIN_COLL_SYMMETRIC``), all
ranks on one NVLink node. Here:

- every NCCL communicator gets the zero CTA policy (``NCCL_CTA_POLICY=2`` for the groups the device meshes
  create, and the default group's options); the policy changes nothing for the other collectives;
- FSDP2's all-gather buffers come from torch's NCCL symmetric-memory pool and are registered as windows
  on first use (``CopyEngineAllGather``, set on every FSDP module).

What does not move: reduce-scatter and all-reduce (gradients) have no copy-engine path in any NCCL
release, and keep their ring kernels; the expert-parallel all-to-all keeps NCCL's kernels too (its
buffers are autograd outputs, not symmetric memory). Where NCCL, torch or the topology do not allow the
copy engines, ``resolve_collectives`` falls back to ``nccl`` and says why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gem_parallel.parallel_dims import LayoutError

try:  # FSDP2's collective protocol (a private module in torch 2.11-2.13)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
except ImportError:  # pragma: no cover - other torch versions: the protocol is duck-typed
    AllGather = object

COLLECTIVES = ("auto", "nccl", "copy_engine", "gloo")
CTA_POLICY_ZERO = 2  # NCCL_CTA_POLICY_ZERO


@dataclass(frozen=True)
class Collectives:
    """What ``resolve_collectives`` decided: the process-group ``backend``, whether the copy engines carry
    FSDP2's all-gathers, and, when ``copy_engine`` was asked for but could not be used, the ``fallback``."""

    requested: str
    backend: str
    copy_engine: bool = False
    fallback: str = ""


def process_group_backend(collectives: str, device: torch.device) -> str:
    """The torch.distributed backend that carries ``collectives`` on ``device``."""
    if collectives not in COLLECTIVES:
        raise LayoutError(f"collectives must be one of {COLLECTIVES}, got {collectives!r}")
    if collectives == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if collectives in ("nccl", "copy_engine") and device.type != "cuda":
        raise LayoutError(f"collectives = {collectives!r} needs CUDA devices; use \"gloo\" (or \"auto\") on CPU")
    return "gloo" if collectives == "gloo" else "nccl"


def resolve_collectives(collectives: str, device: torch.device, ranks: int = 1, nodes: int = 1) -> Collectives:
    """Check what ``collectives`` needs for ``ranks`` processes on ``nodes`` nodes (before the process group
    exists)."""
    backend = process_group_backend(collectives, device)
    if collectives != "copy_engine":
        return Collectives(collectives, backend)
    reason = "one rank has nothing to gather" if ranks < 2 else copy_engine_unavailable(nodes)
    return Collectives(collectives, backend, copy_engine=not reason, fallback=reason)


def copy_engine_unavailable(nodes: int = 1) -> str:
    """Why the copy-engine path cannot run here ("" when it can)."""
    version = torch.cuda.nccl.version() if torch.cuda.is_available() else (0, 0, 0)
    if tuple(version) < (2, 28, 3):
        return f"NCCL {'.'.join(map(str, version))} has no copy-engine collectives (2.28.3 or newer)"
    if not hasattr(dist.ProcessGroupNCCL, "NCCL_CTA_POLICY_ZERO"):
        return f"torch {torch.__version__} cannot set NCCL's CTA policy"
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no symmetric memory"
    if nodes > 1:
        return f"{nodes} nodes: NCCL's copy-engine collectives stay inside one NVLink node"
    if os.environ.get("NCCL_CUMEM_ENABLE") == "0" or os.environ.get("NCCL_WIN_ENABLE") == "0":
        return "NCCL_CUMEM_ENABLE=0 or NCCL_WIN_ENABLE=0 disables NCCL's symmetric windows"
    return ""


def process_group_kwargs(collectives: Collectives, device: torch.device) -> dict[str, Any]:
    """Extra ``init_process_group`` arguments. For the copy engines: the zero CTA policy on every NCCL
    communicator (later groups read it from the environment) and an eager communicator for ``device``,
    which symmetric-memory registration needs to exist."""
    if not collectives.copy_engine:
        return {}
    os.environ["NCCL_CTA_POLICY"] = str(CTA_POLICY_ZERO)
    options = dist.ProcessGroupNCCL.Options()
    options.config.cta_policy = dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO
    return {"pg_options": options, "device_id": device}


class CopyEngineAllGather(AllGather):
    """FSDP2's all-gather (its ``AllGather`` protocol: ``allocate`` and ``__call__``) on symmetric memory, which
    NCCL runs on the copy engines under the zero CTA policy: the buffers come from torch's NCCL
    symmetric-memory pool and are registered as windows of the group on first use (cached after)."""

    def __init__(self, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NCCL")
        self.symm_mem, self.pool = symm_mem, symm_mem.get_mem_pool(device)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # NOTE: entered here, not around backward: the pool is thread-local and backward runs elsewhere
        with torch.cuda.use_mem_pool(self.pool):
            return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        self.symm_mem.rendezvous(output_tensor, group.group_name)
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def apply_copy_engine_all_gather(model: nn.Module, device: torch.device) -> int:
    """Route the parameter all-gathers of every FSDP2 module of ``model`` through ``CopyEngineAllGather``;
    returns the number of modules changed."""
    from torch.distributed.fsdp import FSDPModule

    gather = CopyEngineAllGather(device)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:  # NOTE: set per module: torch 2.11 does not apply it to submodules
        module.set_custom_all_gather(gather)
    return len(modules)
