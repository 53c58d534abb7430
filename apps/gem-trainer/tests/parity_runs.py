"""What the distributed-parity tests share: the synthetic runs' settings, a run through the command line (one
process, or ``gem-trainer launch`` of N Gloo ranks with the global batch split over them), and what two runs are
compared on (every step's loss, every tensor of the final checkpoint, the evaluation)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

STEPS, GLOBAL_BATCH = 20, 32
BASE = [
    "--device=cpu", "--metrics.tensorboard=false", "--metrics.progress_bar=false", "--metrics.log_every=1",
    f"--schedule.steps={STEPS}", "--schedule.warmup_steps=2", "--checkpoint.every_steps=10", "--data.eval_batches=4",
    "--data.synthetic.max_events=24", "--model.kunlun.capacity_factor=1.0",
    # NOTE: checkpoints written by the training process itself: an asynchronous save's writer process costs each rank a
    # torch import (seconds of CPU, more than these runs' saves); ``ASYNCHRONOUS`` puts it back where a test needs it
    "--checkpoint.asynchronous=false",
]
ASYNCHRONOUS = "--checkpoint.asynchronous=true"
# with plain SGD on the tables, averaging 2-D sparse replicas equals one process exactly (Adagrad is not linear);
# two of the three surfaces trained on: the ranks' shares of a global batch differ in size
SGD = ["--optimizer.sparse=sgd", "--optimizer.sparse_lr=0.5", "--model.kunlun.capacity_factor=0",
       "--data.train_surfaces=[0,1]"]


def train(run_dir: Path, ranks: int, *overrides: str) -> subprocess.CompletedProcess:
    batch = f"--data.batch_size={GLOBAL_BATCH // ranks}"
    command = [sys.executable, "-m", "gem_trainer.cli", "launch", "--nproc-per-node", str(ranks)] if ranks > 1 \
        else [sys.executable, "-m", "gem_trainer.cli", "train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the synthetic data's settings only where the data is synthetic (a config reading files refuses them)
    base = [item for item in BASE if not item.startswith("--data.synthetic.")] if any(
        item.startswith("--data.path=") for item in overrides) else BASE
    done = subprocess.run([*command, f"--run_dir={run_dir}", *base, batch, *overrides], capture_output=True, text=True,
                          timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["phase"] == "train"]


def final_state(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model and both optimizers), gathered whatever its layout."""
    path = run_dir / f"state-{step}.pt"
    if not path.exists():
        dcp_to_torch_save(run_dir / "checkpoints" / f"step-{step}", path)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            flat[prefix] = value
    walk("", torch.load(path, weights_only=False))
    return flat


def assert_close_states(mine: dict, expected: dict, tolerance: float = 1e-3) -> None:
    """Same tensors, each within ``tolerance`` of its own scale.

    NOTE: the scale is per tensor because Adam divides by the root of the squared gradients: where the
    exact gradient is zero (the key bias of softmax attention), float32 rounding that differs with the
    summation order becomes an lr-sized update, ~1e-4 of the tensor's scale after 20 steps.
    """
    assert sorted(mine) == sorted(expected)
    for key, value in expected.items():
        assert mine[key].shape == value.shape, key
        if not value.numel():  # an empty projection (data without dense features)
            continue
        error = float((mine[key] - value).abs().max())
        assert error <= tolerance * float(value.abs().max()) + 1e-6, f"{key}: max |difference| {error:.3g}"


def assert_same_run(run: Path, reference: Path) -> None:
    ours, theirs = losses(run), losses(reference)
    assert len(ours) == len(theirs) == STEPS
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=2e-5, atol=2e-6)
    assert_close_states(final_state(run), final_state(reference))
    evaluated = json.loads((run / "eval.json").read_text())
    wanted = json.loads((reference / "eval.json").read_text())
    for key in ("click/all/auc", "click/all/ne", "conversion/all/auc"):
        assert evaluated[key] == pytest.approx(wanted[key], rel=1e-4), key


def logged(run_dir: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if r["phase"] == "train"]
