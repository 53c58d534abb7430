import pytest
import torch
from torch import nn

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


def test_a_capacity_over_the_global_batch_runs_on_fixed_slots_when_its_size_has_a_known_bound():
    """With a capacity counted over several ranks' batches, an expert keeps at most ``capacity(global)`` of
    this rank's examples: a host-known size once the global batch has a known bound; without one, the
    experts gather by mask. A global batch beyond the bound fails rather than dropping (here on the CPU, at
    once; on a GPU as a device-side assert)."""
    moe = make(capacity_factor=1.0, experts=8, top_k=1)
    moe.batch_group = object()  # capacity counted over a global batch (the group is not read by this bound)
    assert moe._slots(12, torch.tensor(48)) is None
    moe.global_batch_bound = 48
    assert moe._slots(12, torch.tensor(48)) == moe.capacity(48) == 6  # fewer than the batch's 12 examples
    assert moe._slots(4, torch.tensor(40)) == 4  # never more than the local batch
    with pytest.raises(RuntimeError, match="global_batch_bound = 48"):
        moe._slots(12, torch.tensor(49))
    moe.eval()  # evaluation drops nothing: no bound below the batch
    assert moe._slots(12, torch.tensor(48)) is None


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


# --- the slotted path runs all experts at once (_batched_wukong) where that is the per-expert loop's computation


class _Calls:
    """Counts the batched path's calls (it still runs)."""

    def __init__(self, monkeypatch):
        from gem_kunlun import moe as moe_module

        self.count, real = 0, moe_module._batched_wukong

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(moe_module, "_batched_wukong", counted)


def _step_both_ways(moe, x, monkeypatch):
    """Output and gradients (input, then every parameter by name) of one training step, batched then through
    the per-expert loop (``_batchable`` forced false); the number of batched calls of the first."""
    from gem_kunlun import moe as moe_module

    target = torch.randn_like(x)
    params = dict(moe.named_parameters())

    def step():
        xi = x.clone().requires_grad_()
        out = moe(xi)
        loss = (out * target).sum() + moe.last_stats.balance_loss
        grads = torch.autograd.grad(loss, [xi, *params.values()], allow_unused=True)
        return out.detach(), dict(zip(["input", *params], grads)), moe.last_stats

    calls = _Calls(monkeypatch)
    batched = step()
    taken = calls.count
    with monkeypatch.context() as m:
        m.setattr(moe_module, "_batchable", lambda blocks: False)
        looped = step()
    assert calls.count == taken  # the loop did not call it
    return batched, looped, taken


