import json

from gem_data import bench


def test_bench_writes_a_row_per_reader(tmp_path, capsys):
    out = tmp_path / "data-cpu.json"
    assert bench.main(["--out", str(out), "--seconds", "0.05"]) == 0
    result = json.loads(out.read_text())
    assert {"machine", "cpu_count", "torch", "commit", "date", "command"} <= set(result["meta"])
    readers = [row["reader"] for row in result["rows"]]
    assert [r for r in readers if not r.endswith(", one batch per read")] == \
        ["synthetic", "beauty_text", "ml100k_atomic", "parquet", "mixer", "balanced_synthetic"]
    # each table reader measured as the trainer reads it, then one batch per read
    for row, after in zip(result["rows"], result["rows"][1:]):
        if "rows per read" in row.get("note", ""):
            assert after["reader"] == f"{row['reader']}, one batch per read" and after["examples_per_s_per_core"] > 0
    assert "parquet, one batch per read" in readers
    assert result["rows"][0]["examples_per_s_per_core"] > 0
    assert "examples/s/core" in capsys.readouterr().out
