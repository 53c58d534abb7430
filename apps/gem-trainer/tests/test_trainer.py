import dataclasses
import json
import math
import sys

import pytest
import torch

from cli_calls import cli, cli_here

from gem_data import ReadAhead
from gem_trainer import builders
from gem_trainer.bench import CycledBatches
from gem_trainer.config import load_config
from gem_trainer.distributed import init_distributed
from gem_trainer.trainer import Trainer, TrainingDiverged

SMALL = ["--data.batch_size=64", "--data.eval_batches=4", "--metrics.tensorboard=false", "--device=cpu"]


def local_tensors(state: dict) -> dict[str, torch.Tensor]:
    """This rank's data of every tensor (the local shard of a sharded embedding table)."""
    local = {}
    for key, value in state.items():
        if hasattr(value, "local_shards"):
            value = value.local_shards()[0].tensor
        local[key] = value.detach().clone()
    return local


def small_config(tmp_path, *extra):
    return load_config(None, [f"--run_dir={tmp_path}", *SMALL, *extra])


def feed(trainer: Trainer, batches: list) -> None:
    """From now on ``trainer`` reads ``batches`` (host batches, over and over), read as its own reader reads."""
    trainer.input.close()
    trainer.input = ReadAhead(CycledBatches(batches, trainer.spec), depth=0, observe=trainer._read_report,
                              device=trainer.env.device)
    trainer._batches = iter(trainer.input)


def test_nan_loss_waits_for_the_checkpoint_still_being_written_and_names_it(tmp_path, monkeypatch):
    import time

    from gem_trainer import checkpoint

    save = checkpoint.dcp.save

    def slow_save(*args, **kwargs):  # the background write of step 10 is still running when step 11 diverges
        time.sleep(1.0)
        return save(*args, **kwargs)

    monkeypatch.setattr(checkpoint.dcp, "save", slow_save)
    config = small_config(tmp_path, "--schedule.steps=30", "--schedule.warmup_steps=2", "--checkpoint.every_steps=10")
    assert config.checkpoint.asynchronous
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    for _ in range(10):
        trainer.train_step()
    trainer.save_checkpoint()
    first = next(iter(trainer.stream))
    feed(trainer, [dataclasses.replace(first, dense=torch.full_like(first.dense, float("nan")))])
    trainer.train_step()
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 11; stopping, the last good checkpoint is .*step-10$"):
        trainer.check_divergence()
    assert trainer.checkpoints.latest_step() == 10


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    config = small_config(tmp_path, "--schedule.steps=30", "--schedule.warmup_steps=2", "--checkpoint.every_steps=10")
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    for _ in range(10):
        trainer.train_step()
    trainer.save_checkpoint()
    good = local_tensors(trainer.model.state_dict())

    poisoned = iter(trainer.stream)
    first, second = next(poisoned), next(poisoned)
    feed(trainer, [dataclasses.replace(first, dense=torch.full_like(first.dense, float("nan"))), second])
    # the loss is read one step late (reading it at once would stall the GPU): step 11 itself returns ...
    assert math.isnan(float(trainer.train_step()["loss"]))
    # ... and every later step or checkpoint stops the run, naming the step and the checkpoint kept
    stop = r"loss is nan at step 11; stopping, the last good checkpoint is .*step-10"
    with pytest.raises(TrainingDiverged, match=stop):
        trainer.train_step()
    with pytest.raises(TrainingDiverged, match=stop):
        trainer.save_checkpoint()
    assert trainer.checkpoints.latest_step() == 10
    # what a restart continues from is the last good state
    restarted = Trainer(config, init_distributed("cpu", "gloo"))
    assert restarted.resume() and restarted.step == 10
    after = local_tensors(restarted.model.state_dict())
    assert after.keys() == good.keys() and any("t_ad_id" in k for k in after)
    for key, value in after.items():
        assert torch.equal(value, good[key]), key


