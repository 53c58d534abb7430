"""Mixing real readers from the trainer's config: the time split's offline log and online stream, two real domains
at once, exact resume mid-ramp, the ranks' view of the mixture, and one-line errors for misaligned sources."""

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch

from gem_data import DataError, TableStream, concat_batches, select_examples
from gem_data.testing import equal_batches, find_repo_root, shared_data_dir
from gem_trainer import builders
from gem_trainer.config import ConfigError, load_config
from gem_trainer.distributed import init_distributed
from gem_trainer.trainer import Trainer

DATA = shared_data_dir(find_repo_root(Path(__file__)))
ML, BEAUTY = DATA / "ml-100k", DATA / "beauty"
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SMALL = ["--data.batch_size=32", "--metrics.tensorboard=false", "--metrics.progress_bar=false", "--device=cpu",
         "--schedule.steps=6", "--schedule.warmup_steps=1", "--schedule.decay=constant", "--metrics.log_every=1",
         "--checkpoint.enable=false", "--deterministic=true"]
TIME_SPLIT = [f"--config={CONFIGS / 'mixing-ml100k-time.toml'}", f"--data.path={ML}", "--data.sequential.eval_users=64",
              "--data.mixture.ramp_start=0", "--data.mixture.ramp_steps=6", "--data.mixture.online_share_end=0.8"]
DOMAINS = [f"--config={CONFIGS / 'mixing-domains.toml'}", f"--data.path={BEAUTY}", "--data.sequential.eval_users=32",
           '--data.mixture.sources=[{name = "beauty", surface = 0}, '
           f'{{name = "movielens", reader = "atomic", path = "{ML}", surface = 1}}]']


def needs(*folders):
    for folder in folders:
        if not folder.is_dir():
            pytest.skip(f"shared real data not found at {folder} (expected ../shared/data beside the repository)")


def config_for(tmp_path, *extra):
    """The config file named by ``--config=`` in ``extra`` (the embedded default without one), made small."""
    files = [e.removeprefix("--config=") for e in extra if e.startswith("--config=")]
    overrides = [e for e in extra if not e.startswith("--config=")]
    return load_config(files[0] if files else None, [f"--run_dir={tmp_path}", *SMALL, *overrides])


def trainer_for(tmp_path, *extra):
    return Trainer(config_for(tmp_path, *extra), init_distributed("cpu", "gloo"))


def test_time_split_trains_on_the_offline_log_and_the_online_stream_and_evaluates_after_it(tmp_path):
    needs(ML)
    trainer = trainer_for(tmp_path, *TIME_SPLIT)
    losses = [float(trainer.train_step()["loss"]) for _ in range(6)]
    assert all(torch.isfinite(torch.tensor(losses)))
    counts = trainer._data_metrics()
    assert counts["source_offline"] + counts["source_online"] == 6 * 32 and counts["source_online"] > 0
    assert set(trainer._last_batch.source.tolist()) <= {0, 1}
    result = trainer.evaluate()  # the next period
    assert result["sampled/queries"] == 64 and 0.0 <= result["sampled/hr@10"] <= 1.0
    # the next period holds several queries (next items) per user: the users are counted apart
    ranking = trainer.data.ranking.ranking_examples("next_period", "sampled", 99, 0)
    chosen = torch.randperm(ranking.num_users, generator=torch.Generator().manual_seed(trainer.config.seed))[:64]
    assert result["sampled/users"] == ranking.users[chosen].unique().numel()
    assert ranking.users.unique().numel() < ranking.num_users
    forgetting = trainer_for(tmp_path / "f", *TIME_SPLIT, "--data.sequential.eval_split=offline_period")
    assert forgetting.data.ranking.ranking_examples("offline_period", "sampled", 99, 0).num_users > 600


