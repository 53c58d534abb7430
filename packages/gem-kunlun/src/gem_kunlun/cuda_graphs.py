"""Replaying a function's forward and backward as CUDA graphs, one pair per input shape.

A small model's training step on a GPU waits on the host: each of a few hundred small kernels costs more host
time to launch than device time to run. A CUDA graph launches a captured sequence of kernels in one call.
``GraphedForward(function, module)`` captures ``function(*inputs)`` and its backward (the gradients of the inputs
and of ``module``'s parameters) the first time it meets inputs of a given shape, and replays both from then on;
gradients reach the parameters through autograd as any other (accumulated into ``.grad``).

What a capture assumes; where a call does not meet it, the call runs eagerly:

- every input is a CUDA tensor, ``module`` is in training mode and gradients are enabled (evaluation and no-grad
  calls run eagerly: their outputs would alias the graph's memory, which the next replay overwrites), no
  autocast cache is on (a weight cast cached outside the capture would be replayed stale), and no saved-tensor
  hooks are (activation checkpointing recomputes the forward in the backward: a graph cannot take part);
- one replay's backward runs before the next replay of the same shape (the saved activations live in the graph's
  memory): a call while the last replay's backward is pending (its autograd graph alive, not run) runs eagerly;
- at most ``max_shapes`` shapes are captured; others run eagerly.

The backward is captured without autocast, as autograd runs an eager backward. Gradients accumulate over several
replays before they are zeroed, as eager ones do; an output changed in place before its backward raises (the
backward graph may read it). A capture that fails (a host synchronisation inside ``function``) raises, naming it.

What the caller guarantees: ``function`` has no host synchronisation and no shape that depends on device values
(a capture fails loudly otherwise), and the parameters keep their storage (the optimizer updates them in place;
``load_state_dict`` copies into them). Outputs are views of the graph's memory, valid until the next replay of
their shape. ``replays`` and ``eager_calls`` count what happened.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.autograd.function import once_differentiable


class _Pending:
    """Lives as long as one replay's autograd node: the backward it still owes (``done`` once run)."""

    __slots__ = ("done", "__weakref__")

    def __init__(self) -> None:
        self.done = False


