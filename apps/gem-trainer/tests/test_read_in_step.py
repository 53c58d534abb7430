"""``ReadAhead`` at depth 0 (``data.read_ahead = false``: no thread) hands out what it hands out at depth 2, records
the same state, and a trainer reading in the step, or in a reading process (``data.read_ahead_process``), trains
exactly as one reading ahead on a thread."""

import itertools

import pytest
import torch

from gem_data import ProcessReadAhead, ReadAhead, SyntheticConfig, SyntheticGenerator, SyntheticStream
from gem_data.testing import equal_batches
from gem_trainer.config import ConfigError, load_config
from gem_trainer.distributed import init_distributed
from gem_trainer.trainer import Trainer


@pytest.fixture(scope="module")
def generator():
    return SyntheticGenerator(SyntheticConfig(num_ads=2000, max_events=16))


def test_batches_states_and_observations_match_the_read_ahead_thread(generator):
    inline_stream, ahead_stream = SyntheticStream(generator, 8, rank=1, world_size=2), SyntheticStream(generator, 8, rank=1, world_size=2)
    inline = ReadAhead(inline_stream, depth=0, observe=lambda batch: inline_stream.position)
    ahead = ReadAhead(ahead_stream, depth=2, observe=lambda batch: ahead_stream.position)
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


READERS = {"thread": ["--data.read_ahead=true"], "in the step": ["--data.read_ahead=false"],
           "process": ["--data.read_ahead=true", "--data.read_ahead_process=true"]}


def test_a_trainer_reading_in_the_step_or_a_process_trains_exactly_as_one_reading_ahead(tmp_path):
    env = init_distributed("cpu", "gloo")
    runs = {}
    for name, reader in READERS.items():
        config = load_config(None, [f"--run_dir={tmp_path / name.replace(' ', '_')}", "--data.batch_size=64",
                                    "--data.eval_batches=2", "--metrics.tensorboard=false", "--device=cpu",
                                    "--schedule.steps=20", "--schedule.warmup_steps=2", *reader])
        trainer = Trainer(config, env)
        assert isinstance(trainer.input, ProcessReadAhead) == (name == "process")
        assert trainer.input.depth == (0 if name == "in the step" else 2)
        steps = [trainer.train_step() for _ in range(4)]
        losses = [float(step["loss"]) for step in steps]
        # each step's FLOPs, counted where its batch was read, are its batch's
        assert [step["flops"] for step in steps] == [3.0 * sum(trainer.flop_model.flops(trainer.stream.rank_batch(i)).values())
                                                    for i in range(4)], name
        state = trainer.state_dict()
        trainer.evaluate()  # eval mode in between: the next step trains in train mode again
        losses += [float(trainer.train_step()["loss"]) for _ in range(2)]
        assert all(m.training for m in trainer.model.modules())
        # a sharded embedding table compares by its (only) local shard
        weights = {k: (v.local_shards()[0].tensor if hasattr(v, "local_shards") else v).detach().clone()
                   for k, v in trainer.model.state_dict().items()}
        runs[name] = losses, state["data"], weights
        trainer.close()
    losses, data, weights = runs["thread"]
    for name in ("in the step", "process"):
        other_losses, other_data, other_weights = runs[name]
        assert other_losses == losses and other_data == data, name
        assert other_weights.keys() == weights.keys()
        assert all(torch.equal(other_weights[k], weights[k]) for k in weights), name


def test_a_reading_process_reports_the_mixtures_shares_as_the_thread_does(tmp_path):
    env = init_distributed("cpu", "gloo")
    observed = {}
    for name in ("thread", "process"):
        config = load_config(None, [f"--run_dir={tmp_path / name}", "--data.batch_size=32", "--metrics.tensorboard=false",
                                    "--device=cpu", "--schedule.steps=20", "--schedule.warmup_steps=2",
                                    '--data.mixture.sources=[{name = "a"}, {name = "b", online = true, seed = 1}]',
                                    "--data.mixture.online_share_start=0.25", "--data.mixture.online_share_end=0.75",
                                    "--data.mixture.ramp_steps=4", *READERS[name]])
        trainer = Trainer(config, env)
        observed[name] = []
        for _ in range(5):
            trainer.train_step()
            observed[name].append(trainer._data_metrics())
        trainer.close()
    assert observed["process"] == observed["thread"]
    assert observed["thread"][0]["share_b"] != observed["thread"][-1]["share_b"]  # the ramp moved


def test_a_reading_process_is_refused_where_it_cannot_read():
    with pytest.raises(ConfigError, match="data.read_ahead_process reads ahead in a process: it needs data.read_ahead = true"):
        load_config(None, ["--data.read_ahead=false", "--data.read_ahead_process=true"])
    with pytest.raises(ConfigError, match="data.read_ahead_process and data.num_workers"):
        load_config(None, ["--data.num_workers=2", "--data.read_ahead_process=true"])
    with pytest.raises(ConfigError, match="data.read_ahead_process: the Solaris input"):
        load_config(None, ["--data.read_ahead_process=true", "--solaris.student_input=served"])