def test_a_validation_fold_of_the_time_split_evaluates_before_the_test_period(tmp_path):
    needs(ML)
    fold = trainer_for(tmp_path, *TIME_SPLIT, "--data.sequential.time_split=[0.6, 0.8, 0.9]")
    offline = fold.data.mixer.sources[0].table.dataset
    ranking = fold.data.ranking.ranking_examples("next_period", "sampled", 99, 0)
    times = offline.corpus.timestamps
    test_from = torch.quantile(times.double(), 0.9).item()  # where the config's own split, [0.7, 0.9], tests
    events = offline.next_events
    assert ranking.num_users == events.numel() > 9_000 and bool((times[events] < test_from).all())
    assert bool((times[events] >= torch.quantile(times.double(), 0.8).item()).all())
    # the leave-one-out targets are training targets of the periods: refused, in a mixture and alone
    lone = [f"--data.path={ML}", "--data.source=atomic", "--data.sequential.time_split=[0.7, 0.9]"]
    for extra in ([*TIME_SPLIT, "--data.sequential.eval_split=test"], [*lone, "--data.sequential.eval_split=valid"]):
        with pytest.raises(ConfigError, match=r"^data\.sequential\.eval_split = \"(test|valid)\": (the evaluated source "
                                              r"'offline'|the data) trains on periods of data\.sequential\.time_split"):
            builders.build_data(config_for(tmp_path, *extra), init_distributed("cpu", "gloo"))
    for bad in ("[0.6, 0.9, 0.9]", "[0.6, 0.8, 0.9, 1.0]", "[0.8]"):
        with pytest.raises(ConfigError, match=r"data\.sequential\.time_split must be event-time quantiles 0 < online_from < "
                                              r"next_from < 1, or 0 < online_from < next_from < next_until <= 1"):
            config_for(tmp_path, *TIME_SPLIT, f"--data.sequential.time_split={bad}")


def test_the_online_stream_reaches_the_model_in_time_order(tmp_path):
    needs(ML)
    data = builders.build_data(config_for(tmp_path, *TIME_SPLIT, "--data.mixture.online_share_start=0.5"),
                               init_distributed("cpu", "gloo"))
    online = data.mixer.sources[1].table.dataset
    expected = online.corpus.items[online.corpus.offsets[online.example_user] + online.example_k]
    batches = list(itertools.islice(data.train, 8))
    read = concat_batches([select_examples(b, (b.source == 1).nonzero().squeeze(1)) for b in batches])
    assert torch.equal(read.sparse["item_id"].values(), expected[: read.batch_size])


def test_the_online_stream_is_read_once_and_a_schedule_reading_past_its_end_is_refused(tmp_path):
    needs(ML)
    # the online period holds 19,810 examples: 700 steps of 32 at an online share of 0.8 after step 0 read ~17.9k
    fits = config_for(tmp_path, *TIME_SPLIT, "--schedule.steps=700")
    builders.check_mixture_reads(fits, builders.build_data(fits, init_distributed("cpu", "gloo")))
    past = config_for(tmp_path, *TIME_SPLIT, "--schedule.steps=900")
    data = builders.build_data(past, init_distributed("cpu", "gloo"))
    with pytest.raises(ConfigError, match=r"^data\.mixture\.sources\.online: its stream holds 19,810 examples, read once "
                                          r"in time order, and schedule\.steps = 900 would read 2\d,\d{3} of it \(it runs "
                                          r"out at step \d{3}\): train fewer steps or give it a smaller share$") as error:
        builders.check_mixture_reads(past, data)
    trainer = trainer_for(tmp_path, *TIME_SPLIT, "--schedule.steps=900")  # evaluating such a run reads no stream
    with pytest.raises(ConfigError, match=r"^data\.mixture\.sources\.online: its stream holds"):
        trainer.train()
    step = int(str(error.value).split("runs out at step ")[1].split(")")[0])
    online = data.mixer.names.index("online")
    # exact: the batch of that step is the first to need an example past the end
    assert data.mixer.positions(step - 1)[online] <= 19_810 < data.mixer.positions(step)[online]


def test_a_resume_with_a_smaller_online_share_is_checked_from_the_examples_the_run_read(tmp_path):
    """With the online period cut to [0.85, 0.9) (4,941 examples), 15 steps of 256 read 3,840 of them at a share of 1;
    resumed at a share of 0.5, 10 more steps would read 1,280 more (past the end): refused before training. The check
    once replayed the whole schedule from step 0 at the new share (3,200 examples), passed it, and the run stopped
    when the stream ran dry."""
    needs(ML)
    online = [*TIME_SPLIT[:3], "--data.sequential.time_split=[0.85, 0.9]", "--data.batch_size=256",
              "--data.mixture.ramp_start=0", "--data.mixture.ramp_steps=1", "--data.mixture.online_share_start=1.0",
              "--data.mixture.online_share_end=1.0", "--checkpoint.enable=true", "--checkpoint.every_steps=15",
              "--checkpoint.asynchronous=false"]
    first = trainer_for(tmp_path, *online, "--schedule.steps=15")
    first.train()
    first.close()
    assert first._data_metrics()["source_online"] == 15 * 256
    halved = [*online, "--data.mixture.online_share_start=0.5", "--data.mixture.online_share_end=0.5"]
    resumed = trainer_for(tmp_path, *halved, "--schedule.steps=25")
    with pytest.raises(ConfigError, match=r"^data\.mixture\.sources\.online: its stream holds 4,941 examples, read once "
                                          r"in time order, and schedule\.steps = 25 would read 5,\d{3} of it \(it runs "
                                          r"out at step 2\d\)"):
        resumed.train()
    resumed.close()
    fits = trainer_for(tmp_path, *halved, "--schedule.steps=18")
    fits.train()  # 3 steps of ~128 online examples: within the period
    assert 3_840 < fits._data_metrics()["source_online"] < 4_941
    fits.close()


