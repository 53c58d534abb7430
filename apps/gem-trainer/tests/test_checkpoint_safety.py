"""Checkpoints that survive damage: a damaged newest checkpoint is skipped for the intact one before it, a
local state that would run code on load is refused, a write that fails (a full disk, a file size limit, the
writer process killed) stops the run in one line with the previous checkpoint kept, and an asynchronous save
holds its step's state while training goes on."""

import errno
import io
import json
import os
import pickle
import resource
import signal
import subprocess
import sys
import time
import zipfile

import pytest
import torch

from gem_trainer.checkpoint import MARKER, CheckpointError, CheckpointManager, _fingerprint
from gem_trainer.config import load_config
from gem_trainer.distributed import init_distributed
from gem_trainer.trainer import Trainer

TINY = ["--device=cpu", "--metrics.tensorboard=false", "--metrics.progress_bar=false", "--data.batch_size=16",
        "--data.eval_batches=1", "--data.synthetic.max_events=8", "--schedule.warmup_steps=1",
        "--checkpoint.every_steps=2", "--checkpoint.keep_latest=3", "--metrics.log_every=1"]


def trainer_at(run_dir, steps: int, *overrides: str) -> Trainer:
    config = load_config(None, [f"--run_dir={run_dir}", *TINY, f"--schedule.steps={steps}", *overrides])
    return Trainer(config, init_distributed("cpu", "gloo"))


@pytest.fixture
def two_checkpoints(tmp_path):
    trainer = trainer_at(tmp_path, 4)
    trainer.train()
    trainer.close()
    return tmp_path, CheckpointManager(tmp_path / "checkpoints", keep_latest=3)


def test_the_marker_is_a_manifest_of_every_file(two_checkpoints):
    _, manager = two_checkpoints
    assert manager.complete_steps() == [2, 4]
    assert manager.damage(4) is None and manager.damage(2) is None


