"""Process-group setup: under torchrun from its environment, otherwise as a single local process."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gem_parallel import Collectives, LayoutError, process_group_kwargs, resolve_collectives


@dataclass(frozen=True)
class DistributedEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    local_world_size: int = 1  # ranks on this node
    collectives: Collectives = Collectives("auto", "gloo")


def resolve_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        from gem_trainer.config import ConfigError

        raise ConfigError("device: \"cuda\" was configured but this machine has no CUDA device (use \"auto\" or \"cpu\")")
    return torch.device(choice)


def init_distributed(device_choice: str, collectives: str) -> DistributedEnv:
    """Initialise the default process group (a one-process group when not launched by torchrun), with the
    backend ``collectives`` asks for (``gem_parallel.collectives``).

    TorchRec's model parallel needs a process group even on one process, so there is always one.
    """
    device = resolve_device(device_choice)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        check_fbgemm_cuda(device)
    ranks = int(os.environ.get("WORLD_SIZE", 1))
    try:
        chosen = resolve_collectives(collectives, device, ranks, ranks // int(os.environ.get("LOCAL_WORLD_SIZE", ranks)))
    except LayoutError as error:
        from gem_trainer.config import ConfigError

        raise ConfigError(f"parallelism.{error}") from None
    if not dist.is_initialized():
        backend = chosen.backend
        if "RANK" in os.environ:
            dist.init_process_group(backend=backend, **process_group_kwargs(chosen, device))
        else:
            # NOTE: a private address rather than MASTER_* variables, which child processes would inherit.
            init = f"tcp://127.0.0.1:{_free_port()}"
            dist.init_process_group(backend=backend, init_method=init, rank=0, world_size=1)
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return DistributedEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, local_world_size, chosen)


def check_fbgemm_cuda(device: torch.device, probe=None) -> None:
    """TorchRec's GPU path runs fbgemm-gpu's CUDA kernels; the CPU build (fbgemm-gpu-cpu) has none, and the
    first batch would fail deep inside the embedding lookup. Found here instead, in one line."""
    import torchrec  # noqa: F401 - loads fbgemm-gpu, which registers torch.ops.fbgemm

    probe = probe or (lambda: torch.ops.fbgemm.asynchronous_complete_cumsum(torch.zeros(2, dtype=torch.int64, device=device)))
    try:
        probe()
    except (RuntimeError, NotImplementedError) as error:
        from gem_trainer.config import ConfigError

        raise ConfigError(f"device: fbgemm-gpu has no CUDA kernels here ({str(error).splitlines()[0][:120]}); "
                          f"install the CUDA build of fbgemm-gpu matching torch {torch.__version__}") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown_distributed() -> None:
    """Tear the process group down before exit (leaving Gloo's threads running can abort the interpreter), meeting
    the other ranks at a barrier first, unless called while an exception leaves this process (from a ``finally``):
    the others may wait in a collective this rank never joins, and a barrier would hang the job where this rank's
    exit lets the launcher stop it with this rank's error."""
    if dist.is_initialized():
        if sys.exc_info()[0] is None:
            dist.barrier()
        dist.destroy_process_group()
