"""The trainer on a GPU: its input path, a step without device synchronisation, compiled blocks around the Triton
kernels, asynchronous checkpoints (run where a CUDA device is; the benchmark sweeps run them on the H200)."""

import math

import pytest
import torch

from gem_kunlun import KunlunLayer, KunlunTrunk
from gem_trainer.config import load_config
from gem_trainer.distributed import init_distributed
from gem_trainer.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


READERS = {"thread": "--data.read_ahead_process=false", "process": "--data.read_ahead_process=true"}


@pytest.mark.parametrize("reader", READERS)
def test_batches_reach_the_gpu_from_the_reader_and_train(tmp_path, reader):
    from gem_trainer import builders

    config = load_config(None, [f"--run_dir={tmp_path}", "--device=cuda", "--data.batch_size=64", "--data.eval_batches=1",
                                "--metrics.tensorboard=false", "--checkpoint.enable=false", READERS[reader]])
    env = init_distributed(config.device, config.parallelism.collectives)
    trainer = Trainer(config, env)
    try:
        batch = next(trainer._batches)  # on the device already (the process reader: one copy of its packed buffer)
        host = next(iter(builders.build_data(config, env).train))
        pairs = [(batch.dense, host.dense), (batch.labels, host.labels), (batch.surface, host.surface),
                 (batch.sparse.values(), host.sparse.values()), (batch.sparse.lengths(), host.sparse.lengths())]
        for name, seq in host.sequences.items():
            got = batch.sequences[name]
            pairs += [(got.timestamps, seq.timestamps), (got.ids.values(), seq.ids.values()), (got.ids.lengths(), seq.ids.lengths())]
            assert got.host_lengths() == seq.lengths().tolist()  # known on the host: nothing read back from the GPU
        assert all(a.is_cuda and torch.equal(a.cpu(), b) for a, b in pairs)
        assert batch.sparse.length_per_key() == host.sparse.length_per_key()
        losses = [float(trainer.train_step()["loss"]) for _ in range(3)]
        assert all(math.isfinite(x) for x in losses)
    finally:
        trainer.close()


def test_dropout_on_the_gpu_resumes_exactly(tmp_path):
    # dropout on a GPU draws from the device's generator: a checkpoint carries its state
    overrides = [f"--run_dir={tmp_path}", "--device=cuda", "--data.batch_size=64", "--data.eval_batches=1",
                 "--metrics.tensorboard=false", "--model.kunlun.dropout=0.3", "--checkpoint.asynchronous=false",
                 "--deterministic=true"]
    env = init_distributed("cuda", load_config(None, overrides).parallelism.collectives)
    first = Trainer(load_config(None, overrides), env)
    for _ in range(2):
        first.train_step()
    first.save_checkpoint()
    expected = [float(first.train_step()["loss"]) for _ in range(2)]
    first.close()
    resumed = Trainer(load_config(None, overrides), env)
    assert resumed.resume(2)
    # other masks move a step's loss by ~1e-2; kernels that add in another order, by far less than the tolerance
    assert [float(resumed.train_step()["loss"]) for _ in range(2)] == pytest.approx(expected, rel=1e-4)
    resumed.close()


@pytest.mark.parametrize("reader", READERS)
def test_a_training_step_waits_on_the_gpu_nowhere(tmp_path, reader):
    # a device value read on the host (or a blocking copy to the device) drains the GPU's queue, which then idles while
    # the host launches the next kernels: a step runs without any (torch's sync debug mode raises at the first)
    config = load_config(None, [f"--run_dir={tmp_path}", "--device=cuda", "--data.batch_size=64", "--data.eval_batches=1",
                                "--metrics.tensorboard=false", "--checkpoint.enable=false", READERS[reader]])
    trainer = Trainer(config, init_distributed(config.device, config.parallelism.collectives))
    try:
        for _ in range(3):  # compiled parts are compiled, the loss checks have a previous step to read
            trainer.train_step()
        steps_without_device_sync(trainer, 2)
    finally:
        trainer.close()


