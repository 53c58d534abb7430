"""Checkpoints that survive damage: a damaged newest checkpoint is skipped for the intact one before it, a
local state that would run code on load is refused, and a disk that fills during a save stops the run in
one line with the previous checkpoint kept."""

import errno
import json
import os
import pickle
import subprocess
import sys
import threading

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


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_full_disk_during_a_save_stops_in_one_line_and_keeps_the_previous_checkpoint(two_checkpoints, monkeypatch,
                                                                                      asynchronous):
    run_dir, manager = two_checkpoints
    trainer = trainer_at(run_dir, 8, f"--checkpoint.asynchronous={str(asynchronous).lower()}")
    assert trainer.resume() and trainer.step == 4
    trainer.train_step()
    trainer.train_step()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("torch.distributed.checkpoint.save", full)
    with pytest.raises(CheckpointError) as error:
        trainer.save_checkpoint()
        trainer.checkpoints.wait()  # an asynchronous save's failure surfaces when it is waited for
    message = str(error.value)
    assert "\n" not in message and "could not write checkpoint" in message and "step-6" in message
    assert "No space left on device" in message and "step-4 is kept" in message
    assert not (run_dir / "checkpoints" / "step-6").exists()
    assert manager.complete_steps() == [2, 4] and manager.damage(4) is None


def test_an_asynchronous_save_holds_the_state_of_its_step_and_counts_only_once_written(two_checkpoints, monkeypatch):
    run_dir, manager = two_checkpoints
    trainer = trainer_at(run_dir, 12)
    assert trainer.config.checkpoint.asynchronous and trainer.resume() and trainer.step == 4
    trainer.train_step()
    trainer.train_step()
    expected = {k: local(v).clone() for k, v in trainer.model.state_dict().items()}
    import torch.distributed.checkpoint as dcp

    release, write = threading.Event(), dcp.save

    def held_back(*args, **kwargs):
        assert release.wait(60)
        return write(*args, **kwargs)

    monkeypatch.setattr("torch.distributed.checkpoint.save", held_back)
    trainer.save_checkpoint()  # returns with the write held back
    marker = run_dir / "checkpoints" / "step-6" / MARKER
    for _ in range(3):  # training goes on and changes the weights while the write waits
        trainer.train_step()
    assert not marker.exists() and manager.latest_step() == 4 and trainer.checkpoints.writing()
    release.set()
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


def local(value: torch.Tensor) -> torch.Tensor:
    """A ShardedTensor's (one) local shard, or the tensor itself."""
    return value.local_shards()[0].tensor if hasattr(value, "local_shards") else value


def test_host_staging_copies_the_state_and_reuses_its_buffers():
    from gem_trainer.checkpoint import HostStaging

    weights, steps = torch.randn(4, 3), [torch.tensor(2.0), {"lr": 0.1}]
    staging = HostStaging()
    first = staging.stage({"w": weights, "opt": steps})
    weights.add_(1.0)  # training goes on: the staged copy must not see it
    assert not torch.equal(first["w"], weights) and first["opt"][1] == {"lr": 0.1}
    second = staging.stage({"w": weights, "opt": steps})
    assert torch.equal(second["w"], weights) and second["w"].data_ptr() == first["w"].data_ptr()
    third = staging.stage({"w": torch.zeros(2, 2), "opt": steps})  # a new shape gets a new buffer
    assert third["w"].shape == (2, 2)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_records_are_written_without_checksums_and_the_checkpoint_loads(two_checkpoints, monkeypatch, asynchronous):
    """torch.save's per-record CRC32 holds the GIL; the manifest's SHA-256 covers the files instead."""
    import torch.distributed.checkpoint as dcp
    import torch.utils.serialization.config as serialization_config

    run_dir, manager = two_checkpoints
    trainer = trainer_at(run_dir, 8, f"--checkpoint.asynchronous={str(asynchronous).lower()}")
    assert trainer.resume() and trainer.step == 4
    trainer.train_step()
    seen, write = [], dcp.save

    def recording(*args, **kwargs):
        seen.append(serialization_config.save.compute_crc32)
        return write(*args, **kwargs)

    monkeypatch.setattr("torch.distributed.checkpoint.save", recording)
    trainer.save_checkpoint()
    trainer.checkpoints.wait()
    assert seen == [False] and serialization_config.save.compute_crc32  # switched back once written
    expected = {k: local(v).clone() for k, v in trainer.model.state_dict().items()}
    trainer.close()
    resumed = trainer_at(run_dir, 8)
    assert resumed.resume(5) and manager.damage(5) is None
    for key, value in resumed.model.state_dict().items():
        assert torch.equal(local(value), expected[key]), key
