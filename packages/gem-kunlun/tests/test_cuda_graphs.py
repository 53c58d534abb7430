"""CUDA-graph replay of a MoE's training forward and backward against the same module run eagerly.

The replay tests need a GPU (they skip on the CPU, where CI runs the fallbacks): run them on one with
``python -m pytest packages/gem-kunlun/tests/test_cuda_graphs.py``."""

import copy

import pytest
import torch

from gem_kunlun import GraphedForward, MixtureOfExperts, apply_expert_graphs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def make(device="cpu", seed=0, capacity_factor=1.25):
    torch.manual_seed(seed)
    return MixtureOfExperts(num_tokens=6, dim=16, num_experts=4, top_k=2, capacity_factor=capacity_factor, rank=4,
                            hidden=32, device=device)


def step(moe, x, upstream):
    """One forward and backward; the output, the routing statistics, and every gradient."""
    x = x.detach().requires_grad_()
    out = moe(x)
    stats = moe.last_stats
    loss = (out * upstream).sum() + 0.5 * stats.balance_loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    for p in moe.parameters():
        p.grad = None
    return out.detach().clone(), stats.assigned.clone(), stats.kept.clone(), x.grad, grads


def assert_same_step(graphed, eager):
    # index_add_ accumulates in a nondeterministic order on a GPU: equal up to float rounding
    for a, b in zip(graphed[:3], eager[:3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(graphed[3], eager[3], rtol=1e-5, atol=1e-6)
    for name in eager[4]:
        torch.testing.assert_close(graphed[4][name], eager[4][name], rtol=1e-5, atol=1e-6, msg=name)


def test_on_the_cpu_every_call_runs_eagerly_and_computes_the_module():
    moe, twin = make(), make()
    apply_expert_graphs(moe)
    x, upstream = torch.randn(32, 6, 16), torch.randn(32, 6, 16)
    assert_same_step(step(moe, x, upstream), step(twin, x, upstream))
    assert isinstance(moe.graphs, GraphedForward) and moe.graphs.replays == 0 and moe.graphs.eager_calls == 1


def test_the_function_must_return_a_tuple_of_tensors():
    from gem_kunlun.cuda_graphs import _as_tuple

    with pytest.raises(TypeError, match="tuple of tensors"):
        _as_tuple(torch.zeros(1))


def test_a_copy_of_a_graphed_module_gets_graphs_of_its_own():
    moe = make()
    apply_expert_graphs(moe)
    twin = copy.deepcopy(moe)
    assert twin.graphs is not moe.graphs and twin.graphs.module is twin
    assert twin.graphs.function.__self__ is twin


def test_a_moe_counting_capacity_over_a_batch_group_is_not_graphed():
    moe = make()
    moe.batch_group = object()
    with pytest.raises(ValueError, match="batch group"):
        apply_expert_graphs(moe)


@cuda
def test_replayed_steps_compute_what_eager_steps_do_across_optimizer_updates():
    moe, twin = make("cuda"), make("cuda")
    apply_expert_graphs(moe)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (moe, twin)]
    for i in range(6):
        torch.manual_seed(100 + i)
        x, upstream = torch.randn(64, 6, 16, device="cuda"), torch.randn(64, 6, 16, device="cuda")
        graphed = step(moe, x, upstream)
        eager = step(twin, x, upstream)
        assert_same_step(graphed, eager)
        # the step: both from the same gradients (the eager ones), so that the parameters stay equal
        for m, opt in zip((moe, twin), optimizers):
            for name, p in m.named_parameters():
                p.grad = eager[4][name].clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert moe.graphs.replays == 6 and moe.graphs.eager_calls == 0


@cuda
def test_each_batch_shape_gets_its_own_graphs_and_evaluation_runs_eagerly():
    moe, twin = make("cuda"), make("cuda")
    apply_expert_graphs(moe)
    for rows in (64, 48, 64):
        x, upstream = torch.randn(rows, 6, 16, device="cuda"), torch.randn(rows, 6, 16, device="cuda")
        assert_same_step(step(moe, x, upstream), step(twin, x, upstream))
    assert moe.graphs.replays == 3 and len(moe.graphs._captures) == 2
    moe.eval(), twin.eval()
    x = torch.randn(64, 6, 16, device="cuda")
    torch.testing.assert_close(moe(x), twin(x))
    with torch.no_grad():
        moe.train()
        torch.testing.assert_close(moe(x), moe.routed(x)[0])
    assert moe.graphs.replays == 3 and moe.graphs.eager_calls == 2


@cuda
def test_a_second_forward_before_the_first_backward_runs_eagerly_and_both_gradients_are_right():
    moe, twin = make("cuda"), make("cuda")
    apply_expert_graphs(moe)
    step(moe, torch.randn(32, 6, 16, device="cuda"), torch.randn(32, 6, 16, device="cuda"))  # captured
    step(twin, torch.randn(32, 6, 16, device="cuda"), torch.randn(32, 6, 16, device="cuda"))
    xs = [torch.randn(32, 6, 16, device="cuda", requires_grad=True) for _ in range(2)]
    outs = [moe(x) for x in xs]  # the second call finds the first replay's backward pending
    assert moe.graphs.replays == 2 and moe.graphs.eager_calls == 1
    sum(o.square().sum() for o in outs).backward()
    reference = [x.detach().clone().requires_grad_() for x in xs]
    sum(twin(x).square().sum() for x in reference).backward()
    for x, r in zip(xs, reference):
        torch.testing.assert_close(x.grad, r.grad, rtol=1e-5, atol=1e-6)
    # a replay dropped without a backward blocks the next call only while something holds its autograd graph (here
    # last_stats' balance loss, until a call replaces it)
    for _ in range(3):
        moe(torch.randn(32, 6, 16, device="cuda", requires_grad=True))
    assert moe.graphs.replays == 4 and moe.graphs.eager_calls == 2
