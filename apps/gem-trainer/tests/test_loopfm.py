"""LoopFM through the trainer: `posttrain` writes the teacher's representations per user (resumably, exactly once)
in the same pass as its logits; `train` / `distill` read each example's earlier ones as an input; 2 ranks = 1."""

import json
import os
import subprocess
import sys

import pytest
import torch

from gem_trainer import builders
from gem_trainer.config import ConfigError, load_config
from gem_trainer.distributed import init_distributed
from gem_trainer.posttrain import posttrain
from gem_trainer.run_folder import write_run_record
from gem_trainer.trainer import Trainer
from gem_transfer import RepresentationStore

USERS = ["--data.synthetic.num_users=40", "--data.synthetic.max_events=24"]
# (checkpoints written by the training process: a writer process would cost each run a torch import)
SMALL = ["--data.batch_size=32", "--data.eval_batches=2", "--metrics.tensorboard=false", "--device=cpu",
         "--schedule.warmup_steps=2", "--metrics.progress_bar=false",
         "--checkpoint.asynchronous=false", *USERS]
STEPS = 8


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A finished (briefly trained) baseline run over a user population."""
    run = tmp_path_factory.mktemp("teacher")
    config = load_config(None, [f"--run_dir={run}", "--model.name=baseline", "--schedule.steps=12", *SMALL])
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    write_run_record(config, trainer.spec)
    trainer.train()
    trainer.close()
    return run


@pytest.fixture(scope="module")
def store(teacher, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pass") / "loopfm"
    posttrain(config(tmp_path_factory.mktemp("run"), f"--distillation.teacher_run_dir={teacher}", f"--loopfm.store={folder}"),
              init_distributed("cpu", "gloo"))
    return folder


def config(run_dir, *extra):
    return load_config(None, [f"--run_dir={run_dir}", f"--schedule.steps={STEPS}", *SMALL, *extra])


def stored_rows(folder) -> dict[tuple[int, int], torch.Tensor]:
    store = RepresentationStore(folder)
    import pyarrow.parquet as pq

    rows = {}
    for part in sorted(folder.glob("part-*.parquet")):
        table = pq.read_table(part).to_pydict()
        for step, row, vector in zip(table["step"], table["row"], table["vector"]):
            assert (step, row) not in rows  # each example written once
            rows[(step, row)] = torch.tensor(vector)
    assert len(rows) == store.rows
    return rows


def test_one_teacher_pass_writes_logits_and_every_examples_representation(teacher, tmp_path):
    labels, folder = tmp_path / "labels", tmp_path / "loopfm"
    written = posttrain(config(tmp_path / "pass", f"--distillation.teacher_run_dir={teacher}", f"--distillation.soft_labels={labels}",
                               f"--loopfm.store={folder}"), init_distributed("cpu", "gloo"))
    assert written["rows"] == STEPS * 32 and written["representations"] == {"folder": str(folder), "resumed_at": 0, "rows": STEPS * 32}
    rows = stored_rows(folder)
    stream = builders.build_data(config(tmp_path / "x"), init_distributed("cpu", "gloo"), representations=False).train
    with_events = sum(int((b.num_events() > 0).sum()) for _, b in zip(range(STEPS), stream))
    assert len(rows) == with_events  # examples without events have no time: nothing to store for them
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["dim"] == 16 and meta["layer"] == "representation" and meta["user_feature"] == "user_id"


def test_a_pass_cut_short_continues_where_it_stopped_and_stores_every_example_once(teacher, store, tmp_path, monkeypatch):
    folder = tmp_path / "loopfm"
    build_data = builders.build_data

    def stopping_after_five_batches(*args, **kwargs):
        data = build_data(*args, **kwargs)
        train = data.train

        def cut():
            for i, batch in enumerate(train):
                if i == 5:
                    raise KeyboardInterrupt
                yield batch
        data.train = type("Cut", (), {"__iter__": lambda self: cut()})()
        return data

    monkeypatch.setattr(builders, "build_data", stopping_after_five_batches)
    run = config(tmp_path / "pass", f"--distillation.teacher_run_dir={teacher}", f"--loopfm.store={folder}")
    with pytest.raises(KeyboardInterrupt):
        posttrain(run, init_distributed("cpu", "gloo"))
    monkeypatch.setattr(builders, "build_data", build_data)
    written = posttrain(run, init_distributed("cpu", "gloo"))
    assert written["representations"]["resumed_at"] == 5  # the five scored steps were kept
    resumed, whole = stored_rows(folder), stored_rows(store)
    assert resumed.keys() == whole.keys()  # nothing lost, nothing twice
    for key, vector in whole.items():
        torch.testing.assert_close(resumed[key], vector)


def test_the_student_reads_the_store_and_learns_from_it(store, tmp_path):
    student = config(tmp_path / "student", f"--loopfm.store={store}", "--loopfm.max_events=6")
    trainer = Trainer(student, init_distributed("cpu", "gloo"))
    try:
        assert [r.name for r in trainer.spec.representations] == ["loopfm"]
        batch = next(iter(trainer.data.train))
        batch.validate(trainer.spec)
        history = batch.representations["loopfm"]
        assert int(history.lengths.max()) <= 6 and int(history.lengths.sum()) > 0
        with_loopfm = [float(trainer.train_step()["loss"]) for _ in range(4)]
        assert all(torch.isfinite(torch.tensor(with_loopfm)))
        result = trainer.evaluate()
        assert 0 < result["click/all/auc"] < 1
    finally:
        trainer.close()
    # the same student (same parameters, same histories' lengths) fed the store with every vector zeroed
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    zeroed = tmp_path / "zeroed"
    shutil.copytree(store, zeroed)
    for part in zeroed.glob("part-*.parquet"):
        table = pq.read_table(part)
        vectors = table["vector"].combine_chunks()
        flat = pa.FixedSizeListArray.from_arrays(pa.array([0.0] * len(vectors.values), pa.float32()), vectors.type.list_size)
        pq.write_table(table.set_column(table.schema.get_field_index("vector"), "vector", flat), part)
    blind = Trainer(config(tmp_path / "blind", f"--loopfm.store={zeroed}", "--loopfm.max_events=6"), init_distributed("cpu", "gloo"))
    try:
        without = [float(blind.train_step()["loss"]) for _ in range(4)]
    finally:
        blind.close()
    assert with_loopfm[0] != pytest.approx(without[0], rel=1e-6)  # the representations' values reach the loss


def test_a_store_that_does_not_fit_is_one_line(teacher, store, tmp_path):
    env = init_distributed("cpu", "gloo")
    cases = [
        (["--loopfm.store=" + str(tmp_path / "nowhere")], r"loopfm.store: .*nowhere: no representation store there"),
        ([f"--loopfm.store={store}", "--data.synthetic.num_dense=3"], r"loopfm.store: .* written over data with other features"),
        ([f"--loopfm.store={store}", "--loopfm.user_feature=device"], r"keyed by user feature 'user_id', loopfm.user_feature is 'device'"),
        # the vectors' settings the run would record, and another data set's users, whose ids the store's share
        ([f"--loopfm.store={store}", "--loopfm.dim=8"], r"loopfm.store: .* holds vectors of dim 16, loopfm.dim is 8$"),
        ([f"--loopfm.store={store}", "--loopfm.projection_seed=5"], r"holds vectors of projection_seed 0, loopfm.projection_seed is 5$"),
        ([f"--loopfm.store={store}", "--seed=1"], r"loopfm.store: .* was written over other data than this run's \(seed: 0 -> 1\)"),
        ([f"--loopfm.store={store}", "--data.synthetic.seed=7"],
         r"written over other data than this run's \(data.synthetic.seed: None -> 7\): run posttrain with this config$"),
        # synthetic data draws each global batch whole: another batch size reads other examples
        ([f"--loopfm.store={store}", "--data.batch_size=16"],
         r"written over other data than this run's \(global batch size \(data.batch_size x ranks\): 32 -> 16\)"),
        # a student trained past the teacher's pass: its later examples' histories would stop at the store's end
        ([f"--loopfm.store={store}", f"--schedule.steps={STEPS + 1}"],
         rf"loopfm.store: .* holds the teacher's pass over {STEPS * 32} examples \({STEPS} steps\), this run trains on "
         rf"{(STEPS + 1) * 32}"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message) as error:
            Trainer(config(tmp_path / "s", *extra), env)
        assert "\n" not in str(error.value)
    (store / "progress.json").rename(store / "progress.moved")
    try:
        with pytest.raises(ConfigError, match=r"not a representation store"):
            Trainer(config(tmp_path / "s", f"--loopfm.store={store}"), env)
    finally:
        (store / "progress.moved").rename(store / "progress.json")
    with pytest.raises(ConfigError, match=r"^loopfm.user_feature: user feature 'user_id' is not among the data's sparse features .* data.synthetic.num_users"):
        posttrain(load_config(None, [f"--run_dir={tmp_path / 'p'}", *SMALL, "--data.synthetic.num_users=0",
                                     f"--distillation.teacher_run_dir={teacher}", f"--loopfm.store={tmp_path / 'new'}"]), env)
    with pytest.raises(ConfigError, match=r"loopfm.layer: the teacher has no layer 'trunk.mlp'"):
        posttrain(config(tmp_path / "p", f"--distillation.teacher_run_dir={teacher}", f"--loopfm.store={tmp_path / 'new2'}",
                         "--loopfm.layer=trunk.mlp"), env)
    with pytest.raises(ConfigError, match=r"loopfm.store: .*is a complete representation store already"):
        posttrain(config(tmp_path / "p", f"--distillation.teacher_run_dir={teacher}", f"--loopfm.store={store}"), env)
    with pytest.raises(ConfigError, match=r"posttrain needs distillation.teacher_run_dir"):
        posttrain(config(tmp_path / "p", f"--loopfm.store={tmp_path / 'new3'}"), env)
    with pytest.raises(ConfigError, match=r"loopfm.store: SASRec reads item ids only"):
        load_config(None, ["--model.name=sasrec", "--data.source=sequence_text", "--data.path=x", "--loopfm.store=s"])


def test_a_hooked_layer_of_the_teacher_can_be_stored(teacher, tmp_path):
    folder = tmp_path / "loopfm"
    posttrain(config(tmp_path / "pass", f"--distillation.teacher_run_dir={teacher}", f"--loopfm.store={folder}", "--loopfm.layer=mlp.0",
                     "--loopfm.dim=4", "--schedule.steps=3"), init_distributed("cpu", "gloo"))
    assert RepresentationStore(folder).vectors.shape[1] == 4


@pytest.mark.slow
def test_two_gloo_ranks_train_a_loopfm_student_as_one_process(store, tmp_path):
    def run(ranks: int):
        run_dir = tmp_path / f"ranks-{ranks}"
        command = [sys.executable, "-m", "gem_trainer.cli", "launch", "--nproc-per-node", str(ranks)] if ranks > 1 \
            else [sys.executable, "-m", "gem_trainer.cli", "train"]
        args = [f"--run_dir={run_dir}", *SMALL, f"--data.batch_size={32 // ranks}", f"--schedule.steps={STEPS}",
                "--metrics.log_every=1", "--checkpoint.enable=false", "--model.kunlun.capacity_factor=0", f"--loopfm.store={store}"]
        done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows if r["phase"] == "train"], json.loads((run_dir / "eval.json").read_text())

    one, one_eval = run(1)
    two, two_eval = run(2)
    assert len(one) == STEPS
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=2e-5, atol=2e-6)
    assert two_eval["click/all/auc"] == pytest.approx(one_eval["click/all/auc"], rel=1e-4)


def test_loopfm_and_the_solaris_input_together(teacher, store, tmp_path):
    """The Solaris join runs first and adds its feature; the store, written without it, still fits."""
    student = config(tmp_path / "both", f"--loopfm.store={store}", "--solaris.student_input=fresh",
                     f"--solaris.teacher_run_dir={teacher}")
    trainer = Trainer(student, init_distributed("cpu", "gloo"))
    try:
        assert sorted(r.name for r in trainer.spec.representations) == ["loopfm", "solaris"]
        batch = next(iter(trainer.data.train))
        batch.validate(trainer.spec)
        assert torch.isfinite(torch.tensor(float(trainer.train_step()["loss"])))
    finally:
        trainer.close()


def test_a_finite_stream_read_more_than_once_stores_each_example_once(teacher, tmp_path, monkeypatch):
    """schedule.steps over two epochs of a finite data set: each user's history holds each example once."""
    build_data = builders.build_data
    epoch = []

    def two_epochs_of_four_batches(*args, **kwargs):
        data = build_data(*args, **kwargs)
        epoch[:] = [b for _, b in zip(range(4), data.train)]
        data.train = type("Finite", (), {"__iter__": lambda self: iter(epoch + epoch), "spec": data.train.spec})()
        return data

    monkeypatch.setattr(builders, "build_data", two_epochs_of_four_batches)
    folder = tmp_path / "loopfm"
    posttrain(config(tmp_path / "pass", f"--distillation.teacher_run_dir={teacher}", f"--loopfm.store={folder}"),
              init_distributed("cpu", "gloo"))
    rows = stored_rows(folder)
    assert len(rows) == sum(int((b.num_events() > 0).sum()) for b in epoch) > 0
    assert {step for step, _ in rows} == {0, 1, 2, 3}  # the second epoch's steps added nothing


