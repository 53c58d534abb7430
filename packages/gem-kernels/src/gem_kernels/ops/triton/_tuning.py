"""A small launch-time tuner: the fastest candidate with GEM_KERNELS_AUTOTUNE=1 on GPU; otherwise the config this
device's benchmark run picked (``tuned/<device>.json``, shipped with the package), else the first candidate.

Triton's own autotuner would also run under the interpreter (where timing is meaningless), so the package
keeps its own: candidates are plain launch-keyword dicts, results are cached per key for the process.

Launches after a kernel's first one skip Triton's per-call binding (``JITFunction.run`` rebinds and
re-specialises every argument on every launch, host time that short calls make the GPU wait for): the compiled
kernel is kept per (key, constexprs, argument specialisation) and its launcher called directly.
``FAST_LAUNCH = False`` (or GEM_KERNELS_FAST_LAUNCH=0) sends every launch through Triton's own path.

Ops whose launches follow from a few facts about their inputs (an attention call's spec, batch size and tensor
layouts) plan them (``plan``, ``PlannedLaunch``): kernel, grid, config and every argument that is not one of the
call's tensors decided once per call shape, so a call only puts its tensors in the plan's slots (the host time
this saves: ``benchmarks/host_time``).

Under ``torch.compile`` the ops that launch these kernels run eagerly between the caller's graphs
(``eager_under_compile``): Dynamo cannot trace the launch path (the direct launcher, the tensor descriptors).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path
from typing import NamedTuple

import torch
import triton

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the Triton version
    TensorDescriptor = None

_TUNED: dict[tuple, dict] = {}
_PRESET: dict[str, dict] = {}  # configs loaded from a file, keyed by repr(key)
_SHIPPED: dict[str, dict] | None = None  # this device's shipped configs, read at the first launch
TUNED_DIR = Path(__file__).parent / "tuned"
FAST_LAUNCH = os.environ.get("GEM_KERNELS_FAST_LAUNCH", "1") != "0"
# (kernel, key, constexpr values, device, argument specialisation) -> (config, compiled kernel, constexpr arguments)
_COMPILED: dict[tuple, tuple] = {}
_INT32 = (-(2**31), 2**31)


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host code: Triton's is a constexpr function whose every host call costs microseconds of
    argument unwrapping, several times per launch of a kernel whose whole call is host-bound."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code (see ``cdiv``): the smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def autotune_enabled() -> bool:
    return os.environ.get("GEM_KERNELS_AUTOTUNE", "0") == "1" and not interpreting()


def tuned_configs() -> dict[tuple, dict]:
    """The configs picked so far (for benchmark logs)."""
    return dict(_TUNED)


@contextlib.contextmanager
def untuned():
    """Launches inside take their untuned (or loaded, or shipped) configs, and what they picked is dropped after:
    for checks on small shapes, whose tuning would only spend time and whose picks must not stand for a
    benchmark's keys."""
    tune = os.environ.pop("GEM_KERNELS_AUTOTUNE", None)
    try:
        yield
    finally:
        if tune is not None:
            os.environ["GEM_KERNELS_AUTOTUNE"] = tune
        _TUNED.clear()
        _PLANS.clear()  # they hold the configs picked inside


def save_tuned(path: str) -> None:
    with open(path, "w") as f:
        json.dump({repr(k): v for k, v in _TUNED.items()}, f, indent=1)


def load_tuned(path: str) -> None:
    with open(path) as f:
        _PRESET.update(json.load(f))
    _PLANS.clear()


def device_file(device_name: str) -> Path:
    """Where the configs tuned on a device are shipped: ``NVIDIA H200`` -> ``tuned/nvidia-h200.json``."""
    return TUNED_DIR / ("-".join(device_name.lower().split()) + ".json")


