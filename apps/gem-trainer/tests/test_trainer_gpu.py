"""The trainer's GPU input path (runs where a CUDA device is; the benchmark sweeps run it on the H200)."""

import math

import pytest
import torch

from gem_trainer.config import load_config
from gem_trainer.distributed import init_distributed
from gem_trainer.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_batches_reach_the_gpu_from_page_locked_memory_and_train(tmp_path):
    config = load_config(None, [f"--run_dir={tmp_path}", "--device=cuda", "--data.batch_size=64", "--data.eval_batches=1",
                                "--metrics.tensorboard=false", "--checkpoint.enable=false"])
    trainer = Trainer(config, init_distributed(config.device, config.parallelism.collectives))
    try:
        host = next(trainer._batches)
        tensors = [host.dense, host.labels, host.surface, host.sparse.values(), host.sparse.lengths()]
        for seq in host.sequences.values():
            tensors += [seq.timestamps, seq.ids.values(), seq.ids.lengths()]
        assert all(t.is_pinned() for t in tensors)
        copied = host.to(trainer.env.device, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(copied.dense.cpu(), host.dense) and torch.equal(copied.sparse.values().cpu(), host.sparse.values())
        losses = [float(trainer.train_step()["loss"]) for _ in range(3)]
        assert all(math.isfinite(x) for x in losses)
    finally:
        trainer.close()