def test_a_ramp_the_run_ends_before_is_refused(tmp_path):
    """The config's ramp starts at step 600: a run of 20 steps would keep the online share at its start throughout."""
    needs(ML)
    short = config_for(tmp_path, f"--config={CONFIGS / 'mixing-ml100k-time.toml'}", f"--data.path={ML}",
                       "--schedule.steps=20")
    with pytest.raises(ConfigError, match=r"^data\.mixture\.ramp_start \(600\) is at or past schedule\.steps \(20\): the "
                                          r"online share stays 0\.0 for the whole run and never moves to 1\.0"):
        builders.check_mixture_reads(short, builders.build_data(short, init_distributed("cpu", "gloo")))


def test_sources_without_event_times_and_a_time_split(tmp_path):
    """A sequence file has no event times: as an offline source of a time-split mixture all its examples train (it is
    not split); as an online source, or evaluated on a period of the split, it is refused in one line."""
    needs(ML, BEAUTY)
    env = init_distributed("cpu", "gloo")
    beauty = f'{{name = "beauty", reader = "sequence_text", path = "{BEAUTY}", surface = 1}}'
    pointwise = ["--data.sequential.objective=pointwise", "--data.sequential.num_negatives=1", "--data.sequential.loss=binary"]
    mixed = [*TIME_SPLIT, *pointwise, "--model.name=kunlun", "--model.kunlun.size=tiny",
             '--data.sequential.eval_split="test"', "--data.mixture.eval_source=beauty",  # leave-one-out: not split
             f'--data.mixture.sources=[{{name = "offline", surface = 0}}, {{name = "online", online = true, surface = 0}}, '
             f'{beauty}]']
    data = builders.build_data(config_for(tmp_path, *mixed), env)
    whole = builders.build_next_item_dataset(config_for(tmp_path, *pointwise, "--data.source=sequence_text",
                                                        f"--data.path={BEAUTY}"))
    assert data.mixer.sources[2].rows_per_epoch == TableStream(whole.training_table(), 32).rows_per_epoch > 200_000
    with pytest.raises(ConfigError, match=r"^override --data\.mixture\.sources=.*: data: data\.mixture\.sources\.beauty: an "
                                          r"online source is read in time order, and a sequence file holds no event times"):
        config_for(tmp_path, *mixed[:-1], f'--data.mixture.sources=[{{name = "offline"}}, {beauty[:-1]}, online = true}}]')
    evaluated = config_for(tmp_path, *mixed, '--data.sequential.eval_split="next_period"', "--data.mixture.eval_source=beauty")
    with pytest.raises(ConfigError, match=r"^data\.sequential\.eval_split = \"next_period\" evaluates a period of the "
                                          r"time split, and the evaluated source 'beauty' has no event times"):
        builders.build_data(evaluated, env)
    alone = config_for(tmp_path, "--data.source=sequence_text", f"--data.path={BEAUTY}", "--data.sequential.queries=last",
                       "--data.sequential.time_split=[0.7, 0.9]")
    with pytest.raises(DataError, match=r"data: data\.sequential\.time_split cuts the data at event times, and this "
                                        r"sequence_text data has none \(its events are in file order\)$"):
        builders.build_data(alone, env)


