"""LoopFM on the teacher side: the compact representation of each example the teacher scores.

``RepresentationTap(teacher, layer, dim, seed)`` reads one layer of the teacher during its ordinary forward
pass (no second pass: the soft labels and the representations come from the same call) and projects it
to ``dim`` values with the fixed ``random_projection(width, dim, seed)``. ``layer`` is ``"representation"``
(what the teacher's heads read: ``ModelOutput.representation``) or the dotted name of any submodule whose
output is ``[B, width]`` (e.g. ``"trunk.mlp"``); either way the choice, the width and the seed decide the
vectors completely, and the store records them.
"""

from __future__ import annotations

import torch
from torch import nn

from gem_kunlun import ModelOutput

from gem_transfer.representation_store import random_projection

REPRESENTATION = "representation"


class RepresentationTap:
    """Hooks ``layer`` of ``teacher``; after each forward, ``vectors(output)`` is ``[B, dim]`` float32 on the CPU."""

    def __init__(self, teacher: nn.Module, layer: str, dim: int, seed: int) -> None:
        self.layer, self.dim, self.seed = layer, dim, seed
        self._seen: torch.Tensor | None = None
        self._projection: torch.Tensor | None = None
        self._handle = None
        if layer != REPRESENTATION:
            # NOTE: a sharded teacher is TorchRec's wrapper around the model; layer names are the model's own
            inner = getattr(teacher, "module", teacher)
            try:
                module = inner.get_submodule(layer)
            except AttributeError:
                names = [n for n, _ in inner.named_modules() if n][:12]
                raise ValueError(f"the teacher has no layer {layer!r} (e.g. {', '.join(names)}, ...)") from None
            self._handle = module.register_forward_hook(self._keep)

    def _keep(self, module: nn.Module, inputs, output) -> None:
        self._seen = output[0] if isinstance(output, tuple) else output

    def vectors(self, output: ModelOutput, batch_size: int) -> torch.Tensor:
        """The projected representations of the forward pass that returned ``output``."""
        seen = output.representation if self._handle is None else self._seen
        self._seen = None
        if not isinstance(seen, torch.Tensor) or seen.dim() != 2 or seen.shape[0] != batch_size:
            shape = tuple(seen.shape) if isinstance(seen, torch.Tensor) else type(seen).__name__
            raise ValueError(f"teacher layer {self.layer!r} gave {shape}, expected one row per example ({batch_size}, width)")
        if self._projection is None:
            self._projection = random_projection(seen.shape[1], self.dim, self.seed)
        if seen.shape[1] != self._projection.shape[0]:
            raise ValueError(f"teacher layer {self.layer!r} changed width from {self._projection.shape[0]} to {seen.shape[1]}")
        return seen.detach().float().cpu() @ self._projection

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
