import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "workers" / "moe_worker.py"


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_equals_the_mixture_on_the_global_batch(tmp_path, ranks):
    logs = tmp_path / "logs"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               f"--log-dir={logs}", "--redirects=3", str(WORKER), str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    # each rank's own output (torchrun's tail names only the signal a rank died of)
    ranks_said = "".join(f"\n--- {f.relative_to(logs)}:\n{f.read_text()[-1500:]}" for f in sorted(logs.rglob("std*.log")))
    assert run.returncode == 0, run.stderr[-1500:] + ranks_said
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]
    owned = sorted(e for r in results for e in r["exact"]["local_experts"])
    assert owned == [0, 1, 2, 3]  # every expert on exactly one rank
    for result in results:
        # local_*: all experts on every rank, capacity over the global batch, on fixed slots (bound) or by mask
        for mode in ("exact_drops", "exact", "padded", "local_bound_drops", "local_mask_drops"):
            errors = result[mode]
            assert errors["out"] < 1e-5 and errors["input_grad"] < 1e-5, (mode, errors)
            assert errors["gate_grad"] < 1e-4 and errors["expert_grad_max"] < 1e-4, (mode, errors)
        # the capacity bites in the drop case, and counts over the global batch
        assert results[0]["exact_drops"]["assigned"] == 2 * 12 * ranks
        # uneven rows (the last rank a stand-in row), all experts on every rank or split exactly or padded
        for mode in ("uneven_balance_drops", "uneven_exact_drops", "uneven_padded"):
            uneven = result[mode]
            assert uneven["balance"] < 1e-6 and uneven["out"] < 1e-5 and uneven["grad_max"] < 1e-5, (mode, uneven)
            assert uneven["assigned"] == uneven["expected_assigned"], mode  # the stand-in row claims nothing
        clip = result["clip"]
        assert clip["norm"] == pytest.approx(clip["expected"], rel=1e-5) and clip["gate_after_clip"] < 1e-6
    for mode in ("exact_drops", "local_bound_drops", "local_mask_drops"):
        kept = sum(r[mode]["kept"] for r in results)
        assert kept < 2 * 12 * ranks



def test_a_model_without_experts_and_padded_messages_without_a_bound_are_refused_in_one_line():
    import torch
    import torch.distributed as dist

    from gem_kunlun import MixtureOfExperts
    from gem_parallel import apply_expert_parallel
    from gem_parallel.parallel_dims import LayoutError

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(LayoutError, match=r"^expert = 1 splits the experts of a mixture of experts over ranks, and "
                                              r"Linear has none: leave it at 1$"):
            apply_expert_parallel(torch.nn.Linear(2, 2), dist.group.WORLD)
        moe = MixtureOfExperts(5, 6, 4, 2, capacity_factor=1.0, rank=3, hidden=16)
        with pytest.raises(LayoutError, match=r"^expert_padded needs rank_batch_bound >= 1"):
            apply_expert_parallel(moe, dist.group.WORLD, padded=True)
        apply_expert_parallel(moe, dist.group.WORLD, padded=True, rank_batch_bound=2)
        moe.capacity_per_rank = True
        with pytest.raises(ValueError, match=r"^padded expert parallelism: a batch of 3 examples reached a MoE sized for "
                                             r"at most rank_batch_bound = 2 per rank$"):
            moe(torch.randn(3, 5, 6))
    finally:
        dist.destroy_process_group()