def test_two_real_domains_mix_as_two_surfaces_and_evaluate_per_domain(tmp_path):
    needs(ML, BEAUTY)
    trainer = trainer_for(tmp_path, *DOMAINS, "--model.kunlun.num_layers=1")
    spec = trainer.spec
    assert spec.num_surfaces == 2
    vocab = {f.name: f.num_embeddings for f in spec.sparse}
    assert vocab["item_id"] == 12_101 + 1_682  # disjoint namespaces, laid end to end
    for _ in range(2):
        assert torch.isfinite(trainer.train_step()["loss"])
    batch = trainer._last_batch
    assert torch.equal(batch.surface, batch.source)  # the domain id is the source's surface
    movies = batch.sparse["item_id"].values()[(batch.source == 1).repeat_interleave(batch.sparse["item_id"].lengths())]
    assert bool((movies >= 12_101).all())
    for domain in ("beauty", "movielens"):
        trainer.data.ranking = builders.build_data(
            config_for(tmp_path / domain, *DOMAINS, f"--data.mixture.eval_source={domain}"), trainer.env).ranking
        result = trainer.evaluate()
        assert result["sampled/users"] == 32, domain


def test_parquet_and_synthetic_sources_mix_in_one_declared_id_space(tmp_path):
    from gem_data import SyntheticConfig, SyntheticGenerator, write_parquet

    generator = SyntheticGenerator(SyntheticConfig())  # the trainer's default synthetic data set, seed 0
    write_parquet((generator.batch(i, 64, split="eval") for i in range(2)), generator.spec, tmp_path / "log.parquet")
    sources = (f'--data.mixture.sources=[{{name = "log", reader = "parquet", path = "{tmp_path / "log.parquet"}", '
               f'eval_path = "{tmp_path / "log.parquet"}", id_space = "ads"}}, {{name = "live", reader = "synthetic", '
               f'id_space = "ads", online = true}}]')
    trainer = trainer_for(tmp_path / "run", sources, "--data.mixture.online_share_start=0.3", "--data.eval_batches=2")
    assert trainer.spec == generator.spec  # one id space: the union is the common spec
    for _ in range(2):
        assert torch.isfinite(trainer.train_step()["loss"])
    assert trainer.evaluate()["click/all/count"] == 128  # the parquet source's held-out file
    live = trainer_for(tmp_path / "live", sources, "--data.mixture.online_share_start=0.3", "--data.eval_batches=2",
                       "--data.mixture.eval_source=live")
    assert live.evaluate()["click/all/count"] == 2 * 32  # the generator's held-out split
    disjoint = config_for(tmp_path / "d", sources.replace('id_space = "ads", ', "").replace(', id_space = "ads"', ""))
    spec = builders.build_data(disjoint, init_distributed("cpu", "gloo")).spec
    assert {f.name: f.num_embeddings for f in spec.sparse}["ad_id"] == 2 * generator.config.num_ads


def test_parquet_sources_of_a_mixture_share_one_clock_with_their_held_out_files(tmp_path):
    # each file's times count from its own earliest event otherwise: a per-user memory (LoopFM, Solaris) comparing
    # times across sources would take a later event of the other source for an earlier one
    import pyarrow.parquet as pq

    from gem_data import SyntheticConfig, SyntheticGenerator, write_parquet

    generator = SyntheticGenerator(SyntheticConfig(num_users=8))

    def users_file(name, indices):  # written by another tool: absolute times, no gem.time_base
        path = tmp_path / f"{name}.parquet"
        write_parquet((generator.batch(i, 16) for i in indices), generator.spec, path)
        table = pq.read_table(path)
        pq.write_table(table.replace_schema_metadata({k: v for k, v in table.schema.metadata.items() if k != b"gem.time_base"}), path)
        return path

    log, live, held_out = users_file("log", range(0, 200, 50)), users_file("live", [400, 401]), users_file("held", [410])
    sources = (f'--data.mixture.sources=[{{name = "log", reader = "parquet", path = "{log}"}}, '
               f'{{name = "live", reader = "parquet", path = "{live}", eval_path = "{held_out}", online = true}}]')
    data = builders.build_data(config_for(tmp_path / "run", sources, "--data.mixture.eval_source=live"),
                               init_distributed("cpu", "gloo"))
    log_table, live_table = (source.table for source in data.mixer.sources)
    assert log_table.time_base == live_table.time_base < 1e6 + 3600  # the log's earliest event: the one clock

    def newest(batches):
        return max(float(s.timestamps.max()) for b in batches for s in b.sequences.values() if s.timestamps.numel())

    def once(table):
        return TableStream(table, 16, shuffle=False, num_epochs=1)

    # each batch's newest event is its examples' time (synthetic histories end then): log, live stream, held-out
    assert newest(once(log_table)) < newest(once(live_table)) < newest(data.eval_batches())
    assert newest(once(live_table)) < 1e6 + 402 * 3600  # not counted from the live file's own first event


