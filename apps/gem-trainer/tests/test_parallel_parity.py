"""Every distributed mode against one process: N Gloo ranks and 1 process train on the same global batches
and must agree on every step's loss, on the final weights and optimizer state, and on the evaluation.

Kunlun with a mixture of experts whose capacity drops assignments, and sharded TorchRec tables. One
single-process run per configuration is the reference; each mode is a ``gem-trainer launch`` of it with
the global batch split over the ranks.
"""

import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from gem_data import SyntheticStream
from gem_trainer.builders import build_generator
from gem_trainer.config import load_config

STEPS, GLOBAL_BATCH = 20, 32
BASE = [
    "--device=cpu", "--metrics.tensorboard=false", "--metrics.progress_bar=false", "--metrics.log_every=1",
    f"--schedule.steps={STEPS}", "--schedule.warmup_steps=2", "--checkpoint.every_steps=10", "--data.eval_batches=4",
    "--data.synthetic.max_events=24", "--model.kunlun.capacity_factor=1.0",
]
# with plain SGD on the tables, averaging 2-D sparse replicas equals one process exactly (Adagrad is not linear);
# two of the three surfaces trained on: the ranks' shares of a global batch differ in size
SGD = ["--optimizer.sparse=sgd", "--optimizer.sparse_lr=0.5", "--model.kunlun.capacity_factor=0",
       "--data.train_surfaces=[0,1]"]

pytestmark = pytest.mark.slow