class _Capture:
    """The forward and backward graphs of one input shape, with the static tensors they read and write."""

    def __init__(self, function: Callable, module: nn.Module, parameters: tuple[nn.Parameter, ...],
                 inputs: tuple[torch.Tensor, ...], warmup: int) -> None:
        self.inputs = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in inputs)
        self.parameters = parameters
        with _fresh_leaves(module, parameters) as leaves:
            self._capture(function, leaves, warmup)
        self.last: weakref.ref | None = None  # the _Pending of the last replay

    def _capture(self, function: Callable, leaves: tuple[nn.Parameter, ...], warmup: int) -> None:
        surface = [t for t in (*self.inputs, *leaves) if t.requires_grad]
        # NOTE: warm-up passes on a side stream first, so that lazy initialisation (cuBLAS handles, Triton's
        # compilation, the caching allocator's first blocks) happens outside the capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                outputs = _as_tuple(function(*self.inputs))
                differentiable = [o for o in outputs if o.requires_grad]
                if differentiable:
                    with _no_autocast():
                        torch.autograd.grad(differentiable, surface, [torch.ones_like(o) for o in differentiable],
                                            allow_unused=True)
        torch.cuda.current_stream().wait_stream(side)
        # NOTE: "thread_local": CUDA calls of other threads (the reader pinning the next batch) do not invalidate the
        # capture, as they would in the default mode
        self.forward_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph, capture_error_mode="thread_local"):
            self.outputs = _as_tuple(function(*self.inputs))
        self.differentiable = tuple(o.requires_grad for o in self.outputs)
        self.grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in self.outputs)
        grads: tuple[torch.Tensor | None, ...] = ()
        self.backward_graph = torch.cuda.CUDAGraph()
        if any(self.differentiable):
            # the backward's memory comes from the forward's pool: replays run forward then backward, in that order;
            # without autocast, as autograd runs an eager backward (the caller's autocast would reach it otherwise)
            with torch.cuda.graph(self.backward_graph, pool=self.forward_graph.pool(), capture_error_mode="thread_local"), \
                    _no_autocast():
                grads = torch.autograd.grad([o for o in self.outputs if o.requires_grad], surface,
                                            [g for g in self.grad_outputs if g is not None], allow_unused=True)
        remaining = iter(grads)
        self.grads = tuple(next(remaining, None) if t.requires_grad else None for t in (*self.inputs, *leaves))
        self.outputs = tuple(o.detach() for o in self.outputs)  # the captured autograd graph is spent

    def unalias_parameter_grads(self) -> None:
        """Autograd keeps a parameter's first gradient without copying it, so a ``.grad`` may be this capture's static
        gradient, which the next replay overwrites (a second step before the gradients are zeroed, as in gradient
        accumulation): such a ``.grad`` gets its own copy."""
        for parameter, static in zip(self.parameters, self.grads[len(self.inputs):]):
            grad = parameter.grad
            if grad is not None and static is not None and grad.data_ptr() == static.data_ptr():
                parameter.grad = grad.clone()

    def busy(self) -> bool:
        pending = None if self.last is None else self.last()
        return pending is not None and not pending.done


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, capture: _Capture, pending: _Pending, *tensors: torch.Tensor):
        # NOTE: the forward graph's temporaries may share memory with the backward graph's static gradients (one
        # pool, the forward's temporaries freed before the backward was captured): a .grad still holding the last
        # replay's static gradient (gradient accumulation) gets its own copy before this replay overwrites it
        capture.unalias_parameter_grads()
        for static, x in zip(capture.inputs, tensors):
            if static.data_ptr() != x.data_ptr():
                static.copy_(x)
        capture.forward_graph.replay()
        ctx.capture, ctx.pending = capture, pending
        outputs = tuple(o.detach() for o in capture.outputs)  # each shares its static output's version counter
        ctx.versions = tuple(o._version for o in outputs)
        ctx.mark_non_differentiable(*(o for o, d in zip(outputs, capture.differentiable) if not d))
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        capture = ctx.capture
        # NOTE: the backward graph may read an output it saved (as autograd would); autograd's own check of an
        # in-place change to a saved tensor does not reach inside the graph, so it is made here
        if any(o._version != v for o, v in zip(capture.outputs, ctx.versions)):
            raise RuntimeError("GraphedForward: an output of a replayed function was modified in place before its "
                               "backward; modify a copy (out.clone()) instead")
        for static, grad in zip(capture.grad_outputs, grads):
            if static is not None and static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        capture.backward_graph.replay()
        ctx.pending.done = True
        # NOTE: the inputs' gradients are copied: upstream, a view's backward passes a view of its gradient on, and a
        # leaf at the end of such a chain would keep the static gradient as its .grad, out of reach of the forward's check
        inputs = tuple(None if g is None else g.clone() for g in capture.grads[: len(capture.inputs)])
        return None, None, *inputs, *(None if g is None else g.detach() for g in capture.grads[len(inputs):])