def test_the_start_names_each_sources_surfaces_and_warns_when_two_data_sets_share_one(tmp_path, capsys):
    def start(name, *stamps):
        sources = ", ".join(f'{{name = "{n}", reader = "synthetic", seed = {i}, id_space = "{n}"{stamp}}}'
                            for i, (n, stamp) in enumerate(zip(("a", "b"), stamps)))
        trainer = trainer_for(tmp_path / name, f"--data.mixture.sources=[{sources}]")
        trainer.close()
        return trainer.spec, capsys.readouterr().out

    spec, out = start("own", "", "")  # each keeps the generator's own surfaces 0-2
    assert spec.num_surfaces == 3
    assert "data.mixture: surfaces (domains) of the sources: a 0-2, b 0-2" in out
    assert ("warning: data.mixture.sources 'a' and 'b' lie in different id spaces but share surface(s) [0, 1, 2]; give "
            "them distinct data.mixture.sources[].surface values to keep their domains apart") in out
    spec, out = start("stamped", ", surface = 0", ", surface = 1")
    assert spec.num_surfaces == 2
    assert "data.mixture: surfaces (domains) of the sources: a 0, b 1" in out and "warning" not in out


def test_the_log_shows_each_sources_share_along_the_ramp(tmp_path, capsys):
    needs(ML)
    trainer = trainer_for(tmp_path, *TIME_SPLIT)
    trainer.train()
    rows = [row for row in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if row["phase"] == "train"]
    # the TIME_SPLIT ramp: online from 0 to 0.8 over global batches 0..6; step t trained on batch t - 1
    assert [round(row["share_online"], 6) for row in rows] == [round(0.8 * (t - 1) / 6, 6) for t in range(1, 7)]
    assert all(row["share_online"] + row["share_offline"] == pytest.approx(1.0) for row in rows)
    assert rows[-1]["source_offline"] + rows[-1]["source_online"] == 6 * 32
    assert "share_online" in capsys.readouterr().out  # the log line too


def test_resume_mid_ramp_continues_exactly(tmp_path):
    needs(ML)
    args = [*TIME_SPLIT, "--checkpoint.enable=true", "--checkpoint.every_steps=100"]
    straight = trainer_for(tmp_path / "straight", *args)
    expected = [float(straight.train_step()["loss"]) for _ in range(6)]
    first = trainer_for(tmp_path / "stopped", *args)
    got = [float(first.train_step()["loss"]) for _ in range(3)]
    first.save_checkpoint()
    first.close()  # the asynchronous save is written and its writer stopped
    second = trainer_for(tmp_path / "stopped", *args)
    assert second.resume() and second.step == 3
    got += [float(second.train_step()["loss"]) for _ in range(3)]
    assert got == expected
    assert second._data_metrics() == straight._data_metrics()


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_reads_its_slice_of_the_one_process_mixture(tmp_path, world_size):
    needs(ML)
    config = config_for(tmp_path, *TIME_SPLIT, "--data.batch_size=24")
    env = init_distributed("cpu", "gloo")
    whole = builders.build_data(config.model_copy(update={"data": config.data.model_copy(update={"batch_size": 24 * world_size})}), env)
    ranks = [builders.build_data(config, dataclasses.replace(env, rank=r, world_size=world_size)) for r in range(world_size)]
    for expected, *parts in itertools.islice(zip(whole.train, *(r.train for r in ranks)), 4):
        assert equal_batches(concat_batches(parts), expected)


def test_misaligned_sources_are_rejected_in_one_line(tmp_path):
    needs(ML, BEAUTY)
    env = init_distributed("cpu", "gloo")
    shared = config_for(tmp_path, *DOMAINS, '--data.mixture.sources=[{name = "beauty", id_space = "items"}, '
                        f'{{name = "movielens", reader = "atomic", path = "{ML}", id_space = "items"}}]')
    with pytest.raises(ConfigError, match="sources 'beauty' and 'movielens' share id space 'items' but their features differ") as error:
        builders.build_data(shared, env)
    assert "\n" not in str(error.value)
    synthetic = config_for(tmp_path, *DOMAINS, '--data.mixture.sources=[{name = "beauty"}, {name = "ads", reader = "synthetic"}]')
    with pytest.raises(ConfigError, match="different tasks"):
        builders.build_data(synthetic, env)
    retrieval = config_for(tmp_path, *DOMAINS, "--model.name=sasrec", '--data.sequential.objective="retrieval"')
    with pytest.raises(ConfigError, match="one item catalogue"):
        builders.build_data(retrieval, env)


