"""bench_transfer's synthetic sections put together from runs over different seeds (``--merge``), and the paired
gains those sections report: pairs by seed, whatever order the rows come in."""

import json

import pytest

from gem_trainer import bench_transfer
from gem_trainer.bench_runs import paired_gains

ARMS = [*bench_transfer.ARMS, *bench_transfer.LOOPFM_ARM]


def _row(arm: str, seed: int) -> dict:
    # each arm 0.001 better click NE than the one before it, every seed shifted by its own offset
    step, shift = ARMS.index(arm), 0.01 * seed
    return {"arm": arm, "seed": seed, "click/all/ne": 0.86 - 0.001 * step + shift, "click/all/auc": 0.74 + 0.001 * step,
            "conversion/all/ne": 0.88 + shift, "conversion/all/auc": 0.745 - 0.0005 * step}


def _part(seeds: list[int], commit: str) -> dict:
    teachers = [{"seed": s, "train_s": 1.0, "click/all/ne": 0.85, "click/all/auc": 0.75, "conversion/all/ne": 0.87,
                 "conversion/all/auc": 0.75} for s in seeds]
    rows = [_row(arm, s) for s in seeds for arm in ARMS]
    return {"meta": {"commit": commit}, **bench_transfer.synthetic_result(rows, teachers, users=True)}


def test_paired_gains_pair_rows_by_seed():
    rows = [_row("distillation", 1), _row("student_alone", 0), _row("distillation", 0), _row("student_alone", 1)]
    gains = paired_gains(rows, ["distillation"], ("click/all/ne", "conversion/all/auc"))["distillation"]
    assert gains["click/all/ne"] == [pytest.approx(0.001), pytest.approx(0.001)]  # lower NE: a positive gain
    assert gains["conversion/all/auc"] == [pytest.approx(-0.0005), pytest.approx(-0.0005)]


def test_merged_parts_equal_one_run_over_all_their_seeds(tmp_path):
    whole = _part([0, 1, 2], "c")
    merged = bench_transfer.merge_synthetic([_part([0, 2], "a"), _part([1], "b")], users=True)
    assert merged["parts"] == [{"commit": "a"}, {"commit": "b"}]
    for key in ("rows", "summary", "paired_gain_over_student_alone", "paired_gain_of_each_step_over_the_one_before",
                "full_transfer_beats_student_alone_beyond_spread"):
        assert merged[key] == whole[key], key
    steps = merged["paired_gain_of_each_step_over_the_one_before"]
    assert list(steps) == ["distillation over student_alone", "distillation_adapter over distillation",
                           "distillation_adapter_loopfm over distillation_adapter"]
    assert steps["distillation_adapter_loopfm over distillation_adapter"]["click/all/ne"] == [pytest.approx(0.001)] * 3
    with pytest.raises(ValueError, match="share seeds"):
        bench_transfer.merge_synthetic([_part([0, 2], "a"), _part([2], "b")], users=True)

    # the command: each file's section merged into --out, its other sections kept
    files = []
    for name, seeds in (("a", [0, 2]), ("b", [1])):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps({"synthetic_users": _part(seeds, name)}))
    out = tmp_path / "transfer.json"
    out.write_text(json.dumps({"beauty": {"kept": True}}))
    assert bench_transfer.main(["--merge", *map(str, files), "--sections", "synthetic_users", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["beauty"] == {"kept": True}
    assert written["synthetic_users"]["rows"] == whole["rows"]
    assert written["synthetic_users"]["meta"]["command"].startswith("python -m gem_trainer.bench_transfer --merge")
    with pytest.raises(SystemExit, match="2"):
        bench_transfer.main(["--merge", str(files[0]), "--sections", "synthetic", "--out", str(out)])
