"""Collectives behind one name: ``nccl`` (GPUs), ``copy_engine`` (NCCL on GPUs, with the all-gathers and
all-to-alls moved to the copy engines where NCCL and torch allow it), ``gloo`` (CPU), ``auto`` (NCCL on
GPUs, Gloo on CPU)."""

from __future__ import annotations

import torch

COLLECTIVES = ("auto", "nccl", "copy_engine", "gloo")


def process_group_backend(collectives: str, device: torch.device) -> str:
    """The torch.distributed backend that carries ``collectives`` on ``device``."""
    if collectives not in COLLECTIVES:
        raise ValueError(f"collectives must be one of {COLLECTIVES}, got {collectives!r}")
    if collectives == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if collectives in ("nccl", "copy_engine") and device.type != "cuda":
        raise ValueError(f"collectives = {collectives!r} needs CUDA devices; use \"gloo\" (or \"auto\") on CPU")
    return "gloo" if collectives == "gloo" else "nccl"
