"""The trainer reaches every data source and data feature from its config."""

import itertools

import pytest
import torch

from gem_data import SyntheticConfig, SyntheticGenerator, write_parquet
from gem_trainer.config import ConfigError, load_config
from gem_trainer.distributed import init_distributed
from gem_trainer.trainer import Trainer

SMALL = ["--data.batch_size=32", "--data.eval_batches=2", "--metrics.tensorboard=false", "--device=cpu",
         "--schedule.steps=4", "--schedule.warmup_steps=1", "--metrics.log_every=2", "--checkpoint.enable=false"]


def trainer_for(tmp_path, *extra):
    return Trainer(load_config(None, [f"--run_dir={tmp_path}", *SMALL, *extra]), init_distributed("cpu", "gloo"))


def test_mixture_of_synthetic_streams_counts_examples_per_source(tmp_path):
    trainer = trainer_for(
        tmp_path,
        '--data.mixture.sources=[{name = "offline", weight = 3.0}, {name = "online", weight = 1.0, online = true, seed = 1}]',
    )
    for _ in range(4):
        trainer.train_step()
    metrics = trainer._data_metrics()
    assert metrics["source_offline"] + metrics["source_online"] == 4 * 32
    assert metrics["source_offline"] > metrics["source_online"]
    batch = trainer._last_batch
    assert batch.source is not None and set(batch.source.tolist()) <= {0, 1}


def test_parquet_source_trains_and_evaluates(tmp_path):
    generator = SyntheticGenerator(SyntheticConfig(num_ads=2000, max_events=16))
    write_parquet((generator.batch(i, 64) for i in range(4)), generator.spec, tmp_path / "train.parquet")
    write_parquet((generator.batch(i, 64, split="eval") for i in range(2)), generator.spec, tmp_path / "eval.parquet")
    trainer = trainer_for(tmp_path / "run", "--data.source=parquet", f"--data.path={tmp_path / 'train.parquet'}",
                          f"--data.eval_path={tmp_path / 'eval.parquet'}")
    assert trainer.spec.tasks == ("click", "conversion")
    for _ in range(4):
        assert torch.isfinite(trainer.train_step()["loss"])
    result = trainer.evaluate()
    assert result["click/all/count"] == 128


def test_held_out_files_must_hold_the_training_columns_and_their_skipped_rows_count(tmp_path):
    """Labels are matched by position: a held-out file with its label columns in another order (or another label)
    would score one task's predictions against the other's labels. Bad held-out rows skipped are counted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gem_data import DataError

    generator = SyntheticGenerator(SyntheticConfig(num_ads=2000, max_events=16))
    write_parquet((generator.batch(i, 64) for i in range(2)), generator.spec, tmp_path / "train.parquet")
    write_parquet((generator.batch(i, 64, split="eval") for i in range(2)), generator.spec, tmp_path / "eval.parquet")
    held_out = pq.read_table(tmp_path / "eval.parquet")
    names = held_out.column_names
    swapped = [n for n in names if not n.startswith("label.")] + ["label.conversion", "label.click"]
    pq.write_table(held_out.select(swapped), tmp_path / "swapped.parquet")
    base = ["--data.source=parquet", f"--data.path={tmp_path / 'train.parquet'}"]
    with pytest.raises(DataError, match=r"swapped\.parquet: data\.eval_path: the held-out data's columns differ from the "
                                        r"training data's \(tasks: \('click', 'conversion'\) != \('conversion', 'click'\)\)$"):
        trainer_for(tmp_path / "a", *base, f"--data.eval_path={tmp_path / 'swapped.parquet'}")
    pq.write_table(held_out.slice(0, 0), tmp_path / "empty.parquet")
    for flag in ("path", "eval_path"):  # (an empty training file was reported as the held-out file's surfaces)
        files = {"path": tmp_path / "train.parquet", "eval_path": tmp_path / "eval.parquet", flag: tmp_path / "empty.parquet"}
        with pytest.raises(DataError, match=rf"empty\.parquet: data\.{flag}: no rows$"):
            trainer_for(tmp_path / flag, "--data.source=parquet", *(f"--data.{k}={v}" for k, v in files.items()))
    labels = held_out.column("label.click").to_pylist()
    labels[3] = 0.5  # a label outside {0, 1}
    bad = held_out.set_column(names.index("label.click"), "label.click", pa.array(labels, held_out.schema.field("label.click").type))
    pq.write_table(bad, tmp_path / "bad.parquet")
    trainer = trainer_for(tmp_path / "b", *base, f"--data.eval_path={tmp_path / 'bad.parquet'}", "--data.skip_bad_rows=true")
    assert trainer.data_report() == {"data/bad_rows": 1.0}
    assert trainer.evaluate()["click/all/count"] == 127
    # the same bad row in a parquet source of a mixture (its training file) is counted as well
    sources = (f'--data.mixture.sources=[{{name = "log", reader = "parquet", path = "{tmp_path / "bad.parquet"}", '
               f'eval_path = "{tmp_path / "eval.parquet"}"}}, {{name = "live", reader = "synthetic"}}]')
    mixed = trainer_for(tmp_path / "c", sources, "--data.skip_bad_rows=true")
    assert mixed.data_report() == {"data/bad_rows": 1.0}


def test_an_id_too_large_for_any_table_is_one_line(tmp_path):
    """One stray id of 10^12 asks for a table of as many rows: TorchRec's planner finds no plan (dozens of lines)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    generator = SyntheticGenerator(SyntheticConfig(num_ads=2000, max_events=16))
    write_parquet([generator.batch(0, 64)], generator.spec, tmp_path / "data.parquet")
    table = pq.read_table(tmp_path / "data.parquet").replace_schema_metadata(None)
    ads = table.column("sparse.ad_id").to_pylist()
    ads[5] = [10**12] if isinstance(ads[5], list) else 10**12
    table = table.set_column(table.column_names.index("sparse.ad_id"), "sparse.ad_id", pa.array(ads, table.schema.field("sparse.ad_id").type))
    pq.write_table(table, tmp_path / "huge.parquet")
    with pytest.raises(ConfigError, match=r"^parallelism: the embedding tables fit no sharding plan \(.*\); the largest: "
                                          r"t_ad_id \(1,000,000,000,001 rows\)"):
        trainer_for(tmp_path / "run", "--data.source=parquet", f"--data.path={tmp_path / 'huge.parquet'}",
                    f"--data.eval_path={tmp_path / 'data.parquet'}")


