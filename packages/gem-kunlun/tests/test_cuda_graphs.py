"""CUDA-graph replay (``GraphedForward``, ``apply_cuda_graphs``) against the same modules run eagerly.

The replay tests need a GPU (they skip on the CPU, where CI runs the fallbacks): run them on one with
``TRITON_INTERPRET=0 python -m pytest packages/gem-kunlun/tests/test_cuda_graphs.py``."""

import copy
import dataclasses

import pytest
import torch

from gem_kunlun import (GraphedForward, KunlunConfig, KunlunModel, MixtureOfExperts, apply_cuda_graphs, multitask_loss,
                        stand_in_rows)
from gem_kunlun.testing import SPEC, random_batch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def make(device="cpu", seed=0, capacity_factor=1.25):
    torch.manual_seed(seed)
    return MixtureOfExperts(num_tokens=6, dim=16, num_experts=4, top_k=2, capacity_factor=capacity_factor, rank=4,
                            hidden=32, device=device)


def step(run, moe, x, upstream):
    """One forward (``run``: the MoE's ``routed`` or a graph of it) and backward; the output, the routing
    statistics, and every gradient."""
    x = x.detach().requires_grad_()
    out, assigned, kept, balance = run(x)
    ((out * upstream).sum() + 0.5 * balance).backward()
    grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    for p in moe.parameters():
        p.grad = None
    return out.detach().clone(), assigned.clone(), kept.clone(), x.grad, grads


