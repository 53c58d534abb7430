import json

from gem_data import bench


def test_bench_writes_a_row_per_reader(tmp_path, capsys):
    out = tmp_path / "data-cpu.json"
    assert bench.main(["--out", str(out), "--seconds", "0.05"]) == 0
    result = json.loads(out.read_text())
    assert {"machine", "cpu_count", "torch", "commit", "date", "command"} <= set(result["meta"])
    readers = [row["reader"] for row in result["rows"]]
    assert readers == ["synthetic", "beauty_text", "ml100k_atomic", "parquet", "mixer", "balanced_synthetic"]
    assert result["rows"][0]["examples_per_s_per_core"] > 0
    assert "examples/s/core" in capsys.readouterr().out
