import pytest
import torch

from gem_kunlun import MixtureOfExperts
from gem_kunlun.moe import dense_moe_reference


def make(capacity_factor=0.0, experts=4, top_k=2, seed=0):
    torch.manual_seed(seed)
    return MixtureOfExperts(num_tokens=5, dim=6, num_experts=experts, top_k=top_k, capacity_factor=capacity_factor,
                            rank=3, hidden=8)


def test_routed_forward_equals_the_dense_reference_without_capacity_limit():
    moe = make()
    x = torch.randn(32, 5, 6)
    torch.testing.assert_close(moe(x), dense_moe_reference(moe, x), rtol=1e-5, atol=1e-6)


def test_routing_conserves_assignments_and_respects_capacity():
    moe = make(capacity_factor=0.0)
    x = torch.randn(40, 5, 6)
    moe(x)
    stats = moe.last_stats
    assert int(stats.assigned.sum()) == 40 * 2 and torch.equal(stats.assigned, stats.kept)

    tight = make(capacity_factor=0.5)
    tight(x)
    capacity = tight.capacity(40)
    assert capacity == 10
    assert int(tight.last_stats.assigned.sum()) == 80
    assert bool((tight.last_stats.kept <= capacity).all())
    assert torch.equal(tight.last_stats.kept, tight.last_stats.assigned.clamp(max=capacity))


def test_dropped_assignments_contribute_nothing():
    moe = make(capacity_factor=0.25, experts=2, top_k=1)
    x = torch.randn(16, 5, 6)
    out = moe(x)
    kept = int(moe.last_stats.kept.sum())
    assert kept < 16
    assert int((out.abs().flatten(1).sum(1) == 0).sum()) == 16 - kept


def test_eval_mode_drops_nothing_so_an_example_scores_the_same_in_any_batch():
    moe = make(capacity_factor=0.25, experts=2, top_k=1).eval()
    x = torch.randn(16, 5, 6)
    together = moe(x)
    assert torch.equal(moe.last_stats.kept, moe.last_stats.assigned)
    torch.testing.assert_close(together, dense_moe_reference(moe, x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([moe(x[i : i + 1]) for i in range(16)]), together, rtol=1e-5, atol=1e-6)


def test_balance_loss_is_one_when_uniform_and_grows_when_collapsed():
    moe = make(experts=4, top_k=1)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.bias.zero_()
    x = torch.randn(64, 5, 6)
    moe(x)
    # uniform probabilities; top-1 on ties picks expert 0 for everyone: f = (1, 0, 0, 0), p = 1/4 each
    assert moe.last_stats.balance_loss.item() == pytest.approx(1.0)
    with torch.no_grad():
        moe.gate.bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))
    moe(x)
    assert moe.last_stats.balance_loss.item() > 3.9  # collapsed onto one expert: close to E = 4
    with torch.no_grad():
        moe.gate.bias.zero_()
        moe.gate.weight.normal_(std=5.0)
    moe(torch.randn(4096, 5, 6))
    assert moe.last_stats.balance_loss.item() < 1.5  # spread routing: near the minimum of 1


def test_balance_loss_has_a_gradient_into_the_gate():
    moe = make()
    moe(torch.randn(16, 5, 6))
    moe.last_stats.balance_loss.backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0


def test_bad_top_k_is_rejected():
    with pytest.raises(ValueError, match="top_k"):
        MixtureOfExperts(5, 6, num_experts=2, top_k=3)


@pytest.mark.parametrize("capacity_factor", [0.5, 1.25])
def test_experts_on_fixed_slots_compute_what_masked_gathers_do(capacity_factor):
    """Training with a capacity runs every expert on a host-known number of rows; the same outputs and
    gradients as gathering each expert's kept examples by mask (the reference twin)."""
    from gem_kunlun.moe import Routing, local_dispatch

    torch.manual_seed(0)
    moe = MixtureOfExperts(num_tokens=4, dim=8, num_experts=4, top_k=2, capacity_factor=capacity_factor, hidden=16)
    x = torch.randn(24, 4, 8, requires_grad=True)
    seen = []
    moe.dispatch = lambda experts, inputs, routing: seen.append(routing) or local_dispatch(experts, inputs, routing)
    slotted = moe(x)
    routing = seen[0]
    assert routing.slots == min(24, moe.capacity(24))
    if capacity_factor < 1:
        assert int(routing.keep.sum()) < routing.keep.numel()  # the capacity drops some assignments
    masked = local_dispatch(moe.experts, x, Routing(routing.example, routing.expert, routing.weight, routing.keep))
    torch.testing.assert_close(slotted, masked, rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(slotted.square().sum(), [x, *moe.experts.parameters()], retain_graph=True)
    expected = torch.autograd.grad(masked.square().sum(), [x, *moe.experts.parameters()])
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