def assert_same_step(graphed, eager):
    # index_add_ accumulates in a nondeterministic order on a GPU: equal up to float rounding
    for a, b in zip(graphed[:4], eager[:4]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for name in eager[4]:
        torch.testing.assert_close(graphed[4][name], eager[4][name], rtol=1e-5, atol=1e-6, msg=name)


def test_on_the_cpu_every_call_runs_eagerly_and_computes_the_function():
    moe, twin = make(), make()
    graphed = GraphedForward(moe.routed, moe)
    x, upstream = torch.randn(32, 6, 16), torch.randn(32, 6, 16)
    assert_same_step(step(graphed, moe, x, upstream), step(twin.routed, twin, x, upstream))
    assert graphed.replays == 0 and graphed.eager_calls == 1


def test_the_function_must_return_a_tuple_of_tensors():
    from gem_kunlun.cuda_graphs import _as_tuple

    with pytest.raises(TypeError, match="tuple of tensors"):
        _as_tuple(torch.zeros(1))


TINY = KunlunConfig(d_model=16, num_heads=2, num_summary_tokens=3, num_seeds=2, num_experts=3, top_k=2,
                    expert_hidden=16, hidden=(16,), block_size=4, window_blocks=2, window=3, max_seq_len=32,
                    recent_tokens=2)


def model_pair(device, config=TINY, history_bucket=0):
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(KunlunModel(SPEC, config, device=device))
    apply_cuda_graphs(models[0], history_bucket=history_bucket)
    return models


def test_a_graphed_model_on_the_cpu_trains_eagerly_as_its_twin_and_copies_get_graphs_of_their_own():
    graphed, eager = model_pair("cpu", dataclasses.replace(TINY, kernel="pytorch"))
    regions = [m.graphs for m in graphed.modules() if getattr(m, "graphs", None) is not None]
    assert len(regions) == TINY.num_layers + 1  # every layer's per-example side, the trunk's head
    twin = copy.deepcopy(graphed)
    layer = twin.layers[0]
    assert layer.graphs is not graphed.layers[0].graphs and layer.graphs.module is layer
    assert layer.graphs.function.__self__ is layer and layer.graphs.parameters[0] is layer.token_mix
    batch = random_batch(12, seed=1)
    losses = []
    for model in (graphed, eager):
        out = model(batch)
        loss = multitask_loss(out.logits, batch.labels, torch.ones(2)) + out.aux_loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1])
    for (name, a), b in zip(graphed.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    assert all(r.replays == 0 and r.eager_calls == 1 for r in regions)


@pytest.mark.parametrize("bucket", [0, 16])
def test_stand_in_rows_bypass_the_graphs_whose_routing_counts_rows(bucket):
    """A graph replays the routing it was captured with: rows that count nothing (``stand_in_rows``) run eagerly,
    beside the graphs (on a GPU a stand-in of a captured batch size would otherwise replay counted routing)."""
    (graphed, _) = model_pair("cpu", dataclasses.replace(TINY, kernel="pytorch"), history_bucket=bucket)
    layers = [m.graphs for m in graphed.layers] if not bucket else [graphed.trunk.trunk_graphs]
    batch = random_batch(12, seed=1)
    with stand_in_rows(graphed):
        graphed(batch)
    assert all(r.eager_calls == 0 for r in layers)
    assert graphed.layers[0].moe.counts_rows and int(graphed.layers[0].moe.last_stats.assigned.sum()) == 0
    graphed(batch)
    assert all(r.eager_calls == 1 for r in layers)


@pytest.mark.parametrize("bucket", [16, 40, 256])
@pytest.mark.parametrize("kernel", ["pytorch", "auto"])
def test_the_trunk_over_a_padded_history_trains_as_the_unpadded_one(bucket, kernel):
    # padding segments after the examples (pad_history): every jagged op works per segment, so the examples' outputs,
    # the MoE's routing and every gradient are those of the unpadded history; on the CPU the padded trunk runs eagerly
    padded, plain = model_pair("cpu", dataclasses.replace(TINY, kernel=kernel), history_bucket=bucket)
    assert padded.trunk.history_bucket == bucket and padded.trunk.trunk_graphs is not None
    assert all(layer.graphs is None for layer in padded.layers) and padded.trunk.graphs is None
    for seed in (1, 2):
        batch = random_batch(12, seed=seed)
        losses, grads, stats = [], [], []
        for model in (padded, plain):
            out = model(batch)
            loss = multitask_loss(out.logits, batch.labels, torch.ones(2)) + out.aux_loss
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            stats.append([(layer.moe.last_stats.assigned, layer.moe.last_stats.kept) for layer in model.layers])
            model.zero_grad(set_to_none=True)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
        assert grads[0].keys() == grads[1].keys()
        for name in grads[1]:
            torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6, msg=name)
        for (a0, k0), (a1, k1) in zip(*stats):
            assert torch.equal(a0, a1) and torch.equal(k0, k1)
    assert padded.trunk.trunk_graphs.replays == 0 and padded.trunk.trunk_graphs.eager_calls == 2
    padded.eval(), plain.eval()  # evaluation runs the unpadded trunk
    with torch.no_grad():
        torch.testing.assert_close(padded(batch).logits, plain(batch).logits)
    assert padded.trunk.trunk_graphs.eager_calls == 2