def train(run_dir: Path, ranks: int, *overrides: str) -> subprocess.CompletedProcess:
    batch = f"--data.batch_size={GLOBAL_BATCH // ranks}"
    command = [sys.executable, "-m", "gem_trainer.cli", "launch", "--nproc-per-node", str(ranks)] if ranks > 1 \
        else [sys.executable, "-m", "gem_trainer.cli", "train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the synthetic data's settings only where the data is synthetic (a config reading files refuses them)
    base = [item for item in BASE if not item.startswith("--data.synthetic.")] if any(
        item.startswith("--data.path=") for item in overrides) else BASE
    done = subprocess.run([*command, f"--run_dir={run_dir}", *base, batch, *overrides], capture_output=True, text=True,
                          timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["phase"] == "train"]


def final_state(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model and both optimizers), gathered whatever its layout."""
    path = run_dir / f"state-{step}.pt"
    if not path.exists():
        dcp_to_torch_save(run_dir / "checkpoints" / f"step-{step}", path)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            flat[prefix] = value
    walk("", torch.load(path, weights_only=False))
    return flat


def assert_close_states(mine: dict, expected: dict, tolerance: float = 1e-3) -> None:
    """Same tensors, each within ``tolerance`` of its own scale.

    NOTE: the scale is per tensor because Adam divides by the root of the squared gradients: where the
    exact gradient is zero (the key bias of softmax attention), float32 rounding that differs with the
    summation order becomes an lr-sized update, ~1e-4 of the tensor's scale after 20 steps.
    """
    assert sorted(mine) == sorted(expected)
    for key, value in expected.items():
        assert mine[key].shape == value.shape, key
        if not value.numel():  # an empty projection (data without dense features)
            continue
        error = float((mine[key] - value).abs().max())
        assert error <= tolerance * float(value.abs().max()) + 1e-6, f"{key}: max |difference| {error:.3g}"


def assert_same_run(run: Path, reference: Path) -> None:
    ours, theirs = losses(run), losses(reference)
    assert len(ours) == len(theirs) == STEPS
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=2e-5, atol=2e-6)
    assert_close_states(final_state(run), final_state(reference))
    evaluated = json.loads((run / "eval.json").read_text())
    wanted = json.loads((reference / "eval.json").read_text())
    for key in ("click/all/auc", "click/all/ne", "conversion/all/auc"):
        assert evaluated[key] == pytest.approx(wanted[key], rel=1e-4), key


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("one-process")
    train(run, 1)
    return run


@pytest.fixture(scope="module")
def reference_sgd(tmp_path_factory):
    run = tmp_path_factory.mktemp("one-process-sgd")
    train(run, 1, *SGD)
    return run


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """FSDP over 2 ranks, tables table-wise over both."""
    run = tmp_path_factory.mktemp("two-ranks")
    train(run, 2)
    return run


def test_two_ranks_fsdp_equal_one_process(two_ranks, reference):
    assert_same_run(two_ranks, reference)
    # from the same weights, each rank draws its own random numbers (dropout masks): their generators differ
    states = [torch.load(two_ranks / "checkpoints" / f"step-{STEPS}" / f"local-rank{r}.pt", weights_only=True)["rng"]["torch"]
              for r in range(2)]
    assert not torch.equal(*states)


def test_four_ranks_hsdp_expert_parallel_column_wise_tables_equal_one_process(tmp_path, reference):
    """HSDP (2 replicas x 2 shards), experts over groups of 2 (exact all-to-all), column-wise tables,
    activation checkpointing."""
    train(tmp_path, 4, "--parallelism.dense_replicate=2", "--parallelism.dense_shard=2", "--parallelism.expert=2",
          "--parallelism.sparse_sharding=column_wise", "--parallelism.activation_checkpointing=true")
    assert_same_run(tmp_path, reference)


def test_four_ranks_2d_sparse_and_padded_expert_parallel_equal_one_process(tmp_path, reference_sgd):
    """Tables sharded over groups of 2 and replicated across the 2 groups (averaged every step), experts over
    groups of 2 inside the 4 dense shards (their gradients reduced over the 2 ranks holding the same experts) with
    the equal-split all-to-all (no capacity drops, so per-rank capacity changes nothing), ranks holding different
    numbers of examples."""
    train(tmp_path, 4, *SGD, "--parallelism.sparse_group=2", "--parallelism.expert=2", "--parallelism.expert_padded=true")
    assert_same_run(tmp_path, reference_sgd)


def test_resume_on_the_same_and_on_another_number_of_ranks_continues_exactly(tmp_path, two_ranks, reference):
    """The 2-rank run's step-10 checkpoint, resumed on 2 ranks and resharded onto 1 process, ends where the
    uninterrupted runs end."""
    for ranks, expected in ((2, two_ranks), (1, reference)):
        run = tmp_path / f"resumed-on-{ranks}"
        (run / "checkpoints").mkdir(parents=True)
        shutil.copytree(two_ranks / "checkpoints" / "step-10", run / "checkpoints" / "step-10")
        done = train(run, ranks)
        assert "resumed from" in done.stdout and "at step 10" in done.stdout
        assert_close_states(final_state(run), final_state(expected))


def test_ranks_resumed_from_fewer_ranks_draw_their_own_random_numbers(tmp_path, reference):
    """The one-process run's step-10 checkpoint holds one random state: resumed on 2 ranks, the rank it has none of
    must not take rank 0's (their dropout masks would be the same)."""
    run = tmp_path / "resumed-on-2"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference / "checkpoints" / "step-10", run / "checkpoints" / "step-10")
    assert "written by 1 ranks, resharded to 2" in train(run, 2).stdout
    states = [torch.load(run / "checkpoints" / f"step-{STEPS}" / f"local-rank{r}.pt", weights_only=True)["rng"]["torch"]
              for r in range(2)]
    assert not torch.equal(*states)


