"""Offline distillation: `posttrain` writes the teacher's logits once, `distill` trains on them without the teacher.

The stored path must train the student exactly as the online path (the teacher inside every step) does."""

import json
import subprocess
import sys

import pytest
import torch

from gem_trainer.config import ConfigError, load_config
from gem_trainer.distributed import init_distributed
from gem_trainer.posttrain import posttrain
from gem_trainer.run_folder import write_run_record
from gem_trainer.trainer import Trainer
from gem_transfer import SoftLabelError

# (checkpoints written by the training process: a writer process would cost each run a torch import)
SMALL = ["--data.batch_size=32", "--data.eval_batches=2", "--metrics.tensorboard=false", "--device=cpu",
         "--schedule.warmup_steps=2", "--metrics.progress_bar=false",
         "--checkpoint.asynchronous=false"]
STEPS = 8


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A finished (briefly trained) baseline run to distil from."""
    run = tmp_path_factory.mktemp("teacher")
    config = load_config(None, [f"--run_dir={run}", "--model.name=baseline", "--schedule.steps=20", *SMALL])
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    write_run_record(config, trainer.spec)
    trainer.train()
    trainer.close()
    return run


def student_config(run_dir, *extra):
    return load_config(None, [f"--run_dir={run_dir}", f"--schedule.steps={STEPS}", *SMALL, *extra])


def losses(config, steps=STEPS) -> list[float]:
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    try:
        return [float(trainer.train_step()["loss"]) for _ in range(steps)]
    finally:
        trainer.close()


def test_stored_soft_labels_train_the_student_exactly_as_the_online_teacher(teacher, tmp_path):
    labels = tmp_path / "labels"
    written = posttrain(student_config(tmp_path / "pass", f"--distillation.teacher_run_dir={teacher}",
                                       f"--distillation.soft_labels={labels}"), init_distributed("cpu", "gloo"))
    assert written == {"folder": str(labels), "steps": STEPS, "rows": STEPS * 32, "teacher_step": 20}
    online = losses(student_config(tmp_path / "online", f"--distillation.teacher_run_dir={teacher}"))
    offline_config = student_config(tmp_path / "offline", f"--distillation.soft_labels={labels}")
    trainer = Trainer(offline_config, init_distributed("cpu", "gloo"))
    assert trainer.teacher is None and trainer.soft_labels is not None  # the teacher is never loaded
    trainer.close()
    offline = losses(offline_config)
    assert offline == pytest.approx(online, rel=1e-6, abs=1e-7)
    plain = losses(student_config(tmp_path / "plain"))
    assert plain != pytest.approx(online, rel=1e-3)  # the stored labels do reach the loss


def test_an_online_student_keeps_its_teacher_checkpoint_when_resumed(teacher, tmp_path):
    """The student records the teacher step it started with; the teacher training on meanwhile (a newer checkpoint)
    does not change the teacher of the resumed student. A step the teacher no longer holds is one line."""
    import shutil

    copy = tmp_path / "teacher"
    shutil.copytree(teacher, copy)
    run = tmp_path / "student"
    config = student_config(run, f"--distillation.teacher_run_dir={copy}", "--checkpoint.every_steps=4")
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    assert trainer.config.distillation.teacher_step == 20
    write_run_record(trainer.config, trainer.spec)
    trainer.close()
    # the teacher trains on to step 30 (a new checkpoint beside step 20)
    longer = [f"--run_dir={copy}", "--schedule.steps=30", "--checkpoint.keep_latest=3"]
    more = Trainer(load_config(copy / "config.toml", longer), init_distributed("cpu", "gloo"))
    more.train()
    more.close()
    (run / "checkpoints" / "step-4").mkdir(parents=True)  # a resume: the student's run holds checkpoints
    (run / "checkpoints" / "step-4" / "COMPLETE").write_text("{}")
    resumed = Trainer(student_config(run, f"--distillation.teacher_run_dir={copy}"), init_distributed("cpu", "gloo"))
    assert resumed.config.distillation.teacher_step == 20
    resumed.close()
    fresh = Trainer(student_config(tmp_path / "fresh", f"--distillation.teacher_run_dir={copy}"), init_distributed("cpu", "gloo"))
    assert fresh.config.distillation.teacher_step == 30  # a new student takes the teacher's newest
    fresh.close()
    with pytest.raises(ConfigError, match=r"^distillation\.teacher_step: no complete checkpoint 25 under .* \(complete: \[20, 30\]\)$"):
        Trainer(student_config(tmp_path / "x", f"--distillation.teacher_run_dir={copy}", "--distillation.teacher_step=25"),
                init_distributed("cpu", "gloo"))
    # a pass over a pinned, older checkpoint records that checkpoint (its store's provenance), not the newest
    labels = tmp_path / "labels-20"
    written = posttrain(student_config(tmp_path / "pass", f"--distillation.teacher_run_dir={copy}",
                                       "--distillation.teacher_step=20", f"--distillation.soft_labels={labels}"),
                        init_distributed("cpu", "gloo"))
    assert written["teacher_step"] == 20 and json.loads((labels / "meta.json").read_text())["teacher"]["step"] == 20


def test_a_pass_records_the_checkpoint_it_loaded_while_the_teacher_trains_on(teacher, tmp_path, monkeypatch):
    """The teacher writes a newer checkpoint once the pass has loaded its newest: the store records the one loaded."""
    import shutil

    from gem_trainer import builders

    copy = tmp_path / "teacher"
    shutil.copytree(teacher, copy)
    load = builders.build_teacher

    def load_then_the_teacher_saves(*args):
        loaded = load(*args)
        shutil.copytree(copy / "checkpoints" / "step-20", copy / "checkpoints" / "step-30")
        return loaded

    monkeypatch.setattr(builders, "build_teacher", load_then_the_teacher_saves)
    labels = tmp_path / "labels"
    written = posttrain(student_config(tmp_path / "pass", f"--distillation.teacher_run_dir={copy}",
                                       f"--distillation.soft_labels={labels}"), init_distributed("cpu", "gloo"))
    assert written["teacher_step"] == 20 and json.loads((labels / "meta.json").read_text())["teacher"]["step"] == 20


def test_a_store_that_does_not_fit_the_run_is_refused_in_one_line(teacher, tmp_path):
    labels = tmp_path / "labels"
    posttrain(student_config(tmp_path / "pass", f"--distillation.teacher_run_dir={teacher}", f"--distillation.soft_labels={labels}",
                             "--schedule.steps=4"), init_distributed("cpu", "gloo"))
    env = init_distributed("cpu", "gloo")
    with pytest.raises(ConfigError, match=r"distillation.soft_labels: .*labels holds 4 steps, schedule.steps is 8"):
        Trainer(student_config(tmp_path / "a", f"--distillation.soft_labels={labels}"), env)
    with pytest.raises(ConfigError, match=r"global batches of 32 examples, this run reads 16"):
        Trainer(student_config(tmp_path / "b", f"--distillation.soft_labels={labels}", "--schedule.steps=4",
                               "--data.batch_size=16"), env)
    with pytest.raises(ConfigError, match=r"written for other features"):
        Trainer(student_config(tmp_path / "c", f"--distillation.soft_labels={labels}", "--schedule.steps=4",
                               "--data.synthetic.num_dense=3"), env)
    # a run naming another teacher or checkpoint than the store's would record one it never learnt from
    with pytest.raises(ConfigError, match=r"^distillation.soft_labels: .*labels was written by the teacher at .*, "
                                          r"distillation.teacher_run_dir is /elsewhere$"):
        Trainer(student_config(tmp_path / "g", f"--distillation.soft_labels={labels}", "--schedule.steps=4",
                               "--distillation.teacher_run_dir=/elsewhere"), env)
    with pytest.raises(ConfigError, match=r"^distillation.soft_labels: .*labels holds the logits of the teacher's "
                                          r"checkpoint 20, distillation.teacher_step is 10$"):
        Trainer(student_config(tmp_path / "h", f"--distillation.soft_labels={labels}", "--schedule.steps=4",
                               f"--distillation.teacher_run_dir={teacher}", "--distillation.teacher_step=10"), env)
    Trainer(student_config(tmp_path / "i", f"--distillation.soft_labels={labels}", "--schedule.steps=4",
                           f"--distillation.teacher_run_dir={teacher}", "--distillation.teacher_step=20"), env).close()
    with pytest.raises(ConfigError, match=r"incomplete soft-label store"):
        (tmp_path / "broken").mkdir()
        Trainer(student_config(tmp_path / "d", f"--distillation.soft_labels={tmp_path / 'broken'}"), env)
    # the same features but other examples (another seed draws other data): found at the first step
    trainer = Trainer(student_config(tmp_path / "e", f"--distillation.soft_labels={labels}", "--schedule.steps=4",
                                     "--seed=7"), env)
    with pytest.raises(SoftLabelError, match=r"32 of step 0's 32 examples have no stored labels"):
        trainer.train_step()
    trainer.close()
    with pytest.raises(ConfigError, match=r"labels already exists"):
        posttrain(student_config(tmp_path / "pass", f"--distillation.teacher_run_dir={teacher}",
                                 f"--distillation.soft_labels={labels}"), env)


@pytest.mark.slow
def test_posttrain_and_distill_from_the_command_line(teacher, tmp_path):
    labels, student = tmp_path / "labels", tmp_path / "student"
    common = [f"--schedule.steps={STEPS}", *SMALL]

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "gem_trainer.cli", *args], capture_output=True, text=True, timeout=600)

    done = cli("distill", f"--run_dir={student}", *common)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "distill needs distillation.soft_labels" in done.stderr
    done = cli("posttrain", f"--run_dir={tmp_path / 'pass'}", f"--distillation.teacher_run_dir={teacher}",
               f"--distillation.soft_labels={labels}", *common)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"for {STEPS * 32} examples of {STEPS} steps to {labels}" in done.stdout
    done = cli("distill", f"--run_dir={student}", f"--distillation.soft_labels={labels}", *common)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((student / "eval.json").read_text())
    assert result["step"] == STEPS and 0.0 < result["click/all/auc"] < 1.0


@pytest.mark.slow
def test_two_ranks_write_and_read_the_store_as_one_process(teacher, tmp_path):
    """posttrain on 2 Gloo ranks stores what 1 process stores; distill on 2 ranks trains as 1 process does."""
    import os

    from gem_transfer import SoftLabelStore

    def run(ranks, command, run_dir, *extra):
        launcher = ["launch", "--nproc-per-node", str(ranks), "--command", command] if ranks > 1 else [command]
        done = subprocess.run([sys.executable, "-m", "gem_trainer.cli", *launcher, f"--run_dir={run_dir}",
                               f"--schedule.steps={STEPS}", *SMALL, f"--data.batch_size={32 // ranks}", "--metrics.log_every=1",
                               *extra], capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]

    one, two = tmp_path / "labels-1", tmp_path / "labels-2"
    run(1, "posttrain", tmp_path / "p1", f"--distillation.teacher_run_dir={teacher}", f"--distillation.soft_labels={one}")
    run(2, "posttrain", tmp_path / "p2", f"--distillation.teacher_run_dir={teacher}", f"--distillation.soft_labels={two}")
    import pyarrow.parquet as pq

    tables = [pq.read_table(folder / "part-00000.parquet").to_pydict() for folder in (one, two)]
    rows = [sorted(zip(t["step"], t["fingerprint"], t["logits"])) for t in tables]
    assert len(rows[0]) == STEPS * 32 and [r[:2] for r in rows[0]] == [r[:2] for r in rows[1]]
    assert all(a[2] == pytest.approx(b[2], rel=1e-5, abs=1e-6) for a, b in zip(rows[0], rows[1]))
    assert SoftLabelStore(two).meta["global_batch_size"] == 32

    run(1, "distill", tmp_path / "s1", f"--distillation.soft_labels={one}")
    run(2, "distill", tmp_path / "s2", f"--distillation.soft_labels={one}")
    logged = [[json.loads(line)["loss"] for line in (tmp_path / s / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["phase"] == "train"] for s in ("s1", "s2")]
    assert len(logged[0]) == STEPS and logged[1] == pytest.approx(logged[0], rel=1e-5, abs=1e-6)


def sequence_file(folder):
    """A small next-item corpus (users with 5 to 12 items out of 60)."""
    lines = [f"{u} " + " ".join(str(1 + (u * 7 + 3 * k + k * k) % 60) for k in range(5 + u % 8)) for u in range(1, 81)]
    path = folder / "corpus.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("queries", ["every", "last"])
def test_retrieval_students_distil_each_querys_candidates_offline_as_online(tmp_path, queries):
    """SASRec teacher and student on next-item retrieval: the stored path (several queries per example with
    queries = every) trains exactly as the online teacher, and the stored labels change the training."""
    data = [f"--data.path={sequence_file(tmp_path)}", "--data.source=sequence_text", "--model.name=sasrec",
            "--data.sequential.objective=retrieval", f"--data.sequential.queries={queries}", "--data.sequential.num_negatives=3",
            "--data.sequential.max_history=12", "--model.sasrec.max_seq_len=12", "--model.sasrec.dim=16",
            "--data.sequential.eval_protocols=[\"sampled\"]", "--data.sequential.eval_negatives=20"]
    env = init_distributed("cpu", "gloo")
    teacher = tmp_path / "teacher"
    config = load_config(None, [f"--run_dir={teacher}", "--schedule.steps=10", *SMALL, *data])
    trainer = Trainer(config, env)
    write_run_record(config, trainer.spec)
    trainer.train()
    trainer.close()
    labels = tmp_path / "labels"
    posttrain(student_config(tmp_path / "pass", f"--distillation.teacher_run_dir={teacher}", f"--distillation.soft_labels={labels}",
                             *data), env)
    online = losses(student_config(tmp_path / "online", f"--distillation.teacher_run_dir={teacher}", *data))
    offline = losses(student_config(tmp_path / "offline", f"--distillation.soft_labels={labels}", *data))
    plain = losses(student_config(tmp_path / "plain", *data))
    assert offline == pytest.approx(online, rel=1e-6, abs=1e-7)
    assert plain != pytest.approx(online, rel=1e-3)
    with pytest.raises(ConfigError, match="num_negatives >= 1"):
        student_config(tmp_path / "full", f"--distillation.soft_labels={labels}", *data, "--data.sequential.num_negatives=0",
                       "--data.sequential.loss=softmax")


def test_the_adapter_corrects_a_teacher_trained_on_an_earlier_time_window(tmp_path):
    """MovieLens-100K's time split: the teacher learns the offline period only, the student the online period
    after it; on the student's data, the adapter's corrected teacher fits the true labels better than the
    teacher's own logits."""
    from pathlib import Path

    from torch.nn import functional as F

    from gem_data.testing import find_repo_root, shared_data_dir

    movielens = shared_data_dir(find_repo_root(Path(__file__))) / "ml-100k"
    if not movielens.is_dir():
        pytest.skip(f"shared real data not found at {movielens} (expected ../shared/data beside the repository)")
    config_file = Path(__file__).resolve().parent.parent / "configs" / "mixing-ml100k-time.toml"
    pointwise = [f"--data.path={movielens}", "--data.sequential.objective=pointwise", "--data.sequential.num_negatives=1",
                 "--data.sequential.loss=binary", "--model.sasrec.dim=16", "--data.sequential.eval_users=32",
                 "--data.mixture.online_share_end=none", "--data.mixture.ramp_start=0", "--data.mixture.ramp_steps=0",
                 "--data.batch_size=64", "--schedule.warmup_steps=2",
                 "--metrics.tensorboard=false", "--metrics.progress_bar=false", "--device=cpu"]
    env = init_distributed("cpu", "gloo")
    teacher = tmp_path / "teacher"
    config = load_config(config_file, [f"--run_dir={teacher}", *pointwise, "--data.mixture.online_share_start=0.0",
                                       "--schedule.steps=150"])
    trainer = Trainer(config, env)
    write_run_record(config, trainer.spec)
    trainer.train()
    trainer.close()
    student = Trainer(load_config(config_file, [f"--run_dir={tmp_path / 'student'}", *pointwise, "--schedule.steps=400", "--optimizer.lr=5e-3",
                                                "--data.mixture.online_share_start=1.0", f"--distillation.teacher_run_dir={teacher}",
                                                "--checkpoint.enable=false"]), env)
    for _ in range(200):
        student.train_step()
    raw = corrected = 0.0
    with torch.no_grad():
        for _ in range(8):  # the online period's next batches, not yet trained on
            batch = next(student._batches)
            teacher_logits = student.teacher(batch).logits.float()
            out = student.model(batch, teacher_logits)
            raw += F.binary_cross_entropy_with_logits(teacher_logits, batch.labels).item()
            corrected += F.binary_cross_entropy_with_logits(out.corrected_teacher_logits, batch.labels).item()
    student.close()
    # paired over the same 512 examples: the teacher is decent on the later period, the adapter still gains ~1%
    assert corrected < 0.995 * raw, (corrected, raw)
