"""A training process SIGKILLed mid-run and restarted ends with exactly the weights and loss of a run that
was never interrupted."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

STEPS = 40
ARGS = [
    f"--schedule.steps={STEPS}",
    "--schedule.warmup_steps=5",
    "--checkpoint.every_steps=10",
    "--checkpoint.keep_latest=3",
    "--metrics.log_every=5",
    "--metrics.tensorboard=false",
    "--data.batch_size=128",
    "--data.eval_batches=2",
    "--deterministic=true",
    "--device=cpu",
]


def train_command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "gem_trainer.cli", "train", f"--run_dir={run_dir}", *ARGS]


def final_state(run_dir: Path, tmp_path: Path) -> dict:
    out = tmp_path / f"{run_dir.name}.pt"
    dcp_to_torch_save(str(run_dir / "checkpoints" / f"step-{STEPS}"), str(out))
    return torch.load(out, weights_only=False)


def final_loss(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["phase"] == "train" and r["step"] == STEPS][-1]["loss"]


def assert_same_tensors(a, b, where=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_tensors(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs"
    else:
        assert a == b, where


def kill_after_checkpoint(command: list[str], run_dir: Path, step: int, env: dict) -> None:
    """Start a training run and SIGKILL it as soon as its checkpoint of ``step`` is complete."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = run_dir / "checkpoints" / f"step-{step}" / "COMPLETE"
    deadline = time.time() + 300
    while not marker.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL, "the run ended before it could be killed"


@pytest.mark.slow
def test_sigkill_and_resume_matches_an_uninterrupted_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    subprocess.run(train_command(straight), check=True, env=env, capture_output=True, timeout=600)

    kill_after_checkpoint(train_command(interrupted), interrupted, 20, env)
    assert not (interrupted / "checkpoints" / f"step-{STEPS}").exists()

    resumed = subprocess.run(train_command(interrupted), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout

    assert final_loss(interrupted) == final_loss(straight)
    assert_same_tensors(final_state(interrupted, tmp_path), final_state(straight, tmp_path))


@pytest.mark.slow
def test_a_compiled_sasrec_resumes_exactly(tmp_path):
    """``parallelism.compile`` (beauty-sasrec.toml's) keeps the exact resume: compiled dropout draws its masks
    from the generators a checkpoint restores."""
    from gem_data.testing import find_repo_root, shared_data_dir

    beauty = shared_data_dir(find_repo_root(Path(__file__))) / "beauty"
    if not beauty.is_dir():
        pytest.skip(f"shared real data not found at {beauty} (expected ../shared/data beside the repository)")
    config = Path(__file__).resolve().parents[1] / "configs" / "beauty-sasrec.toml"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def command(run_dir: Path) -> list[str]:
        return [sys.executable, "-m", "gem_trainer.cli", "train", f"--config={config}", f"--data.path={beauty}",
                f"--run_dir={run_dir}", "--schedule.steps=8", "--schedule.warmup_steps=1", "--checkpoint.every_steps=4",
                "--data.batch_size=64", "--eval.at_end=false", "--metrics.log_every=1", "--metrics.tensorboard=false",
                "--deterministic=true", "--device=cpu"]

    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    subprocess.run(command(straight), check=True, env=env, capture_output=True, timeout=600)
    kill_after_checkpoint(command(interrupted), interrupted, 4, env)
    resumed = subprocess.run(command(interrupted), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    losses = [[(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if r["phase"] == "train" and r["step"] > 4] for run in (straight, interrupted)]
    assert len(losses[0]) == 4 and losses[1][-4:] == losses[0]
