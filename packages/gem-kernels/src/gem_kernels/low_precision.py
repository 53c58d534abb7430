"""Putting a model's GEMMs in low precision: one swap for every recipe (``MXRecipe``: emulated MXFP8;
``Fp8Recipe``: FP8 on Hopper's tensor cores).

A recipe says what becomes of an ``nn.Linear`` (``recipe.linear``: its low-precision twin on the same
parameters, or None to leave it) and of a module's ``low_precision_matmul`` (``recipe.matmul``: the matmul of
token products that use raw parameters, which a swap of linear layers would miss, or None).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn


class LowPrecisionLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs follow a recipe; built on an existing layer's parameters (not copies)."""

    recipe = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe) -> "LowPrecisionLinear":
        twin = cls.__new__(cls)
        nn.Module.__init__(twin)
        twin.in_features, twin.out_features = linear.in_features, linear.out_features
        twin.weight, twin.bias = linear.weight, linear.bias
        twin.recipe = recipe
        return twin

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features]`` as rows ``[M, in_features]`` (a reshape would fail with a message about sizes)."""
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__}: input of shape {tuple(x.shape)} does not end in in_features = "
                             f"{self.in_features}")
        return x.reshape(-1, self.in_features)


class LowPrecisionRecipe(Protocol):
    def linear(self, linear: nn.Linear) -> nn.Module | None: ...

    def matmul(self) -> Callable | None: ...


def convert_to_low_precision(model: nn.Module, recipe: LowPrecisionRecipe, keep: Callable[[str], bool]) -> list[str]:
    """Swap every ``nn.Linear`` of ``model`` whose qualified name ``keep`` does not claim for the recipe's twin,
    and give every such module with a ``low_precision_matmul`` attribute the recipe's matmul; returns the
    converted names. Call before wrapping for data parallelism (the swap replaces submodules)."""
    if not (callable(getattr(recipe, "linear", None)) and callable(getattr(recipe, "matmul", None))):
        raise ValueError(f"convert_to_low_precision: recipe must have linear and matmul (an Fp8Recipe or MXRecipe), got "
                         f"{type(recipe).__name__}")
    if not callable(keep):
        raise ValueError(f"convert_to_low_precision: keep must be a callable of a module's name, got {type(keep).__name__}")
    converted = []
    for name, module in list(model.named_modules()):
        if keep(name):
            continue
        matmul = recipe.matmul() if hasattr(module, "low_precision_matmul") else None
        if matmul is not None:
            module.low_precision_matmul = matmul
            converted.append(name)
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and not keep(full):
                twin = recipe.linear(child)
                if twin is not None:
                    setattr(module, child_name, twin)
                    converted.append(full)
    return converted
