"""A batch as one flat byte buffer plus a small description of where each of its tensors lies in it.

What a batch is made of (``Batch`` and the dataclasses in it, TorchRec's ``KeyedJaggedTensor``, dicts, plain Python
values) is walked once by ``describe``: the tensors go into the buffer one dtype after the other (each dtype's region
64-byte aligned, so that it can be viewed as that dtype; each tensor in it 16-byte aligned, as a tensor of its own
would be, for the kernels that read it with vector loads), the rest stays in the description. ``pack_into`` copies
the tensors into a buffer, ``unpack`` rebuilds the batch as views of one, or of a copy of it on a GPU. A batch then
crosses a process boundary, or goes to a device, as one memory copy and a description of a few hundred bytes, where
pickling it would send every tensor on its own (``ProcessReadAhead``), and ``Batch.to`` would copy each.

Host-side facts a batch carries for the step (a KJT's ids per key, an event sequence's host lengths) are kept, so the
rebuilt batch moves to a GPU without reading anything back. Objects that ``describe`` is told are shared (one object
in every batch, e.g. a data set's item catalogue) are not copied: the description names them by a token, and the
receiver keeps one object per token, so that their identity (and the device copy cached by it) survives.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torchrec import KeyedJaggedTensor

ALIGN = 64  # bytes; each dtype's region of the buffer starts on a multiple of it
TENSOR_ALIGN = 16  # bytes; each tensor within its region starts on a multiple of it (of its element size, if larger)


@dataclasses.dataclass
class Description:
    """A batch without its tensors. ``tree`` names each tensor by its index in walk order; the buffer holds the
    tensors of one dtype together, one region per dtype: ``regions`` is a tuple of (dtype, first byte, element
    count of each of its tensors, their indices, their shapes, their first elements within the region, the region's
    element count); ``nbytes`` is the buffer size that holds them all."""

    tree: Any
    regions: tuple
    nbytes: int


class Shared:
    """The objects of a stream that every batch shares, by token: ``describe`` registers each on first sight."""

    def __init__(self) -> None:
        self.by_token: dict[int, Any] = {}
        self._tokens: dict[int, int] = {}  # id(object) -> token

    def token(self, obj: Any) -> tuple[int, bool]:
        """``obj``'s token, and whether it was new."""
        key = id(obj)
        if key in self._tokens:
            return self._tokens[key], False
        token = self._tokens[key] = len(self.by_token)
        self.by_token[token] = obj  # held, so that its id is never reused for another object
        return token, True


# the fields of gem-kunlun's batch types that hold one object for the whole stream (see NextItemTargets.catalogue)
SHARED_FIELDS = {"NextItemTargets": ("catalogue",)}


