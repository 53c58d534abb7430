"""``ReadAhead`` at depth 0 (``data.read_ahead = false``: no thread) hands out what it hands out at depth 2, records
the same state, and a trainer reading in the step trains exactly as one reading ahead."""

import itertools

import pytest
import torch

from gem_data import ReadAhead, SyntheticConfig, SyntheticGenerator, SyntheticStream
from gem_data.testing import equal_batches
from gem_trainer.config import load_config
from gem_trainer.distributed import init_distributed
from gem_trainer.trainer import Trainer


@pytest.fixture(scope="module")
def generator():
    return SyntheticGenerator(SyntheticConfig(num_ads=2000, max_events=16))


def test_batches_states_and_observations_match_the_read_ahead_thread(generator):
    inline_stream, ahead_stream = SyntheticStream(generator, 8, rank=1, world_size=2), SyntheticStream(generator, 8, rank=1, world_size=2)
    inline = ReadAhead(inline_stream, depth=0, observe=lambda: inline_stream.position)
    ahead = ReadAhead(ahead_stream, depth=2, observe=lambda: ahead_stream.position)
    for a, b in zip(itertools.islice(iter(inline), 5), itertools.islice(iter(ahead), 5), strict=True):
        assert equal_batches(a, b)
        assert inline.observed == ahead.observed
        assert inline.state_dict() == ahead.state_dict()
    assert inline.state_dict()["position"] == 5
    ahead.close()


def test_resume_and_a_new_iteration_continue_after_the_last_delivered_batch(generator):
    expected = list(itertools.islice(SyntheticStream(generator, 8), 6))
    stream = SyntheticStream(generator, 8)
    reader = ReadAhead(stream, depth=0)
    first = iter(reader)
    got = [next(first), next(first)]
    state = reader.state_dict()
    got += list(itertools.islice(iter(reader), 2))
    assert all(equal_batches(a, b) for a, b in zip(got, expected[:4], strict=True))
    reader.close()
    assert stream.position == 4

    resumed = ReadAhead(SyntheticStream(generator, 8), depth=0)
    resumed.load_state_dict(state)
    assert equal_batches(next(iter(resumed)), expected[2])


def test_a_trainer_reading_in_the_step_trains_exactly_as_one_reading_ahead(tmp_path):
    env = init_distributed("cpu", "gloo")
    runs = {}
    for read_ahead in (True, False):
        config = load_config(None, [f"--run_dir={tmp_path / str(read_ahead)}", "--data.batch_size=64", "--data.eval_batches=2",
                                    "--metrics.tensorboard=false", "--device=cpu", "--schedule.steps=20",
                                    "--schedule.warmup_steps=2", f"--data.read_ahead={str(read_ahead).lower()}"])
        trainer = Trainer(config, env)
        assert trainer.input.depth == (2 if read_ahead else 0)
        losses = [float(trainer.train_step()["loss"]) for _ in range(4)]
        state = trainer.state_dict()
        trainer.evaluate()  # eval mode in between: the next step trains in train mode again
        losses += [float(trainer.train_step()["loss"]) for _ in range(2)]
        assert all(m.training for m in trainer.model.modules())
        # a sharded embedding table compares by its (only) local shard
        weights = {k: (v.local_shards()[0].tensor if hasattr(v, "local_shards") else v).detach().clone()
                   for k, v in trainer.model.state_dict().items()}
        runs[read_ahead] = losses, state["data"], weights
        trainer.close()
    (losses, data, weights), (inline_losses, inline_data, inline_weights) = runs[True], runs[False]
    assert losses == inline_losses and data == inline_data
    assert weights.keys() == inline_weights.keys()
    assert all(torch.equal(weights[k], inline_weights[k]) for k in weights)
