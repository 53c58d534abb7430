"""Which grid the attention kernels should run: over the real tiles, or one program per declared tile.

The general kernels (and the one-key-tile forward) launch either a grid over the real tiles of a batch (each program
finds its sequence among the offsets) or one sized by the declared max length, whose programs past a sequence's end
exit at once. The first pays where the sequences fill little of their declared lengths; where they fill them, it
saves no program. This times each policy in one process, alternating, on sequences far shorter than declared (the
run_all JFA batches) and on sequences of the declared length (run_all's BlockAttention cases):

- ``real``: the grid over the real tiles whenever the batch has at most ``COMPACT_MAX_SEQS`` sequences;
- ``declared``: always the declared grid;
- ``chosen``: what the ops pick (``_sparse_grid``: the real tiles below ``COMPACT_FILL`` of the declared rows).

    PYTHONPATH=packages/gem-kernels/src python -m gem_kernels.ops.benchmarks.grid_choice --out grid-choice.json

Rows: wall milliseconds per call (back to back) and the GPU time of the call's kernels (profiler), per kernel too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys

import torch

from gem_kernels import block_attention, jagged_flash_attention
from gem_kernels.ops.benchmarks.provenance import git_commit
from gem_kernels.ops.benchmarks.run_all import bench_ms, fwd_bwd, kernel_times, lognormal_lengths, offsets, randn
from gem_kernels.ops.triton import _tuning
from gem_kernels.ops.triton import triton_attention as ta

H, D = 4, 128
POLICIES = ("real", "declared", "chosen")


def cases() -> dict:
    """name -> (call, inputs to differentiate, the share of the declared rows the sequences fill)."""
    torch.manual_seed(0)
    blocks = offsets([8192] * 8)
    bq, bk, bv = (randn(8 * 8192, H, D, grad=True) for _ in range(3))
    lens = lognormal_lengths(256, 512, 4096)
    off = offsets(lens)
    q, k, v = (randn(int(off[-1]), H, D, grad=True) for _ in range(3))
    jfa_fill = sum(lens) / (256 * 4096)
    return {
        "block_w512 B=8 L=8192": (lambda: block_attention(bq, bk, bv, blocks, 64, 8, max_seq_len=8192, kernel="triton",
                                                          validate=False), [bq, bk, bv], 1.0),
        "block_w64 B=8 L=8192": (lambda: block_attention(bq, bk, bv, blocks, 64, 1, max_seq_len=8192, kernel="triton",
                                                         validate=False), [bq, bk, bv], 1.0),
        "jfa_self B=256 mean=512 max=4096": (lambda: jagged_flash_attention(q, k, v, off, 4096, kernel="triton",
                                                                            validate=False), [q, k, v], jfa_fill),
        "jfa_causal B=256 mean=512 max=4096": (lambda: jagged_flash_attention(q, k, v, off, 4096, causal=True,
                                                                              kernel="triton", validate=False),
                                               [q, k, v], jfa_fill),
    }


def use(policy: str, defaults: tuple[int, float]) -> None:
    """The ops take ``policy``'s grids from their next call on (their plans are made again)."""
    max_seqs, fill = defaults
    if policy == "declared":
        ta.COMPACT_MAX_SEQS, ta.COMPACT_FILL = 0, fill
    else:
        ta.COMPACT_MAX_SEQS, ta.COMPACT_FILL = max_seqs, math.inf if policy == "real" else fill
    _tuning._PLANS.clear()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=2, help="rounds of every policy, one after the other")
    a = p.parse_args(argv)
    import triton

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m gem_kernels.ops.benchmarks.grid_choice " + " ".join(argv or sys.argv[1:]),
            "H": H, "D": D, "compact_max_seqs": ta.COMPACT_MAX_SEQS, "compact_fill": ta.COMPACT_FILL}
    defaults = (ta.COMPACT_MAX_SEQS, ta.COMPACT_FILL)
    calls, rows = cases(), []
    print(f"{'round':>5s} {'policy':9s} {'case':36s} {'pass':8s} {'wall ms':>9s} {'kernels ms':>11s}")
    for round_ in range(a.rounds):
        for policy in POLICIES:
            use(policy, defaults)
            for name, (call, inputs, fill) in calls.items():
                for pas in ("fwd", "fwd+bwd"):
                    run = call if pas == "fwd" else fwd_bwd(call, inputs)
                    by_kernel = kernel_times(run)
                    row = {"round": round_, "policy": policy, "case": name, "fill": round(fill, 3), "pass": pas,
                           "wall_ms": round(bench_ms(run), 4), "kernel_ms": round(sum(by_kernel.values()), 4),
                           "by_kernel": {k: round(t, 4) for k, t in by_kernel.items()}}
                    rows.append(row)
                    print(f"{round_:5d} {policy:9s} {name:36s} {pas:8s} {row['wall_ms']:9.4f} {row['kernel_ms']:11.4f}",
                          flush=True)
    use("chosen", defaults)
    summary = []
    for name in calls:
        for pas in ("fwd", "fwd+bwd"):
            medians = {policy: statistics.median(r["kernel_ms"] for r in rows if (r["case"], r["pass"], r["policy"]) ==
                                                 (name, pas, policy)) for policy in POLICIES}
            summary.append({"case": name, "pass": pas, "kernel_ms_median": medians})
            print(f"{name:36s} {pas:8s} " + "  ".join(f"{p} {m:.4f}" for p, m in medians.items()))
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