@pytest.mark.parametrize("how", ["missing", "truncated", "changed"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_intact_one(two_checkpoints, how):
    run_dir, manager = two_checkpoints
    shard = next(p for p in sorted((run_dir / "checkpoints" / "step-4").iterdir()) if p.suffix == ".distcp")
    if how == "missing":
        shard.unlink()
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
    assert "step-4" in manager.damage(4)
    step, skipped = manager.newest_intact()
    assert step == 2 and len(skipped) == 1 and "step-4 is damaged" in skipped[0]
    resumed = trainer_at(run_dir, 6)
    assert resumed.resume() and resumed.step == 2
    with pytest.raises(CheckpointError, match=r"checkpoint .*step-4 is damaged"):
        trainer_at(run_dir, 6).resume(4)


def test_an_unfinished_newest_checkpoint_is_named_when_skipped(two_checkpoints):
    """A run stopped while its newest checkpoint was still being written leaves a folder without the marker: the
    restart says it skips it (it went unnamed, the restart quietly falling back or starting over)."""
    run_dir, manager = two_checkpoints
    (run_dir / "checkpoints" / "step-4" / MARKER).unlink()
    step, skipped = manager.newest_intact()
    assert step == 2 and skipped == [f"checkpoint {run_dir / 'checkpoints' / 'step-4'} is incomplete (its write did not "
                                     f"finish: no {MARKER} marker); skipping it"]
    (run_dir / "checkpoints" / "step-2" / MARKER).unlink()
    step, skipped = manager.newest_intact()
    assert step is None and [line.split("step-")[1][:1] for line in skipped] == ["4", "2"]
    restarted = trainer_at(run_dir, 6)
    restarted.train()  # starts over and writes steps 2 and 4 anew
    restarted.close()
    assert manager.newest_intact() == (6, [])


def test_a_damaged_final_checkpoint_is_written_anew_when_the_restart_reaches_its_step_again(tmp_path):
    first = trainer_at(tmp_path, 5)  # saves steps 2 and 4, and the last step, 5, which is no multiple of 2
    first.train()
    first.close()
    manager = CheckpointManager(tmp_path / "checkpoints", keep_latest=3)
    shard = next(p for p in sorted((tmp_path / "checkpoints" / "step-5").iterdir()) if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    restarted = trainer_at(tmp_path, 5)
    restarted.train()  # resumes at step 4 (step 5 damaged) and trains step 5 again
    restarted.close()
    assert manager.damage(5) is None and manager.newest_intact()[0] == 5


def test_a_damaged_newer_checkpoint_never_prunes_the_one_just_written(tmp_path):
    """keep_latest counts the steps up to the one written: a complete but damaged step above it (the resume passed
    over it) would otherwise have each new checkpoint deleted at once in its favour, and every crash start over."""
    first = trainer_at(tmp_path, 6, "--checkpoint.keep_latest=1")
    first.train()
    first.close()
    manager = CheckpointManager(tmp_path / "checkpoints", keep_latest=1)
    assert manager.complete_steps() == [6]
    shard = next(p for p in sorted((tmp_path / "checkpoints" / "step-6").iterdir()) if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    restarted = trainer_at(tmp_path, 10, "--checkpoint.keep_latest=1")
    assert not restarted.resume()  # step 6 is damaged: it starts over
    for _ in range(2):
        restarted.train_step()
    restarted.save_checkpoint()
    restarted.checkpoints.wait()
    restarted.close()
    assert manager.complete_steps() == [2, 6] and manager.newest_intact()[0] == 2


def test_the_marker_reaches_the_disk_with_its_folder_before_older_checkpoints_go(tmp_path, monkeypatch):
    """The marker's rename is synced through its folder before pruning: a crash must not keep the deletions of the
    older checkpoints and lose the marker of the newer one."""
    import shutil
    import stat

    from gem_trainer import checkpoint

    events, fsync, rmtree = [], os.fsync, shutil.rmtree

    def record_fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            events.append(("synced folder", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return fsync(fd)

    def record_rmtree(path, *args, **kwargs):
        events.append(("removed", os.path.basename(str(path))))
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.os, "fsync", record_fsync)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", record_rmtree)
    trainer = trainer_at(tmp_path, 4, "--checkpoint.keep_latest=1", "--checkpoint.asynchronous=false")
    trainer.train()
    trainer.close()
    assert events.index(("synced folder", "step-4")) < events.index(("removed", "step-2"))


def test_a_deterministic_trainer_leaves_the_process_as_it_found_it_when_closed(tmp_path):
    """deterministic = true switches deterministic algorithms on for the run; closed, the trainer restores the
    process's settings (other work in it, another trainer or a test, ran under them)."""
    assert not torch.are_deterministic_algorithms_enabled()
    trainer = trainer_at(tmp_path, 2, "--deterministic=true")
    assert torch.are_deterministic_algorithms_enabled()
    trainer.train()
    trainer.close()
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_changed_learning_rate_applies_from_the_resumed_step(tmp_path):
    """The scheduler's saved state holds the base rate it was built with: a resume with another optimizer.lr sets
    the new one (times the schedule's factor), as the resume note tells."""
    first = trainer_at(tmp_path, 2, "--schedule.decay=constant", "--optimizer.lr=0.002")
    first.train()
    first.close()
    resumed = trainer_at(tmp_path, 4, "--schedule.decay=constant", "--optimizer.lr=0.5")
    assert resumed.resume() and resumed.step == 2
    assert [g["lr"] for g in resumed.dense_optimizer.param_groups] == [0.5] * len(resumed.dense_optimizer.param_groups)
    resumed.train_step()
    assert resumed.scheduler.get_last_lr() == [0.5] * len(resumed.dense_optimizer.param_groups)
    resumed.close()
    same = trainer_at(tmp_path, 4, "--schedule.decay=constant", "--optimizer.lr=0.002")
    assert same.resume() and same.scheduler.get_last_lr()[0] == pytest.approx(0.002)
    same.close()


def test_a_restart_without_a_checkpoint_starts_the_log_over(tmp_path):
    first = trainer_at(tmp_path, 3, "--checkpoint.enable=false")
    first.train()
    first.close()
    again = trainer_at(tmp_path, 3)  # no checkpoint was written: it starts at step 0
    again.train()
    again.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("phase", "train") == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 3  # each training step logged once


def test_a_restart_after_damage_says_so_in_one_line_and_continues(two_checkpoints):
    run_dir, _ = two_checkpoints
    (run_dir / "checkpoints" / "step-4" / "local-rank0.pt").unlink()
    done = subprocess.run([sys.executable, "-m", "gem_trainer.cli", "train", f"--run_dir={run_dir}", *TINY,
                           "--schedule.steps=6"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "warning: checkpoint" in done.stdout and "local-rank0.pt is missing" in done.stdout
    assert "resumed from" in done.stdout and "at step 2" in done.stdout


class _Payload:
    """Unpickling this would create a file: what a hostile local state could do on load."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_local_state_that_would_run_code_is_refused(two_checkpoints):
    run_dir, manager = two_checkpoints
    marker = run_dir / "code-ran"
    local = run_dir / "checkpoints" / "step-4" / "local-rank0.pt"
    with local.open("wb") as handle:
        pickle.dump({"step": 4, "payload": _Payload(str(marker))}, handle)
    # the attacker also rewrites the manifest, so only the loader itself can refuse
    manifest = run_dir / "checkpoints" / "step-4" / MARKER
    record = json.loads(manifest.read_text())
    record["files"]["local-rank0.pt"] = _fingerprint(local)
    manifest.write_text(json.dumps(record))
    assert manager.damage(4) is None
    with pytest.raises(CheckpointError, match=r"local-rank0.pt holds more than plain training state"):
        manager.load(4, {})
    assert not marker.exists()


def test_a_full_disk_during_a_save_stops_in_one_line_and_keeps_the_previous_checkpoint(two_checkpoints, monkeypatch):
    run_dir, manager = two_checkpoints
    trainer = trainer_at(run_dir, 8, "--checkpoint.asynchronous=false")
    assert trainer.resume() and trainer.step == 4
    trainer.train_step()
    trainer.train_step()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("torch.distributed.checkpoint.save", full)
    with pytest.raises(CheckpointError) as error:
        trainer.save_checkpoint()
    message = str(error.value)
    assert "\n" not in message and "could not write checkpoint" in message and "step-6" in message
    assert "No space left on device" in message and "step-4 is kept" in message
    assert not (run_dir / "checkpoints" / "step-6").exists()
    assert manager.complete_steps() == [2, 4] and manager.damage(4) is None


def test_a_write_that_fails_in_the_writer_process_stops_in_one_line_and_keeps_the_previous_checkpoint(
        two_checkpoints, monkeypatch, request):
    """A real failure inside the writer: it starts under a 64 KiB limit on the size of any file it writes."""
    from gem_trainer.checkpoint_writer import WriterProcess, stop_idle_writers

    stop_idle_writers()  # the writer must be a new one, started under the limit
    request.addfinalizer(stop_idle_writers)  # and serve no later manager
    start = WriterProcess.start

    def start_limited(self):
        # the limit passes to the child at its start (whose interpreter ignores SIGXFSZ: a write past the limit
        # fails rather than kills); this process gets its own back at once
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, limits[1]))
        try:
            start(self)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)

    monkeypatch.setattr(WriterProcess, "start", start_limited)
    run_dir, manager = two_checkpoints
    trainer = trainer_at(run_dir, 8)  # its writer starts under the limit
    assert trainer.config.checkpoint.asynchronous and trainer.resume() and trainer.step == 4
    trainer.train_step()
    trainer.train_step()
    trainer.save_checkpoint()
    with pytest.raises(CheckpointError) as error:
        trainer.checkpoints.wait()  # an asynchronous save's failure surfaces when it is waited for
    message = str(error.value)
    assert "\n" not in message and "could not write checkpoint" in message and "step-6" in message
    assert "rank 0: " in message and "step-4 is kept" in message
    assert not (run_dir / "checkpoints" / "step-6").exists()
    assert manager.complete_steps() == [2, 4] and manager.damage(4) is None
    trainer.checkpoints.close()


def _held_writer(trainer) -> int:
    """Write one asynchronous checkpoint (so that the writer runs), then stop the writer process: the next save is
    staged and handed over, and waits until it is continued."""
    trainer.save_checkpoint()
    trainer.checkpoints.wait()
    os.kill(trainer.checkpoints.writer_pid, signal.SIGSTOP)
    return trainer.checkpoints.writer_pid


def test_an_asynchronous_save_holds_the_state_of_its_step_and_counts_only_once_written(two_checkpoints):
    run_dir, manager = two_checkpoints
    trainer = trainer_at(run_dir, 12)
    assert trainer.config.checkpoint.asynchronous and trainer.resume() and trainer.step == 4
    trainer.train_step()
    writer = _held_writer(trainer)
    trainer.train_step()
    expected = {k: local(v).clone() for k, v in trainer.model.state_dict().items()}
    trainer.save_checkpoint()  # returns with the write held back
    marker = run_dir / "checkpoints" / "step-6" / MARKER
    for _ in range(3):  # training goes on and changes the weights while the write waits
        trainer.train_step()
    assert not marker.exists() and manager.latest_step() == 5 and trainer.checkpoints.writing()
    os.kill(writer, signal.SIGCONT)
    trainer.checkpoints.wait()
    assert marker.exists() and manager.latest_step() == 6 and manager.damage(6) is None
    assert not trainer.checkpoints.writing()
    trainer.close()

    resumed = trainer_at(run_dir, 12)
    assert resumed.resume(6) and resumed.step == 6
    restored, later = resumed.model.state_dict(), trainer.model.state_dict()
    changed = [k for k in expected if not torch.equal(expected[k], local(later[k]))]
    assert len(changed) > 5, "training after the save changed no weight: the test would prove nothing"
    for key, value in expected.items():
        assert torch.equal(local(restored[key]), value), key


def test_a_writer_killed_mid_write_fails_that_save_in_one_line_and_the_next_save_starts_a_new_one(two_checkpoints):
    run_dir, manager = two_checkpoints
    trainer = trainer_at(run_dir, 12)
    assert trainer.resume() and trainer.step == 4
    trainer.train_step()
    writer = _held_writer(trainer)
    trainer.train_step()
    trainer.save_checkpoint()
    os.kill(writer, signal.SIGKILL)
    with pytest.raises(CheckpointError, match=r"^the checkpoint writer process died \(exit code -9\) while writing "
                                              r"step 6$"):
        trainer.checkpoints.wait()
    assert manager.latest_step() == 5 and not (run_dir / "checkpoints" / "step-6" / MARKER).exists()
    trainer.train_step()
    trainer.save_checkpoint()
    trainer.checkpoints.wait()
    assert trainer.checkpoints.writer_pid != writer and manager.latest_step() == 7 and manager.damage(7) is None
    trainer.close()


def local(value: torch.Tensor) -> torch.Tensor:
    """A ShardedTensor's (one) local shard, or the tensor itself."""
    return value.local_shards()[0].tensor if hasattr(value, "local_shards") else value


def test_shared_staging_copies_the_state_and_reuses_its_arena(tmp_path):
    from gem_trainer.checkpoint_writer import SharedStaging, item_key

    weights, steps = torch.randn(4, 3), [torch.tensor(2.0), {"lr": 0.1}]
    staging = SharedStaging()

    def staged_tensor(staged, fqn):
        (key,) = [k for k in staged.tensors if k[0] == fqn]
        return staging.arena.view(*staged.tensors[key])

    first, fresh = staging.stage({"w": weights, "opt": steps}, tmp_path, 1, 2, True)
    assert fresh and {item_key(item.index)[0] for item in first.plan.items} == {"w", "opt.0", "opt.1.lr"}
    assert torch.equal(staged_tensor(first, "w"), weights) and torch.equal(staged_tensor(first, "opt.0"), steps[0])
    assert torch.load(io.BytesIO(first.values[("opt.1.lr", None)])) == 0.1
    arena = staging.arena
    weights.add_(1.0)  # training goes on: the staged copy must not see it
    assert not torch.equal(staged_tensor(first, "w"), weights)
    second, fresh = staging.stage({"w": weights, "opt": steps}, tmp_path, 2, 2, True)
    assert not fresh and staging.arena is arena and torch.equal(staged_tensor(second, "w"), weights)
    third, fresh = staging.stage({"w": torch.zeros(20, 20), "opt": steps}, tmp_path, 3, 2, True)
    assert fresh and staged_tensor(third, "w").shape == (20, 20)  # a new size gets a new arena
    staging.close()


def _record_checksums(folder) -> list[int]:
    """The CRC-32 of every record of every tensor DCP wrote in ``folder`` (each item is a torch.save archive)."""
    import torch.distributed.checkpoint as dcp

    checksums = []
    for info in dcp.FileSystemReader(str(folder)).read_metadata().storage_data.values():
        data = (folder / info.relative_path).read_bytes()[info.offset: info.offset + info.length]
        if data[:2] == b"PK":
            checksums += [record.CRC for record in zipfile.ZipFile(io.BytesIO(data)).infolist()]
    return checksums


@pytest.mark.parametrize("asynchronous", [False, True])
def test_records_are_written_without_checksums_and_the_checkpoint_loads(two_checkpoints, asynchronous):
    """torch.save's per-record CRC32 is DCP's largest piece of work; the manifest's SHA-256 covers the files instead."""
    import torch.utils.serialization.config as serialization_config

    run_dir, manager = two_checkpoints
    trainer = trainer_at(run_dir, 8, f"--checkpoint.asynchronous={str(asynchronous).lower()}")
    assert trainer.resume() and trainer.step == 4
    trainer.train_step()
    trainer.save_checkpoint()
    trainer.checkpoints.wait()
    checksums = _record_checksums(run_dir / "checkpoints" / "step-5")
    assert len(checksums) > 20 and set(checksums) == {0}
    assert serialization_config.save.compute_crc32  # switched back once written
    expected = {k: local(v).clone() for k, v in trainer.model.state_dict().items()}
    trainer.close()
    resumed = trainer_at(run_dir, 8)
    assert resumed.resume(5) and manager.damage(5) is None
    for key, value in resumed.model.state_dict().items():
        assert torch.equal(local(value), expected[key]), key


def test_a_closed_managers_writer_serves_the_next_manager_of_the_process(tmp_path):
    """Starting a writer imports torch (seconds): a process building manager after manager starts one."""
    from gem_trainer.checkpoint_writer import stop_idle_writers

    stop_idle_writers()
    first = CheckpointManager(tmp_path / "first", keep_latest=2)
    first.save(1, {"w": torch.randn(4, 3)}, {"step": 1}, asynchronous=True)
    first.wait()
    writer = first.writer_pid
    first.close()
    second = CheckpointManager(tmp_path / "second", keep_latest=2)
    state = {"w": torch.randn(40, 30), "b": torch.randn(7)}  # another size: the writer is handed a new arena
    expected = {k: v.clone() for k, v in state.items()}
    second.save(3, state, {"step": 3}, asynchronous=True)
    second.wait()
    assert second.writer_pid == writer and second.complete_steps() == [3] and second.damage(3) is None
    restored = {k: torch.zeros_like(v) for k, v in state.items()}
    second.load(3, restored)
    for key, value in expected.items():
        assert torch.equal(restored[key], value), key
    second.close()
    stop_idle_writers()
    assert subprocess.run(["kill", "-0", str(writer)], capture_output=True).returncode != 0  # stopped, not left behind


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_after_its_step_with_a_checkpoint_it_resumes_from(tmp_path, signum):
    """A preempted job's SIGTERM, or Ctrl-C: the run stops after the step it is in, writes a checkpoint there (the
    asynchronous writes finished), says so in one line and exits with 128 + the signal; the same command resumes."""
    command = [sys.executable, "-m", "gem_trainer.cli", "train", f"--run_dir={tmp_path}", *TINY, "--schedule.steps=100000"]
    # its own process group, signalled whole: as a terminal's Ctrl-C or a scheduler reaches every process of the job,
    # the checkpoint writer's too (which must live on to write the last checkpoint)
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in run.stdout:
        if line.startswith("train step 5 "):  # checkpoints of steps 2 and 4 written in the background
            break
    os.killpg(run.pid, signum)
    out, err = run.communicate(timeout=300)
    assert run.returncode == 128 + signum, err[-2000:]
    lines = err.strip().splitlines()
    assert f"{signum.name}: stopping after this step with a checkpoint (again: stop at once)" in lines
    step = int(lines[-1].split(" at step ")[1].split()[0])
    assert lines[-1] == (f"gem-trainer: stopped by {signum.name} at step {step} of 100000: checkpoint "
                         f"{tmp_path / 'checkpoints' / f'step-{step}'}; run the same command to resume")
    manager = CheckpointManager(tmp_path / "checkpoints", keep_latest=3)
    assert step >= 5 and manager.newest_intact() == (step, [])
    resumed = trainer_at(tmp_path, step + 1)
    assert resumed.resume() and resumed.step == step


def test_a_second_signal_stops_at_once_with_its_own_exit_code(tmp_path):
    command = [sys.executable, "-m", "gem_trainer.cli", "train", f"--run_dir={tmp_path}", *TINY, "--schedule.steps=100000"]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in run.stdout:
        if line.startswith("train step 3 "):
            break
    run.send_signal(signal.SIGTERM)
    time.sleep(0.2)  # apart: two pending signals of one kind are delivered once
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=300)
    assert run.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert err.strip().splitlines()[-1] == "gem-trainer: interrupted by SIGTERM"


def test_the_logged_learning_rate_is_the_one_the_step_used(tmp_path):
    """It was read after the scheduler stepped: each line showed the next step's rate."""
    trainer = trainer_at(tmp_path, 4, "--schedule.warmup_steps=3", "--checkpoint.enable=false")
    for _ in range(3):
        used = trainer.dense_optimizer.param_groups[0]["lr"]
        assert trainer.train_step()["lr"] == used
    trainer.close()