def _shipped() -> dict[str, dict]:
    global _SHIPPED
    if _SHIPPED is None:
        import torch

        path = device_file(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
        _SHIPPED = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    return _SHIPPED


def _preset(key: tuple, cands: list[dict]) -> dict | None:
    """A config given for this key: from ``load_tuned``, else (when not tuning) this device's shipped file. One
    whose launch keywords differ from the candidates' (a kernel changed since) is ignored."""
    cfg = _PRESET.get(repr(key))
    if cfg is None and not autotune_enabled() and not interpreting():
        cfg = _shipped().get(repr(key))
    return dict(cfg) if cfg is not None and set(cfg) == set(cands[0]) else None


def specialisation(args: tuple) -> tuple | None:
    """What Triton specialises a compiled kernel on, per non-constexpr argument, at least as finely as Triton
    does (so two launches with equal tuples run the same binary): a tensor's dtype and 16-byte alignment, an
    integer's width, divisibility by 16 and being 1, a float or bool's type, a tensor descriptor's dtype, block and
    padding. None for any other argument."""
    sig = []
    for a in args:
        t = type(a)
        if t is int:
            sig.append(1 if a == 1 else (a & 15 == 0, _INT32[0] <= a < _INT32[1], a < 2**63))
        elif isinstance(a, torch.Tensor):
            sig.append((a.dtype, a.data_ptr() & 15 == 0))
        elif t is float or t is bool:
            sig.append(t)
        elif t is TensorDescriptor:  # Triton specialises a host descriptor on its dtype, block and padding
            sig.append((a.base.dtype, tuple(a.block_shape), a.padding))
        else:
            return None
    return tuple(sig)


try:  # what Triton's driver asks torch for (torch.cuda.current_stream builds a Stream object every call)
    from torch._C import _cuda_getCurrentRawStream as _current_stream
except ImportError:  # pragma: no cover - depends on the torch build
    def _current_stream(device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream


def eager_under_compile(op):
    """``op`` (a function launching Triton kernels through ``launch``) run as it is where a ``torch.compile``d caller
    calls it: its graph breaks around the op, which autograd then differentiates as in eager mode."""
    disabled = torch.compiler.disable(op, recursive=True)

    @functools.wraps(op)
    def run(*args, **kwargs):
        # NOTE: Dynamo reads is_compiling() as True and breaks its graph at the disabled call; eager callers skip the
        # disabled wrapper, whose frame handling costs ~5 us a call
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return op(*args, **kwargs)

    return run


def _direct_launch_ok() -> bool:
    # a launch hook (e.g. a profiler) needs Triton's launch metadata: take its path then
    hooks = triton.knobs.runtime.launch_enter_hook
    return FAST_LAUNCH and not interpreting() and not getattr(hooks, "calls", hooks)


def _grid3(grid: tuple) -> tuple[int, int, int]:
    return grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1


def _constexpr_tail(kernel, n_args: int, consts: dict, cfg: dict) -> tuple:
    """The launcher takes every parameter in order: the constexprs (given or defaulted) after the positional
    arguments too."""
    named = dict(consts, **cfg)
    params = kernel.signature.parameters
    return tuple(named[n] if n in named else params[n].default for n in kernel.arg_names[n_args:])


def _launch(kernel, grid: tuple, args: tuple, consts: dict, cfg: dict, key: tuple):
    """``kernel[grid](*args, **consts, **cfg)``, through the compiled kernel's launcher when this key, these
    constexprs and this argument specialisation have launched before. Returns ``(compiled kernel, constexpr tail)``
    when the launch can be repeated through the launcher, else None."""
    if not _direct_launch_ok():
        kernel[grid](*args, **consts, **cfg)
        return None
    device = torch.cuda.current_device()
    sig = specialisation(args)
    fast_key = (id(kernel), key, tuple(consts.values()), device, sig)
    hit = _COMPILED.get(fast_key) if sig is not None else None
    if hit is not None and hit[0] is cfg:
        _, compiled, tail = hit
        compiled.run(*_grid3(grid), _current_stream(device), compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *tail)
        return compiled, tail
    compiled = kernel[grid](*args, **consts, **cfg)
    if sig is not None and compiled is not None and compiled.run is not None and compiled.function is not None:
        tail = _constexpr_tail(kernel, len(args), consts, cfg)
        _COMPILED[fast_key] = (cfg, compiled, tail)
        return compiled, tail
    return None


def candidate_ms(run) -> float:
    """GPU milliseconds of one launch of a candidate (median), replayed from a CUDA graph. Timed launch by launch,
    a kernel shorter than its launch's host time measures the host, the same for every candidate; the graph leaves
    only the GPU's time (without the L2 flush that ``do_bench`` puts between launches)."""
    return triton.testing.do_bench_cudagraph(run, rep=20, return_mode="median")


def launch(kernel, grid_fn, args, consts: dict, key: tuple, cands):
    """args: a tuple, or a function of the config returning one (for inputs that depend on the config); the
    launch that counts is the last one. cands: the candidate configs, or a function returning them, called only
    when the key has no config yet (building them on every launch is host time the GPU may wait for). Returns the
    config and what ``_launch`` returns."""
    args_fn = args if callable(args) else (lambda c: args)
    # NOTE: every kernel launched through here only writes its outputs, so timing a candidate by
    # re-running it leaves the result unchanged.
    cfg = _TUNED.get(key)
    if cfg is None and callable(cands):
        cands = cands()
    if cfg is None:
        cfg = _preset(key, cands)
        if cfg is not None:
            _TUNED[key] = cfg
    if cfg is None:
        cfg = cands[0]
        if autotune_enabled() and len(cands) > 1:
            best = None
            torch.cuda.synchronize()  # the candidates run on the timing's own stream, after the inputs exist
            for c in cands:
                try:
                    t = candidate_ms(lambda c=c: kernel[grid_fn(c)](*args_fn(c), **consts, **c))
                except Exception:  # a candidate can run out of shared memory or registers
                    continue
                if best is None or t < best[0]:
                    best = (t, c)
            if best is not None:
                cfg = best[1]
        _TUNED[key] = cfg
    return cfg, _launch(kernel, grid_fn(cfg), args_fn(cfg), consts, cfg, key)


# --- planned launches -------------------------------------------------------------------------------------------

class Slot(NamedTuple):
    """In a planned launch's arguments: the call's tensor number ``index``."""

    index: int


class RowTiles(NamedTuple):
    """In a planned launch's arguments: a tensor descriptor of the call's tensor number ``index`` (``[T, H, D]``,
    heads side by side) read as the ``[T, H * D]`` matrix in ``[rows, D]`` tiles; ``rows``: a number, or the config
    key giving it."""

    index: int
    rows: int | str

    def descriptor(self, x: torch.Tensor, cfg: dict) -> "TensorDescriptor":
        T, H, D = x.shape
        return TensorDescriptor(x, [T, H * D], [x.stride(0), 1], [cfg[self.rows] if type(self.rows) is str
                                                                  else self.rows, D])


def _unchecked_row_tiles(x: torch.Tensor, block: list[int]) -> "TensorDescriptor":
    """``RowTiles.descriptor`` without the constructor's checks (alignment, strides, block shape: ~10 us of host),
    which the first launch of the plan ran on a tensor of the same layout."""
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(base=x, shape=[x.shape[0], block[1] * x.shape[1]], strides=[x.stride(0), 1], block_shape=block,
                      padding="zero")
    return d


class PlannedLaunch:
    """One kernel launch of a planned call shape (see ``plan``): kernel, grid function, constexprs, tuning key and
    candidates as for ``launch``; ``template`` holds the positional arguments, the call's tensors as ``Slot`` /
    ``RowTiles`` markers. The first launch goes through ``launch`` (config, compiling); later ones fill the slots
    and call the compiled kernel's launcher, with no per-argument work (the plan's key stands for the arguments'
    specialisation). ``rows``: a grid that depends on the call's length, ``grid_fn(cfg, rows)`` with the row count
    of the call's tensor number ``rows`` (the plan's key leaves lengths out)."""

    def __init__(self, kernel, grid_fn, template: tuple, consts: dict, key: tuple, cands, rows: int | None = None):
        self.kernel, self.grid_fn, self.template, self.consts, self.key, self.cands, self.rows = (
            kernel, grid_fn, template, consts, key, cands, rows)
        self._direct = None  # what the launcher needs, set by the first launch that can be repeated

    def _args(self, tensors: tuple, cfg: dict) -> tuple:
        return tuple(tensors[a.index] if type(a) is Slot else a.descriptor(tensors[a.index], cfg)
                     if type(a) is RowTiles else a for a in self.template)

    def __call__(self, tensors: tuple) -> None:
        direct = self._direct
        if direct is not None and _direct_launch_ok():
            run, grid, device, function, metadata, constants, slots, tiles, tail = direct
            if self.rows is not None:
                grid = grid(tensors[self.rows].shape[0])
            args = constants.copy()
            for pos, i in slots:
                args[pos] = tensors[i]
            for pos, i, block in tiles:
                args[pos] = _unchecked_row_tiles(tensors[i], block)
            run(*grid, _current_stream(device), function, metadata, None, None, None, *args, *tail)
            return
        if self.rows is None:
            grid_fn = self.grid_fn
        else:
            n_rows = tensors[self.rows].shape[0]
            grid_fn = lambda c: self.grid_fn(c, n_rows)  # noqa: E731
        cfg, fast = launch(self.kernel, grid_fn, lambda c: self._args(tensors, c), self.consts, self.key, self.cands)
        if fast is None:
            return
        compiled, tail = fast
        slots = [(p, a.index) for p, a in enumerate(self.template) if type(a) is Slot]
        tiles = [(p, a.index, [cfg[a.rows] if type(a.rows) is str else a.rows, tensors[a.index].shape[2]])
                 for p, a in enumerate(self.template) if type(a) is RowTiles]
        constants = [None if type(a) in (Slot, RowTiles) else a for a in self.template]
        grid = _grid3(self.grid_fn(cfg)) if self.rows is None else (lambda n: _grid3(self.grid_fn(cfg, n)))
        self._direct = (compiled.run, grid, torch.cuda.current_device(), compiled.function, compiled.packed_metadata,
                        constants, slots, tiles, tail)


# planned calls: call key -> list of PlannedLaunch. Bounded: a key that changes every call (a max length read
# from the offsets) must not grow it without end.
_PLANS: dict[tuple, list] = {}
PLANS_MAX = 4096


def plan(key: tuple, build) -> list:
    """The planned launches of a call shape: ``build()``'s, made the first time ``key`` is seen. The key must hold
    everything the plan depends on: what decides the kernels, grids and constant arguments, and what Triton
    specialises the compiled kernels on (each tensor's dtype and 16-byte alignment, each integer's value class)."""
    launches = _PLANS.get(key)
    if launches is None:
        if len(_PLANS) >= PLANS_MAX:
            _PLANS.clear()
        launches = _PLANS[key] = build()
    return launches
