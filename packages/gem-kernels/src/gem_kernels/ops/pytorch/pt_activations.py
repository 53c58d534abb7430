"""Activations for GDPA / BlockAttention, shared by the references and the tests."""

from __future__ import annotations

import math

import torch

ACTIVATIONS = ("softmax", "gelu", "gelu_tanh", "gelu_taylor6", "silu", "relu", "relu2", "identity")
POINTWISE = ACTIVATIONS[1:]

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def pt_gelu_taylor6(x: torch.Tensor) -> torch.Tensor:
    # x * Phi(x) with Phi's Taylor series to x^5: a 6th-order polynomial, accurate only for |x| <~ 1.5
    # (inputs bounded by QK-norm); cheaper than erf and free of special functions.
    x2 = x * x
    return 0.5 * x + _INV_SQRT_2PI * x2 * (1.0 - x2 / 6.0 + x2 * x2 / 40.0)


def pt_pointwise(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "gelu":
        return torch.nn.functional.gelu(x)
    if name == "gelu_tanh":
        return torch.nn.functional.gelu(x, approximate="tanh")
    if name == "gelu_taylor6":
        return pt_gelu_taylor6(x)
    if name == "silu":
        return torch.nn.functional.silu(x)
    if name == "relu":
        return torch.relu(x)
    if name == "relu2":
        return torch.relu(x).square()
    if name == "identity":
        return x
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")
