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


def test_the_commit_of_a_result_is_dirty_for_code_changes_but_not_for_result_files(tmp_path, monkeypatch):
    import subprocess

    from gem_trainer.provenance import git_commit

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    monkeypatch.delenv("GEM_COMMIT", raising=False)
    git("init", "-q")
    (tmp_path / "module.py").write_text("x = 1\n")
    git("add", "module.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = git_commit(tmp_path)
    assert len(head) == 40 and not head.endswith("+dirty")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "out.json").write_text("{}\n")
    assert git_commit(tmp_path) == head  # a benchmark's output beside the code
    (tmp_path / "new_module.py").write_text("y = 2\n")
    assert git_commit(tmp_path) == head + "+dirty"
    (tmp_path / "new_module.py").unlink()
    (tmp_path / "module.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == head + "+dirty"
    # a tree copied to another machine names its commit, whatever repository came with it
    monkeypatch.setenv("GEM_COMMIT", "0" * 40)
    assert git_commit(tmp_path) == "0" * 40
