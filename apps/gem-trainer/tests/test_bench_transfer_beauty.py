"""bench_transfer's Beauty section, shortened (a few steps, 100 users evaluated) on the real data beside the
project; skipped when ../shared/data/beauty is absent."""

import json

import pytest

from gem_trainer import bench_transfer
from gem_trainer.bench_runs import write_section

BEAUTY = bench_transfer.beauty_data()
SHORT = ["--data.batch_size=32", "--schedule.warmup_steps=2", "--data.sequential.eval_users=100"]

needs_beauty = pytest.mark.skipif(not (BEAUTY / "Beauty.txt").is_file(), reason=f"the Beauty data set is not at {BEAUTY}")


@pytest.mark.slow
@needs_beauty
def test_the_beauty_section_trains_every_arm_from_one_teacher_and_writes_its_table(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_transfer, "git_commit", lambda root: "0" * 40)  # a clean commit: finished work is kept
    result = bench_transfer.beauty([0], tmp_path, student_steps=8, teacher_steps=10, top_k=5, tail=3, extra=SHORT)
    arms = ["student_alone", "distillation", "distillation_adapter", "distillation_loopfm", "distillation_adapter_loopfm",
            "student_alone_catalogue"]
    assert [r["arm"] for r in result["rows"]] == arms
    assert set(result["summary"]) == {*arms, "teacher"}
    for row in [*result["rows"], *result["teacher"]["rows"]]:
        assert all(0 <= row[m] <= 1 for m in bench_transfer.BEAUTY_METRICS)
    store = json.loads((tmp_path / "beauty" / "seed0" / "soft-labels" / "meta.json").read_text())
    assert store["top_k"] == 5 + 3 and len(store["log_weights"]) == 1 + 5 + 3 and store["steps"] == 8
    loopfm = json.loads((tmp_path / "beauty" / "seed0" / "loopfm" / "progress.json").read_text())
    assert loopfm["complete"] and loopfm["rows"] == 8 * 32  # one per training prefix of the 8 batches of 32
    assert result["teacher"]["rows"][0]["reused_finished_run"] is False
    # called again (a section cut short by a time limit), finished passes and arms are kept, not redone
    monkeypatch.setattr(bench_transfer, "train", lambda *args: pytest.fail("a finished arm was trained again"))
    monkeypatch.setattr(bench_transfer, "posttrain_pass", lambda *args: pytest.fail("a finished pass was run again"))
    again = bench_transfer.beauty([0], tmp_path, student_steps=8, teacher_steps=10, top_k=5, tail=3, extra=SHORT)
    assert again["rows"] == result["rows"]
    monkeypatch.undo()
    # the finished teacher is found again (the same config and steps), and only then
    config = bench_transfer.ROOT / "apps" / "gem-trainer" / "configs" / bench_transfer.BEAUTY_TEACHER
    teacher = [f"--data.path={BEAUTY}", "--device=cpu", "--metrics.tensorboard=false", "--metrics.progress_bar=false",
               *SHORT, "--seed=0", "--schedule.steps=10"]
    teacher_dir = tmp_path / "beauty" / "teacher"
    assert bench_transfer.finished_run(config, teacher, teacher_dir, 10)
    assert not bench_transfer.finished_run(config, teacher, teacher_dir, 20)
    assert not bench_transfer.finished_run(config, [*teacher, "--model.kunlun.dropout=0.5"], teacher_dir, 10)
    # how the batches are read does not change what the run computed
    assert bench_transfer.finished_run(config, [*teacher, "--data.read_ahead=true"], teacher_dir, 10)
    out = tmp_path / "transfer.json"
    out.write_text(json.dumps({"synthetic": {"kept": True}}))
    write_section(out, "beauty", {}, 0.0, result)
    assert set(json.loads(out.read_text())) == {"synthetic", "beauty"}


@pytest.mark.slow
@needs_beauty
def test_the_tail_section_compares_top_k_stores_with_and_without_a_tail_on_the_validation_split(tmp_path):
    result = bench_transfer.beauty_tail([0], tmp_path, student_steps=6, teacher_steps=10, top_k=5, tail=7, extra=SHORT)
    arms = ["student_alone", "distillation", "distillation_tail", "distillation_adapter_tail"]
    assert [r["arm"] for r in result["rows"]] == arms and "validation split" in result["data"]
    for row in result["rows"]:
        assert all(0 <= row[m] <= 1 for m in bench_transfer.BEAUTY_METRICS)
    plain = json.loads((tmp_path / "beauty" / "tail-seed0" / "top_k" / "soft-labels" / "meta.json").read_text())
    tailed = json.loads((tmp_path / "beauty" / "tail-seed0" / "top_k_tail" / "soft-labels" / "meta.json").read_text())
    assert (plain["top_k"], plain["log_weights"]) == (5, None) and tailed["top_k"] == 5 + 7 and len(tailed["log_weights"]) == 13
    assert set(result["paired_gain_over_student_alone"]) == set(arms[1:])


def test_the_beauty_section_names_the_missing_data(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_transfer, "beauty_data", lambda: tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"the Beauty data set is not at .*nowhere"):
        bench_transfer.beauty([0], tmp_path)
    with pytest.raises(SystemExit) as stopped:
        bench_transfer.main(["--out", str(tmp_path / "out.json"), "--sections", "beauty", "--work", str(tmp_path)])
    assert stopped.value.code == 2


def test_large_blocks_are_mapped_from_a_fixed_threshold():
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    from gem_trainer.evaluators import fixed_mmap_threshold

    assert fixed_mmap_threshold()  # the ranking evaluation sets it (trainer and benchmark alike)


def test_the_runner_gives_results_in_order_from_worker_processes_and_in_process():
    for jobs in (1, 2):
        with bench_transfer._runner(jobs) as run:
            assert run(pow, [(2, 3), (3, 2), (5, 0)]) == [8, 9, 1]
