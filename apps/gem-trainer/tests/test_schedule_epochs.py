"""``schedule.epochs``: the training length in passes over the data, resolved to ``schedule.steps`` once the data
is built, for the loop, the run record and the teacher's pass of offline distillation alike."""

import json
import math

import pytest

from gem_trainer import builders
from gem_trainer.cli import main
from gem_trainer.config import ConfigError, load_config
from gem_trainer.distributed import init_distributed
from gem_trainer.posttrain import posttrain
from gem_trainer.run_folder import write_run_record
from gem_trainer.trainer import Trainer
from gem_transfer import SoftLabelStore

SMALL = ["--device=cpu", "--metrics.tensorboard=false", "--metrics.progress_bar=false", "--metrics.log_every=1",
         "--schedule.warmup_steps=1", "--data.batch_size=16", "--data.source=sequence_text", "--model.name=sasrec",
         "--model.sasrec.dim=16", "--model.sasrec.max_seq_len=12", "--data.sequential.max_history=12",
         "--data.sequential.eval_protocols=[\"sampled\"]", "--data.sequential.eval_negatives=20"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    """A small next-item corpus (80 users with 5 to 12 items out of 60), as overrides."""
    folder = tmp_path_factory.mktemp("epochs")
    lines = [f"{u} " + " ".join(str(1 + (u * 7 + 3 * k + k * k) % 60) for k in range(5 + u % 8)) for u in range(1, 81)]
    (folder / "corpus.txt").write_text("\n".join(lines) + "\n")
    return [f"--data.path={folder / 'corpus.txt'}", *SMALL]


def rows_per_epoch(data: list[str]) -> int:
    config = load_config(None, data)
    return builders.build_data(config, init_distributed("cpu", "gloo")).rows_per_epoch


def trained_steps(run_dir) -> list[int]:
    return [row["step"] for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if row["phase"] == "train"]


def test_train_runs_the_steps_of_its_epochs_and_records_them(data, tmp_path, capsys):
    rows = rows_per_epoch(data)
    steps = math.ceil(2 * rows / 16)
    assert main(["train", f"--run_dir={tmp_path}", *data, "--schedule.epochs=2", "--eval.at_end=false"]) == 0
    assert trained_steps(tmp_path) == list(range(1, steps + 1))
    assert f"schedule.epochs 2 = {steps:,} steps of 16 examples ({rows:,} rows per epoch)" in capsys.readouterr().out
    recorded = load_config(tmp_path / "config.toml").schedule
    assert (recorded.epochs, recorded.steps) == (2, steps)


def test_config_says_that_epochs_decide_the_steps(data, capsys):
    assert main(["config", *data, "--schedule.epochs=2"]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[-1].startswith("# schedule.steps = 600 stands in: schedule.epochs = 2.0 decides the steps")
    assert main(["config", *data]) == 0 and "stands in" not in capsys.readouterr().out


def test_a_batch_twice_as_large_runs_half_the_steps(data, tmp_path):
    rows = rows_per_epoch(data)
    config = load_config(None, [f"--run_dir={tmp_path}", *data, "--schedule.epochs=2", "--data.batch_size=32",
                                "--checkpoint.enable=false"])
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    try:
        trainer.train()
    finally:
        trainer.close()
    assert trainer.step == trainer.config.schedule.steps == math.ceil(2 * rows / 32)
    assert trainer.step == math.ceil(math.ceil(2 * rows / 16) / 2)
    assert trained_steps(tmp_path)[-1] == trainer.step


def test_posttrain_covers_the_steps_the_students_epochs_resolve_to(data, tmp_path):
    env = init_distributed("cpu", "gloo")
    teacher = load_config(None, [f"--run_dir={tmp_path / 'teacher'}", *data, "--schedule.steps=4"])
    trainer = Trainer(teacher, env)
    write_run_record(trainer.config, trainer.spec)
    trainer.train()
    trainer.close()
    labels = tmp_path / "labels"
    student = [*data, "--schedule.epochs=1.5"]
    written = posttrain(load_config(None, [f"--run_dir={tmp_path / 'pass'}", *student,
                                           f"--distillation.teacher_run_dir={tmp_path / 'teacher'}",
                                           f"--distillation.soft_labels={labels}"]), env)
    steps = math.ceil(1.5 * rows_per_epoch(data) / 16)
    assert written["steps"] == SoftLabelStore(labels).steps == steps
    distilled = Trainer(load_config(None, [f"--run_dir={tmp_path / 'student'}", *student, f"--distillation.soft_labels={labels}"]), env)
    distilled.close()
    assert distilled.config.schedule.steps == steps


def test_epochs_of_an_endless_stream_are_a_config_error():
    with pytest.raises(ConfigError, match=r"schedule\.epochs .*data\.source = \"synthetic\" is an endless stream"):
        load_config(None, ["--schedule.epochs=2"])
    with pytest.raises(ConfigError, match=r"schedule\.epochs .*data\.mixture is an endless stream"):
        load_config(None, ["--schedule.epochs=2", '--data.mixture.sources=[{name="a"}, {name="b", seed=1}]'])


def test_warmup_is_checked_against_the_resolved_steps(data, tmp_path):
    steps = math.ceil(rows_per_epoch(data) / 16)
    # at load the steps are not known yet: the warmup is checked once the data is read
    config = load_config(None, [f"--run_dir={tmp_path}", *data, "--schedule.epochs=1", f"--schedule.warmup_steps={steps}"])
    with pytest.raises(ConfigError, match=rf"schedule\.warmup_steps \({steps}\) must be below the {steps} steps of schedule\.epochs"):
        Trainer(config, init_distributed("cpu", "gloo"))
    below = load_config(None, [f"--run_dir={tmp_path}", *data, "--schedule.epochs=1", f"--schedule.warmup_steps={steps - 1}"])
    resolved = builders.resolve_schedule(below, builders.build_data(below, init_distributed("cpu", "gloo")),
                                         init_distributed("cpu", "gloo"))
    assert resolved.schedule.steps == steps and below.schedule.steps == 600


def test_the_later_layer_gives_the_training_length(tmp_path):
    base = tmp_path / "base.toml"
    base.write_text('[data]\nsource = "sequence_text"\npath = "x.txt"\n[schedule]\nepochs = 6\nwarmup_steps = 5\n')
    child = tmp_path / "child.toml"
    child.write_text('base = "base.toml"\n[schedule]\nsteps = 70\n')
    # an override of either replaces the other: `--schedule.steps` shortens a recipe given in epochs
    assert load_config(base, ["--schedule.steps=40"]).schedule.model_dump(include={"steps", "epochs"}) == {"steps": 40, "epochs": None}
    assert load_config(child).schedule.model_dump(include={"steps", "epochs"}) == {"steps": 70, "epochs": None}
    assert load_config(child, ["--schedule.epochs=2"]).schedule.epochs == 2
    # in one file both (a run record): the epochs decide, the steps being what they resolved to
    both = tmp_path / "both.toml"
    both.write_text('[data]\nsource = "sequence_text"\npath = "x.txt"\n[schedule]\nepochs = 6\nsteps = 123\n')
    assert load_config(both).schedule.model_dump(include={"steps", "epochs"}) == {"steps": 123, "epochs": 6}
