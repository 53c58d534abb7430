"""Host time of one attention call: what the CPU spends issuing it (Python, allocations, launches, autograd) while
the GPU is kept busy, for gem and the fast peers, on ``run_all``'s short cases.

A call whose host time exceeds the GPU time of its kernels is bound by the host: the GPU waits between calls, and
its wall time in ``run_all`` follows the host CPU of the machine lent rather than the kernels. This measures that
side alone.

    PYTHONPATH=packages/gem-kernels/src python -m gem_kernels.ops.benchmarks.host_time --out host-time.json

Each measurement enqueues a spin kernel (``torch.cuda._sleep``) long enough to cover the calls, times ``--calls``
calls on the host without synchronising, then synchronises; the median over ``--repeats`` is reported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch

from gem_kernels.ops.benchmarks.provenance import git_commit
from gem_kernels.ops.benchmarks.run_all import H, D, fwd_bwd, lognormal_lengths, offsets, randn, varlen

SPIN_CYCLES = int(4e9)  # ~2 s of GPU clock: far longer than the timed calls' host time


def host_us(run, calls: int, repeats: int) -> float:
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda._sleep(SPIN_CYCLES)
        start = time.perf_counter()
        for _ in range(calls):
            run()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def cases() -> dict[str, dict[str, tuple]]:
    """case -> impl -> (call, inputs to differentiate): run_all's shapes."""
    from gem_kernels import block_attention, gdpa, jagged_flash_attention

    out = {}
    lens = lognormal_lengths(256, 512, 4096)
    qo = offsets(lens)
    Tq = int(qo[-1])
    q = randn(Tq, H, D, scale=0.3, grad=True)
    k, v = randn(Tq, H, D, scale=0.3, grad=True), randn(Tq, H, D, grad=True)
    cu = qo.to(torch.int32)
    out["jfa_self B=256 mean=512"] = {
        "gem": (lambda: jagged_flash_attention(q, k, v, qo, 4096, kernel="triton", validate=False), [q, k, v]),
        "varlen_attn": (lambda: varlen(q, k, v, cu, cu, max(lens), max(lens)), [q, k, v])}
    ko = offsets([16] * 256)
    k16, v16 = randn(256 * 16, H, D, scale=0.3, grad=True), randn(256 * 16, H, D, grad=True)
    cu16 = ko.to(torch.int32)
    out["cross_kv16 softmax"] = {
        "gem": (lambda: gdpa(q, k16, v16, qo, ko, max_seq_len_q=4096, max_seq_len_kv=16, kernel="triton",
                             validate=False), [q, k16, v16]),
        "varlen_attn": (lambda: varlen(q, k16, v16, cu, cu16, max(lens), 16), [q, k16, v16])}
    seeds = randn(32, H, D, scale=0.3, grad=True)
    repeated = seeds.detach().repeat(256, 1, 1).requires_grad_()
    cu_q = torch.arange(0, 257 * 32, 32, device="cuda", dtype=torch.int32)
    out["pma_q32 softmax"] = {
        "gem": (lambda: gdpa(seeds, k, v, None, qo, max_seq_len_kv=4096, kernel="triton", validate=False),
                [seeds, k, v]),
        "varlen_attn": (lambda: varlen(repeated, k, v, cu_q, cu, 32, max(lens)), [repeated, k, v])}
    bq, bk, bv = (randn(8 * 8192, H, D, grad=True) for _ in range(3))
    bo = offsets([8192] * 8)
    blocks = [x.detach().view(-1, 64, H, D).transpose(1, 2).requires_grad_() for x in (bq, bk, bv)]
    out["block_w64 B=8 L=8192"] = {
        "gem": (lambda: block_attention(bq, bk, bv, bo, 64, 1, max_seq_len=8192, kernel="triton", validate=False),
                [bq, bk, bv]),
        "sdpa_batched_blocks": (lambda: torch.nn.functional.scaled_dot_product_attention(*blocks), blocks)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    import triton

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m gem_kernels.ops.benchmarks.host_time " + " ".join(argv or sys.argv[1:]),
            "calls": a.calls, "repeats": a.repeats, "H": H, "D": D, "dtype": "bfloat16"}
    rows = []
    print(f"{'case':26s} {'impl':20s} {'pass':8s} {'host us/call':>12s}")
    for case, impls in cases().items():
        for impl, (call, inputs) in impls.items():
            for pas in ("fwd", "fwd+bwd"):
                us = host_us(call if pas == "fwd" else fwd_bwd(call, inputs), a.calls, a.repeats)
                rows.append({"case": case, "impl": impl, "pass": pas, "host_us": round(us, 1)})
                print(f"{case:26s} {impl:20s} {pas:8s} {us:12.1f}", flush=True)
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
