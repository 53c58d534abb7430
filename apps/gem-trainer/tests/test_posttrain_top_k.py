"""`posttrain` with distillation.top_k: a retrieval teacher scores the whole catalogue and only its k best items per query
(other than the next one) are stored; the student then distils on them while its serving head trains on its
own candidates. A Kunlun two-tower teacher and a narrower Kunlun student, as in bench_transfer's Beauty section."""

import json
import math

import pytest
import torch

from gem_trainer import builders
from gem_trainer.config import ConfigError, load_config
from gem_trainer.distributed import init_distributed
from gem_trainer.posttrain import posttrain
from gem_trainer.trainer import Trainer
from gem_transfer import SoftLabelStore, TopKLogits, example_fingerprints, top_k_logits

STUDENT = ["--model.kunlun.d_model=16", "--model.kunlun.num_layers=1", "--model.kunlun.hidden=[16]",
           "--data.sequential.num_negatives=3"]  # a narrower student of the shared retrieval teacher
STEPS, K = 6, 5


@pytest.fixture(scope="module")
def corpus(retrieval_teacher):
    return retrieval_teacher


def student_config(run_dir, data, *extra):
    return load_config(None, [f"--run_dir={run_dir}", f"--schedule.steps={STEPS}", *data, *STUDENT, *extra])


def losses(config) -> list[float]:
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    try:
        return [float(trainer.train_step()["loss"]) for _ in range(STEPS)]
    finally:
        trainer.close()


def test_posttrain_stores_the_teachers_top_k_of_the_catalogue_and_the_student_distils_on_it(corpus, tmp_path):
    folder, data = corpus
    env = init_distributed("cpu", "gloo")
    labels = tmp_path / "labels"
    config = student_config(tmp_path / "pass", data, f"--distillation.teacher_run_dir={folder / 'teacher'}",
                            f"--distillation.soft_labels={labels}", f"--distillation.top_k={K}")
    written = posttrain(config, env)
    assert written["steps"] == STEPS and written["rows"] == STEPS * 16
    meta = json.loads((labels / "meta.json").read_text())
    assert meta["top_k"] == K and meta["width"] == 1 + K

    # step 0's rows are the teacher's own scores of every item for the student's first batch, cut to its top k
    trainer = Trainer(student_config(tmp_path / "look", data), env)
    batch = next(trainer._batches)
    teacher, _ = builders.build_teacher(config, trainer.spec, env)
    trainer.close()
    targets = batch.next_items
    assert targets.negatives.shape == (16, 3)  # the student trains against 3 sampled items; the teacher saw all 60
    with torch.no_grad():
        catalogue = teacher(dataclasses_replace_catalogue(batch)).logits.float()
    expected = top_k_logits(catalogue, targets.positives, K)
    stored = SoftLabelStore(labels).lookup(0, example_fingerprints(batch))
    assert isinstance(stored, TopKLogits)
    assert torch.equal(stored.items, expected.items)
    torch.testing.assert_close(stored.logits, expected.logits)
    assert not (stored.items == targets.positives[:, None]).any()

    distilled = losses(student_config(tmp_path / "distilled", data, f"--distillation.soft_labels={labels}"))
    plain = losses(student_config(tmp_path / "plain", data))
    assert all(torch.isfinite(torch.tensor(distilled))) and distilled != pytest.approx(plain, rel=1e-3)


def test_posttrain_adds_a_weighted_tail_of_the_catalogue_and_the_student_distils_on_it(corpus, tmp_path):
    folder, data = corpus
    env = init_distributed("cpu", "gloo")
    tail = 7
    labels = tmp_path / "labels"
    config = student_config(tmp_path / "pass", data, f"--distillation.teacher_run_dir={folder / 'teacher'}",
                            f"--distillation.soft_labels={labels}", f"--distillation.top_k={K}", f"--distillation.tail_samples={tail}")
    posttrain(config, env)
    meta = json.loads((labels / "meta.json").read_text())
    assert meta["top_k"] == K + tail and meta["width"] == 1 + K + tail and len(meta["log_weights"]) == 1 + K + tail

    trainer = Trainer(student_config(tmp_path / "look", data), env)
    batch = next(trainer._batches)
    teacher, _ = builders.build_teacher(config, trainer.spec, env)
    trainer.close()
    with torch.no_grad():
        catalogue = teacher(dataclasses_replace_catalogue(batch)).logits.float()
    stored = SoftLabelStore(labels).lookup(0, example_fingerprints(batch))
    best = top_k_logits(catalogue, batch.next_items.positives, K)
    assert torch.equal(stored.items[:, :K], best.items)  # the top k, then the tail: other items, with their logits
    drawn = stored.items[:, K:]
    assert not (drawn[:, :, None] == torch.cat([batch.next_items.positives[:, None], best.items], 1)[:, None, :]).any()
    torch.testing.assert_close(stored.logits[:, 1 + K:], catalogue.gather(1, drawn))
    num_items = catalogue.shape[1]
    torch.testing.assert_close(stored.log_weights[1 + K:], torch.full((tail,), math.log((num_items - 1 - K) / tail)))
    # a second pass draws the same tail (a function of the seed and the step)
    again = tmp_path / "again"
    posttrain(student_config(tmp_path / "pass2", data, f"--distillation.teacher_run_dir={folder / 'teacher'}",
                             f"--distillation.soft_labels={again}", f"--distillation.top_k={K}", f"--distillation.tail_samples={tail}"), env)
    assert torch.equal(SoftLabelStore(again).lookup(0, example_fingerprints(batch)).items, stored.items)

    for adapter in ("false", "true"):
        distilled = losses(student_config(tmp_path / f"distilled-{adapter}", data, f"--distillation.soft_labels={labels}",
                                          f"--distillation.adapter={adapter}"))
        assert all(torch.isfinite(torch.tensor(distilled)))