def test_a_sources_missing_or_wrong_path_is_named_by_its_field(tmp_path):
    needs(ML)
    env = init_distributed("cpu", "gloo")
    cases = {
        f'{{name = "beauty", reader = "sequence_text", path = "{tmp_path / "beuaty"}"}}':
            rf"^data\.mixture\.sources\.beauty\.path: {tmp_path / 'beuaty'} does not exist$",
        f'{{name = "movies", reader = "atomic", path = "{ML}k"}}': rf"^data\.mixture\.sources\.movies\.path: {ML}k does not exist$",
        f'{{name = "movies", reader = "atomic", path = "{ML / "ml-100k.inter"}"}}':
            rf"^data\.mixture\.sources\.movies\.path: {ML / 'ml-100k.inter'} is not a folder of atomic files: give its "
            rf"folder, {ML}$",
        f'{{name = "logs", reader = "parquet", path = "{tmp_path}", eval_path = "{tmp_path}"}}':
            rf"^data\.mixture\.sources\.logs\.path: no \*\.parquet file at {tmp_path}$",
    }
    for source, expected in cases.items():
        config = config_for(tmp_path, *DOMAINS, f'--data.mixture.sources=[{{name = "base"}}, {source}]')
        with pytest.raises(FileNotFoundError, match=expected):
            builders.build_data(config, env)


def test_mixture_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="data.mixture.sources.live: an online next-item source is the online period"):
        load_config(None, ["--data.source=atomic", "--data.path=x", '--data.mixture.sources=[{name = "log"}, {name = "live", online = true}]'])
    with pytest.raises(ConfigError, match="data.mixture.eval_source names 'nope'"):
        load_config(None, ['--data.mixture.sources=[{name = "a"}]', "--data.mixture.eval_source=nope"])
    with pytest.raises(ConfigError, match=r"^override --data\.mixture\.ramp_steps=100: data\.mixture: data\.mixture\.ramp_start "
                                          r"/ ramp_steps move the online share to online_share_end, which is not set"):
        load_config(None, ['--data.mixture.sources=[{name = "a"}, {name = "b", online = true, seed = 1}]',
                           "--data.mixture.online_share_start=0.25", "--data.mixture.ramp_steps=100"])
    with pytest.raises(ConfigError, match="needs online and offline sources"):
        load_config(None, ['--data.mixture.sources=[{name = "a"}]', "--data.mixture.online_share_start=0.5"])
    with pytest.raises(ConfigError, match="needs data.sequential.time_split"):
        load_config(None, ["--data.source=atomic", "--data.path=x", "--data.sequential.eval_split=next_period"])
    constant = load_config(None, ['--data.mixture.sources=[{name = "a"}, {name = "b", online = true, seed = 1}]',
                                  "--data.mixture.online_share_start=0.25"])
    assert constant.data.mixture.online_share_end is None
    # settings that cannot apply are refused, not dropped
    with pytest.raises(ConfigError, match=r"data\.mixture\.online_share_start schedules a mixture, which has no sources"):
        load_config(None, ["--data.mixture.online_share_start=0.5", "--data.mixture.online_share_end=1.0",
                           "--data.mixture.ramp_steps=10"])
    with pytest.raises(ConfigError, match=r"data\.mixture\.granularity schedules a mixture, which has no sources"):
        load_config(None, ["--data.mixture.granularity=batch"])
    with pytest.raises(ConfigError, match="data.sequential.time_split cuts a next-item source's events by time: no "
                                          "source reads atomic"):
        load_config(None, ["--data.sequential.time_split=[0.7, 0.9]"])
    with pytest.raises(ConfigError, match=r"data\.sequential\.eval_split = \"next_period\" ranks a next-item source's "
                                          r"events: the evaluated source reads synthetic data"):
        load_config(None, ["--data.source=atomic", "--data.path=x", "--data.sequential.time_split=[0.7, 0.9]",
                           "--data.sequential.eval_split=next_period",
                           '--data.mixture.sources=[{name = "s", reader = "synthetic"}, {name = "m"}]'])
