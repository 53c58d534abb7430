"""Shortened versions of the Amazon Beauty quality benchmark (apps/gem-trainer/configs/beauty-*.toml) on
the real data beside the project; skipped when ../shared/data is absent."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from gem_kunlun import CandidateInput, CandidateScorer
from gem_parallel import gathered_parameters
from gem_trainer.config import load_config
from gem_trainer.distributed import init_distributed
from gem_trainer.quality import build_table
from gem_trainer.trainer import Trainer

REPO_ROOT = Path(__file__).resolve().parents[3]
BEAUTY = REPO_ROOT.parent / "shared" / "data" / "beauty"
CONFIGS = REPO_ROOT / "apps" / "gem-trainer" / "configs"
SHORT = ["--device=cpu", "--metrics.tensorboard=false", "--checkpoint.enable=false", "--data.batch_size=128",
         "--schedule.warmup_steps=5", f"--data.path={BEAUTY}"]

pytestmark = pytest.mark.skipif(not (BEAUTY / "Beauty.txt").is_file(), reason=f"the Beauty data set is not at {BEAUTY}")


def short_trainer(tmp_path, config_name, *extra):
    config = load_config(CONFIGS / config_name, [f"--run_dir={tmp_path}", *SHORT, *extra])
    return Trainer(config, init_distributed("cpu", "gloo"))


def assert_fast_path_matches_one_row_per_candidate(trainer, num_users=50):
    """The user-once ranking path scores exactly what the model says on one (user, candidate) row at a time."""
    core = getattr(trainer.model, "module", trainer.model)
    assert isinstance(core, CandidateScorer)  # the path under test is taken
    dataset = trainer.data.ranking
    ranking = dataset.ranking_examples("test", "sampled", 99, seed=0)
    users = torch.arange(0, ranking.num_users, ranking.num_users // num_users)[:num_users]
    trainer.model.eval()
    with gathered_parameters(trainer.model, reshard_after_forward=True):  # as evaluate() runs it
        fast = trainer.evaluator().score(dataset, ranking, users, trainer.config.data.sequential.eval_chunk)
    subset = dataclasses.replace(ranking, users=ranking.users[users], history_length=ranking.history_length[users],
                                 candidates=ranking.candidates[users], target_index=ranking.target_index[users])
    slow = torch.empty(fast.shape)
    trainer.model.eval()
    with torch.no_grad():
        for start, batch in dataset.scoring_batches(subset, 1000):
            slow.view(-1)[start : start + batch.batch_size] = trainer.model(batch).logits[:, 0]
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)


def test_sasrec_fast_ranking_path_matches_one_row_per_candidate_and_metrics_are_written(tmp_path):
    trainer = short_trainer(tmp_path, "beauty-sasrec.toml", "--schedule.steps=40", "--data.sequential.eval_users=300")
    trainer.train()
    result = trainer.evaluate()
    for key in ("hr@1", "hr@5", "hr@10", "ndcg@5", "ndcg@10", "mrr"):
        assert 0 <= result[f"sampled/{key}"] <= 1 and f"sampled/{key}/std" in result
        assert all(f"sampled/seed{s}/{key}" in result for s in (0, 1, 2))
    for key in ("hr@5", "hr@10", "hr@20", "ndcg@5", "ndcg@10", "ndcg@20"):
        assert 0 <= result[f"full/{key}"] <= 1
    assert result["sampled/users"] == result["full/users"] == 300
    assert result["sampled/hr@1"] <= result["sampled/hr@5"] <= result["sampled/hr@10"]
    # 40 steps already rank the test item above chance (HR@10 = 0.1 for 99 random negatives)
    assert result["sampled/hr@10"] > 0.15

    assert_fast_path_matches_one_row_per_candidate(trainer)
    (tmp_path / "eval.json").write_text(json.dumps(result))
    table = build_table({"sasrec": tmp_path}, {}, ["test"])
    assert {(r["protocol"], r["seed"]) for r in table["rows"]} == {("sampled", 0), ("sampled", 1), ("sampled", 2), ("full", None)}
    assert table["summary"][0]["users"] == 300


def test_sasrec_trains_on_every_position_of_each_sequence(tmp_path):
    trainer = short_trainer(tmp_path, "beauty-sasrec.toml", "--schedule.steps=10")
    batch = next(trainer._batches)
    targets = batch.next_items
    assert targets.every and targets.loss == "binary" and targets.num_queries == int(batch.sequences["history"].lengths().sum())
    assert targets.num_queries > 2 * batch.batch_size  # Beauty sequences hold ~9 items: several queries per user


def test_kunlun_two_tower_trains_on_beauty_with_item_attributes_and_ranks_through_its_fast_path(tmp_path):
    trainer = short_trainer(tmp_path, "beauty-kunlun.toml", "--schedule.steps=20", "--data.sequential.eval_users=40",
                            "--data.sequential.eval_seeds=[0]")
    names = {f.name for f in trainer.spec.sparse} | {f.name for e in trainer.spec.events for f in e.features}
    assert {"item_id", "item_attributes", "history_item_id", "history_attributes_0"} <= names
    assert trainer.spec.candidate == ("item_id", "item_attributes")
    core = getattr(trainer.model, "module", trainer.model)
    assert core.config.two_tower and core.candidate_input is CandidateInput.CATALOGUE
    trainer.train()
    result = trainer.evaluate()
    assert result["sampled/users"] == result["full/users"] == 40 and 0 <= result["sampled/ndcg@10"] <= 1
    # the softmax over the catalogue already lifts the test item above chance after 20 steps
    assert result["sampled/hr@10"] > 0.15
    assert_fast_path_matches_one_row_per_candidate(trainer, num_users=20)
