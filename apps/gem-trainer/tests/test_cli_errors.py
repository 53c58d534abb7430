"""What a newcomer meets: every failure is one line naming the file, line or field (``--debug`` keeps the
traceback), nothing is dropped silently, and a run folder is never damaged by a mistaken re-run."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_calls import cli, cli_here

from gem_trainer.config import ConfigError, load_config
from gem_trainer.distributed import check_fbgemm_cuda

TINY = ["--device=cpu", "--metrics.tensorboard=false", "--metrics.progress_bar=false", "--data.batch_size=16",
        "--data.eval_batches=1", "--data.synthetic.max_events=8", "--schedule.steps=4", "--schedule.warmup_steps=1",
        "--checkpoint.every_steps=2", "--checkpoint.keep_latest=3", "--metrics.log_every=1"]
TINY_NEXT_ITEM = [item for item in TINY if not item.startswith("--data.synthetic.")]  # (refused where no source is synthetic)


def one_line(done: subprocess.CompletedProcess, code: int) -> str:
    assert done.returncode == code, done.stderr[-2000:]
    lines = [line for line in done.stderr.strip().splitlines() if line.startswith("gem-trainer:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return lines[0]


def sequence_file(folder: Path, lines: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "seq.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("finished")
    done = cli("train", f"--run_dir={run}", *TINY)
    assert done.returncode == 0, done.stderr[-2000:]
    return run


def test_another_model_in_the_same_run_dir_stops_before_touching_it(finished_run):
    before = (finished_run / "config.toml").read_text()
    line = one_line(cli("train", f"--run_dir={finished_run}", *TINY, "--model.kunlun.d_model=64"), 2)
    assert "holds checkpoints of another model (model.kunlun.d_model: None -> 64)" in line and "new run_dir" in line
    assert (finished_run / "config.toml").read_text() == before
    # launch refuses it before starting any process
    done = cli("launch", "--nproc-per-node=2", f"--run_dir={finished_run}", *TINY, "--model.kunlun.d_model=64")
    assert "holds checkpoints of another model (model.kunlun.d_model: None -> 64)" in one_line(done, 2)
    assert "launching:" not in done.stdout and (finished_run / "config.toml").read_text() == before


def test_launch_ends_with_its_process_one_line_error_and_exit_code(tmp_path):
    """`launch` runs torchrun's agent in its own process: an error a process finds once it reads its data (a bad row)
    is the launch's one line on stderr, with that error's exit code (torchrun itself exits 1 with a report of the
    failed process)."""
    good = [f"{u} " + " ".join(str(i) for i in range(1 + u, 9 + u)) for u in range(12)]
    path = sequence_file(tmp_path / "bad", [*good[:5], "5 3 ²3 4", *good[6:]])
    done = cli("launch", "--nproc-per-node=1", "--config", str(Path(__file__).parents[1] / "configs" / "beauty-sasrec.toml"),
               f"--data.path={path}", f"--run_dir={tmp_path / 'run'}", *TINY_NEXT_ITEM, "--parallelism.compile=off")
    assert one_line(done, 5) == f"gem-trainer: data error: {path}:6: '²3' is not a non-negative integer id"
    assert "launching:" in done.stdout


def test_config_command_and_bad_config_exit_codes(tmp_path):
    shown = cli_here("config", "--optimizer.lr=0.5", "--data.path", "some/folder")
    assert shown.returncode == 0 and "lr = 0.5" in shown.stdout and 'path = "some/folder"' in shown.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[optimizer]\nlearning_rate = 1\n")
    failed = cli_here("config", "--config", str(bad))
    assert failed.returncode == 2
    assert failed.stderr.strip() == f"gem-trainer: config error: {bad}: optimizer.learning_rate: unknown field"


@pytest.mark.parametrize("override", ["--optimizer.sparse_lr=0.1", "--optimizer.sparse_eps=1e-6",
                                      "--model.task_weights={click = 2.0}", "--model.sasrec.num_blocks=3"])
def test_settings_that_shape_no_checkpointed_tensor_resume(finished_run, override):
    """The sparse optimizer's rates, the loss's task weights and an unselected model's section hold no tensor of
    the checkpoint: a resume with them changed goes on (its fields were refused by name prefix)."""
    from gem_trainer.run_folder import check_same_model

    check_same_model(load_config(None, [f"--run_dir={finished_run}", *TINY, override]))


def test_another_seed_drawing_another_synthetic_data_set_is_refused_on_resume(finished_run):
    """With data.synthetic.seed unset the run's seed draws the data: a resume with another one trains and evaluates
    on another data set, as a changed data.synthetic.seed would (refused); on a data set read from files it reorders
    the stream from the resumed step on (a note)."""
    from gem_trainer.run_folder import check_same_model

    with pytest.raises(ConfigError, match=r"holds checkpoints of another model \(data\.synthetic\.seed: 0 -> 5\)"):
        check_same_model(load_config(None, [f"--run_dir={finished_run}", *TINY, "--seed=5"]))
    check_same_model(load_config(None, [f"--run_dir={finished_run}", *TINY, "--seed=5", "--data.synthetic.seed=0"]))


@pytest.mark.parametrize("overrides, named", [
    (["--distillation.teacher_run_dir=/nowhere"], "distillation (a teacher"),
    (["--loopfm.store=/nowhere"], "loopfm.store"),
    (["--model.name=baseline"], "model.name"),
    (["--solaris.student_input=served"], "solaris.student_input"),
])
def test_settings_that_add_tensors_to_the_model_are_refused_by_name(finished_run, overrides, named):
    """A teacher (its adapter and auxiliary head), a LoopFM input, another model: the checkpoint holds none of their
    tensors; the refusal names the setting (a teacher went through and failed inside the checkpoint's load)."""
    from gem_trainer.run_folder import check_same_model

    with pytest.raises(ConfigError, match="holds checkpoints of another model") as error:
        check_same_model(load_config(None, [f"--run_dir={finished_run}", *TINY, *overrides]))
    assert f"({named}" in str(error.value)


def test_a_resume_that_fails_leaves_the_run_record_as_it_was(finished_run):
    """The record (config.toml) is written once the resume succeeded: a mixture the checkpoint's data state does
    not hold stops in one line with the record of the run its checkpoints belong to."""
    before = (finished_run / "config.toml").read_text()
    line = one_line(cli("train", f"--run_dir={finished_run}", *TINY, "--schedule.steps=6",
                        '--data.mixture.sources=[{name = "a", weight = 1.0}, {name = "b", weight = 1.0, seed = 1}]'), 2)
    assert "checkpoint.resume" in line or "mixture" in line
    assert (finished_run / "config.toml").read_text() == before


def test_a_finished_run_says_it_had_nothing_to_train(finished_run):
    done = cli("train", f"--run_dir={finished_run}", *TINY)
    assert done.returncode == 0 and "already trained to step 4 (nothing left to train)" in done.stdout
    assert "trained 4 steps in 0 s" not in done.stdout


def test_eval_of_a_given_step_keeps_the_final_eval_json_and_the_training_log(finished_run):
    final = (finished_run / "eval.json").read_text()
    assert json.loads(final)["split"] == "held-out split"  # what was evaluated, also in the header
    logged = (finished_run / "metrics.jsonl").read_text()
    assert '"phase": "train", "step": 4' in logged
    done = cli("eval", f"--run_dir={finished_run}", *TINY, "--step=2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "evaluation at step 2 (held-out split)" in done.stdout
    assert json.loads((finished_run / "eval-step-2.json").read_text())["step"] == 2
    assert (finished_run / "eval.json").read_text() == final
    # an earlier checkpoint's evaluation adds its record; the training's later records stay
    now = (finished_run / "metrics.jsonl").read_text()
    assert now.startswith(logged) and json.loads(now.splitlines()[-1])["phase"] == "eval"


def test_a_run_that_would_not_resume_the_checkpoints_in_its_run_dir_is_refused(finished_run):
    before = sorted(p.name for p in (finished_run / "checkpoints").iterdir())
    for off in ("--checkpoint.resume=false", "--checkpoint.enable=false"):
        line = one_line(cli("train", f"--run_dir={finished_run}", *TINY, off), 2)
        assert f"{off[2:].replace('=', ' = ')}: run_dir {finished_run} holds checkpoints of an earlier run (steps 2, 4)" in line
        assert "use a new run_dir" in line
    assert sorted(p.name for p in (finished_run / "checkpoints").iterdir()) == before


def test_a_resumed_run_with_another_length_or_other_settings_says_so(finished_run, tmp_path):
    run = tmp_path / "longer"
    shutil.copytree(finished_run, run)
    done = cli("train", f"--run_dir={run}", *TINY, "--schedule.steps=6", "--optimizer.lr=0.004")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "note: schedule.steps is 6, the run recorded 4: the learning-rate schedule follows the new length" in done.stdout
    assert ("note: resuming with settings other than the run recorded (optimizer.lr: 0.002 -> 0.004): they apply from "
            "the resumed step on, and config.toml now records them") in done.stdout
    assert "trained 2 steps (to step 6)" in done.stdout


def test_eval_reads_the_runs_own_config_and_refuses_another_model_in_one_line(finished_run, tmp_path):
    # the run trained with TINY's overrides: without --config, eval takes them from run_dir/config.toml, and the
    # overrides need only suit it (the embedded default's 50 warmup steps would refuse 3 steps)
    done = cli("eval", f"--run_dir={finished_run}", "--step=4", "--schedule.steps=3")
    assert done.returncode == 0, done.stderr[-2000:]
    written = json.loads((finished_run / "eval-step-4.json").read_text())
    # --out: another evaluation beside it, the run's own files untouched
    done = cli("eval", f"--run_dir={finished_run}", "--step=4", f"--out={tmp_path / 'side' / 'other.json'}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "side" / "other.json").read_text())["step"] == 4
    assert json.loads((finished_run / "eval-step-4.json").read_text()) == written
    for extra in ([], ["--checkpoint.resume=false"]):  # eval loads the checkpoint whatever the resume setting
        line = one_line(cli("eval", f"--run_dir={finished_run}", "--step=4", "--model.kunlun.d_model=64", *extra), 2)
        assert "holds checkpoints of another model (model.kunlun.d_model: None -> 64)" in line
        assert "evaluate it with the config it trained with" in line and "delete" not in line
    # a record that no longer loads (an older run's): the given config stands in, as before records were read
    old = tmp_path / "old"
    shutil.copytree(finished_run, old)
    (old / "config.toml").write_text((old / "config.toml").read_text() + "\nretired_field = 1\n")
    done = cli("eval", f"--run_dir={old}", *TINY, "--step=4")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"note: {old / 'config.toml'} no longer loads" in done.stderr
    # a damaged record and overrides of another model: the checkpoint does not fit the model, said in one line
    (old / "config.toml").write_text("this is [not toml\n")
    line = one_line(cli("eval", f"--run_dir={old}", "--step=4", "--model.kunlun.d_model=64"), 4)
    assert re.search(r"^gem-trainer: checkpoint error: checkpoint .*step-4 does not fit this model \(", line), line


def test_a_run_that_resumes_nothing_starts_its_log_over_and_a_finished_run_keeps_its_record(finished_run, tmp_path):
    crashed = tmp_path / "crashed"  # a run that stopped before its first checkpoint
    crashed.mkdir()
    (crashed / "metrics.jsonl").write_text(json.dumps({"phase": "train", "step": 8, "loss": 1.0}) + "\n")
    done = cli("train", f"--run_dir={crashed}", *TINY, "--checkpoint.enable=false")
    assert done.returncode == 0, done.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert 8 not in steps and max(steps) == 4
    # asked for fewer steps than it trained, a finished run trains nothing and keeps its record
    run = tmp_path / "finished"
    shutil.copytree(finished_run, run)
    done = cli("train", f"--run_dir={run}", *TINY, "--schedule.steps=3")
    assert done.returncode == 0 and "already trained to step 4" in done.stdout and "note:" not in done.stdout
    assert load_config(run / "config.toml").schedule.steps == 4


def test_a_benchmark_run_from_scratch_does_not_mix_with_an_earlier_run_in_its_folder(tmp_path):
    from gem_trainer.bench_runs import train

    train(None, TINY[:-2], tmp_path)  # to step 4, checkpoints at 2 and 4
    train(None, [*TINY[:-2], "--schedule.steps=2"], tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-")) == ["step-2"]


def test_a_missing_checkpoint_step_and_a_missing_run_dir_are_one_line(finished_run, tmp_path):
    line = one_line(cli("eval", f"--run_dir={finished_run}", *TINY, "--step=3"), 4)
    assert line.startswith("gem-trainer: checkpoint error: no complete checkpoint at") and "step-3" in line
    missing = tmp_path / "typo"
    line = one_line(cli("eval", f"--run_dir={missing}", *TINY), 2)
    assert "no complete checkpoint under" in line and not missing.exists()
    # --debug keeps the traceback
    debug = cli("eval", f"--run_dir={finished_run}", *TINY, "--step=3", "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_metrics_after_a_resume_do_not_repeat_steps(tmp_path):
    run = tmp_path / "run"
    assert cli("train", f"--run_dir={run}", *TINY).returncode == 0
    # as if killed after logging step 4 but before its checkpoint: the rerun trains 3 and 4 again
    shutil.rmtree(run / "checkpoints" / "step-4")
    again = cli("train", f"--run_dir={run}", *TINY)
    assert again.returncode == 0 and "resumed from" in again.stdout and "at step 2" in again.stdout
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["phase"] == "train"]
    assert steps == [1, 2, 3, 4]


def test_a_log_cut_short_resumes_without_its_torn_record_and_a_damaged_one_is_one_line(tmp_path):
    run = tmp_path / "run"
    assert cli("train", f"--run_dir={run}", *TINY).returncode == 0
    shutil.rmtree(run / "checkpoints" / "step-4")
    log = run / "metrics.jsonl"
    whole = log.read_text()
    log.write_text(whole[:-40])  # killed while writing its last record
    again = cli("train", f"--run_dir={run}", *TINY)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"note: {log}:" in again.stdout and "dropped a record cut short" in again.stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]  # every line a record again
    assert [r["step"] for r in records if r["phase"] == "train"] == [1, 2, 3, 4]
    shutil.rmtree(run / "checkpoints" / "step-4")
    lines = log.read_text().splitlines()
    log.write_text("\n".join([lines[0], "{torn", *lines[1:]]) + "\n")  # damage inside the log: refused, kept as it was
    damaged = log.read_text()
    line = one_line(cli("train", f"--run_dir={run}", *TINY), 5)
    assert line.startswith(f"gem-trainer: data error: {log}:2: not a JSON record") and log.read_text() == damaged


def test_bad_rows_are_one_line_errors_or_counted_and_reported(tmp_path):
    good = [f"{u} " + " ".join(str(i) for i in range(1 + u, 9 + u)) for u in range(12)]
    path = sequence_file(tmp_path / "bad", [*good[:5], "5 3 ²3 4", *good[6:]])
    common = ["--config", str(Path(__file__).parents[1] / "configs" / "beauty-sasrec.toml"), f"--data.path={path}",
              *TINY_NEXT_ITEM, "--data.sequential.eval_negatives=10", "--data.sequential.eval_protocols=[\"sampled\"]",
              "--data.sequential.eval_seeds=[0]", "--parallelism.compile=off"]
    line = one_line(cli("train", f"--run_dir={tmp_path / 'r1'}", *common), 5)
    assert line == f"gem-trainer: data error: {path}:6: '²3' is not a non-negative integer id"
    done = cli("train", f"--run_dir={tmp_path / 'r2'}", *common, "--data.skip_bad_rows=true")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "data: skipped 1 bad rows" in done.stdout
    assert json.loads((tmp_path / "r2" / "eval.json").read_text())["data/bad_rows"] == 1
    logged = [json.loads(line) for line in (tmp_path / "r2" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["phase"] == "data" and r["bad_rows"] == 1 for r in logged)


def test_too_few_items_for_the_sampled_ranking_is_found_before_training(tmp_path):
    path = sequence_file(tmp_path / "small", [f"{u} " + " ".join(str(i) for i in range(1 + u, 9 + u)) for u in range(12)])
    line = one_line(cli("train", f"--run_dir={tmp_path / 'r'}", "--config",
                        str(Path(__file__).parents[1] / "configs" / "beauty-sasrec.toml"), f"--data.path={path}",
                        *TINY_NEXT_ITEM), 2)
    assert "data.sequential.eval_negatives (99) exceeds the" in line and "set it to at most" in line
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_too_few_items_rated_before_a_time_split_period_is_found_before_training(tmp_path):
    """A time split ranks each event among the items rated before it: fewer than the catalogue's free items."""
    folder = tmp_path / "toy"
    folder.mkdir()
    rows = [f"{u}\t{1 + (u * 5 + 3 * k) % 60}\t{1000 * k + 7 * u}" for u in range(1, 41) for k in range(2 + u % 9)]
    (folder / "toy.inter").write_text("user_id:token\titem_id:token\ttimestamp:float\n" + "\n".join(rows) + "\n")
    line = one_line(cli("train", f"--run_dir={tmp_path / 'r'}", "--config",
                        str(Path(__file__).parents[1] / "configs" / "mixing-ml100k-time.toml"), f"--data.path={folder}",
                        "--data.sequential.time_split=[0.6, 0.85]", "--data.sequential.eval_split=offline_period",
                        "--data.sequential.eval_negatives=50", "--data.mixture.ramp_start=0", "--data.mixture.ramp_steps=4",
                        *TINY_NEXT_ITEM), 2)
    assert "data.sequential.eval_negatives (50) exceeds the" in line and "rated before the ranked event" in line
    assert not (tmp_path / "r" / "checkpoints").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_on_a_machine_without_one_is_one_line(tmp_path):
    line = one_line(cli("train", "--device=cuda", f"--run_dir={tmp_path / 'r'}"), 2)
    assert line == 'gem-trainer: config error: device: "cuda" was configured but this machine has no CUDA device (use "auto" or "cpu")'


@pytest.mark.parametrize("args, code, expected", [
    (["config", "--model.kunlun.top_k=5"], 2, r"config error: override --model.kunlun.top_k=5: model.kunlun: top_k \(5\) must lie in \[1, num_experts = 4\]"),
    (["config", "--model.name=sasrec"], 2, r"config error: .*model.name = \"sasrec\" needs next-item data"),
    (["train", "--data.source=parquet", "--data.path=/nowhere/x.parquet", "--data.eval_path=/nowhere/y.parquet"], 5,
     r"data error: .*/nowhere/x.parquet"),
])
def test_runtime_failures_are_one_line(tmp_path, args, code, expected):
    run = cli_here if args[0] == "config" else cli  # (a config is refused before any work)
    line = one_line(run(*args, f"--run_dir={tmp_path / 'r'}"), code)
    assert re.search(expected, line), line


def test_a_cuda_device_without_fbgemm_cuda_kernels_is_one_line():
    def probe():
        raise NotImplementedError("Could not run 'fbgemm::asynchronous_complete_cumsum' with arguments from the 'CUDA' backend.\nmore")

    with pytest.raises(ConfigError, match=r"^device: fbgemm-gpu has no CUDA kernels here \(Could not run .*'CUDA' backend.\); install") as error:
        check_fbgemm_cuda(torch.device("cpu"), probe)
    assert "\n" not in str(error.value)


def test_help_tells_how_to_override_and_resume():
    top = cli_here("--help")
    assert "``" not in top.stdout and "--section.field=value" in top.stdout
    train = " ".join(cli_here("train", "--help").stdout.split())  # argparse wraps lines
    assert "--section.field=value" in train and "resumes from the newest intact checkpoint" in train
    assert "--debug" in train
    plot = cli_here("plot", "--help").stdout
    assert "FLOP" not in plot and "PNG" in plot


def test_a_rank_failing_alone_stops_the_job_instead_of_hanging(tmp_path):
    """Rank 0 fails while rank 1 waits in a collective rank 0 never joins: leaving on its exception, rank 0 skips the
    shutdown's barrier (which rank 1 would never reach), so the launcher ends the job with rank 0's error."""
    script = tmp_path / "fail_alone.py"
    script.write_text(
        "import torch.distributed as dist\n"
        "from gem_trainer.distributed import shutdown_distributed\n"
        "dist.init_process_group('gloo')\n"
        "try:\n"
        "    if dist.get_rank() == 0:\n"
        "        raise RuntimeError('rank 0 fails alone')\n"
        "    dist.broadcast_object_list([None], src=0)\n"
        "finally:\n"
        "    shutdown_distributed()\n"
    )
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode != 0 and "rank 0 fails alone" in run.stdout + run.stderr


def test_a_sharding_that_torchrec_cannot_apply_to_sequence_tables_is_one_line(tmp_path):
    line = one_line(cli("train", f"--run_dir={tmp_path}", *TINY, "--parallelism.sparse_sharding=table_column_wise"), 2)
    assert "sparse_sharding = 'table_column_wise' cannot shard the model's sequence tables" in line


def test_embedding_tables_too_narrow_for_torchrecs_sharded_lookups_are_one_line(tmp_path):
    line = one_line(cli("train", f"--run_dir={tmp_path}", *TINY, "--model.kunlun.d_model=6", "--model.kunlun.num_heads=3",
                        "--model.kunlun.rote=false"), 2)
    assert re.search(r"^gem-trainer: config error: model: embedding table 't_\w+' is 6 wide \(and \d+ more\); "
                     r"TorchRec's sharded lookups need widths that are a multiple of 4: make model\.kunlun\.d_model \(or "
                     r"an event type's own width\) a multiple of 4$", line), line


def test_output_paths_and_process_counts_are_checked_before_any_work(tmp_path):
    taken = tmp_path / "a_file"
    taken.write_text("")
    cases = [
        (["flops", f"--out={tmp_path}"], f"argument --out: {tmp_path} is a folder; name the file to write"),
        (["eval", f"--out={tmp_path}", f"--run_dir={tmp_path / 'nowhere'}"], f"argument --out: {tmp_path} is a folder"),
        (["flops", f"--out={taken / 'x.json'}"], f"argument --out: {taken} is a file, not a folder to write x.json in"),
        (["plot", f"--out={taken}", f"--run_dir={tmp_path}"], f"argument --out: {taken} is a file; name a folder"),
        (["launch", "--nproc-per-node=0"], "argument --nproc-per-node: a number of processes is a positive integer, got '0'"),
        (["launch", "--nproc-per-node=-1"], "argument --nproc-per-node: a number of processes is a positive integer"),
    ]
    for args, expected in cases:
        done = cli_here(*args)
        assert done.returncode == 2 and expected in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)
    assert not (tmp_path / "nowhere").exists()
    done = cli_here("flops", "--device=cpu", f"--out={tmp_path / 'new' / 'flops.json'}")  # its folder is made
    assert done.returncode == 0 and json.loads((tmp_path / "new" / "flops.json").read_text()), done.stderr[-2000:]


def test_a_compile_cache_dir_that_cannot_be_a_folder_is_one_line(tmp_path):
    taken = tmp_path / "a_file"
    taken.write_text("not a folder")
    line = one_line(cli("train", f"--run_dir={tmp_path / 'run'}", *TINY, f"--parallelism.compile_cache_dir={taken}"), 2)
    assert line.startswith("gem-trainer:") and "parallelism.compile_cache_dir" in line and "a_file" in line


def test_a_solaris_input_fresh_or_served_is_the_same_model():
    """Fresh or served, the student reads one input feature: a student trained on fresh embeddings is evaluated on
    served ones (the README's use), which the compatibility check must let through."""
    from gem_trainer.run_folder import state_settings

    fresh = load_config(None, ["--solaris.student_input=fresh", "--solaris.teacher_run_dir=t"])
    served = load_config(None, ["--solaris.student_input=served", "--solaris.teacher_run_dir=t", "--solaris.output=o"])
    assert state_settings(fresh) == state_settings(served) != state_settings(load_config(None, []))


def test_a_resume_with_another_seed_says_the_data_order_changes(tmp_path):
    """A shuffled table's epoch is a permutation drawn from the seed: resumed with another, the rest of the epoch is
    another permutation's (the generic settings note did not say what that does to the data)."""
    from gem_trainer.config import dump_config, load_config
    from gem_trainer.run_folder import resume_changes

    args = [f"--run_dir={tmp_path}", "--data.source=atomic", "--data.path=x", "--model.name=sasrec"]
    (tmp_path / "config.toml").write_text(dump_config(load_config(None, args)))
    assert resume_changes(load_config(None, args)) == []
    lines = resume_changes(load_config(None, [*args, "--seed=3"]))
    assert lines[0] == ("note: seed is 3, the run recorded 0: the data is read in another order from the resumed step on "
                        "(a shuffled table's current epoch is drawn again: examples already trained on in it may come "
                        "again, others not in it at all; a mixture draws other sources)")
    assert lines[1].startswith("note: resuming with settings other than the run recorded (seed: 0 -> 3)")


def test_eval_on_ranks_not_dividing_the_runs_global_batch_is_refused_only_where_the_held_out_set_depends_on_it(tmp_path):
    """A synthetic held-out set is drawn in global batches: another global batch reads other examples. Held-out files
    and next-item users are read whole in batches of any size: the run's per-rank batch serves."""
    from gem_trainer.cli import _with_the_runs_global_batch

    class TrainedOnOneRank:
        def complete_steps(self):
            return [3]

        def local_state(self, step):
            return {"world_size": 1}

    next_item = load_config(None, [f"--run_dir={tmp_path}", "--data.source=sequence_text", "--data.path=corpus.txt",
                                   "--data.batch_size=5"])
    assert _with_the_runs_global_batch(next_item, TrainedOnOneRank(), None, 2) is next_item
    synthetic = load_config(None, [f"--run_dir={tmp_path}", "--data.batch_size=5"])
    with pytest.raises(ConfigError, match=r"global batches of 5 examples \(1 ranks\), which 2 ranks cannot split evenly"):
        _with_the_runs_global_batch(synthetic, TrainedOnOneRank(), None, 2)
    assert _with_the_runs_global_batch(synthetic, TrainedOnOneRank(), None, 5).data.batch_size == 1
