"""A rank's empty share of a batch: held-out rows that leave the last global batch shorter than the ranks give some
rank a batch of no rows, which every model and the step's loss take (an empty output, no NaN in the global loss)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from gem_data import SyntheticConfig, SyntheticGenerator, write_parquet
from gem_data.batch_ops import select_examples
from gem_trainer.config import load_config
from gem_trainer.distributed import init_distributed, shutdown_distributed
from gem_trainer.trainer import Trainer

folder = Path(sys.argv[1])
env = init_distributed("cpu", "gloo")
if env.rank == 0:
    generator = SyntheticGenerator(SyntheticConfig(num_ads=200, max_events=8))
    write_parquet((generator.batch(i, 64) for i in range(2)), generator.spec, folder / "train.parquet")
    # 9 rows in global batches of 2 x 4: the last holds 1 row, rank 1's share of it none
    write_parquet([generator.batch(0, 9, split="eval")], generator.spec, folder / "eval.parquet")
dist.barrier()
try:
    for model in sys.argv[2:]:
        config = load_config(None, [
            f"--run_dir={folder / model}", "--data.batch_size=4", "--metrics.tensorboard=false", "--device=cpu",
            "--schedule.steps=2", "--schedule.warmup_steps=1", "--checkpoint.enable=false", "--metrics.progress_bar=false",
            "--data.source=parquet", f"--data.path={folder / 'train.parquet'}", f"--data.eval_path={folder / 'eval.parquet'}",
            f"--model.name={model}"])
        trainer = Trainer(config, env)
        counts = trainer.evaluate()["click/all/count"]
        # a training step's loss where rank 1 holds no example: the global loss is rank 0's, not NaN
        batch = next(iter(trainer.data.train))
        if env.rank == 1:
            batch = select_examples(batch, torch.zeros(0, dtype=torch.int64))
        local = torch.tensor(1.5) if env.rank == 0 else torch.tensor(float("nan"))
        _, global_loss = trainer._weighted_by_share(local, batch)
        print(f"rank {env.rank} {model} count {counts} global {float(global_loss)}", flush=True)
        trainer.close()
finally:
    shutdown_distributed()
"""


def test_every_model_evaluates_with_a_rank_whose_last_held_out_share_is_empty(tmp_path):
    script = tmp_path / "empty_share.py"
    script.write_text(SCRIPT)
    models = ["kunlun", "interformer", "domain_experts", "baseline"]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
                          str(tmp_path), *models], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in (0, 1):
        for model in models:
            assert f"rank {rank} {model} count 9.0 global 1.5" in run.stdout, run.stdout[-3000:]
