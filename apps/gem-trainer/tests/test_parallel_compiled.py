"""Compiled training against eager training: ``parallelism.compile`` (each Kunlun layer, or SASRec's blocks
with CUDA graphs where a GPU runs them) and ``parallelism.compile_experts`` (each MoE alone) train and evaluate as
the eager modules do, and the compiled graphs are shared through a cache folder between jobs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity_runs import BASE, losses

pytestmark = pytest.mark.slow


def test_compiled_blocks_equal_eager_blocks(tmp_path):
    """``parallelism.compile`` (torch.compile of each Kunlun layer, inductor on the CPU) on a small model."""
    small = ["--schedule.steps=2", "--schedule.warmup_steps=1", "--eval.at_end=false", "--checkpoint.enable=false",
             "--model.kunlun.num_layers=1", "--model.kunlun.d_model=16", "--data.synthetic.max_events=8"]
    eager, compiled, again = tmp_path / "eager", tmp_path / "compiled", tmp_path / "again"
    shared = ["--parallelism.compile=true", f"--parallelism.compile_cache_dir={tmp_path / 'cache'}"]
    cached: list[dict[str, int]] = []
    for run, extra in ((eager, []), (compiled, shared), (again, shared)):
        subprocess.run([sys.executable, "-m", "gem_trainer.cli", "train", f"--run_dir={run}", *BASE, *small,
                        "--data.batch_size=16", *extra], check=True, capture_output=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        # NOTE: lock files are not entries: torch 2.11's inductor takes (and so touches) them when it reads one
        cached.append({str(f.relative_to(tmp_path)): f.stat().st_mtime_ns for f in (tmp_path / "cache").rglob("*")
                       if f.is_file() and "locks" not in f.relative_to(tmp_path).parts})
    torch.testing.assert_close(torch.tensor(losses(compiled)), torch.tensor(losses(eager)), rtol=1e-5, atol=1e-6)
    # the compiled graphs went to the shared folder, and the second job loaded them: a graph compiled again would
    # have rewritten its entry
    assert any(f.startswith("cache/inductor/") for f in cached[1])
    assert cached[2] == cached[1]
    torch.testing.assert_close(torch.tensor(losses(again)), torch.tensor(losses(compiled)), rtol=0, atol=0)


def test_compiled_experts_equal_eager_experts(tmp_path):
    """``parallelism.compile_experts`` (torch.compile of each MoE alone, inductor on the CPU) trains as the eager
    MoEs do (routing under capacity, slot dispatch and batched experts included) and evaluates as they do
    (evaluation keeps every assignment: the experts gather theirs by mask, shapes the compiled MoE leaves eager)."""
    small = ["--schedule.steps=3", "--schedule.warmup_steps=1", "--data.eval_batches=2", "--checkpoint.enable=false",
             "--model.kunlun.num_layers=1", "--model.kunlun.d_model=16", "--data.synthetic.max_events=8"]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    for run, extra in ((eager, ["--parallelism.compile_experts=off"]), (compiled, ["--parallelism.compile_experts=on"])):
        subprocess.run([sys.executable, "-m", "gem_trainer.cli", "train", f"--run_dir={run}", *BASE, *small,
                        "--data.batch_size=16", *extra], check=True, capture_output=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    torch.testing.assert_close(torch.tensor(losses(compiled)), torch.tensor(losses(eager)), rtol=1e-5, atol=1e-6)
    evaluated, wanted = (json.loads((run / "eval.json").read_text()) for run in (compiled, eager))
    assert evaluated.keys() == wanted.keys() and wanted
    for key, value in wanted.items():
        if "/" in key:  # the metrics (not the timings); NaN where a surface's few examples hold one class (no AUC)
            assert evaluated[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), key


def beauty_sasrec(tmp_path: Path, device: str, *overrides: str) -> list[str]:
    """SASRec on Beauty for a few steps and a small evaluation, without dropout (whose masks compiled code draws
    differently): each run's output."""
    from gem_data.testing import find_repo_root, shared_data_dir

    beauty = shared_data_dir(find_repo_root(Path(__file__))) / "beauty"
    if not beauty.is_dir():
        pytest.skip(f"shared real data not found at {beauty} (expected ../shared/data beside the repository)")
    config = Path(__file__).resolve().parents[1] / "configs" / "beauty-sasrec.toml"
    common = [f"--config={config}", f"--data.path={beauty}", f"--device={device}", "--metrics.tensorboard=false",
              "--metrics.log_every=1", "--schedule.steps=6", "--schedule.warmup_steps=1", "--checkpoint.enable=false",
              "--model.sasrec.dropout=0", "--data.sequential.eval_users=100",
              '--data.sequential.eval_protocols=["sampled"]']
    outputs = []
    for run, extra in (("eager", []), ("compiled", ["--parallelism.compile=reduce-overhead"])):
        done = subprocess.run([sys.executable, "-m", "gem_trainer.cli", "train", f"--run_dir={tmp_path / run}", *common,
                               *overrides, *extra], capture_output=True, text=True, timeout=900,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        outputs.append(done.stdout + done.stderr)
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "compiled")), torch.tensor(losses(tmp_path / "eager")),
                               rtol=1e-4, atol=1e-5)
    evaluated, wanted = (json.loads((tmp_path / run / "eval.json").read_text()) for run in ("compiled", "eager"))
    assert evaluated["sampled/ndcg@10"] == pytest.approx(wanted["sampled/ndcg@10"], abs=2e-3)
    return outputs


def test_sasrec_blocks_compiled_to_cuda_graphs_train_as_eager_blocks(tmp_path):
    """``parallelism.compile = "reduce-overhead"`` trains and evaluates SASRec as the eager blocks do (on the CPU
    the blocks are compiled without graphs)."""
    beauty_sasrec(tmp_path, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_sasrec_blocks_replay_as_cuda_graphs_on_a_gpu(tmp_path):
    """On a GPU with the padded layout (fixed shapes), every block runs as CUDA graphs: inductor skips none."""
    _, compiled = beauty_sasrec(tmp_path, "cuda", "--model.sasrec.layout=padded")
    assert "skipping cudagraphs" not in compiled, compiled[-3000:]