class GraphedForward:
    """``function(*inputs) -> tuple of tensors`` replayed as CUDA graphs (see the module docstring); ``module``:
    whose training mode decides, ``parameters``: those the function reads (None: all of ``module``'s; their
    gradients come back from the backward graph)."""

    def __init__(self, function: Callable, module: nn.Module, parameters: list[nn.Parameter] | None = None,
                 max_shapes: int = 8, warmup: int = 3) -> None:
        self.function, self.module, self.max_shapes, self.warmup = function, module, max_shapes, warmup
        # each parameter once: a repeated one would get its gradient twice
        self.parameters = None if parameters is None else tuple(dict.fromkeys(parameters))
        if self.parameters is not None:
            # a capture swaps each parameter for a fresh leaf where the module holds it (_fresh_leaves)
            held = {id(p) for p in module.parameters()}
            foreign = sum(id(p) not in held for p in self.parameters)
            if foreign:
                raise ValueError(f"GraphedForward: {foreign} of the given parameters are not parameters of the module "
                                 f"({type(module).__name__})")
        self._captures: dict[tuple, _Capture] = {}
        self.replays = self.eager_calls = 0

    def __call__(self, *inputs: torch.Tensor):
        if not self._capturable(inputs):
            self.eager_calls += 1
            return self.function(*inputs)
        key = (tuple((x.shape, x.dtype, x.requires_grad, x.device) for x in inputs),
               torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        capture = self._captures.get(key)
        if capture is None and len(self._captures) < self.max_shapes:
            parameters = self.parameters if self.parameters is not None else tuple(self.module.parameters())
            try:
                capture = self._captures[key] = _Capture(self.function, self.module, parameters, inputs, self.warmup)
            except RuntimeError as error:
                name = getattr(self.function, "__qualname__", repr(self.function))
                raise RuntimeError(f"GraphedForward: capturing {name} as a CUDA graph failed (a host synchronisation "
                                   f"or a shape read from device values inside it?): {error}") from error
        if capture is None or capture.busy():
            self.eager_calls += 1
            return self.function(*inputs)
        pending = _Pending()
        capture.last = weakref.ref(pending)
        self.replays += 1
        return _Replay.apply(capture, pending, *inputs, *capture.parameters)

    def _capturable(self, inputs: tuple[torch.Tensor, ...]) -> bool:
        return (self.module.training and torch.is_grad_enabled() and bool(inputs)
                and all(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs)
                and not torch.cuda.is_current_stream_capturing()
                and not (torch.is_autocast_enabled("cuda") and torch.is_autocast_cache_enabled())
                and not _saved_tensor_hooks_active())

    def __deepcopy__(self, memo: dict) -> "GraphedForward":
        # a copy of the module (a teacher, an average of weights) captures its own graphs; the module may be half
        # copied here (this object is one of its attributes): its parameters are not checked again
        copied = GraphedForward(copy.deepcopy(self.function, memo), copy.deepcopy(self.module, memo), None,
                                self.max_shapes, self.warmup)
        copied.parameters = copy.deepcopy(self.parameters, memo)
        return copied


@contextlib.contextmanager
def _fresh_leaves(module: nn.Module, parameters: tuple[nn.Parameter, ...]):
    """Each of ``parameters`` replaced, wherever ``module`` or a submodule holds it, by a new leaf sharing its
    memory: ``(the new leaves)``, the originals put back on exit.

    Why: autograd feeds a parameter's gradient through the parameter's one gradient accumulator, which runs on the
    stream current where it was made. While any autograd graph of the parameter lives (a step's, kept by whoever
    keeps a loss or statistics), that accumulator is on the default stream, and a backward captured on the capture
    stream would make the default stream wait on it, which invalidates the capture. New leaves have accumulators
    of their own, made inside the capture."""
    leaves = {id(p): nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in parameters}
    swapped = [(owner, name, p) for owner in module.modules() for name, p in owner._parameters.items()
               if p is not None and id(p) in leaves]
    for owner, name, p in swapped:
        owner._parameters[name] = leaves[id(p)]
    try:
        yield tuple(leaves[id(p)] for p in parameters)
    finally:
        for owner, name, p in swapped:
            owner._parameters[name] = p


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are on (``torch.autograd.graph.saved_tensors_hooks``, activation checkpointing)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _no_autocast():
    return torch.autocast("cuda", enabled=False)


def _as_tuple(outputs) -> tuple[torch.Tensor, ...]:
    if not isinstance(outputs, tuple) or not all(isinstance(o, torch.Tensor) for o in outputs):
        raise TypeError(f"GraphedForward: the function must return a tuple of tensors, got {type(outputs).__name__}")
    return outputs
