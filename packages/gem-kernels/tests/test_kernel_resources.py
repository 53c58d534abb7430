"""kernel_resources: the attention kernels' sm_90 builds read from this CPU (registers, spills, shared memory)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from gem_kernels.ops.benchmarks.kernel_resources import ctas_per_sm

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def test_programs_per_sm_take_the_tightest_limit():
    # 128 registers x 4 warps: 16,384 registers a program, four fit; shared memory and warps allow more
    assert ctas_per_sm(128, 0, 4) == (4, "registers")
    # registers are handed out per warp in steps of 256: 255 a thread takes 256, as 249 does
    assert ctas_per_sm(255, 0, 4) == ctas_per_sm(249, 0, 4) == (2, "registers")
    assert ctas_per_sm(248, 0, 4) == (2, "registers")  # 248 * 32 * 4 = 31,744: still two (65,536 / 31,744)
    assert ctas_per_sm(160, 0, 4) == (3, "registers")
    # 100 KiB of shared memory and 1 KiB reserved each: two programs in 228 KiB
    assert ctas_per_sm(64, 100 * 1024, 4) == (2, "shared memory")
    # both at two: both named
    assert ctas_per_sm(255, 115712, 4) == (2, "registers + shared memory")
    assert ctas_per_sm(32, 1024, 8) == (8, "registers + warps")
    assert ctas_per_sm(16, 0, 1) == (32, "programs")


@pytest.mark.skipif(not (TOOLS / "cuobjdump").exists() or not (TOOLS / "nvdisasm").exists(),
                    reason="Triton's bundled CUDA tools (cuobjdump, nvdisasm) are not in this install")
def test_jfa_kernels_build_for_sm90_with_the_shipped_h100_configs(tmp_path):
    """The JFA case's three kernels, recorded as the benchmark shape plans them (a grid over the real tiles of 256
    sequences, tensor descriptors) and built with the H100 file's tile configs; FP8 JFA's forward as planned on a GPU
    (its first GPU candidate, the GPU's casts: not the interpreter's)."""
    out = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "gem_kernels.ops.benchmarks.kernel_resources", "--device", "NVIDIA H100 80GB HBM3",
               "--families", "jfa_self,jfa_self_fp8", "--out", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["meta"]["target"] == "sm_90" and result["meta"]["configs_of"] == "NVIDIA H100 80GB HBM3"
    rows = {r["kernel"]: r for r in result["rows"] if r["family"] == "jfa_self"}
    assert set(rows) == {"attn_fwd_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"}
    (fp8,) = [r for r in result["rows"] if r["kernel"] == "attn_fwd_fp8_kernel"]
    assert fp8["family"] == "jfa_self_fp8" and fp8["config_from"] == "first candidate"
    assert fp8["constexprs"]["EXACT_CAST"] is False and fp8["constexprs"]["BLOCK_M"] >= 64
    assert fp8["sass"]["QGMMA"] > 0 and fp8["sass"]["HGMMA"] == 0  # FP8 warpgroup MMAs
    shipped = json.loads((Path(__file__).parents[1] / "src" / "gem_kernels" / "ops" / "triton" / "tuned" /
                          "nvidia-h100-80gb-hbm3.json").read_text())
    for r in rows.values():
        assert r["config_from"] == "nvidia-h100-80gb-hbm3.json"
        assert r["constexprs"]["COMPACT"] is True and r["constexprs"]["SEQS"] == 256 and r["constexprs"]["TMA"] is True
        assert 0 < r["regs"] <= 255 and r["shared_bytes"] > 0 and r["sass"]["HGMMA"] > 0
        assert (r["ctas_per_sm"], r["limited_by"]) == ctas_per_sm(r["regs"], r["shared_bytes"], r["num_warps"])
    fwd = rows["attn_fwd_kernel"]
    config = shipped["('fwd', 0, 0, True, False, 128, torch.bfloat16, 4096, 4096, None, True, True)"]
    assert (fwd["constexprs"]["BLOCK_M"], fwd["constexprs"]["BLOCK_N"]) == (config["BLOCK_M"], config["BLOCK_N"])
    assert (fwd["num_warps"], fwd["num_stages"]) == (config["num_warps"], config["num_stages"])
