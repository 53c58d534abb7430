"""Smoke test of the training benchmark harness on CPU: a tiny Kunlun, every variant, the JSON it writes."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gem_trainer import bench

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "bench-h200.toml"
TINY = ["--model.kunlun.d_model=32", "--model.kunlun.num_layers=2", "--model.kunlun.num_heads=2",
        "--model.kunlun.max_seq_len=96", "--model.kunlun.block_size=16", "--model.kunlun.window_blocks=2",
        "--model.kunlun.expert_hidden=32", "--model.kunlun.hidden=[32]"]


def test_bench_config_is_the_gem_like_shape():
    from gem_trainer.config import load_config

    config = load_config(CONFIG)
    model = config.model.kunlun.build()
    assert config.model.name == "kunlun" and config.data.batch_size >= 512
    assert model.d_model >= 512 and model.num_layers >= 4 and model.num_experts >= 8 and model.max_seq_len == 8192
    args = bench.parse_args(["--config", str(CONFIG), "--out", "x.json"])
    assert args.sparse_features >= 100 and args.mean_len == 1024


def test_bench_batches_have_lognormal_lengths_and_are_valid():
    data = bench.BenchData(batch_size=64, sparse_features=5, mean_len=300, max_len=2048)
    source = bench.BenchBatches(data)
    batch = source.next()
    batch.validate(data.spec())
    lengths = batch.num_events()
    assert torch.equal(lengths, source.total) and int(lengths.min()) >= 16 and int(lengths.max()) <= 2048
    assert 150 < float(lengths.float().mean()) < 600
    assert torch.equal(source.next().num_events(), lengths)  # fixed lengths, fresh ids
    seq = batch.sequences["click"]
    t, off = seq.timestamps, seq.offsets()
    assert all(bool((t[a + 1:b] >= t[a:b - 1]).all()) for a, b in zip(off[:-1].tolist(), off[1:].tolist()))


@pytest.mark.slow  # ~25 s on 2 cores: tiny models trained and profiled
def test_bench_runs_every_variant_and_writes_the_json(tmp_path):
    out = tmp_path / "train.json"
    other = tmp_path / "small.toml"
    # a config that compiles is also measured with its blocks eager (the baseline has none: nothing to compile)
    other.write_text('[model]\nname = "baseline"\n[data]\nbatch_size = 8\n[data.synthetic]\nmax_events = 8\n'
                     '[parallelism]\ncompile = "default"\n')
    doc = bench.main(["--config", str(CONFIG), "--out", str(out), "--device", "cpu", "--batch-size", "4",
                      "--sparse-features", "3", "--mean-len", "40", "--max-len", "96", "--warmup", "1",
                      "--steps", "2", "--profile-steps", "1", "--batches", "2", "--trainer-configs", str(other), "--config-steps", "2",
                      "--trainer-override", "data.eval_batches=1", "--checkpoint-steps", "2",
                      "--save-tuned", str(tmp_path / "tuned.json"), "--parallelism.compile_experts=on", *TINY])
    written = json.loads(out.read_text())
    assert written["meta"]["command"].startswith("python -m gem_trainer.bench")
    # the kernels' tile configs the run launched, in the document and in the file run_all's --tuned reads
    assert written["meta"]["kernel_autotune"] is False
    assert json.loads((tmp_path / "tuned.json").read_text()) == written["meta"]["tuned_configs"]
    for key in ("date", "commit", "torch", "device"):
        assert written["meta"][key]
    assert set(written["variants"]) == {"gem", "bare", "plain"} and not written["errors"]
    assert written["variants"]["gem"]["step"] == "Trainer.train_step"  # the trainer's own step, not a copy
    for name, kernel in (("gem", "auto"), ("bare", "auto"), ("plain", "builtin")):
        v = written["variants"][name]
        assert v["kernel"] == kernel and v["examples_per_s"] > 0 and v["loss_finite"]
        assert v["tflops"] >= 0 and 0 <= v["mfu_local"] < 1
        assert v["examples_per_s"] == pytest.approx(4 / v["step_ms"] * 1e3, rel=0.01)
    for name in ("gem", "plain"):
        # gem's MoEs compiled (parallelism.compile_experts): their ranges still wrap their kernels
        components = written["variants"][name]["components_ms_per_step"]
        assert {"attention", "pffn", "moe", "embedding"} <= set(components)
        assert all(0 <= c["share_of_step"] and 0 <= c["host_ms"] for c in components.values())
        assert sum(c["host_ms"] for c in components.values()) > 0
        assert "tflops" in components["attention"] and "tflops" not in components["norm"]  # norms count no FLOPs
        # each component names its costliest launching ops, their times within its own
        ops = components["attention"]["ops"]
        assert ops and all(name.split(" ")[0] in ("fwd", "bwd") and " < " in name for name in ops)
        assert sum(ops.values()) <= components["attention"]["total_ms"] + 0.01
    assert written["config"]["forward_gflop_per_example"] > 0
    assert doc["gem_vs_plain"]["examples_per_s_ratio"] > 0 and doc["trainer_overhead"] > 0
    assert set(doc["targets"]) == {"mfu_local >= 0.30", "examples_per_s >= 1.5x plain", "trainer_overhead <= 1.10",
                                   "checkpoint every 200 steps <= 2% of step time"}
    startup, checkpoint = written["variants"]["gem"]["startup"], written["variants"]["gem"]["checkpoint"]
    assert startup["setup_s"] > 0 and startup["first_step_s"] > 0
    assert checkpoint["size_gb"] > 0 and checkpoint["write_s"] > 0
    for mode in ("synchronous", "asynchronous"):
        assert checkpoint[mode]["save_call_ms"] > 0 and 0 <= checkpoint[mode]["cost_share"] < 1
        # the training waits at least as long as the save call blocks it, however noisy the steps' pace
        blocked = checkpoint[mode]["save_call_ms"] / 1e3
        floor = blocked / (checkpoint["every_steps"] * written["variants"]["gem"]["step_ms"] / 1e3 + blocked)
        assert checkpoint[mode]["cost_share"] >= floor - 1e-4
        # every round timed at least the minimum of steps, the reported one is the median round's
        assert all(r[mode]["steps"] >= checkpoint["min_steps_timed"] for r in checkpoint["rounds"])
        stalls = sorted(r[mode]["stall_ms"] for r in checkpoint["rounds"])
        assert stalls[len(stalls) // 2] == checkpoint[mode]["stall_ms"]
    small = written["trainer_configs"][str(other)]
    assert small["gem"]["examples_per_s"] == pytest.approx(8 / small["gem"]["step_ms"] * 1e3, rel=0.01)
    assert small["bare"]["loss_finite"] and small["trainer_overhead"] > 0
    assert small["uncompiled"]["bare"]["loss_finite"]
    eager_ms, compiled_ms = small["uncompiled"]["bare"]["step_ms"], small["bare"]["step_ms"]
    assert small["compile_speedup"]["bare"] == pytest.approx(eager_ms / compiled_ms, abs=2e-3)


def test_an_asynchronous_save_is_timed_until_its_write_is_marked(tmp_path):
    """The background write's interference counts whole: the window runs until the write is done."""
    class Checkpoints:
        def __init__(self):
            self.polls_left = 0

        def save(self, step, distributed, local, asynchronous):
            self.polls_left = 7 if asynchronous else 0  # the write outlasts the minimum of 2 steps

        def writing(self):
            self.polls_left = max(0, self.polls_left - 1)
            return self.polls_left > 0

        def wait(self):  # blocks until the write is marked
            self.polls_left = 0

        def path(self, step):
            folder = tmp_path / f"step-{step}"
            folder.mkdir(exist_ok=True)
            (folder / "shard").write_bytes(b"x" * 10)
            return folder

    trainer = SimpleNamespace(checkpoints=Checkpoints(), step=3, distributed_state=dict, state_dict=dict)
    args = SimpleNamespace(checkpoint_steps=2, checkpoint_rounds=3, checkpoint_every=200)
    result = {"step_ms": 1.0}
    bench.measure_checkpoints(trainer, lambda i: None, result, args, torch.device("cpu"), lambda line: None)
    checkpoint = result["checkpoint"]
    # two steps before the write is first asked about, six while it still runs
    assert [r["asynchronous"]["steps"] for r in checkpoint["rounds"]] == [8, 8, 8]
    assert [r["synchronous"]["steps"] for r in checkpoint["rounds"]] == [2, 2, 2]
    assert checkpoint["min_steps_timed"] == 2 and len(checkpoint["rounds"]) == 3