def dataclasses_replace_catalogue(batch):
    import dataclasses

    return dataclasses.replace(batch, next_items=dataclasses.replace(batch.next_items, negatives=None, loss="softmax"))


def test_bad_top_k_is_a_one_line_error_naming_it(corpus, tmp_path):
    folder, data = corpus
    env = init_distributed("cpu", "gloo")
    teacher = f"--distillation.teacher_run_dir={folder / 'teacher'}"
    with pytest.raises(ConfigError, match=r"^override --distillation.top_k=0: distillation.top_k: Input should be greater than or equal to 1 \(got 0\)$"):
        student_config(tmp_path / "a", data, teacher, "--distillation.top_k=0")
    with pytest.raises(ConfigError, match=r"distillation.top_k chooses what posttrain stores in distillation.soft_labels"):
        student_config(tmp_path / "a", data, teacher, "--distillation.top_k=5")  # online: nothing to choose
    config = student_config(tmp_path / "b", data, teacher, f"--distillation.soft_labels={tmp_path / 'b-labels'}", "--distillation.top_k=500")
    with pytest.raises(ConfigError, match=r"^distillation.top_k / tail_samples: k must lie in \[1, \d+\] \(the catalogue's items but the next one\), got 500$"):
        posttrain(config, env)
    assert not (tmp_path / "b-labels").exists()  # the pass stopped: no store that looks complete
    config = student_config(tmp_path / "c", data, teacher, f"--distillation.soft_labels={tmp_path / 'c-labels'}", "--distillation.top_k=5",
                            "--distillation.tail_samples=500")
    with pytest.raises(ConfigError, match=r"^distillation.top_k / tail_samples: the tail must lie in \[1, \d+\] .*got 500$"):
        posttrain(config, env)
    with pytest.raises(ConfigError, match=r"distillation.tail_samples extends the teacher's top k \(distillation.top_k\): set it"):
        student_config(tmp_path / "f", data, teacher, f"--distillation.soft_labels={tmp_path / 'f-labels'}", "--distillation.tail_samples=3")
    with pytest.raises(ConfigError, match=r"distillation.top_k applies to next-item data with data.sequential.objective"):
        load_config(None, [f"--run_dir={tmp_path / 'd'}", teacher, "--distillation.top_k=5"])
    with pytest.raises(ConfigError, match=r"distillation.top_k applies to next-item data with data.sequential.objective = \"retrieval\""):
        load_config(None, [f"--run_dir={tmp_path / 'e'}", *data, "--model.kunlun.two_tower=false",
                                 "--data.sequential.objective=pointwise", "--data.sequential.loss=binary", "--distillation.top_k=5"])


def test_each_rank_draws_its_own_tail():
    """The i-th query of every rank once drew from one stream (seeded by the seed and the step alone): with the same
    logits, nearly the same tail on every rank. Each rank now draws its own, the same again for the same rank."""
    from gem_trainer.posttrain import tail_generator

    logits = torch.randn(8, 500)
    positives = torch.randint(0, 500, (8,))
    drawn = {rank: top_k_logits(logits, positives, 5, 20, tail_generator(0, 3, rank)).items[:, 5:] for rank in (0, 1)}
    shared = (drawn[0][:, :, None] == drawn[1][:, None, :]).any(-1).sum(-1).float().mean()
    assert shared < 5  # of 20 per query: ~0.8 by chance among 494 items
    again = top_k_logits(logits, positives, 5, 20, tail_generator(0, 3, 1)).items[:, 5:]
    assert torch.equal(again, drawn[1])


def test_a_student_trained_against_the_catalogue_distils_on_the_top_k(corpus, tmp_path):
    """data.sequential.num_negatives = 0: the serving head trains against every item; the teacher's top k of the
    catalogue (and a tail) reach it through the same item vectors (no sampled candidates to widen)."""
    folder, data = corpus
    env = init_distributed("cpu", "gloo")
    labels, catalogue = tmp_path / "labels", "--data.sequential.num_negatives=0"
    top_k = [f"--distillation.soft_labels={labels}", f"--distillation.top_k={K}", "--distillation.tail_samples=3"]
    posttrain(student_config(tmp_path / "pass", data, catalogue, f"--distillation.teacher_run_dir={folder / 'teacher'}",
                             *top_k), env)
    distilled = losses(student_config(tmp_path / "distilled", data, catalogue, *top_k))
    plain = losses(student_config(tmp_path / "plain", data, catalogue))
    assert all(torch.isfinite(torch.tensor(distilled))) and distilled != pytest.approx(plain, rel=1e-3)
    with pytest.raises(ConfigError, match=r"distillation of retrieval scores sampled candidates: set "
                                          r"data.sequential.num_negatives >= 1 \(or distil on the teacher's top k"):
        student_config(tmp_path / "online", data, catalogue, f"--distillation.teacher_run_dir={folder / 'teacher'}")