def test_a_pass_resumed_over_another_data_stream_is_one_line(teacher, tmp_path, monkeypatch):
    folder = tmp_path / "loopfm"
    build_data = builders.build_data

    def stopping_after_two_batches(*args, **kwargs):
        data = build_data(*args, **kwargs)
        train = data.train

        def cut():
            for i, batch in enumerate(train):
                if i == 2:
                    raise KeyboardInterrupt
                yield batch
        data.train = type("Cut", (), {"__iter__": lambda self: cut()})()
        return data

    monkeypatch.setattr(builders, "build_data", stopping_after_two_batches)
    with pytest.raises(KeyboardInterrupt):
        posttrain(config(tmp_path / "pass", f"--distillation.teacher_run_dir={teacher}", f"--loopfm.store={folder}"),
                  init_distributed("cpu", "gloo"))
    monkeypatch.setattr(builders, "build_data", build_data)
    changed = config(tmp_path / "pass", f"--distillation.teacher_run_dir={teacher}", f"--loopfm.store={folder}",
                     "--data.balance=true")
    with pytest.raises(ConfigError, match=r"loopfm.store: .* another pass \(differs in data.balance\)") as error:
        posttrain(changed, init_distributed("cpu", "gloo"))
    assert "\n" not in str(error.value)


def test_the_store_covers_the_steps_schedule_epochs_resolves_to(tmp_path):
    """Under schedule.epochs the coverage check counts the steps the epochs resolve to (28 here), not the
    schedule.steps placeholder (600): a store of exactly those steps is taken, one step short is refused."""
    from gem_trainer.run_folder import spec_record
    from gem_transfer import RepresentationWriter, example_times, example_users

    lines = [f"{u} " + " ".join(str(1 + (u * 7 + 3 * k + k * k) % 60) for k in range(5 + u % 8)) for u in range(1, 81)]
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    env = init_distributed("cpu", "gloo")

    def epochs_config(store):
        return load_config(None, [
            f"--run_dir={tmp_path / 'run'}", f"--data.path={tmp_path / 'corpus.txt'}", "--data.batch_size=16", "--device=cpu",
            "--metrics.tensorboard=false", "--schedule.warmup_steps=2", "--schedule.epochs=1", "--data.source=sequence_text",
            "--model.name=kunlun", "--model.kunlun.two_tower=true", "--model.kunlun.max_seq_len=16",
            "--data.sequential.max_history=12", "--data.sequential.objective=retrieval", "--data.sequential.queries=last",
            "--data.sequential.loss=softmax", "--data.sequential.with_user_id=true", "--loopfm.key_only=true",
            f"--loopfm.store={store}"])

    data = builders.build_data(epochs_config(tmp_path / "unused"), env, representations=False)
    steps = builders.resolve_schedule(epochs_config(tmp_path / "unused"), data, env).schedule.steps
    assert steps == 28 and data.rows_per_epoch == 440
    for written, taken in ((steps, True), (steps - 1, False)):
        store = tmp_path / f"store{written}"
        config = epochs_config(store)
        # the store as posttrain writes it over this data (no teacher needed to check the coverage)
        meta = {"teacher": {"run_dir": "teacher", "step": 1}, "spec": spec_record(builders.model_spec(config, data.spec)),
                "global_batch_size": 16, "seed": config.seed, "data": config.data.model_dump(mode="json"), "dim": 16,
                "layer": "representation", "projection": "gaussian", "projection_seed": 0, "user_feature": "user_id"}
        writer, batches = RepresentationWriter(store, meta), iter(builders.build_data(config, env, representations=False).train)
        for step in range(written):
            batch = next(batches)
            writer.append(step, example_users(batch, "user_id"), example_times(batch), torch.zeros(batch.batch_size, 16))
        writer.close()
        if taken:
            assert builders.build_data(config, env).train.spec.representations
        else:
            with pytest.raises(ConfigError, match=rf"over {written * 16} examples \({written} steps\), this run trains on "
                                                  rf"{steps * 16} \({steps} steps x data.batch_size x ranks\)"):
                builders.build_data(config, env)
