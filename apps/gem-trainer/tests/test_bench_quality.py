"""bench_quality: a group of trainer runs side by side, the choice on validation, the quality table."""

import json
from pathlib import Path

import pytest

from gem_trainer.bench_quality import TARGETS, main, min_ratio, ndcg_sum, run_group

CONFIG = "apps/gem-trainer/configs/beauty-sasrec.toml"
TINY = ["--model.sasrec.dim=16", "--data.batch_size=16", "--schedule.warmup_steps=1", "--metrics.progress_bar=false",
        "--data.sequential.eval_negatives=20", "--data.sequential.eval_seeds=[0]", "--checkpoint.enable=false",
        "--parallelism.compile=off"]  # compiling costs more than these few steps


def test_the_rules_score_against_the_targets():
    at_target = dict(TARGETS)
    assert min_ratio(at_target) == pytest.approx(1.0) and ndcg_sum(at_target) == pytest.approx(2.0)
    short_on_one = {**at_target, "sampled/hr@10": TARGETS["sampled/hr@10"] * 0.9, "full/ndcg@10": TARGETS["full/ndcg@10"] * 2}
    assert min_ratio(short_on_one) == pytest.approx(0.9)  # the weakest metric decides
    assert ndcg_sum(short_on_one) == pytest.approx(3.0)  # NDCG only: the HR shortfall does not count


@pytest.mark.slow
def test_a_group_runs_chooses_on_validation_and_tables(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[3])  # the group names its configs from the repository root
    corpus = tmp_path / "data"
    corpus.mkdir()
    (corpus / "corpus.txt").write_text("\n".join(f"{u} " + " ".join(str(1 + (u * 5 + 3 * k) % 40) for k in range(5 + u % 6))
                                                 for u in range(1, 61)) + "\n")
    valid = ["--data.sequential.eval_split=valid"]
    group = {"arms": [{"name": "short", "config": CONFIG, "overrides": [*TINY, *valid, "--schedule.steps=3"]},
                      {"name": "long", "config": CONFIG, "overrides": [*TINY, *valid, "--schedule.epochs=2"]},
                      {"name": "broken", "config": CONFIG, "overrides": [*TINY, "--model.sasrec.dim=-1"]}],
             "choose": ["short", "long"], "rule": "min_ratio", "earlier_scores": {"before": -1.0}}
    group_file = tmp_path / "valid-x.json"
    group_file.write_text(json.dumps(group))
    results = run_group(group_file, corpus / "corpus.txt", tmp_path / "out", device="cpu")
    arms = results["arms"]
    assert arms["broken"]["rc"] != 0 and "dim" in arms["broken"]["log_tail"]
    scores = {name: min_ratio(arms[name]["eval"]) for name in ("short", "long")}
    assert results["scores"] == {**scores, "before": -1.0}
    assert results["chosen"] == max(scores, key=scores.get)
    steps = int(arms["long"]["eval"]["step"])
    assert steps > 3 and f"schedule.epochs 2 = {steps:,} steps" in (tmp_path / "out" / "runs" / "long.log").read_text()
    assert (tmp_path / "out" / "runs.tgz").stat().st_size > 0
    assert json.loads((tmp_path / "out" / "results.json").read_text())["chosen"] == results["chosen"]

    quality = tmp_path / "quality.json"
    quality.write_text(json.dumps({"meta": {"kept": True}}))
    main(["table", str(tmp_path / "out"), "--out", str(quality), "--finding", "a finding"])
    document = json.loads(quality.read_text())
    assert document["meta"] == {"kept": True}  # earlier sections stay
    section = document["history_excluded"]
    assert {row["arm"] for row in section["rows"]} == {"short", "long"}
    row = next(r for r in section["rows"] if r["arm"] == "long")
    assert (row["split"], row["seed"], row["model"]) == ("valid", 0, "sasrec")
    assert "--schedule.epochs=2" in row["recipe"] and "--seed" not in row["recipe"]
    assert row["metrics"]["sampled/hr@10"] == pytest.approx(arms["long"]["eval"]["sampled/hr@10"], abs=1e-5)
    assert section["groups"][0]["chosen"] == results["chosen"] and section["finding"] == "a finding"
    assert section["summary"] == []  # one seed per recipe: nothing to average
    assert "unfinished" not in section["groups"][0]  # the broken arm ran: its log is kept instead
    cut = tmp_path / "cut"
    cut.mkdir()
    partial = {**results, "arms": {"short": results["arms"]["short"]}}  # a group ended by a time limit
    (cut / "results.json").write_text(json.dumps(partial))
    main(["table", str(cut), "--out", str(quality)])  # the same group again: replaced
    section = json.loads(quality.read_text())["history_excluded"]
    assert len(section["groups"]) == 1 and section["groups"][0]["unfinished"] == ["long", "broken"]
    assert [row["arm"] for row in section["rows"]] == ["short"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "results.json").write_text(json.dumps({**partial, "group": "test-x"}))
    main(["table", str(other), "--out", str(quality)])  # another group: added beside the first, whose folder is not given
    section = json.loads(quality.read_text())["history_excluded"]
    assert [g["group"] for g in section["groups"]] == ["valid-x", "test-x"]
    # the same recipe (config file at the same commit) on the same split: averaged over the two rows
    (mean,) = section["summary"]
    assert mean["recipe"] == row["recipe"].replace("--schedule.epochs=2", "--schedule.steps=3") and mean["split"] == "valid"
    assert mean["config_version"] == section["rows"][0]["config_version"] != ""
