"""bench_solaris: a short load test of each backend writes its table and its JSON section with provenance."""

import json

import pytest

from gem_trainer.bench_solaris import SyntheticTraffic, main
from gem_transfer.solaris import LEVELS, find_redis_server


def test_synthetic_traffic_asks_for_predicted_pairs_in_the_stated_share():
    traffic = SyntheticTraffic(users=200, items=2000, seed=0)
    users, items = traffic.requests(5000, seed=1)
    predicted = (traffic.predicted[users] == items[:, None]).any(1)
    assert 0.55 < predicted.mean() < 0.7 and items.max() < 2000
    entries = traffic.preload(now=1e6)
    assert len(entries) == traffic.precomputed.sum() * 16 and entries[0].timestamp <= entries[-1].timestamp


def test_a_short_load_test_of_every_backend(tmp_path, capsys):
    backends = ["memory"] + (["redis"] if find_redis_server() is not None else [])
    out = tmp_path / "solaris.json"
    assert main(["--out", str(out), "--backends", *backends, "--duration", "0.5", "--threads", "2", "--users", "300",
                 "--items", "3000"]) == 0
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(backends)
    for name in backends:
        section = results[name]
        assert section["meta"]["commit"] and section["meta"]["command"].startswith("python -m gem_trainer.bench_solaris")
        assert section["lookups"] > 0 and sum(section["hit_rate"].values()) == pytest.approx(1.0)
        assert section["hit_rate"]["exact"] > 0 and set(section["levels"]) == set(LEVELS)
    assert "lookups/s over 2 threads" in capsys.readouterr().out


def test_the_quality_section_compares_fresh_and_served_embeddings(tmp_path, monkeypatch):
    import gem_trainer.bench_solaris as bench

    monkeypatch.setattr(bench, "TEACHER_STEPS", 4)
    monkeypatch.setattr(bench, "STUDENT_STEPS", 4)
    monkeypatch.setattr(bench, "EVAL_SHARES", (0.0, 1.0))
    monkeypatch.setattr(bench, "TRAINED_SHARES", (0.5,))
    result = bench.quality([0], tmp_path, ("--data.batch_size=32", "--data.eval_batches=2", "--schedule.warmup_steps=1",
                                           "--data.synthetic.num_users=50"))
    arms = {r["arm"]: r for r in result["rows"]}
    assert sorted(arms) == ["fresh", "served_0.0", "served_1.0", "served_trained_0.5", "student_alone"]
    # every held-out pair precomputed: the served embeddings are the fresh ones, and so is the quality
    assert arms["served_1.0"]["click/all/auc"] == pytest.approx(arms["fresh"]["click/all/auc"], rel=1e-6)
    assert [x["held_out_hit_rate"]["exact"] for x in result["lookups"]][:2] == [0.0, 1.0]
    gain = result["paired_gains"]["fresh"]["click/all/ne"]
    assert gain == [pytest.approx(arms["student_alone"]["click/all/ne"] - arms["fresh"]["click/all/ne"], abs=1e-5)]