def steps_without_device_sync(trainer, steps: int) -> None:
    """``steps`` training steps under torch's sync debug mode "error": it raises at a step's first device value
    read on the host or blocking copy to the device."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            trainer.train_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_compiled_kunlun_blocks_run_the_triton_kernels_between_their_graphs_and_train_as_eager_ones(tmp_path):
    # Dynamo cannot trace the kernels' launch path: under parallelism.compile each op launching them runs eagerly
    # between the block's compiled graphs (it failed inside Triton's launcher before)
    losses = {}
    for mode in ("off", "default"):
        config = load_config(None, [f"--run_dir={tmp_path / mode}", "--device=cuda", "--data.batch_size=64",
                                    "--data.eval_batches=1", "--metrics.tensorboard=false", "--checkpoint.enable=false",
                                    f"--parallelism.compile={mode}", "--parallelism.compile_experts=off"])
        trainer = Trainer(config, init_distributed(config.device, config.parallelism.collectives))
        try:
            losses[mode] = [float(trainer.train_step()["loss"]) for _ in range(4)]
        finally:
            trainer.close()
    # the same kernels on the same batches; only the compiled glue's bf16 rounding differs
    torch.testing.assert_close(torch.tensor(losses["default"]), torch.tensor(losses["off"]), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("autocast,history_bucket", [("off", 0), ("bf16", 0), ("off", 256), ("bf16", 256)])
def test_layers_replayed_as_cuda_graphs_train_as_eager_ones_and_do_replay(tmp_path, autocast, history_bucket):
    # history_bucket > 0: the history padded to token buckets and each trunk replayed whole
    losses, graphs = {}, {}
    for mode in ("eager", "graphs"):
        config = load_config(None, [f"--run_dir={tmp_path / mode}", "--device=cuda", "--data.batch_size=64",
                                    "--data.eval_batches=1", "--metrics.tensorboard=false", "--checkpoint.enable=false",
                                    f"--precision.autocast={autocast}", "--parallelism.compile_experts=off",
                                    f"--parallelism.cuda_graphs={'on' if mode == 'graphs' else 'off'}",
                                    f"--parallelism.cuda_graph_history_bucket={history_bucket if mode == 'graphs' else 0}"])
        trainer = Trainer(config, init_distributed(config.device, config.parallelism.collectives))
        try:
            losses[mode] = [float(trainer.train_step()["loss"]) for _ in range(5)]
            # a padded history replays each trunk whole, its layers inside it
            replayed = KunlunTrunk if history_bucket else (KunlunLayer, KunlunTrunk)
            graphs[mode] = [m.trunk_graphs if history_bucket else m.graphs
                            for m in trainer.model.modules() if isinstance(m, replayed)]
        finally:
            trainer.close()
    # the same kernels on the same batches, replayed; index_add_'s atomics add in any order. A padded history gives
    # the GEMMs over its tokens more rows, for which cuBLAS picks other kernels: in bf16 their rounding differs by
    # up to an ulp (2**-8), which five steps carry into the loss
    tolerance = dict(rtol=1e-2, atol=1e-3) if history_bucket and autocast == "bf16" else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(losses["graphs"]), torch.tensor(losses["eager"]), **tolerance)
    assert graphs["eager"] and all(g is None for g in graphs["eager"])
    assert all(g.replays == 5 and g.eager_calls == 0 for g in graphs["graphs"])


def test_an_asynchronous_checkpoint_from_the_gpu_restores_the_state_of_its_step(tmp_path):
    # staging goes through page-locked buffers (sharded tables, dense parameters, optimizer state)
    config = load_config(None, [f"--run_dir={tmp_path}", "--device=cuda", "--data.batch_size=64", "--data.eval_batches=1",
                                "--metrics.tensorboard=false", "--checkpoint.asynchronous=true"])
    env = init_distributed(config.device, config.parallelism.collectives)
    trainer = Trainer(config, env)
    try:
        for _ in range(2):
            trainer.train_step()
        expected = {k: _local(v).detach().cpu().clone() for k, v in trainer.model.state_dict().items()}
        trainer.save_checkpoint()
        for _ in range(2):  # changes the weights while the write runs
            trainer.train_step()
        trainer.checkpoints.wait()
    finally:
        trainer.close()
    resumed = Trainer(config, env)
    try:
        assert resumed.resume(2) and resumed.step == 2
        for key, value in resumed.model.state_dict().items():
            assert torch.equal(_local(value).cpu(), expected[key]), key
    finally:
        resumed.close()


def _local(value):
    return value.local_shards()[0].tensor if hasattr(value, "local_shards") else value


def test_index_dedup_of_the_sequence_tables_trains_the_same(tmp_path):
    """TorchRec's index dedup (each distinct sequence id looked up and sent once, rows expanded after) is a
    different route to the same step: the same losses and tables over a few float32 steps."""
    env = None
    losses, tables = {}, {}
    for dedup in (False, True):
        config = load_config(None, [f"--run_dir={tmp_path}/{dedup}", "--device=cuda", "--data.batch_size=64",
                                    "--data.eval_batches=1", "--metrics.tensorboard=false", "--checkpoint.enable=false",
                                    "--precision.autocast=off", f"--parallelism.sparse_index_dedup={str(dedup).lower()}"])
        env = env or init_distributed(config.device, config.parallelism.collectives)
        trainer = Trainer(config, env)
        try:
            losses[dedup] = torch.tensor([float(trainer.train_step()["loss"]) for _ in range(4)])
            tables[dedup] = {k: _local(v).detach().cpu().clone() for k, v in trainer.model.state_dict().items()
                             if "embedding" in k and "weight" in k}
        finally:
            trainer.close()
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)
    assert tables[True].keys() == tables[False].keys() and tables[True]
    for key in tables[True]:
        torch.testing.assert_close(tables[True][key], tables[False][key], rtol=1e-4, atol=1e-6, msg=key)


def test_a_kunlun_history_computed_in_bfloat16_looks_its_events_up_in_bfloat16(tmp_path):
    """Under bf16 autocast the sequence tables (float32, as their optimizer) return bfloat16 rows: each event's
    vector is the sum of its features' float32 rows, each rounded once; training on them stays finite."""
    config = load_config(None, [f"--run_dir={tmp_path}", "--device=cuda", "--data.batch_size=64", "--data.eval_batches=1",
                                "--metrics.tensorboard=false", "--checkpoint.enable=false", "--precision.autocast=bf16"])
    trainer = Trainer(config, init_distributed(config.device, config.parallelism.collectives))
    try:
        embedding = getattr(trainer.model, "module", trainer.model).encoder.embedding
        tables = {k.split(".")[-2]: _local(v) for k, v in embedding.state_dict().items()
                  if ".embeddings." in k and k.endswith(".weight")}
        batch = next(trainer._batches).to(trainer.env.device)
        with torch.no_grad():
            _, _, events = embedding(batch)
        for event in embedding.spec.events:
            ids = batch.sequences[event.name].ids
            rows = [tables[f"t_{f.name}"][ids[f.name].values()] for f in event.features]
            expected = sum(r.to(torch.bfloat16).float() for r in rows)
            scale = max(float(r.abs().max()) for r in rows)
            assert events[event.name].dtype == torch.bfloat16, event.name
            # each row rounded once (to nearest or toward zero), then the rows added in bfloat16
            torch.testing.assert_close(events[event.name].float(), expected, rtol=2**-7, atol=2**-7 * scale,
                                       msg=event.name)
        losses = [float(trainer.train_step()["loss"]) for _ in range(3)]
        assert all(math.isfinite(x) for x in losses)
    finally:
        trainer.close()


