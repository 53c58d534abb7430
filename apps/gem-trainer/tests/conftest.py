"""Fixtures shared by the trainer's tests."""

import sys
from pathlib import Path

import pytest

from gem_trainer.config import load_config
from gem_trainer.distributed import init_distributed
from gem_trainer.run_folder import write_run_record
from gem_trainer.trainer import Trainer

# NOTE: the suite runs with --import-mode=importlib, which puts nothing on sys.path: the helpers module the parity
# test files share (uniquely named: the whole workspace's tests run in one process) is found through this folder
sys.path.insert(0, str(Path(__file__).resolve().parent))

# a small two-tower Kunlun retriever on next-item data: the teacher of the top-k and LoopFM tests
RETRIEVAL = ["--data.batch_size=16", "--metrics.tensorboard=false", "--device=cpu", "--schedule.warmup_steps=2",
             "--metrics.progress_bar=false", "--data.source=sequence_text", "--model.name=kunlun",
             "--model.kunlun.two_tower=true", "--model.kunlun.max_seq_len=16", "--data.sequential.max_history=12",
             "--data.sequential.objective=retrieval", "--data.sequential.queries=last", "--data.sequential.loss=softmax",
             "--data.sequential.eval_protocols=[\"sampled\"]", "--data.sequential.eval_negatives=20"]


@pytest.fixture(scope="session")
def retrieval_teacher(tmp_path_factory):
    """``(folder, data overrides)``: a small next-item corpus (80 users with 5 to 12 items out of 60; times are
    positions) and, in ``folder / "teacher"``, a Kunlun two-tower teacher trained on it against the whole
    catalogue (12 steps)."""
    folder = tmp_path_factory.mktemp("retrieval-teacher")
    lines = [f"{u} " + " ".join(str(1 + (u * 7 + 3 * k + k * k) % 60) for k in range(5 + u % 8)) for u in range(1, 81)]
    (folder / "corpus.txt").write_text("\n".join(lines) + "\n")
    data = [f"--data.path={folder / 'corpus.txt'}", *RETRIEVAL]
    config = load_config(None, [f"--run_dir={folder / 'teacher'}", "--schedule.steps=12", "--data.sequential.num_negatives=0", *data])
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    write_run_record(config, trainer.spec)
    trainer.train()
    trainer.close()
    return folder, data