def test_a_diverged_run_stops_before_writing_its_next_checkpoint(tmp_path):
    config = small_config(tmp_path, "--schedule.steps=4", "--schedule.warmup_steps=1", "--checkpoint.every_steps=2")
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    batches = iter(trainer.stream)
    first = next(batches)
    feed(trainer, [next(batches), dataclasses.replace(first, dense=torch.full_like(first.dense, float("inf")))])
    with pytest.raises(TrainingDiverged, match=r"at step 2; stopping, no checkpoint was written"):
        trainer.train()
    assert trainer.checkpoints.latest_step() is None


@pytest.mark.parametrize("decay", ["linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_the_learning_rate_peaks_once_and_reaches_its_floor_at_the_last_step(decay, warmup):
    config = load_config(None, ["--schedule.steps=12", f"--schedule.warmup_steps={warmup}", f"--schedule.decay={decay}",
                                "--schedule.min_lr_ratio=0.1", "--optimizer.lr=1.0"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = builders.build_lr_scheduler(config, optimizer)
    rates = []
    for _ in range(12):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    peak = max(warmup - 1, 0)
    assert rates[:warmup] == pytest.approx([(k + 1) / warmup for k in range(warmup)])
    assert rates[peak] == 1.0 and rates.count(1.0) == 1  # the peak, once
    assert all(a > b for a, b in zip(rates[peak:], rates[peak + 1:]))
    assert rates[-1] == pytest.approx(0.1, abs=1e-12)


def test_the_logged_training_rate_leaves_out_evaluations_and_checkpoints(tmp_path, monkeypatch):
    """On a clock that only training steps (0.01 s each), evaluations and saves (100 s each) move, every logged
    window trained log_every steps in 0.01 s each."""
    import time

    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    trainer = Trainer(small_config(tmp_path, "--schedule.steps=8", "--schedule.warmup_steps=1", "--metrics.log_every=2",
                                   "--eval.every_steps=3", "--checkpoint.every_steps=4"), init_distributed("cpu", "gloo"))
    step, evaluate, save = trainer.train_step, trainer.evaluate, trainer.save_checkpoint

    def moved(seconds, call):
        def run(*args, **kwargs):
            result = call(*args, **kwargs)
            now[0] += seconds
            return result
        return run

    trainer.train_step, trainer.evaluate, trainer.save_checkpoint = moved(0.01, step), moved(100.0, evaluate), moved(100.0, save)
    trainer.train()
    trainer.close()
    rates = [r["examples_per_s"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if r["phase"] == "train"]
    assert len(rates) == 4 and rates == pytest.approx([2 * 64 / 0.02] * 4)


def test_the_first_logged_rate_leaves_out_the_first_steps_warm_up(tmp_path, monkeypatch):
    """The first step compiles and warms up (100 s on this clock, every later one 0.01 s): reported apart as
    first_step_s, it is not in the first window's examples/s."""
    import time

    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    trainer = Trainer(small_config(tmp_path, "--schedule.steps=6", "--schedule.warmup_steps=1", "--metrics.log_every=3",
                                   "--checkpoint.enable=false"), init_distributed("cpu", "gloo"))
    step = trainer.train_step

    def timed():
        result = step()
        now[0] += 100.0 if trainer.step == 1 else 0.01
        return result

    trainer.train_step = timed
    trainer.train()
    trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["first_step_s"] for r in rows if r["phase"] == "startup"] == [pytest.approx(100.0)]
    train = [r for r in rows if r["phase"] == "train"]
    assert [r["examples"] for r in train] == [2 * 64, 3 * 64]  # steps 2-3, then 4-6
    assert [r["examples_per_s"] for r in train] == pytest.approx([64 / 0.01] * 2)


def test_each_logged_line_has_its_steps_mean_loss_beside_its_own(tmp_path):
    trainer = Trainer(small_config(tmp_path, "--schedule.steps=6", "--schedule.warmup_steps=1", "--metrics.log_every=3",
                                   "--checkpoint.enable=false"), init_distributed("cpu", "gloo"))
    step, losses = trainer.train_step, []

    def recorded():
        metrics = step()
        losses.append(float(metrics["loss"]))
        return metrics

    trainer.train_step = recorded
    trainer.train()
    trainer.close()
    train = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if r["phase"] == "train"]
    assert [r["loss"] for r in train] == pytest.approx([losses[2], losses[5]])
    assert [r["loss_mean"] for r in train] == pytest.approx([sum(losses[:3]) / 3, sum(losses[3:]) / 3])
    assert len(set(losses)) == 6


def test_state_dict_round_trip_restores_step_data_position_and_schedule(tmp_path):
    config = small_config(tmp_path, "--schedule.steps=30", "--schedule.warmup_steps=5")
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    for _ in range(7):
        trainer.train_step()
    state = trainer.state_dict()
    lr = trainer.scheduler.get_last_lr()
    other = Trainer(small_config(tmp_path / "other", "--schedule.steps=30", "--schedule.warmup_steps=5"), trainer.env)
    other.load_state_dict(state)
    assert other.step == 7 and other.stream.position == 7 and other.scheduler.get_last_lr() == lr
    assert torch.equal(next(other._batches).dense, next(trainer._batches).dense)


@pytest.mark.slow
def test_train_learns_then_eval_plot_and_flops_work(tmp_path):
    run = tmp_path / "run"
    done = cli("train", f"--run_dir={run}", "--schedule.steps=150", "--schedule.warmup_steps=10", "--metrics.log_every=50",
                   *SMALL, "--data.eval_batches=16")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "train step 150" in done.stdout and "examples_per_s" in done.stdout and "tflops" in done.stdout
    result = json.loads((run / "eval.json").read_text())
    assert result["click/all/auc"] > 0.65, result
    assert result["conversion/all/auc"] > 0.6, result
    assert (run / "config.toml").is_file() and list((run / "tensorboard").glob("events.*")) == []

    evaluated = cli("eval", f"--run_dir={run}", *SMALL, "--data.eval_batches=16")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads((run / "eval.json").read_text())["click/all/auc"] == result["click/all/auc"]

    plotted = cli_here("plot", f"--run_dir={run}")
    assert plotted.returncode == 0, plotted.stderr[-3000:]
    assert (run / "train.png").stat().st_size > 1000 and (run / "eval.png").is_file()

    flops = cli_here("flops", f"--out={tmp_path / 'flops.json'}")
    assert flops.returncode == 0 and "layer0.attention" in flops.stdout and "layer1.moe" in flops.stdout
    report = json.loads((tmp_path / "flops.json").read_text())
    assert report["total_train_flops_per_example"] == pytest.approx(3 * report["total_forward_flops_per_example"])


@pytest.mark.slow
def test_launch_runs_two_processes_through_torchrun(tmp_path):
    run = tmp_path / "run"
    done = cli(
        "launch", "--nproc-per-node", "2", f"--run_dir={run}", "--schedule.steps=20", "--schedule.warmup_steps=2",
        "--metrics.log_every=10", "--checkpoint.every_steps=10", *SMALL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--nproc-per-node=2" in done.stdout and "train step 20" in done.stdout
    assert (run / "checkpoints" / "step-20" / "local-rank1.pt").is_file()
    result = json.loads((run / "eval.json").read_text())
    # 4 global eval batches of 2 ranks x 64, every example counted once
    assert result["click/all/count"] == 4 * 2 * 64


@pytest.mark.slow
def test_distillation_from_a_finished_teacher_run(tmp_path):
    teacher, student = tmp_path / "teacher", tmp_path / "student"
    steps = ["--schedule.steps=100", "--schedule.warmup_steps=5", "--metrics.log_every=50"]
    done = cli("train", f"--run_dir={teacher}", "--model.name=baseline", *steps, *SMALL)
    assert done.returncode == 0, done.stderr[-3000:]
    done = cli("train", f"--run_dir={student}", f"--distillation.teacher_run_dir={teacher}", *steps, *SMALL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "train step 100" in done.stdout
    result = json.loads((student / "eval.json").read_text())
    assert result["click/all/auc"] > 0.6
    # the student's checkpoint holds the auxiliary head and the adapter beside the Kunlun student
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(student / "checkpoints" / "step-100")).read_metadata().state_dict_metadata
    assert any(k.startswith("model.auxiliary_head.") for k in keys) and any(k.startswith("model.adapter.") for k in keys)
    assert any(k.startswith("model.student.trunk.layers.") for k in keys)


def test_a_missing_teacher_is_a_config_error(tmp_path):
    config = small_config(tmp_path, f"--distillation.teacher_run_dir={tmp_path / 'nowhere'}")
    from gem_trainer.config import ConfigError

    with pytest.raises(ConfigError, match=r"distillation.teacher_run_dir: .*nowhere/config.toml not found"):
        Trainer(config, init_distributed("cpu", "gloo"))


def test_log_line_splits_end_to_end_mfu_into_local_mfu_and_scaling_ratio_and_start_up_is_logged(tmp_path):
    config = small_config(tmp_path, "--schedule.steps=2", "--schedule.warmup_steps=1", "--metrics.log_every=1",
                          "--checkpoint.enable=false", "--metrics.peak_tflops=1.0",
                          "--metrics.single_device_examples_per_s=1000")
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    startup = [row for row in rows if row["phase"] == "startup"]  # logged once, after the first step
    assert len(startup) == 1 and startup[0]["step"] == 1 and startup[0]["setup_s"] > 0 and startup[0]["first_step_s"] > 0
    assert startup[0]["time_to_first_step_s"] == pytest.approx(startup[0]["setup_s"] + startup[0]["first_step_s"])
    rows = [row for row in rows if row["phase"] == "train"]
    assert len(rows) == 2
    for row in rows:
        assert row["scaling_ratio"] == pytest.approx(row["examples_per_s"] / 1000)
        assert row["mfu_local"] * row["scaling_ratio"] == pytest.approx(row["mfu"])
        assert row["mfu"] == pytest.approx(row["tflops"] / 1.0)


@pytest.mark.parametrize("override, message", [
    ("--parallelism.expert=2", r"^parallelism\.expert \(2\) must divide dense_shard \(1\)"),
    ("--parallelism.dense_replicate=2", r"^parallelism\.dense_replicate \(2\) must divide the world size \(1\)"),
    ("--parallelism.sparse_group=3", r"^parallelism\.sparse_group \(3\) must divide the world size \(1\)"),
    ("--parallelism.compile=reduce-overhead --parallelism.param_dtype=bfloat16",
     r"^parallelism\.compile = 'reduce-overhead' replays each block as CUDA graphs, which cannot hold FSDP's"),
    ("--parallelism.compile=reduce-overhead",
     r"^parallelism\.compile = 'reduce-overhead' needs the model's blocks chained in one nn\.Sequential \(SASRec's\); "
     r"KunlunModel calls its blocks one by one"),
])
def test_a_layout_that_does_not_fit_the_world_is_a_one_line_config_error(tmp_path, override, message):
    from gem_trainer.config import ConfigError

    with pytest.raises(ConfigError, match=message) as error:
        Trainer(small_config(tmp_path, *override.split()), init_distributed("cpu", "gloo"))
    assert "\n" not in str(error.value)


def test_gpu_only_settings_on_cpu_are_one_line_config_errors(tmp_path):
    from gem_trainer.config import ConfigError

    with pytest.raises(ConfigError, match=r"^parallelism\.collectives = 'copy_engine' needs CUDA devices"):
        init_distributed("cpu", "copy_engine")
    with pytest.raises(ConfigError, match=r"^parallelism\.sparse_sharding = 'row_wise' needs GPUs"):
        Trainer(small_config(tmp_path, "--parallelism.sparse_sharding=row_wise"), init_distributed("cpu", "gloo"))


def test_mxfp8_emulation_reaches_the_flop_heavy_layers_and_keeps_the_rest_in_high_precision(tmp_path):
    from gem_kernels import MXLinear

    config = small_config(tmp_path, "--schedule.steps=4", "--schedule.warmup_steps=1", "--checkpoint.enable=false",
                          "--precision.low_precision=mxfp8_emulated", "--precision.mx_rounding=rceil")
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    converted = trainer.low_precision_modules
    assert any(n.endswith("attention.qkv") for n in converted) and any(n.endswith("pffn.kv") for n in converted)
    assert any(n.endswith("fm_mlp.0") for n in converted)  # the Wukong experts' MLPs
    assert any(".experts." in n and not n.split(".")[-1].isalpha() for n in converted)  # and their token products
    assert not any(part in ("embedding", "heads", "gate") for n in converted for part in n.split("."))
    mx = [m for m in trainer.model.modules() if isinstance(m, MXLinear)]
    assert mx and all(m.recipe.rounding == "rceil" and m.recipe.grad_elem == "e5m2" for m in mx)
    losses = [float(trainer.train_step()["loss"]) for _ in range(4)]
    reference = Trainer(small_config(tmp_path / "fp32", "--schedule.steps=4", "--schedule.warmup_steps=1",
                                     "--checkpoint.enable=false"), trainer.env)
    exact = [float(reference.train_step()["loss"]) for _ in range(4)]
    assert losses != exact and losses == pytest.approx(exact, rel=0.05)


def test_a_two_towers_score_stays_in_high_precision_on_both_sides():
    """The query map and the item tower feed the retrieval score (their product) as the heads feed a ranking's."""
    from gem_kunlun import EventType, FeatureSpec, KunlunConfig, KunlunModel, SparseFeature

    spec = FeatureSpec(num_dense=0, sparse=(SparseFeature("item_id", 30), SparseFeature("item_attributes", 7)),
                       events=(EventType("history", (SparseFeature("history_item_id", 30),)),), tasks=("next_item",),
                       candidate=("item_id", "item_attributes"))
    model = KunlunModel(spec, KunlunConfig(two_tower=True, num_layers=1, max_seq_len=8, block_size=4, window=4))
    converted = builders.apply_low_precision(load_config(None, ["--precision.low_precision=mxfp8_emulated"]), model)
    assert converted and not any(part in ("query", "item_tower") for n in converted for part in n.split("."))


def test_a_high_precision_name_of_no_module_is_a_one_line_config_error():
    """A misspelt name kept nothing: its layers went low precision without a word. Names of the defaults may match no
    module of a model (the MoE gate, a two-tower's query map, what distillation adds), a name of the model's is kept."""
    from gem_kunlun import KunlunConfig, KunlunModel

    from gem_kunlun.testing import SPEC

    from gem_trainer.config import ConfigError

    def convert(*names):
        model = KunlunModel(SPEC, KunlunConfig(num_layers=1, max_seq_len=8, block_size=4, window=4))
        config = load_config(None, ["--precision.low_precision=mxfp8_emulated", f"--precision.high_precision={list(names)}"])
        return builders.apply_low_precision(config, model)

    with pytest.raises(ConfigError, match=r"^precision\.high_precision: 'atention' is no part of a module name of this "
                                          r"model \(e\.g\. ") as error:
        convert("embedding", "heads", "atention")
    assert "\n" not in str(error.value)
    assert not any("attention" in n.split(".") for n in convert("embedding", "heads", "gate", "query", "attention"))


def test_fp8_attention_reaches_the_sequence_attention_and_trains_near_float32(tmp_path):
    from gem_kunlun.local_attention import LocalAttention

    steps = ("--schedule.steps=4", "--schedule.warmup_steps=1", "--checkpoint.enable=false")
    trainer = Trainer(small_config(tmp_path, *steps, "--precision.fp8_attention=true"), init_distributed("cpu", "gloo"))
    attention = [(n, m) for n, m in trainer.model.named_modules() if isinstance(m, LocalAttention)]
    assert attention and all(m.fp8 for _, m in attention)
    # named before the parallel wrapper: the unwrapped model's own names
    assert len(trainer.low_precision_modules) == len(attention)
    assert all(n.endswith(m) for (n, _), m in zip(attention, trainer.low_precision_modules))
    losses = [float(trainer.train_step()["loss"]) for _ in range(4)]
    reference = Trainer(small_config(tmp_path / "fp32", *steps), trainer.env)
    assert not any(m.fp8 for m in reference.model.modules() if isinstance(m, LocalAttention))
    exact = [float(reference.train_step()["loss"]) for _ in range(4)]
    # gradients flow through the FP8 attention (its backward: the gradient at the quantised operands)
    assert losses != exact and losses == pytest.approx(exact, rel=0.05)


def test_fp8_recipe_reaches_the_wide_layers_and_trains_near_float32(tmp_path, monkeypatch):
    from gem_kernels import Fp8Linear
    from gem_kunlun import norm

    fused, block = [], norm.fp8_norm_mlp

    def counted(*args, **kwargs):  # a norm + MLP whose linears the recipe converted runs as one FP8 block
        fused.append(args[0].shape)
        return block(*args, **kwargs)

    monkeypatch.setattr(norm, "fp8_norm_mlp", counted)

    steps = ("--schedule.steps=4", "--schedule.warmup_steps=1", "--checkpoint.enable=false")
    # the small model's layers are narrow: the crossover is lowered so that the recipe reaches them
    config = small_config(tmp_path, *steps, "--precision.low_precision=fp8", "--precision.fp8_min_features=16",
                          "--precision.fp8_min_tokens=0", "--precision.fp8_weight_gradient=fp8")
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    converted = trainer.low_precision_modules
    assert any(n.endswith("attention.qkv") for n in converted) and any(n.endswith("pffn.kv") for n in converted)
    assert not any(part in ("embedding", "heads", "gate") for n in converted for part in n.split("."))
    fp8 = [m for m in trainer.model.modules() if isinstance(m, Fp8Linear)]
    assert fp8 and all(m.recipe.weight_gradient == "fp8" and m.recipe.min_tokens == 0 for m in fp8)
    losses = [float(trainer.train_step()["loss"]) for _ in range(4)]
    assert any(n.endswith("compress_mlp.0") for n in converted) and fused
    reference = Trainer(small_config(tmp_path / "fp32", *steps), trainer.env)
    exact = [float(reference.train_step()["loss"]) for _ in range(4)]
    assert losses != exact and losses == pytest.approx(exact, rel=0.05)
    # at the default crossover nothing of this narrow model pays: it stays as it is
    default = Trainer(small_config(tmp_path / "default", *steps, "--precision.low_precision=fp8"), trainer.env)
    assert default.low_precision_modules == []


def test_blockwise_fp8_recipe_reaches_the_layers_of_whole_blocks_and_trains_near_float32(tmp_path, monkeypatch):
    from gem_kernels import Fp8Linear
    from gem_kunlun import norm

    fused = []
    monkeypatch.setattr(norm, "fp8_norm_mlp", lambda *args, **kwargs: fused.append(args) or None)
    steps = ("--schedule.steps=4", "--schedule.warmup_steps=1", "--checkpoint.enable=false")
    config = small_config(tmp_path, *steps, "--precision.low_precision=fp8", "--precision.fp8_scaling=blockwise",
                          "--precision.fp8_min_features=16", "--precision.fp8_min_tokens=0",
                          "--precision.fp8_weight_gradient=fp8")
    trainer = Trainer(config, init_distributed("cpu", "gloo"))
    fp8 = {name: m for name, m in trainer.model.named_modules() if isinstance(m, Fp8Linear)}
    assert fp8 and all(m.recipe.scaling == "blockwise" for m in fp8.values())
    # only layers of whole 128 x 128 blocks convert (the rowwise recipe also takes this model's narrower ones)
    assert all(m.in_features % 128 == 0 and m.out_features % 128 == 0 for m in fp8.values())
    losses = [float(trainer.train_step()["loss"]) for _ in range(4)]
    assert not fused  # the norm + MLP block's producers write rowwise E4M3: blockwise linears quantise their own inputs
    reference = Trainer(small_config(tmp_path / "fp32", *steps), trainer.env)
    exact = [float(reference.train_step()["loss"]) for _ in range(4)]
    assert losses != exact and losses == pytest.approx(exact, rel=0.05)


def test_a_history_padded_to_token_buckets_trains_as_the_unpadded_one(tmp_path):
    # parallelism.cuda_graph_history_bucket pads Kunlun's history with padding segments (a GPU then replays the whole
    # trunk as CUDA graphs; on the CPU the padded trunk runs eagerly): the same losses, step by step
    losses = {}
    for bucket in (0, 64):
        config = load_config(None, [f"--run_dir={tmp_path / str(bucket)}", "--device=cpu", "--data.batch_size=16",
                                    "--data.eval_batches=1", "--metrics.tensorboard=false", "--checkpoint.enable=false",
                                    "--model.kunlun.kernel=pytorch", "--parallelism.cuda_graphs=on",
                                    f"--parallelism.cuda_graph_history_bucket={bucket}"])
        trainer = Trainer(config, init_distributed(config.device, config.parallelism.collectives))
        try:
            trunk = trainer.model.module.trunk if hasattr(trainer.model, "module") else trainer.model.trunk
            assert trunk.history_bucket == bucket and (trunk.trunk_graphs is not None) == bool(bucket)
            losses[bucket] = torch.tensor([float(trainer.train_step()["loss"]) for _ in range(3)])
        finally:
            trainer.close()
    torch.testing.assert_close(losses[64], losses[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("read_ahead", [True, False])
def test_the_thread_switch_interval_is_the_configs_while_a_reading_trainer_lives(tmp_path, read_ahead):
    before = sys.getswitchinterval()
    trainer = Trainer(small_config(tmp_path, "--data.read_ahead_switch_ms=0.5", f"--data.read_ahead={read_ahead}"),
                      init_distributed("cpu", "gloo"))
    try:
        trainer.train_step()
        # without a reader thread there is nothing to switch to: Python's setting stays
        assert sys.getswitchinterval() == pytest.approx(0.0005 if read_ahead else before)
    finally:
        trainer.close()
    assert sys.getswitchinterval() == pytest.approx(before, abs=2e-6)  # kept in whole microseconds


@pytest.mark.parametrize("shift", [3, -4])
def test_a_batch_with_surface_ids_outside_the_spec_is_refused_in_one_line(tmp_path, shift):
    trainer = Trainer(small_config(tmp_path, "--checkpoint.enable=false"), init_distributed("cpu", "gloo"))
    first = next(iter(trainer.stream))
    assert trainer.spec.num_surfaces == 3
    feed(trainer, [dataclasses.replace(first, surface=first.surface + shift)])
    with pytest.raises(ValueError, match=r"^data: a training batch has surface \(domain\) ids in \[-?\d+, -?\d+\], "
                                         r"outside the data spec's \[0, 3\)$"):
        trainer.train_step()
    trainer.close()


def test_a_surface_filter_reports_the_global_batches_it_skipped(tmp_path):
    """A domain's model skips global batches without its examples: the log line counts them (and their examples)."""
    trainer = Trainer(small_config(tmp_path, "--data.train_surfaces=[2]", "--data.batch_size=2", "--schedule.steps=6",
                                   "--schedule.warmup_steps=1", "--checkpoint.enable=false"), init_distributed("cpu", "gloo"))
    try:
        for _ in range(6):
            trainer.train_step()
        metrics = trainer._data_metrics()
        skipped = trainer.input.state_dict()["surface_filter_skipped"]  # as of the last batch trained on
        assert metrics["surfaces_skipped_batches"] == skipped["batches"] > 0
        assert metrics["surfaces_skipped_examples"] == skipped["examples"] == 0  # one rank: a batch skipped kept none
    finally:
        trainer.close()
