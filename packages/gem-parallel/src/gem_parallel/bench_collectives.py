"""Copy-engine against NCCL kernel collectives in isolation: all-gather and equal-split all-to-all bandwidth
per message size, and what each occupies on the GPU (kernels and their thread blocks, or copies).

    torchrun --nproc-per-node 2 -m gem_parallel.bench_collectives --out collectives.json

Both paths run on one NCCL communicator with the zero CTA policy (``gem_parallel.collectives``): plain
buffers take NCCL's kernels, buffers in symmetric memory take the copy engines. Bus bandwidth is
``bytes * (W - 1) / W / time`` (what each rank moves over its links). Rank 0 prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist

from gem_parallel.collectives import process_group_kwargs, resolve_collectives

SIZES_MIB = (1, 4, 16, 64, 256)


def _timed(op, iterations: int) -> float:
    """Median milliseconds of ``op`` over ``iterations`` (after warm-up), on a side stream: NCCL 2.28's copy
    engines refuse the legacy default stream."""
    stream = torch.cuda.Stream()
    times = []
    with torch.cuda.stream(stream):
        for _ in range(3):
            op()
        for _ in range(iterations):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            op()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _gpu_footprint(op) -> dict:
    """Kernels (with their thread blocks: the SMs they hold) and peer copies one call of ``op`` puts on the GPU."""
    from torch.profiler import ProfilerActivity, profile

    stream = torch.cuda.Stream()
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.cuda.stream(stream):
        op()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    blocks = [int(e.get("args", {}).get("grid", [0])[0]) * max(1, int(e.get("args", {}).get("grid", [1, 1])[1]))
              for e in kernels]
    return {"kernels": sorted({e["name"][:60] for e in kernels}), "thread_blocks": max(blocks, default=0),
            "copies": sorted({e["name"] for e in copies})}


def run(iterations: int = 20) -> list[dict]:
    import torch.distributed._symmetric_memory as symm_mem

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    symm_mem.set_backend("NCCL")

    def symmetric(n: int) -> torch.Tensor:
        t = symm_mem.empty(n, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(t, group.group_name)
        return t

    rows = []
    for mib in SIZES_MIB:
        n = mib * 2**20 // 2  # bf16 elements of the gathered output / the all-to-all buffer
        plain = {"ag_in": torch.randn(n // world, device=device, dtype=torch.bfloat16),
                 "ag_out": torch.empty(n, device=device, dtype=torch.bfloat16),
                 "a2a_in": torch.randn(n, device=device, dtype=torch.bfloat16),
                 "a2a_out": torch.empty(n, device=device, dtype=torch.bfloat16)}
        shared = {"ag_in": symmetric(n // world), "ag_out": symmetric(n), "a2a_in": symmetric(n), "a2a_out": symmetric(n)}
        shared["ag_in"].copy_(plain["ag_in"])
        shared["a2a_in"].copy_(plain["a2a_in"])
        for collective in ("all_gather", "all_to_all"):
            row = {"collective": collective, "mib": mib}
            for path, buffers in (("nccl", plain), ("copy_engine", shared)):
                if collective == "all_gather":
                    op = lambda b=buffers: dist.all_gather_into_tensor(b["ag_out"], b["ag_in"], group=group)  # noqa: E731
                else:
                    op = lambda b=buffers: dist.all_to_all_single(b["a2a_out"], b["a2a_in"], group=group)  # noqa: E731
                ms = _timed(op, iterations)
                row[f"{path}_ms"] = ms
                row[f"{path}_bus_gb_per_s"] = n * 2 * (world - 1) / world / (ms / 1e3) / 1e9
                row[f"{path}_gpu"] = _gpu_footprint(op)
            out = "ag_out" if collective == "all_gather" else "a2a_out"
            row["same_result"] = bool(torch.equal(plain[out], shared[out]))
            rows.append(row)
    if rank == 0:
        print(f"{'collective':<12}{'MiB':>6}{'nccl GB/s':>11}{'CE GB/s':>10}{'nccl blocks':>13}{'CE kernels':>12}")
        for r in rows:
            print(f"{r['collective']:<12}{r['mib']:>6}{r['nccl_bus_gb_per_s']:>11.1f}{r['copy_engine_bus_gb_per_s']:>10.1f}"
                  f"{r['nccl_gpu']['thread_blocks']:>13}{len(r['copy_engine_gpu']['kernels']):>12}")
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gem_parallel.bench_collectives", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    world = int(os.environ.get("WORLD_SIZE", 1))
    chosen = resolve_collectives("copy_engine", device, ranks=world)
    if not chosen.copy_engine:
        raise SystemExit(f"copy-engine collectives unavailable here: {chosen.fallback}")
    dist.init_process_group("nccl", **process_group_kwargs(chosen, device))
    rows = run(args.iterations)
    if dist.get_rank() == 0:
        doc = {"world_size": dist.get_world_size(), "nccl": ".".join(map(str, torch.cuda.nccl.version())), "rows": rows}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
