"""Checks shared by the model config dataclasses: their ``__post_init__`` is where a config's rules live (the
trainer's config sections are generated from these dataclasses and run them)."""

from __future__ import annotations

from typing import Any

from gem_kernels.ops import ACTIVATIONS
from gem_kernels.ops._validation import KERNELS


def check_at_least(config: Any, minimums: dict[str, float]) -> None:
    """``ValueError`` naming the first field of ``config`` below its minimum (None fields are unset: skipped)."""
    for name, low in minimums.items():
        value = getattr(config, name)
        if value is not None and value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


def check_widths(config: Any, name: str) -> None:
    """``ValueError`` unless every width of the tuple field ``name`` is >= 1: a layer 0 wide passes nothing on, and the
    model's output would be a constant."""
    widths = getattr(config, name)
    if any(width < 1 for width in widths):
        raise ValueError(f"{name} widths must be >= 1, got {list(widths)}")


def check_choice(config: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_activation_and_kernel(config: Any) -> None:
    """The attention activation and kernel choices every attention-based config has."""
    check_choice(config, "pffn_activation", ACTIVATIONS)
    check_choice(config, "kernel", KERNELS)
