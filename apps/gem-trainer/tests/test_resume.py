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

STEPS = 160
ARGS = [
    f"--schedule.steps={STEPS}",
    "--schedule.warmup_steps=10",
    "--checkpoint.every_steps=20",
    "--checkpoint.keep_latest=3",
    "--metrics.log_every=10",
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


@pytest.mark.slow
def test_sigkill_and_resume_matches_an_uninterrupted_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    subprocess.run(train_command(straight), check=True, env=env, capture_output=True, timeout=600)

    process = subprocess.Popen(train_command(interrupted), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = interrupted / "checkpoints" / "step-40" / "COMPLETE"
    deadline = time.time() + 300
    while not marker.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (interrupted / "checkpoints" / f"step-{STEPS}").exists()

    resumed = subprocess.run(train_command(interrupted), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout

    assert final_loss(interrupted) == final_loss(straight)
    assert_same_tensors(final_state(interrupted, tmp_path), final_state(straight, tmp_path))
