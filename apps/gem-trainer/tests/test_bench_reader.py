import json
from pathlib import Path

import pytest

from gem_data.testing import find_repo_root, shared_data_dir


def test_the_reader_benchmark_times_each_config_at_each_read_size_and_writes_the_json(tmp_path):
    from gem_trainer.bench_reader import main

    data = shared_data_dir(find_repo_root(Path(__file__)))
    if not (data / "beauty").is_dir():
        pytest.skip(f"shared real data not found at {data / 'beauty'} (expected ../shared/data beside the repository)")
    out = tmp_path / "reader.json"
    assert main(["--out", str(out), "--configs", "beauty-sasrec.toml", "--read-rows", "0", "2048", "--batches", "2",
                 "--data", str(data)]) == 0
    section = json.loads(out.read_text())["read_rows"]
    assert section["meta"]["command"].startswith("python -m gem_trainer.bench_reader")
    assert [(r["config"], r["read_rows"]) for r in section["rows"]] == [("beauty-sasrec.toml", 0), ("beauty-sasrec.toml", 2048)]
    assert all(r["ms_per_batch"] > 0 and len(r["rounds_ms_per_batch"]) == section["rounds"] for r in section["rows"])