def test_the_model_check_compares_logits_and_every_gradient():
    from gem_trainer.config import load_config

    args = bench.parse_args(["--config", str(CONFIG), "--out", "unused", "--sparse-features", "3", *TINY])
    config = load_config(CONFIG, args.overrides)
    check = bench.check_model_agreement(config, args, torch.device("cpu"))
    model = bench.build_variant(config, bench.BenchData(batch_size=8, sparse_features=3).spec(), "pytorch",
                                torch.device("cpu"), config.seed)
    assert check["parameters_compared"] == len(list(model.parameters()))
    # on the CPU both variants run PyTorch's ops (fused or not): equal up to float32 rounding, routed alike
    assert check["logits_rel_err_plain_vs_gem"] < 1e-4 and check["grad_rel_err_plain_vs_gem"] < 1e-4
    assert check["routing_equal"] and check["ok"] and check["mode"] == "eval"


def test_top_kernels_lists_kernels_not_the_components_labels():
    def event(key, ms, calls):
        return SimpleNamespace(key=key, self_device_time_total=ms * 1000.0 * 2, device_type="DeviceType.CUDA",
                               count=calls * 2)

    events = [event("gem::attention", 40.0, 4), event("attn_fwd_kernel", 9.0, 4), event("rotary_kernel", 11.0, 8)]
    rows = bench.top_kernels(SimpleNamespace(key_averages=lambda: events), steps=2)
    assert rows == [{"kernel": "rotary_kernel", "ms_per_step": 11.0, "calls": 8},
                    {"kernel": "attn_fwd_kernel", "ms_per_step": 9.0, "calls": 4}]


