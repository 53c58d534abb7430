import json

import pytest

from gem_trainer.config import dump_config, load_config
from gem_trainer.report import main


def fake_run(folder, model, ne):
    folder.mkdir()
    (folder / "config.toml").write_text(dump_config(load_config(None, [f"--model.name={model}"])))
    (folder / "eval.json").write_text(json.dumps({
        "step": 10, "click/all/ne": ne, "click/all/auc": 0.7, "click/all/calibration": 1.0, "click/all/count": 8.0,
        "click/surface_0/ne": ne - 0.1, "click/surface_0/auc": 0.8, "click/surface_0/calibration": 1.1, "click/surface_0/count": 4.0,
    }))


def test_report_tabulates_runs_side_by_side(tmp_path, capsys):
    fake_run(tmp_path / "a", "kunlun", 0.9)
    fake_run(tmp_path / "b", "domain_experts", 0.8)
    out = tmp_path / "table.json"
    assert main(["--run", f"shared={tmp_path / 'a'}", "--run", f"experts={tmp_path / 'b'}", "--out", str(out)]) == 0
    table = json.loads(out.read_text())
    assert {"commit", "date", "command"} <= table["meta"].keys()
    rows = {(r["run"], r["group"]): r for r in table["rows"]}
    assert rows[("experts", "surface_0")]["metrics"]["ne"] == pytest.approx(0.7)
    assert rows[("shared", "all")]["model"] == "kunlun"
    assert "click/surface_0" in capsys.readouterr().out


def test_a_run_without_results_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty/eval.json does not exist"):
        main(["--run", f"x={tmp_path / 'empty'}", "--out", str(tmp_path / "t.json")])
