"""Every distributed mode against one process: N Gloo ranks and 1 process train on the same global batches
and must agree on every step's loss, on the final weights and optimizer state, and on the evaluation.

Kunlun with a mixture of experts whose capacity drops assignments, and sharded TorchRec tables. One
single-process run per configuration is the reference; each mode is a ``gem-trainer launch`` of it with
the global batch split over the ranks.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from gem_trainer.config import load_config
from parity_runs import (ASYNCHRONOUS, BASE, SGD, STEPS, assert_close_states, assert_same_run, final_state, losses,
                         train)

pytestmark = pytest.mark.slow


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
    """FSDP over 2 ranks, tables table-wise over both; checkpoints written by the ranks' writer processes (agreeing
    on one plan over a group of their own), which the resumption tests read."""
    run = tmp_path_factory.mktemp("two-ranks")
    train(run, 2, ASYNCHRONOUS)
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
