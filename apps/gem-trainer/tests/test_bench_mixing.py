"""The mixing benchmark: the reader cost's rate, batch time split and shares read; the time split's schedules."""

from pathlib import Path

import pytest

from gem_data import (BatchTable, MixedStream, MixingConfig, MixSource, SyntheticConfig, SyntheticGenerator, SyntheticStream,
                      TableStream)
from gem_data.testing import find_repo_root, shared_data_dir
from gem_trainer import bench_mixing, builders
from gem_trainer.bench_mixing import measure_mixed
from gem_trainer.config import load_config
from gem_trainer.distributed import init_distributed


def test_a_mixture_is_measured_with_the_shares_it_read():
    generators = [SyntheticGenerator(SyntheticConfig(seed=s, num_ads=2000, max_events=16)) for s in range(2)]
    makers = {"feed": lambda: SyntheticStream(generators[0], 16), "video": lambda: SyntheticStream(generators[1], 16)}
    config = MixingConfig((MixSource("feed", 3.0), MixSource("video", 1.0)), batch_size=16)
    rate, ms, shares = measure_mixed("mix", makers, config, None, seconds=0.3, batch=16)
    assert rate > 0 and ms["mixed"] >= ms["source_reads"] > 0
    assert shares.keys() == {"feed", "video"} and abs(sum(shares.values()) - 1) < 1e-9
    assert 0.6 < shares["feed"] < 0.9  # drawn 3:1


def test_every_online_schedule_of_the_time_split_reads_the_stream_once_on_both_splits(tmp_path):
    """The benchmark's online schedules fit the online period (the trainer would refuse them otherwise) on the
    validation fold and on the test split, and each reads as much of it as sequential fine-tuning."""
    data = shared_data_dir(find_repo_root(Path(__file__))) / "ml-100k"
    if not (data / "ml-100k.inter").is_file():
        pytest.skip(f"shared real data not found at {data} (expected ../shared/data beside the repository)")
    world = init_distributed("cpu", "gloo")
    for split in ([], [f"--data.sequential.time_split={bench_mixing.VALIDATION_FOLD}"]):
        for name, schedule in {"sequential": bench_mixing.SEQUENTIAL, **bench_mixing.RAMPS}.items():
            config = load_config(bench_mixing.TIME_SPLIT_CONFIG, [f"--data.path={data}", f"--run_dir={tmp_path}", "--device=cpu",
                                               f"--schedule.steps={bench_mixing.TIME_SPLIT_STEPS}", *split, *schedule])
            setup = builders.build_data(config, world)
            builders.check_mixture_reads(config, setup)
            online = setup.mixer.positions(bench_mixing.TIME_SPLIT_STEPS)[setup.mixer.names.index("online")]
            assert 18_500 < online <= 19_810, (name, split)


def test_the_loss_spike_is_measured_where_the_online_stream_enters():
    def records(shares, losses):
        return {step + 1: {"share_online": share, "loss": loss} for step, (share, loss) in enumerate(zip(shares, losses))}

    # a switch at step 31: 20 steps before it at 1.0, then a bump to 3.0 for five steps, later steps back at 1.0
    switch = records([0.0] * 30 + [1.0] * 40, [1.0] * 30 + [3.0] * 5 + [1.0] * 35)
    assert bench_mixing.loss_spike(switch) == {"onset_step": 31, "before": 1.0, "after_max": 3.0, "spike": 2.0}
    # a ramp from step 31: its bump at steps 61-65 is found, as a switch's late one would be
    ramp = records([0.0] * 30 + [i / 30 for i in range(1, 31)] + [1.0] * 10, [1.0] * 60 + [2.0] * 5 + [1.0] * 5)
    assert bench_mixing.loss_spike(ramp)["spike"] == 1.0
    # no online share, or one from the start: nothing to measure
    assert bench_mixing.loss_spike(records([0.0] * 40, [1.0] * 40)) is None
    assert bench_mixing.loss_spike(records([0.2] * 40, [1.0] * 40)) is None


@pytest.mark.parametrize("workers", [0, 2])
def test_the_worker_cost_counts_every_process_and_the_rows_the_workers_read(workers):
    generator = SyntheticGenerator(SyntheticConfig(seed=0, num_ads=2000, max_events=16))
    table = BatchTable(generator.batch(0, 200), generator.spec)
    config = MixingConfig((MixSource("log", 2.0), MixSource("live", 1.0)), batch_size=16)
    mixture = MixedStream({"log": TableStream(table, 16, seed=1), "live": TableStream(table, 16, shuffle=False)}, config)
    cpu, read, delivered = bench_mixing.worker_cost(mixture, workers, warm_up=0, batches=40)
    assert delivered == 40 * 16 and cpu > 0
    # every row delivered was read (in a worker, where the reads are counted through shared memory); the reads ahead
    # (of at least the tables' read_rows) past the last batch, in each worker, bound the rest
    assert delivered <= read <= delivered + 2 * max(workers, 1) * (TableStream(table, 16).read_rows + 32 * 16)