def test_balanced_batches_report_imbalance_before_and_after(tmp_path):
    # how well balancing works is tested in gem-data; here: the trainer reads through it and logs its report
    trainer = trainer_for(tmp_path, "--data.balance=true", "--data.balance_window=2")
    trainer.train_step()
    report = trainer._data_metrics()
    assert {"balance_tokens_before", "balance_tokens_after", "balance_attention_after"} <= report.keys()
    assert all(value >= 1.0 for value in report.values())


def test_data_workers_give_the_same_batches(tmp_path):
    plain = trainer_for(tmp_path / "a")
    workers = trainer_for(tmp_path / "b", "--data.num_workers=2")
    for a, b in itertools.islice(zip(plain.stream, workers.stream), 3):
        assert torch.equal(a.dense, b.dense)


def test_a_fixed_synthetic_seed_gives_every_run_seed_the_same_data_and_the_run_seed_decides_otherwise(tmp_path):
    from gem_trainer import builders

    def first_batch(*extra):
        config = load_config(None, [f"--run_dir={tmp_path}", *SMALL, *extra])
        return next(iter(builders.build_data(config, init_distributed("cpu", "gloo")).train))

    fixed = [first_batch(f"--seed={seed}", "--data.synthetic.seed=7") for seed in (0, 1)]
    assert torch.equal(fixed[0].dense, fixed[1].dense) and torch.equal(fixed[0].labels, fixed[1].labels)
    assert torch.equal(fixed[0].sparse.values(), fixed[1].sparse.values())
    assert torch.equal(first_batch("--seed=7").dense, fixed[0].dense)  # None: the run's seed
    assert not torch.equal(first_batch("--seed=0").dense, fixed[0].dense)


def test_sources_other_than_synthetic_need_a_path():
    with pytest.raises(ConfigError, match="data.path is required"):
        load_config(None, ["--data.source=sequence_text"])


def test_an_attributes_file_given_must_exist(tmp_path):
    from gem_data.testing import small_corpus
    from gem_trainer import builders

    small_corpus(tmp_path, "shop", 10, 12, attributes=True)
    base = [f"--run_dir={tmp_path / 'run'}", *SMALL, "--data.source=sequence_text", f"--data.path={tmp_path / 'shop.txt'}"]
    # a typo in the attributes file's name must not train without the attributes
    config = load_config(None, [*base, f"--data.sequential.attributes_file={tmp_path / 'shop_typo.json'}"])
    with pytest.raises(FileNotFoundError, match=r"data.sequential.attributes_file: .*shop_typo.json does not exist"):
        builders.build_data(config, init_distributed("cpu", "gloo"))
    config = load_config(None, [*base, f"--data.sequential.attributes_file={tmp_path / 'shop.json'}"])
    assert builders.build_data(config, init_distributed("cpu", "gloo")).spec.candidate == ("item_id", "item_attributes")


def test_a_corpus_without_training_examples_is_named_in_one_line(tmp_path):
    from gem_data import DataError
    from gem_trainer import builders

    (tmp_path / "short.txt").write_text("1 1 2 3\n2 4 5 6 7\n3 6\n")  # a user id, then its items
    config = load_config(None, [f"--run_dir={tmp_path / 'run'}", *SMALL, "--data.source=sequence_text",
                                f"--data.path={tmp_path / 'short.txt'}"])
    builders.build_data(config, init_distributed("cpu", "gloo"))  # user 2 has 4 items: one training example
    (tmp_path / "short.txt").write_text("1 1 2 3\n2 4 5\n3 6\n")
    with pytest.raises(DataError, match=r"short.txt: no training examples: .* 3 of its 3 users have 3 items or fewer"):
        builders.build_data(config, init_distributed("cpu", "gloo"))