def _assert_same_step(batched, looped):
    (out_b, grads_b, stats_b), (out_l, grads_l, stats_l) = batched, looped
    assert torch.equal(stats_b.kept, stats_l.kept)
    torch.testing.assert_close(out_b, out_l, rtol=1e-5, atol=1e-6)
    assert grads_b.keys() == grads_l.keys()
    for name in grads_l:
        assert grads_b[name] is not None and grads_l[name] is not None, name
        torch.testing.assert_close(grads_b[name], grads_l[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("experts,top_k,tokens", [(1, 1, 5), (2, 1, 5), (4, 2, 5), (6, 3, 3), (3, 3, 4), (5, 2, 2)])
def test_batched_experts_match_the_per_expert_loop_in_outputs_and_every_gradient(experts, top_k, tokens, monkeypatch):
    torch.manual_seed(experts * 10 + top_k)
    moe = MixtureOfExperts(num_tokens=tokens, dim=6, num_experts=experts, top_k=top_k, capacity_factor=0.6, rank=3,
                           hidden=8)
    with torch.no_grad():  # non-trivial norm affines, so that their gradients and uses are checked too
        for block in moe.experts.values():
            block.fm_norm.weight.normal_(1.0, 0.5)
            block.fm_norm.bias.normal_()
    x = torch.randn(37, tokens, 6)
    batched, looped, calls = _step_both_ways(moe, x, monkeypatch)
    assert calls == 1  # the batched path ran
    stats = batched[2]
    assert int(stats.kept.sum()) < int(stats.assigned.sum())  # the capacity drops some assignments
    _assert_same_step(batched, looped)
    # every expert's parameters and the gate's are among those compared
    names = {"gate.weight", "gate.bias", f"experts.{experts - 1}.fm_mlp.2.weight", "experts.0.compress"}
    assert names <= batched[1].keys()


def test_batched_experts_match_the_loop_on_a_subset_of_experts_as_expert_parallelism_keeps(monkeypatch):
    """A rank's experts ``2, 3`` of 4, under their global names: rows routed to others are left out."""
    from gem_kunlun.moe import local_dispatch

    torch.manual_seed(3)
    moe = MixtureOfExperts(num_tokens=4, dim=8, num_experts=4, top_k=2, capacity_factor=0.75, rank=3, hidden=16)
    seen = []
    moe.dispatch = lambda experts, inputs, routing: seen.append(routing) or local_dispatch(experts, inputs, routing)
    x = torch.randn(24, 4, 8)
    moe(x)
    routing = seen[0]
    del moe.experts["0"], moe.experts["1"]
    params = list(moe.experts.parameters())
    assert len(params) == 2 * 8
    calls = _Calls(monkeypatch)

    def run():
        xi = x.clone().requires_grad_()
        out = local_dispatch(moe.experts, xi, routing)
        return out, torch.autograd.grad(out.square().sum(), [xi, *params])

    out_b, grads_b = run()
    assert calls.count == 1
    from gem_kunlun import moe as moe_module

    monkeypatch.setattr(moe_module, "_batchable", lambda blocks: False)
    out_l, grads_l = run()
    assert calls.count == 1
    torch.testing.assert_close(out_b, out_l, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads_b, grads_l):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_batched_experts_under_bf16_autocast_compute_in_bf16_like_the_loop(monkeypatch):
    torch.manual_seed(1)
    moe = MixtureOfExperts(num_tokens=5, dim=8, num_experts=4, top_k=2, capacity_factor=0.75, rank=3, hidden=16)
    x = torch.randn(32, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (out_b, grads_b, _), (out_l, grads_l, _), calls = _step_both_ways(moe, x, monkeypatch)
    assert calls == 1
    assert out_b.dtype == out_l.dtype
    torch.testing.assert_close(out_b, out_l, rtol=3e-2, atol=3e-2)
    for name in grads_l:
        assert grads_b[name].dtype == grads_l[name].dtype, name
        scale = grads_l[name].abs().max().clamp(min=1e-3)
        torch.testing.assert_close(grads_b[name] / scale, grads_l[name] / scale, rtol=0, atol=3e-2)
    # the experts' outputs come out in bf16 (their last ops ran in it), close to each expert's own forward
    from gem_kunlun.moe import _batched_wukong

    blocks = list(moe.experts.values())
    rows = torch.randn(4, 6, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        together = _batched_wukong(blocks, rows)
        alone = torch.stack([block(r) for block, r in zip(blocks, rows)])
    assert together.dtype == alone.dtype == torch.bfloat16
    torch.testing.assert_close(together, alone, rtol=3e-2, atol=3e-2)


class _ScaledLinear(nn.Linear):
    """A Linear subclass (as a low-precision recipe swaps in) that computes something else."""

    def forward(self, x):
        return super().forward(x) * 1.5


def _subclassed_linear(moe):
    old = moe.experts["1"].fm_mlp[0]
    new = _ScaledLinear(old.in_features, old.out_features)
    new.weight, new.bias = old.weight, old.bias
    moe.experts["1"].fm_mlp[0] = new


def _other_matmul(moe):
    moe.experts["2"].low_precision_matmul = lambda a, b: torch.matmul(a, b) * 0.5


def _forward_hook(moe):
    moe.experts["0"].fm_norm.register_forward_hook(lambda module, args, out: out * 2)


def _no_norm_bias(moe):
    block = moe.experts["3"]
    block.fm_norm = nn.LayerNorm(block.fm_norm.normalized_shape, bias=False)


@pytest.mark.parametrize("change", [_subclassed_linear, _other_matmul, _forward_hook, _no_norm_bias])
def test_experts_outside_the_batched_form_keep_the_per_expert_loop(change, monkeypatch):
    def make_moe():
        torch.manual_seed(2)
        return MixtureOfExperts(num_tokens=5, dim=6, num_experts=4, top_k=2, capacity_factor=0.75, rank=3, hidden=8)

    moe, x = make_moe(), torch.randn(24, 5, 6)
    plain = moe(x)
    change(moe)
    batched, looped, calls = _step_both_ways(moe, x, monkeypatch)
    assert calls == 0  # the loop ran
    _assert_same_step(batched, looped)
    if change is not _no_norm_bias:  # (its bias was zero) the change shows in the output: batching would miss it
        assert not torch.allclose(batched[0], plain)


def test_the_experts_run_in_one_call_of_their_module_which_a_parallel_wrapper_sees():
    """Slotted dispatch hands all experts' rows to the ``Experts`` module at once: a wrapper on it (FSDP on
    the expert mesh) gathers every local expert in one collective; a wrong number of row groups is refused."""
    moe = make(capacity_factor=1.25)
    calls = []
    moe.experts.register_forward_hook(lambda module, args, out: calls.append(tuple(args[0].shape)))
    moe(torch.randn(16, 5, 6))
    assert calls == [(4, moe.capacity(16), 5, 6)]
    with pytest.raises(ValueError, match="4 experts here but rows for 3"):
        moe.experts(torch.randn(3, 2, 5, 6))


def test_the_experts_are_a_mapping_of_their_own_not_a_module_dict_which_fsdp2_of_torch_2_11_refuses():
    """torch 2.11's ``fully_shard`` raises for any ``nn.ModuleDict`` or ``nn.ModuleList``, whatever its forward: the
    experts' unit is neither, and still reads, prunes and names its experts by global index."""
    moe = make()
    experts = moe.experts
    assert not isinstance(experts, (nn.ModuleDict, nn.ModuleList))
    assert list(experts) == list(experts.keys()) == ["0", "1", "2", "3"] and len(experts) == 4
    assert "2" in experts and "4" not in experts and experts["2"] is dict(experts.items())["2"]
    assert list(experts.values()) == [experts[k] for k in "0123"]
    del experts["0"], experts["1"]
    assert list(experts) == ["2", "3"]
    names = {name for name, _ in moe.named_parameters()}
    assert "experts.2.fm_norm.weight" in names and not any(n.startswith("experts.0.") for n in names)


def test_routed_goes_through_the_module_call_and_returns_what_forward_keeps():
    """``routed`` (what a Kunlun layer and its CUDA graph call) runs the MoE's own call: hooks (profiler ranges) fire
    and a compiled MoE (``nn.Module.compile``) runs compiled; its statistics are those ``forward`` keeps."""
    moe = make(capacity_factor=1.25)
    calls = []
    moe.register_forward_pre_hook(lambda module, args: calls.append(tuple(args[0].shape)))
    x = torch.randn(16, 5, 6)
    out, assigned, kept, balance = moe.routed(x)
    assert calls == [(16, 5, 6)]
    torch.testing.assert_close(moe(x), out)
    stats = moe.last_stats
    assert torch.equal(stats.assigned, assigned) and torch.equal(stats.kept, kept)
    torch.testing.assert_close(stats.balance_loss, balance)


def test_every_kunlun_layer_calls_its_moe_as_a_module():
    from gem_kunlun import KunlunConfig, KunlunModel
    from gem_kunlun.testing import SPEC, random_batch

    torch.manual_seed(0)
    model = KunlunModel(SPEC, KunlunConfig(d_model=16, num_heads=2, num_summary_tokens=3, num_seeds=2, num_experts=3,
                                           top_k=2, max_seq_len=8, block_size=4, window=4))
    calls = []
    for layer in model.trunk.layers:
        layer.moe.register_forward_hook(lambda module, args, out: calls.append(module))
    model(random_batch(4, seed=0))
    assert calls == [layer.moe for layer in model.trunk.layers]
    assert all(layer.moe.last_stats is not None for layer in model.trunk.layers)


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_task_loss_trains_the_gate_for_every_top_k(top_k):
    """With one expert per example the weight is its gate probability (Switch's): renormalised it was 1 for every
    example, and only the balance loss reached the gate. The dense reference weighs the same."""
    from gem_kunlun.moe import dense_moe_reference

    torch.manual_seed(0)
    moe = MixtureOfExperts(num_tokens=4, dim=8, num_experts=4, top_k=top_k, capacity_factor=0)
    x = torch.randn(16, 4, 8)
    out = moe(x)
    out.pow(2).sum().backward()
    assert moe.gate.weight.grad.abs().max() > 1e-2
    torch.testing.assert_close(out, dense_moe_reference(moe, x), rtol=1e-4, atol=1e-5)