@pytest.mark.parametrize("autocast", ["off", "bf16"])
def test_sasrec_replayed_as_cuda_graphs_trains_as_the_eager_one_and_does_replay(tmp_path, autocast):
    # every-position next-item training (SASRec's recipe) on a small corpus, dropout off: the same batches and kernels
    lines = [f"{u} " + " ".join(str(1 + (u * 7 + 3 * k + k * k) % 60) for k in range(5 + u % 8)) for u in range(1, 81)]
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    losses, graphs = {}, {}
    for mode in ("off", "on"):
        config = load_config(None, [f"--run_dir={tmp_path / mode}", "--device=cuda", "--data.batch_size=16",
                                    "--metrics.tensorboard=false", "--checkpoint.enable=false", "--data.source=sequence_text",
                                    f"--data.path={tmp_path / 'corpus.txt'}", "--model.name=sasrec",
                                    "--model.sasrec.dim=16", "--model.sasrec.max_seq_len=12", "--model.sasrec.dropout=0.0",
                                    "--data.sequential.max_history=12", "--data.sequential.objective=retrieval",
                                    "--data.sequential.queries=every", "--data.sequential.loss=binary",
                                    "--data.sequential.num_negatives=1", "--data.sequential.eval_negatives=20",
                                    f"--precision.autocast={autocast}",
                                    f"--parallelism.cuda_graphs={mode}"])
        trainer = Trainer(config, init_distributed(config.device, config.parallelism.collectives))
        try:
            losses[mode] = [float(trainer.train_step()["loss"]) for _ in range(5)]
            graphs[mode] = getattr(trainer.model, "module", trainer.model).graphs
            # the lookup's batch size (every scored item of the batch) changes from batch to batch: no step may wait
            # on the GPU for it (TorchRec's all-to-all index made by a blocking copy)
            steps_without_device_sync(trainer, 3)
        finally:
            trainer.close()
    torch.testing.assert_close(torch.tensor(losses["on"]), torch.tensor(losses["off"]), rtol=1e-4, atol=1e-5)
    assert graphs["off"] is None and graphs["on"].replays == 8 and graphs["on"].eager_calls == 0