def test_2d_sparse_replicas_averaged_every_few_steps_resume_exactly(tmp_path):
    """Table replicas averaged every 3 steps drift apart in between, and a checkpoint holds one copy of each shard:
    the step-10 checkpoint (between two averages) is written from averaged replicas, and a run resumed from it
    ends where the uninterrupted run ends."""
    replicas = [*SGD, "--parallelism.sparse_group=1", "--parallelism.sparse_sync_every=3"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    train(full, 2, *replicas)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step-10", resumed / "checkpoints" / "step-10")
    assert "at step 10" in train(resumed, 2, *replicas).stdout
    torch.testing.assert_close(torch.tensor(losses(resumed)), torch.tensor(losses(full)[10:]), rtol=2e-5, atol=2e-6)
    assert_close_states(final_state(resumed), final_state(full))


def test_evaluation_reads_the_average_of_2d_sparse_replicas_with_or_without_a_final_checkpoint(tmp_path):
    """Four steps with replicas averaged every 3: they differ at the end. A final checkpoint averages them before it
    is written; without one, the evaluation must read the same average (not each rank's own replica)."""
    replicas = [*SGD, "--parallelism.sparse_group=1", "--parallelism.sparse_sync_every=3", "--schedule.steps=4"]
    train(tmp_path / "saved", 2, *replicas)
    train(tmp_path / "unsaved", 2, *replicas, "--checkpoint.enable=false")
    saved, unsaved = (json.loads((tmp_path / run / "eval.json").read_text()) for run in ("saved", "unsaved"))
    for key in ("click/all/auc", "click/all/ne", "conversion/all/auc"):
        assert unsaved[key] == pytest.approx(saved[key], rel=1e-6), key


def test_a_run_trained_on_two_ranks_is_evaluated_in_one_process_on_its_own_held_out_examples(tmp_path, two_ranks):
    """`launch` records its processes, and `eval` in one process keeps the run's global batch (the synthetic held-out
    set is drawn in global batches): its metrics are the run's own evaluation's."""
    assert load_config(two_ranks / "config.toml").parallelism.nproc_per_node == 2
    out = tmp_path / "eval.json"
    wanted = json.loads((two_ranks / "eval.json").read_text())
    # the run's own config.toml given as --config keeps the run's global batch as well
    for extra in ([], [f"--config={two_ranks / 'config.toml'}"]):
        done = subprocess.run([sys.executable, "-m", "gem_trainer.cli", "eval", f"--run_dir={two_ranks}", f"--out={out}",
                               *extra], capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        evaluated = json.loads(out.read_text())
        for key in ("click/all/auc", "click/all/ne", "conversion/all/auc", "click/all/count"):
            assert evaluated[key] == pytest.approx(wanted[key], rel=1e-5), (extra, key)


def test_resume_with_another_global_batch_stops_with_one_line(tmp_path, two_ranks):
    run = tmp_path / "other-batch"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(two_ranks / "checkpoints" / "step-10", run / "checkpoints" / "step-10")
    done = subprocess.run([sys.executable, "-m", "gem_trainer.cli", "train", f"--run_dir={run}", *BASE,
                           "--data.batch_size=48"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("gem-trainer: config error: checkpoint.resume:") and "global batch" in message


def test_bf16_blocks_stay_within_bf16_rounding_of_float32(tmp_path, reference):
    """FSDP2 mixed precision (bf16 block parameters and compute, float32 reduction and master weights) on 2
    ranks. From the same weights the first loss differs from float32 by bf16 rounding only (and does differ:
    the policy is applied); later steps follow their own trajectory (routing flips under capacity) without
    diverging."""
    train(tmp_path, 2, "--parallelism.param_dtype=bfloat16")
    ours, theirs = torch.tensor(losses(tmp_path)), torch.tensor(losses(reference))
    first = abs(ours[0] - theirs[0]) / theirs[0]
    assert 0 < first < 2e-3, first
    assert torch.isfinite(ours).all() and abs(ours[-5:].mean() / theirs[-5:].mean() - 1) < 0.1


def test_two_ranks_keeping_parameters_gathered_after_forward_equal_one_process(tmp_path, reference):
    """reshard_after_forward = false: the blocks' parameters stay gathered between forward and backward."""
    train(tmp_path, 2, "--parallelism.reshard_after_forward=false")
    assert_same_run(tmp_path, reference)


def test_bf16_gradient_reduction_stays_near_float32(tmp_path, reference):
    """FSDP2's gradients reduced in bf16 (float32 parameters and compute): the first step's loss is float32's
    exactly (nothing reduced yet), later ones stay within bf16 rounding of it, and the run does not diverge."""
    train(tmp_path, 2, "--parallelism.reduce_dtype=bfloat16")
    ours, theirs = torch.tensor(losses(tmp_path)), torch.tensor(losses(reference))
    torch.testing.assert_close(ours[0], theirs[0], rtol=2e-5, atol=2e-6)
    assert not torch.equal(ours, theirs)  # the policy is applied
    assert torch.isfinite(ours).all() and abs(ours[-5:].mean() / theirs[-5:].mean() - 1) < 0.1


def test_compiled_blocks_equal_eager_blocks(tmp_path):
    """``parallelism.compile`` (torch.compile of each Kunlun layer, inductor on the CPU) on a small model."""
    small = ["--schedule.steps=2", "--schedule.warmup_steps=1", "--eval.at_end=false", "--checkpoint.enable=false",
             "--model.kunlun.num_layers=1", "--model.kunlun.d_model=16", "--data.synthetic.max_events=8"]
    eager, compiled, again = tmp_path / "eager", tmp_path / "compiled", tmp_path / "again"
    shared = ["--parallelism.compile=true", f"--parallelism.compile_cache_dir={tmp_path / 'cache'}"]
    cached: list[dict[str, int]] = []
    for run, extra in ((eager, []), (compiled, shared), (again, shared)):
        subprocess.run([sys.executable, "-m", "gem_trainer.cli", "train", f"--run_dir={run}", *BASE, *small,
                        "--data.batch_size=16", *extra], check=True, capture_output=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        # NOTE: lock files are not entries: torch 2.11's inductor takes (and so touches) them when it reads one
        cached.append({str(f.relative_to(tmp_path)): f.stat().st_mtime_ns for f in (tmp_path / "cache").rglob("*")
                       if f.is_file() and "locks" not in f.relative_to(tmp_path).parts})
    torch.testing.assert_close(torch.tensor(losses(compiled)), torch.tensor(losses(eager)), rtol=1e-5, atol=1e-6)
    # the compiled graphs went to the shared folder, and the second job loaded them: a graph compiled again would
    # have rewritten its entry
    assert any(f.startswith("cache/inductor/") for f in cached[1])
    assert cached[2] == cached[1]
    torch.testing.assert_close(torch.tensor(losses(again)), torch.tensor(losses(compiled)), rtol=0, atol=0)


def test_compiled_experts_equal_eager_experts(tmp_path):
    """``parallelism.compile_experts`` (torch.compile of each MoE alone, inductor on the CPU) trains as the eager
    MoEs do (routing under capacity, slot dispatch and batched experts included) and evaluates as they do
    (evaluation keeps every assignment: the experts gather theirs by mask, shapes the compiled MoE leaves eager)."""
    small = ["--schedule.steps=3", "--schedule.warmup_steps=1", "--data.eval_batches=2", "--checkpoint.enable=false",
             "--model.kunlun.num_layers=1", "--model.kunlun.d_model=16", "--data.synthetic.max_events=8"]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    for run, extra in ((eager, ["--parallelism.compile_experts=off"]), (compiled, ["--parallelism.compile_experts=on"])):
        subprocess.run([sys.executable, "-m", "gem_trainer.cli", "train", f"--run_dir={run}", *BASE, *small,
                        "--data.batch_size=16", *extra], check=True, capture_output=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    torch.testing.assert_close(torch.tensor(losses(compiled)), torch.tensor(losses(eager)), rtol=1e-5, atol=1e-6)
    evaluated, wanted = (json.loads((run / "eval.json").read_text()) for run in (compiled, eager))
    assert evaluated.keys() == wanted.keys() and wanted
    for key, value in wanted.items():
        if "/" in key:  # the metrics (not the timings); NaN where a surface's few examples hold one class (no AUC)
            assert evaluated[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), key


def beauty_sasrec(tmp_path: Path, device: str, *overrides: str) -> list[str]:
    """SASRec on Beauty for a few steps and a small evaluation, without dropout (whose masks compiled code draws
    differently): each run's output."""
    from gem_data.testing import find_repo_root, shared_data_dir

    beauty = shared_data_dir(find_repo_root(Path(__file__))) / "beauty"
    if not beauty.is_dir():
        pytest.skip(f"shared real data not found at {beauty} (expected ../shared/data beside the repository)")
    config = Path(__file__).resolve().parents[1] / "configs" / "beauty-sasrec.toml"
    common = [f"--config={config}", f"--data.path={beauty}", f"--device={device}", "--metrics.tensorboard=false",
              "--metrics.log_every=1", "--schedule.steps=6", "--schedule.warmup_steps=1", "--checkpoint.enable=false",
              "--model.sasrec.dropout=0", "--data.sequential.eval_users=100",
              '--data.sequential.eval_protocols=["sampled"]']
    outputs = []
    for run, extra in (("eager", []), ("compiled", ["--parallelism.compile=reduce-overhead"])):
        done = subprocess.run([sys.executable, "-m", "gem_trainer.cli", "train", f"--run_dir={tmp_path / run}", *common,
                               *overrides, *extra], capture_output=True, text=True, timeout=900,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        outputs.append(done.stdout + done.stderr)
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "compiled")), torch.tensor(losses(tmp_path / "eager")),
                               rtol=1e-4, atol=1e-5)
    evaluated, wanted = (json.loads((tmp_path / run / "eval.json").read_text()) for run in ("compiled", "eager"))
    assert evaluated["sampled/ndcg@10"] == pytest.approx(wanted["sampled/ndcg@10"], abs=2e-3)
    return outputs


def test_sasrec_blocks_compiled_to_cuda_graphs_train_as_eager_blocks(tmp_path):
    """``parallelism.compile = "reduce-overhead"`` trains and evaluates SASRec as the eager blocks do (on the CPU
    the blocks are compiled without graphs)."""
    beauty_sasrec(tmp_path, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_sasrec_blocks_replay_as_cuda_graphs_on_a_gpu(tmp_path):
    """On a GPU with the padded layout (fixed shapes), every block runs as CUDA graphs: inductor skips none."""
    _, compiled = beauty_sasrec(tmp_path, "cuda", "--model.sasrec.layout=padded")
    assert "skipping cudagraphs" not in compiled, compiled[-3000:]


def test_two_ranks_of_a_two_tower_kunlun_sharing_its_item_table_equal_one_process(tmp_path):
    """The item tower reads the history's item table (one table, two features): sharded over 2 ranks, each step
    looks the history and the whole catalogue up in one call, as one process does."""
    from gem_data.testing import find_repo_root, shared_data_dir

    beauty = shared_data_dir(find_repo_root(Path(__file__))) / "beauty"
    if not beauty.is_dir():
        pytest.skip(f"shared real data not found at {beauty} (expected ../shared/data beside the repository)")
    config = Path(__file__).resolve().parents[1] / "configs" / "beauty-kunlun.toml"
    overrides = [f"--config={config}", f"--data.path={beauty}", "--model.kunlun.share_item_table=true",
                 "--data.sequential.eval_users=200", '--data.sequential.eval_protocols=["sampled"]',
                 "--model.kunlun.dropout=0"]  # dropout masks are drawn per rank
    train(tmp_path / "one", 1, *overrides)
    train(tmp_path / "two", 2, *overrides)
    ours, theirs = losses(tmp_path / "two"), losses(tmp_path / "one")
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=2e-5, atol=2e-6)
    state, expected = final_state(tmp_path / "two"), final_state(tmp_path / "one")
    assert any("t_history_item_id" in key for key in state) and not any("item_tower_t_item_id" in key for key in state)
    # NOTE: a softmax over the catalogue does not change when every item vector moves by one vector: the item
    # tower's bias has an exact gradient of zero (its Adam state and value only hold summation-order rounding)
    assert all(key in state for key in [k for k in expected if "item_tower.project.bias" in k])
    assert_close_states(*({k: v for k, v in s.items() if "item_tower.project.bias" not in k} for s in (state, expected)))
    evaluated, wanted = (json.loads((tmp_path / run / "eval.json").read_text()) for run in ("two", "one"))
    assert evaluated["sampled/hr@10"] == pytest.approx(wanted["sampled/hr@10"], abs=1e-6)


@pytest.mark.parametrize("case", ["uneven surface shares", "interformer"])
def test_two_ranks_equal_one_process_with_uneven_shares_and_an_interformer(tmp_path, case):
    """A surface filter's ranks hold slices differing by one example (each rank's loss weighted by its share of the
    global batch, as one process averages); InterFormer's first summary runs inside its sharded first layer."""
    steps = 4
    overrides = {"uneven surface shares": ["--data.train_surfaces=[1]", "--model.kunlun.capacity_factor=0"],
                 "interformer": ["--model.name=interformer"]}[case]
    overrides += [f"--schedule.steps={steps}", "--data.synthetic.max_events=8"]
    train(tmp_path / "one", 1, *overrides)
    train(tmp_path / "two", 2, *overrides)
    ours, theirs = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert len(ours) == len(theirs) == steps
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=2e-5, atol=2e-6)
    assert_close_states(final_state(tmp_path / "two", steps), final_state(tmp_path / "one", steps))
    # the logged throughput counts every rank's examples (the ranks' slices differ by one example)
    assert logged(tmp_path / "two", "examples") == logged(tmp_path / "one", "examples")


def logged(run_dir: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if r["phase"] == "train"]


def test_two_ranks_of_domain_experts_with_a_domain_missing_from_a_rank_equal_one_process(tmp_path):
    """Each domain's experts see a different number of its rows on each rank, and none where a rank's slice lacks
    the domain (a stand-in row runs there, so that every rank runs the same modules): the MoE balance loss, the
    expert fractions and the capacity are those of the domain's rows of the global batch, as one process counts."""
    steps = 4
    overrides = ["--model.name=domain_experts", "--model.domain_experts.num_shared=1", "--model.kunlun.num_layers=1",
                 "--model.kunlun.balance_loss_weight=0.5", "--data.batch_size=4", f"--schedule.steps={steps}",
                 "--data.synthetic.max_events=8", "--data.synthetic.num_surfaces=3"]
    generator = build_generator(load_config(overrides=[*BASE, *overrides]))
    ranks_surfaces = [[set(b.surface.tolist()) for b in itertools.islice(SyntheticStream(generator, 4, rank, 2), steps)]
                      for rank in range(2)]
    assert any(a != b for a, b in zip(*ranks_surfaces)), "no step with a domain on one rank only: the test tests nothing"
    train(tmp_path / "one", 1, *overrides, "--data.batch_size=8")
    train(tmp_path / "two", 2, *overrides)
    ours, theirs = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert len(ours) == len(theirs) == steps
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=2e-5, atol=2e-6)
    assert_close_states(final_state(tmp_path / "two", steps), final_state(tmp_path / "one", steps))


@pytest.mark.parametrize("experts", ["exact", "padded"])
def test_contrastive_views_train_on_two_ranks(tmp_path, experts):
    """A contrastive weight runs the trunk on two views of every example: each MoE receives twice a rank's examples,
    and the capacity's global bound and padded expert parallelism's messages count those rows. (Each rank contrasts
    its own examples and draws its own dropout masks, so two ranks are not one process here.)"""
    overrides = ["--model.kunlun.contrastive_weight=0.1", "--model.kunlun.dropout=0.1", "--schedule.steps=3",
                 "--data.synthetic.max_events=8"]
    if experts == "padded":
        overrides += ["--parallelism.expert=2", "--parallelism.expert_padded=true"]
    train(tmp_path, 2, *overrides)
    assert len(ours := losses(tmp_path)) == 3 and all(torch.isfinite(torch.tensor(ours)))
