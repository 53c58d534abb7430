"""Host time per call of the ops: what a call costs the CPU before its last kernel is queued.

A kernel shorter than its call's host time leaves the GPU waiting on Python (validation, autograd, launch
arguments), and the recommendation shapes are full of such calls: short cross attention, PMA, small blocks,
norms of narrow streams. This times each op's call alone, forward and forward+backward, median over many calls.

- On CUDA: each call starts with the GPU's queue drained (a call never waits on a full queue), so the time is the
  host's alone; the shapes are small (their kernels take microseconds).
- Without a GPU (the Triton interpreter): compiling a kernel gives a stand-in whose launcher does nothing, and
  ``_tuning`` takes it for the compiled kernel, so the time is everything the package does around a launch (the
  ops' validation, autograd, plans, ``_tuning``'s direct launch with its argument specialisation) without Triton's
  own launcher and the launch itself (together ~10 us a launch on the H200's host).

    PYTHONPATH=packages/gem-kernels/src python -m gem_kernels.ops.benchmarks.host_time --out host-time.json

Prints a table and writes ``{"meta", "rows"}``; ``reference`` rows time one torch op and an empty autograd
Function on the same machine, for scale. ``fwd_bwd_calling_thread_us``: forward+backward with the backward run on the
calling thread (``torch.autograd.set_multithreading_enabled(False)``): on CUDA the autograd engine otherwise hands a
backward over to its device thread and back, a cost of the host (two thread wake-ups) that this column leaves out;
without a GPU the backward of CPU tensors runs on the calling thread either way.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU tensors take the Triton path

from gem_kernels.ops.benchmarks.provenance import git_commit  # noqa: E402
from gem_kernels.ops.benchmarks.run_all import fwd_bwd  # noqa: E402

H, D = 4, 128


class _NoLaunch:
    """A compiled kernel whose launcher does nothing."""

    function, packed_metadata = "no function", "no metadata"

    @staticmethod
    def run(*args) -> None:
        return None


class _StandInKernel:
    """Stands for a Triton kernel in ``_tuning._launch``: its parameters, and compiling gives ``_NoLaunch``."""

    def __init__(self, kernel) -> None:
        self.signature, self.arg_names = inspect.signature(kernel.fn), kernel.arg_names

    def __getitem__(self, grid):
        return lambda *args, **kwargs: _NoLaunch


def stub_launches() -> None:
    """Launches through ``_tuning`` take their direct path to a launcher that does nothing (CPU: no Triton launch)."""
    from gem_kernels.ops.triton import _tuning

    launch, stand_ins = _tuning._launch, {}

    def stubbed(kernel, grid, args, consts, cfg, key):
        if kernel not in stand_ins:  # one per kernel: _tuning keys its compiled kernels by the kernel's identity
            stand_ins[kernel] = _StandInKernel(kernel)
        return launch(stand_ins[kernel], grid, args, consts, cfg, key)

    _tuning._launch = stubbed
    _tuning._direct_launch_ok = lambda: True
    _tuning._current_stream = lambda device: 0
    torch.cuda.current_device = lambda: 0


def cases(device: str) -> dict:
    """name -> (forward function, inputs to differentiate). Small shapes: a few hundred tokens, 4 heads of 128."""
    from gem_kernels import block_attention, gdpa, jagged_flash_attention, layer_norm, qkv_rotary_attention, rms_norm

    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float16

    def rand(*shape, grad=True):
        x = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
        return x.requires_grad_(grad)

    def offsets(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device=device)

    qo = offsets([48] * 8)
    T = int(qo[-1])
    ko = offsets([16] * 8)
    q, k, v = rand(T, H, D), rand(8 * 16, H, D), rand(8 * 16, H, D)
    kv = rand(8 * 16, 2, H, D)
    sq, sk, sv = rand(T, H, D), rand(T, H, D), rand(T, H, D)
    pq = rand(8, H, D)
    qkv = rand(T, 3, H, D) * 1.0  # a projection's output, as in the model (the fused path refuses to rotate a leaf)
    positions = torch.cat([torch.arange(48, device=device)] * 8).float()
    x, w, b = rand(T, 256), rand(256), rand(256)
    return {
        "gdpa cross, 16 keys": (lambda: gdpa(q, k, v, qo, ko, max_seq_len_q=64, max_seq_len_kv=16, validate=False,
                                             kernel="triton"), [q, k, v]),
        "gdpa cross, packed kv": (lambda: gdpa(q, kv, None, qo, ko, max_seq_len_q=64, max_seq_len_kv=16,
                                               validate=False, kernel="triton"), [q, kv]),
        "gdpa pma, 8 queries": (lambda: gdpa(pq, sk, sv, None, qo, max_seq_len_kv=64, validate=False, kernel="triton"),
                                [pq, sk, sv]),
        "block_attention 16 x 1": (lambda: block_attention(sq, sk, sv, qo, 16, 1, max_seq_len=64, validate=False,
                                                           kernel="triton"), [sq, sk, sv]),
        "jagged_flash_attention causal": (lambda: jagged_flash_attention(sq, sk, sv, qo, 64, causal=True,
                                                                         validate=False, kernel="triton"),
                                          [sq, sk, sv]),
        # NOTE: rotates q and k inside qkv at every call (the trainer's fused projection): timing only
        "qkv_rotary_attention blocks": (lambda: qkv_rotary_attention(qkv, positions, qo, 64, block_size=16,
                                                                     validate=False, kernel="triton"), [qkv]),
        "layer_norm": (lambda: layer_norm(x, w, b, kernel="triton"), [x, w, b]),
        "rms_norm": (lambda: rms_norm(x, w, kernel="triton"), [x, w]),
    }


def reference_cases(device: str) -> dict:
    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b, c):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, grad):
            return grad, None, None

    a = torch.zeros(8, device=device, requires_grad=True)
    return {"reference: torch add": (lambda: a + 1, [a]),
            "reference: empty autograd Function, 3 inputs": (lambda: Empty.apply(a, a, a), [a])}


def median_us(run, calls: int, sync) -> float:
    """Median microseconds of ``run()`` called alone, each call after ``sync()``."""
    for _ in range(5):
        run()
    times = []
    for _ in range(calls):
        sync()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    sync()
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--calls", type=int, default=2000, help="calls timed per row")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        stub_launches()
    torch.set_num_threads(1)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    import triton

    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.machine()}), launches stubbed",
            "host_cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(), "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m gem_kernels.ops.benchmarks.host_time " + " ".join(argv or sys.argv[1:]),
            "calls_per_row": a.calls, "H": H, "D": D}
    rows = []
    print(f"{'op':46s} {'fwd us':>9s} {'fwd+bwd us':>11s} {'(calling thread)':>17s}")
    for name, (fn, inputs) in {**cases(device), **reference_cases(device)}.items():
        fwd = median_us(fn, a.calls, sync)
        both = median_us(fwd_bwd(fn, inputs), a.calls // 2, sync)
        with torch.autograd.set_multithreading_enabled(False):
            here = median_us(fwd_bwd(fn, inputs), a.calls // 2, sync)
        rows.append({"op": name, "fwd_us": round(fwd, 1), "fwd_bwd_us": round(both, 1),
                     "fwd_bwd_calling_thread_us": round(here, 1)})
        print(f"{name:46s} {fwd:9.1f} {both:11.1f} {here:17.1f}", flush=True)
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
