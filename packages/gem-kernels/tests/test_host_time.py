"""The host-time benchmark runs without a GPU (the ops' Python path, launches stubbed) and writes its table."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import triton_on_cpu


@triton_on_cpu
def test_host_time_times_every_op_forward_and_backward(tmp_path):
    src = Path(__file__).resolve().parents[1] / "src"
    out = tmp_path / "host.json"
    # NOTE: a process of its own: the benchmark replaces the launcher of every kernel for the rest of its process
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "gem_kernels.ops.benchmarks.host_time", "--out", str(out), "--calls", "10"],
                   check=True, env=env, timeout=600, capture_output=True)
    result = json.loads(out.read_text())
    assert "launches stubbed" in result["meta"]["device"] and result["meta"]["commit"]
    ops = {row["op"] for row in result["rows"]}
    assert {"gdpa cross, 16 keys", "gdpa pma, 8 queries", "block_attention 16 x 1", "layer_norm",
            "reference: torch add"} <= ops
    assert all(row["fwd_us"] > 0 and row["fwd_bwd_us"] > 0 and row["fwd_bwd_calling_thread_us"] > 0
               for row in result["rows"])
