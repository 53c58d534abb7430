"""Run by torchrun from test_expert_parallel.py: expert parallelism (exact and padded) against the same MoE on
the global batch in one process, forward and backward; the clipped gradient norm against torch's."""

import json
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from teardown import finish

from gem_kunlun import MixtureOfExperts, stand_in_rows
from gem_parallel import apply_expert_parallel, clip_grad_norm_

TOKENS, DIM, EXPERTS, TOP_K, LOCAL = 5, 6, 4, 2, 12


def make(capacity_factor: float) -> MixtureOfExperts:
    torch.manual_seed(0)
    return MixtureOfExperts(TOKENS, DIM, EXPERTS, TOP_K, capacity_factor=capacity_factor, rank=3, hidden=16)


def compare(capacity_factor: float, padded: bool, expert_parallel: bool = True, bound: int | None = None) -> dict[str, float]:
    """``expert_parallel=False``: every rank runs all experts on its slice, capacity still counted over the
    global batch (``bound``: its ``global_batch_bound``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(world * LOCAL, TOKENS, DIM, generator=torch.Generator().manual_seed(7))
    weight = torch.randn(world * LOCAL, TOKENS, DIM, generator=torch.Generator().manual_seed(8))
    reference = make(capacity_factor)
    whole = x.clone().requires_grad_()
    (reference(whole) * weight).sum().backward()

    moe = make(capacity_factor)
    if expert_parallel:
        apply_expert_parallel(moe, dist.group.WORLD, padded=padded, rank_batch_bound=LOCAL)
    moe.batch_group, moe.capacity_per_rank, moe.global_batch_bound = dist.group.WORLD, padded, bound
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    local = x[mine].clone().requires_grad_()
    out = moe(local)
    (out * weight[mine]).sum().backward()
    gate_grad = moe.gate.weight.grad.clone()
    dist.all_reduce(gate_grad)  # each rank holds its slice's share of the gate gradient
    errors = {
        "out": (out - reference(x)[mine]).abs().max().item(),
        "input_grad": (local.grad - whole.grad[mine]).abs().max().item(),
        "gate_grad": (gate_grad - reference.gate.weight.grad).abs().max().item(),
        "kept": int(moe.last_stats.kept.sum()),
        "assigned": int(moe.last_stats.assigned.sum()),
    }
    # an owner's expert gradient sums the examples every rank sent it (without expert parallelism: every
    # rank holds its slice's share)
    for key, expert in moe.experts.items():
        for name, p in expert.named_parameters():
            expected = dict(reference.experts[key].named_parameters())[name].grad
            if not expert_parallel:
                p.grad = p.grad.clone()
                dist.all_reduce(p.grad)
            errors["expert_grad_max"] = max(errors.get("expert_grad_max", 0.0), (p.grad - expected).abs().max().item())
    errors["local_experts"] = sorted(int(k) for k in moe.experts)
    return errors


def uneven_with_balance_loss(capacity_factor: float, padded: bool | None = None) -> dict[str, float]:
    """Ranks holding different numbers of rows, the last none (it routes a stand-in row), the balance loss in each
    rank's loss (divided by the ranks, as gradients summed over them count it once): output, balance loss and
    gradients equal one process's on the global batch. ``padded``: with expert parallelism, exact (False) or padded
    (True: messages sized by the largest rank's rows, as the trainer's bound sizes them)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [3 + 5 * r for r in range(world - 1)] + [0]
    x = torch.randn(sum(sizes), TOKENS, DIM, generator=torch.Generator().manual_seed(9))
    weight = torch.randn(sum(sizes), TOKENS, DIM, generator=torch.Generator().manual_seed(10))
    reference = make(capacity_factor)
    whole = x.clone().requires_grad_()
    expected_out = reference(whole)
    ((expected_out * weight).sum() + reference.last_stats.balance_loss).backward()

    moe = make(capacity_factor)
    if padded is not None:
        apply_expert_parallel(moe, dist.group.WORLD, padded=padded, rank_batch_bound=max(sizes))
    moe.batch_group, moe.capacity_per_rank = dist.group.WORLD, bool(padded)
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    present = sizes[rank] > 0
    local = (x[mine] if present else torch.randn(1, TOKENS, DIM)).clone().requires_grad_()
    with nullcontext() if present else stand_in_rows(moe):
        out = moe(local)
    task = (out * weight[mine]).sum() if present else (out * 0).sum()
    (task + moe.last_stats.balance_loss / world).backward()
    errors = {"balance": abs(moe.last_stats.balance_loss.item() - reference.last_stats.balance_loss.item()),
              "out": (out - expected_out[mine]).abs().max().item() if present else out.abs().max().item(),
              "assigned": int(moe.last_stats.assigned.sum()), "expected_assigned": int(reference.last_stats.assigned.sum())}
    for name, p in moe.named_parameters():
        grad = p.grad.clone()
        if padded is None or not name.startswith("experts."):  # an expert's owner holds its whole gradient
            dist.all_reduce(grad)
        expected = reference.get_parameter(name).grad
        errors["grad_max"] = max(errors.get("grad_max", 0.0), (grad - expected).abs().max().item())
    return errors


def clipped_norm() -> dict[str, float]:
    """Experts split over the ranks: the global norm equals torch's over every parameter of one process."""
    reference = make(0.0)
    for p in reference.parameters():
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    moe = make(0.0)
    apply_expert_parallel(moe, dist.group.WORLD)
    for p in moe.parameters():
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
    total = clip_grad_norm_(list(moe.gate.parameters()), 0.5, list(moe.experts.parameters()), dist.group.WORLD)
    scaled = max((a.grad - b.grad).abs().max().item() for a, b in zip(moe.gate.parameters(), reference.gate.parameters()))
    return {"norm": float(total), "expected": float(expected), "gate_after_clip": scaled}


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    result = {
        "exact_drops": compare(capacity_factor=0.75, padded=False),
        "exact": compare(capacity_factor=0.0, padded=False),
        "padded": compare(capacity_factor=0.0, padded=True),
        "local_bound_drops": compare(capacity_factor=0.75, padded=False, expert_parallel=False, bound=dist.get_world_size() * LOCAL),
        "local_mask_drops": compare(capacity_factor=0.75, padded=False, expert_parallel=False),
        "uneven_balance_drops": uneven_with_balance_loss(capacity_factor=0.75),
        "uneven_exact_drops": uneven_with_balance_loss(capacity_factor=0.75, padded=False),
        # no drops: capacity per rank (padded) would otherwise keep other assignments than the global batch's
        "uneven_padded": uneven_with_balance_loss(capacity_factor=0.0, padded=True),
        "clip": clipped_norm(),
    }
    with open(f"{out_dir}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    finish()


if __name__ == "__main__":
    main(sys.argv[1])