def describe(batch: Any, shared: Shared | None = None) -> tuple[Description, list[torch.Tensor], dict[int, Any]]:
    """``batch``'s description, its tensors in slot order, and the shared objects first seen in it (token ->
    object), which the receiver must be given before it unpacks."""
    tensors: list[torch.Tensor] = []
    new_shared: dict[int, Any] = {}

    def leaf(t: torch.Tensor) -> tuple:
        if t.device.type != "cpu":
            raise ValueError(f"packing a batch: a tensor is on {t.device}; batches are packed on the host")
        if t.layout != torch.strided:
            raise ValueError(f"packing a batch: a tensor has layout {t.layout}; only dense tensors are packed")
        tensors.append(t)
        return ("tensor", len(tensors) - 1)

    def walk(obj: Any) -> tuple:
        if isinstance(obj, torch.Tensor):
            return leaf(obj)
        if isinstance(obj, KeyedJaggedTensor):
            if obj.variable_stride_per_key():
                raise ValueError("packing a batch: KeyedJaggedTensors with a stride per key are not packed")
            return ("kjt", obj.keys(), obj.stride(), obj._length_per_key, obj._offset_per_key,
                    walk(obj.values()), walk(obj.weights_or_none()), walk(obj.lengths_or_none()),
                    walk(obj.offsets_or_none()))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            shared_fields = SHARED_FIELDS.get(type(obj).__name__, ())
            fields = []
            for f in dataclasses.fields(obj):
                if not f.init:  # made by the class itself when rebuilt
                    continue
                value = getattr(obj, f.name)
                if f.name in shared_fields and value is not None and shared is not None:
                    token, new = shared.token(value)
                    if new:
                        new_shared[token] = value
                    fields.append((f.name, ("shared", token)))
                else:
                    fields.append((f.name, walk(value)))
            return ("dataclass", type(obj), tuple(fields))
        if isinstance(obj, dict):
            return ("dict", tuple((k, walk(v)) for k, v in obj.items()))
        if isinstance(obj, (list, tuple)) and any(isinstance(v, (torch.Tensor, KeyedJaggedTensor)) for v in obj):
            return ("list" if isinstance(obj, list) else "tuple", tuple(walk(v) for v in obj))
        return ("value", obj)  # None, numbers, strings, lists of host ints

    tree = walk(batch)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    regions, end = [], 0
    for dtype, indices in by_dtype.items():
        counts = tuple(tensors[i].numel() for i in indices)
        step = max(TENSOR_ALIGN // dtype.itemsize, 1)  # elements
        starts, size = [], 0
        for count in counts:
            starts.append(size)
            size += -(-count // step) * step
        regions.append((dtype, end, counts, tuple(indices), tuple(tuple(tensors[i].shape) for i in indices),
                        tuple(starts), size))
        end += -(-size * dtype.itemsize // ALIGN) * ALIGN
    return Description(tree, tuple(regions), end), tensors, new_shared


def pack_into(buffer: torch.Tensor, description: Description, tensors: list[torch.Tensor]) -> None:
    """Copy ``tensors`` into their slots of ``buffer`` (uint8, at least ``description.nbytes`` long)."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < description.nbytes:
        raise ValueError(f"pack_into needs a 1-D uint8 buffer of at least {description.nbytes} bytes, "
                         f"got {buffer.dtype} {tuple(buffer.shape)}")
    for dtype, first, counts, indices, _, starts, size in description.regions:
        region = buffer[first: first + size * dtype.itemsize].view(dtype)
        for i, start, count in zip(indices, starts, counts):
            region[start: start + count].copy_(tensors[i].reshape(-1))


def unpack(buffer: torch.Tensor, description: Description, shared: dict[int, Any] | None = None) -> Any:
    """The batch ``description`` describes, its tensors views of ``buffer`` (on any device; it must outlive them: the
    views keep its storage alive); ``shared``: token -> object for the shared fields."""
    views: list[torch.Tensor | None] = [None] * sum(len(r[3]) for r in description.regions)
    for dtype, first, counts, indices, shapes, starts, size in description.regions:
        region = buffer[first: first + size * dtype.itemsize].view(dtype)
        for i, start, count, shape in zip(indices, starts, counts, shapes):
            part = region[start: start + count]
            views[i] = part if len(shape) == 1 else part.view(shape)

    def build(node: tuple) -> Any:
        kind = node[0]
        if kind == "tensor":
            return views[node[1]]
        if kind == "value":
            return node[1]
        if kind == "shared":
            if shared is None or node[1] not in shared:
                raise KeyError(f"unpacking a batch: shared object {node[1]} was never received")
            return shared[node[1]]
        if kind == "kjt":
            _, keys, stride, length_per_key, offset_per_key, values, weights, lengths, offsets = node
            return KeyedJaggedTensor(keys=keys, values=build(values), weights=build(weights), lengths=build(lengths),
                                     offsets=build(offsets), stride=stride, length_per_key=length_per_key,
                                     offset_per_key=offset_per_key)
        if kind == "dataclass":
            return node[1](**{name: build(child) for name, child in node[2]})
        if kind == "dict":
            return {k: build(child) for k, child in node[1]}
        if kind in ("list", "tuple"):
            items = [build(child) for child in node[1]]
            return items if kind == "list" else tuple(items)
        raise ValueError(f"unpacking a batch: unknown node {kind!r}")

    return build(description.tree)