@pytest.mark.parametrize("tokens", [0, 1, 15, 16, 17, 100])
def test_pad_history_fills_whole_buckets_with_short_padding_segments(tokens):
    from gem_kunlun.kunlun import pad_history

    lengths = torch.tensor([tokens // 2, tokens - tokens // 2])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    seq, positions = torch.randn(tokens, 3), torch.rand(tokens)
    padded, padded_offsets, padded_positions = pad_history(seq, offsets, positions, bucket=16, max_len=6)
    total = max(-(-tokens // 16), 1) * 16
    assert padded.shape == (total, 3) and padded_positions.shape == (total,)
    assert padded_offsets.shape == (2 + 1 + 3,)  # ceil(16 / 6) padding segments
    assert torch.equal(padded_offsets[:3], offsets) and int(padded_offsets[-1]) == total
    padding = padded_offsets[3:] - padded_offsets[2:-1]
    assert bool((padding >= 0).all()) and bool((padding <= 6).all())
    assert torch.equal(padded[:tokens], seq) and not padded[tokens:].any()


def test_a_moe_counting_capacity_over_a_batch_group_is_not_graphed():
    torch.manual_seed(0)
    model = KunlunModel(SPEC, TINY)
    model.layers[0].moe.batch_group = object()
    with pytest.raises(ValueError, match="batch group"):
        apply_cuda_graphs(model)


def test_a_moe_without_a_capacity_is_refused():
    model = KunlunModel(SPEC, dataclasses.replace(TINY, capacity_factor=0.0))
    with pytest.raises(ValueError, match="without a capacity"):
        apply_cuda_graphs(model)


def test_parameters_are_taken_once():
    moe = make()
    graphed = GraphedForward(moe.routed, moe, [*moe.parameters(), *moe.parameters()])
    assert graphed.parameters == tuple(moe.parameters())


def test_saved_tensor_hooks_are_seen_as_activation_checkpointing_sets_them():
    from torch.utils.checkpoint import checkpoint

    from gem_kunlun.cuda_graphs import _saved_tensor_hooks_active

    seen = []
    assert not _saved_tensor_hooks_active()
    checkpoint(lambda x: seen.append(_saved_tensor_hooks_active()) or x * 2, torch.ones(2, requires_grad=True),
               use_reentrant=False)
    assert seen == [True]


@cuda
def test_replayed_steps_compute_what_eager_steps_do_across_optimizer_updates():
    moe, twin = make("cuda"), make("cuda")
    graphed = GraphedForward(moe.routed, moe)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (moe, twin)]
    for i in range(6):
        torch.manual_seed(100 + i)
        x, upstream = torch.randn(64, 6, 16, device="cuda"), torch.randn(64, 6, 16, device="cuda")
        replayed = step(graphed, moe, x, upstream)
        eager = step(twin.routed, twin, x, upstream)
        assert_same_step(replayed, eager)
        # the step: both from the same gradients (the eager ones), so that the parameters stay equal
        for m, opt in zip((moe, twin), optimizers):
            for name, p in m.named_parameters():
                p.grad = eager[4][name].clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert graphed.replays == 6 and graphed.eager_calls == 0


@cuda
@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_accumulate_over_replays_as_over_eager_steps(set_to_none):
    """Two forwards and backwards before the gradients are zeroed (gradient accumulation): autograd keeps the first
    replay's parameter gradients without a copy, and the second replay must not overwrite them."""
    moe, twin = make("cuda"), make("cuda")
    graphed = GraphedForward(moe.routed, moe)
    for step_ in range(3):
        for module, run in ((moe, graphed), (twin, twin.routed)):
            module.zero_grad(set_to_none=set_to_none)
            for micro in range(2):
                torch.manual_seed(10 * step_ + micro)
                x, upstream = torch.randn(64, 6, 16, device="cuda"), torch.randn(64, 6, 16, device="cuda")
                out, _, _, balance = run(x)
                ((out * upstream).sum() + 0.5 * balance).backward()
        for (name, p), q in zip(moe.named_parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert graphed.replays == 6


@cuda
def test_dropout_draws_fresh_masks_at_every_replay_and_its_backward_uses_the_forward_mask():
    module = torch.nn.Dropout(0.5).cuda().train()
    graphed = GraphedForward(lambda x: (module(x),), module, [])
    masks = []
    for _ in range(3):
        x = torch.ones(4096, device="cuda", requires_grad=True)
        (y,) = graphed(x)
        y.sum().backward()
        masks.append(y != 0)
        torch.testing.assert_close(x.grad, (y != 0).float() * 2.0)  # kept entries scaled by 1 / (1 - p)
    assert graphed.replays == 3 and not torch.equal(masks[1], masks[2])


@cuda
def test_a_checkpointed_caller_runs_the_function_eagerly():
    from torch.utils.checkpoint import checkpoint

    moe = make("cuda")
    graphed = GraphedForward(moe.routed, moe)
    x = torch.randn(64, 6, 16, device="cuda", requires_grad=True)
    out = checkpoint(lambda t: graphed(t)[0], x, use_reentrant=False)
    out.sum().backward()
    assert graphed.replays == 0 and graphed.eager_calls >= 1 and x.grad is not None


@cuda
def test_an_output_changed_in_place_before_its_backward_is_refused():
    moe = make("cuda")
    graphed = GraphedForward(moe.routed, moe)
    x = torch.randn(64, 6, 16, device="cuda")
    graphed(x)  # captures and replays; its outputs dropped at once, so that the next call replays too
    out, _, _, balance = graphed(x)
    assert graphed.replays == 2
    with torch.no_grad():
        out.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place before its backward"):
        (out.sum() + balance).backward()


@cuda
def test_each_batch_shape_gets_its_own_graphs_and_evaluation_runs_eagerly():
    moe, twin = make("cuda"), make("cuda")
    graphed = GraphedForward(moe.routed, moe)
    for rows in (64, 48, 64):
        x, upstream = torch.randn(rows, 6, 16, device="cuda"), torch.randn(rows, 6, 16, device="cuda")
        assert_same_step(step(graphed, moe, x, upstream), step(twin.routed, twin, x, upstream))
    assert graphed.replays == 3 and len(graphed._captures) == 2
    moe.eval(), twin.eval()
    x = torch.randn(64, 6, 16, device="cuda")
    torch.testing.assert_close(graphed(x)[0], twin.routed(x)[0])
    with torch.no_grad():
        moe.train()
        torch.testing.assert_close(graphed(x)[0], moe.routed(x)[0])
    assert graphed.replays == 3 and graphed.eager_calls == 2


@cuda
def test_shapes_are_captured_while_earlier_autograd_graphs_of_the_parameters_live():
    # a module keeping its last statistics (MixtureOfExperts.last_stats) keeps the last step's autograd graph, and
    # with it the parameters' gradient accumulators, made on the default stream: a capture must not depend on them
    moe, twin = make("cuda"), make("cuda")
    graphed = GraphedForward(moe.routed, moe)
    alive = [moe.routed(torch.randn(16, 6, 16, device="cuda"))[3]]  # an eager graph
    for rows in (64, 48, 32):
        x, upstream = torch.randn(rows, 6, 16, device="cuda"), torch.randn(rows, 6, 16, device="cuda")
        assert_same_step(step(graphed, moe, x, upstream), step(twin.routed, twin, x, upstream))
        # a replay's graph, never run backward (the input requires its gradient, as step's: the same capture)
        alive.append(graphed(torch.randn(rows, 6, 16, device="cuda", requires_grad=True))[3])
    assert graphed.replays == 6 and len(graphed._captures) == 3 and graphed.eager_calls == 0
    # the module's own parameters are back in place after each capture
    assert all(a is b for a, b in zip(moe.parameters(), graphed._captures[next(iter(graphed._captures))].parameters))


def test_parameters_outside_the_module_are_refused():
    moe, other = make(), make(seed=1)
    with pytest.raises(ValueError, match="1 of the given parameters are not parameters of the module"):
        GraphedForward(moe.routed, moe, [*moe.parameters(), other.gate.weight])


@cuda
def test_a_second_forward_before_the_first_backward_runs_eagerly_and_both_gradients_are_right():
    moe, twin = make("cuda"), make("cuda")
    graphed = GraphedForward(moe.routed, moe)
    step(graphed, moe, torch.randn(32, 6, 16, device="cuda"), torch.randn(32, 6, 16, device="cuda"))  # captured
    xs = [torch.randn(32, 6, 16, device="cuda", requires_grad=True) for _ in range(2)]
    outs = [graphed(x)[0] for x in xs]  # the second call finds the first replay's backward pending
    assert graphed.replays == 2 and graphed.eager_calls == 1
    sum(o.square().sum() for o in outs).backward()
    reference = [x.detach().clone().requires_grad_() for x in xs]
    sum(twin.routed(x)[0].square().sum() for x in reference).backward()
    for x, r in zip(xs, reference):
        torch.testing.assert_close(x.grad, r.grad, rtol=1e-5, atol=1e-6)
    # a replay dropped without a backward blocks nothing once its outputs are gone
    for _ in range(2):
        graphed(torch.randn(32, 6, 16, device="cuda", requires_grad=True))
    assert graphed.replays == 4 and graphed.eager_calls == 1


@cuda
@pytest.mark.parametrize("kernel,history_bucket", [("auto", 0), ("pytorch", 0), ("auto", 64), ("pytorch", 64)])
def test_a_graphed_kunlun_model_trains_as_its_eager_twin(kernel, history_bucket):
    # history_bucket > 0: the whole trunk replayed over a padded history
    graphed, eager = model_pair("cuda", dataclasses.replace(TINY, kernel=kernel), history_bucket)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (graphed, eager)]
    for i in range(5):
        batch = random_batch(24, seed=10 + i).to(torch.device("cuda"))
        losses, grads = [], []
        for model in (graphed, eager):
            out = model(batch)
            loss = multitask_loss(out.logits, batch.labels, torch.ones(2, device="cuda")) + out.aux_loss
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
        assert grads[0].keys() == grads[1].keys()
        for name in grads[1]:
            torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6, msg=name)
        for model, opt in zip((graphed, eager), optimizers):
            for name, p in model.named_parameters():  # both step from the eager gradients: the weights stay equal
                if name in grads[1]:
                    p.grad = grads[1][name].clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
    regions = [r for m in graphed.modules() for r in (getattr(m, "graphs", None), getattr(m, "trunk_graphs", None))
               if r is not None]
    assert len(regions) == (1 if history_bucket else TINY.num_layers + 1)
    assert all(r.replays == 5 and r.eager_calls == 0 for r in regions)


def sasrec_pair(dropout: float):
    """A SASRec replayed as CUDA graphs (``apply_cuda_graphs``) and its eager twin, same weights, on the GPU."""
    from gem_kunlun import EventType, FeatureSpec, SasrecConfig, SasrecModel, SparseFeature

    spec = FeatureSpec(num_dense=0, sparse=(SparseFeature("item_id", 40),), tasks=("next_item",),
                       events=(EventType("history", (SparseFeature("history_item_id", 40),)),))
    config = SasrecConfig(dim=16, num_blocks=2, num_heads=2, dropout=dropout, max_seq_len=6, layout="padded")
    pair = []
    for _ in range(2):
        torch.manual_seed(0)
        pair.append(SasrecModel(spec, config, device=torch.device("cuda")).train())
    apply_cuda_graphs(pair[0])
    assert pair[0].graphs is not None and pair[1].graphs is None
    return pair


@cuda
def test_a_graphed_sasrec_encodes_every_position_as_its_eager_twin():
    graphed, eager = sasrec_pair(dropout=0.0)
    for i in range(4):  # one capture, then replays; the last batch is smaller: its own capture
        g = torch.Generator().manual_seed(i)
        lengths = torch.randint(0, 7, (12 if i < 3 else 5,), generator=g)
        vectors, upstream = (torch.randn(int(lengths.sum()), 16, generator=g).cuda() for _ in range(2))
        grads = []
        for m in (graphed, eager):
            x = vectors.clone().requires_grad_()
            out = m.position_representations(x, lengths.cuda())
            (out * upstream).sum().backward()
            grads.append((out.detach().clone(), x.grad, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
            m.zero_grad(set_to_none=True)
        torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-5)
        assert grads[0][2].keys() == grads[1][2].keys()
        for name in grads[1][2]:
            torch.testing.assert_close(grads[0][2][name], grads[1][2][name], rtol=1e-4, atol=1e-5, msg=name)
    assert graphed.graphs.replays == 4 and len(graphed.graphs._captures) == 2


@cuda
def test_a_graphed_sasrec_draws_fresh_dropout_masks_at_every_replay():
    graphed, _ = sasrec_pair(dropout=0.5)
    lengths = torch.full((8,), 6, device="cuda")
    vectors = torch.randn(48, 16, device="cuda")
    outs = []
    for _ in range(3):
        x = vectors.clone().requires_grad_()
        out = graphed.position_representations(x, lengths)
        out.sum().backward()
        outs.append(out.detach().clone())
    assert graphed.graphs.replays == 3 and not torch.equal(outs[1], outs[2])