def test_model_flops_are_summed_per_benchmark_component():
    table = {"layer0.attention": 3.0, "layer1.attention": 4.0, "layer0.pffn": 1.0, "final_summary": 2.0, "mlp": 0.5,
             "heads": 0.25, "embedding.dense_proj": 0.125}
    assert bench.component_flops(table) == {"attention": 7.0, "pffn": 1.0, "final_summary": 2.0, "mlp_heads": 0.75,
                                            "embedding": 0.125}


def test_backward_time_is_attributed_to_the_component_that_ran_forward():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    x = torch.randn(256, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("gem::first"):
            h = model[1](model[0](x))
        with torch.profiler.record_function("gem::second"):
            y = model[2](h)
        y.sum().backward()
    table = bench.attribute_device_time(prof.events(), 1, bench._cpu_time)
    assert table["first"]["bwd_ms"] > 0 and table["second"]["bwd_ms"] > 0


def test_the_mfu_denominator_is_the_benchmarked_devices_peak(monkeypatch):
    """A PCIe or NVL card runs at lower clocks than the SXM parts: its MFU is taken against its own peak."""
    from gem_trainer.bench import device_peak

    for name, peak in (("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert device_peak(torch.device("cuda")) == peak
    assert device_peak(torch.device("cpu")) == 989.0  # no peak of its own: the SXM figure
