import dataclasses

import pytest
import torch

from gem_kernels import rotary
from gem_kunlun import (
    KUNLUN_SIZES,
    EventPersonalization,
    KunlunConfig,
    KunlunLayer,
    KunlunModel,
    SumKronLinear,
    multitask_loss,
)
from gem_kunlun.rote import ROTE_BASE, time_gap_positions
from gem_kunlun.sequence import lengths_to_offsets
from gem_kunlun.testing import SPEC, overfit, random_batch, select_example

# unbounded expert capacity: routing of one example never depends on the others
TINY = KunlunConfig(d_model=16, num_heads=2, num_summary_tokens=3, num_seeds=2, num_experts=3, top_k=2,
                    expert_hidden=16, hidden=(16,), block_size=4, window_blocks=2, window=3, max_seq_len=32,
                    capacity_factor=0.0, kernel="pytorch")


def build(config=TINY, seed=0):
    torch.manual_seed(seed)
    return KunlunModel(SPEC, config)


@pytest.mark.parametrize("summarization", ["pma", "hsp"])
@pytest.mark.parametrize("attention", ["block", "window"])
def test_forward_shapes_and_gradients(summarization, attention):
    model = build(dataclasses.replace(TINY, summarization=summarization, attention=attention))
    batch = random_batch(12, seed=1)
    out = model(batch)
    assert out.logits.shape == (12, 2) and out.aux_loss.shape == ()
    (multitask_loss(out.logits, batch.labels, torch.ones(2)) + out.aux_loss).backward()
    unused_experts = {
        f"trunk.layers.{i}.moe.experts.{e}" for i, layer in enumerate(model.layers) for e in range(3)
        if int(layer.moe.last_stats.kept[e]) == 0
    }
    missing = [
        n for n, p in model.named_parameters()
        if (p.grad is None or not torch.isfinite(p.grad).all()) and not any(n.startswith(u) for u in unused_experts)
    ]
    assert not missing, missing


@pytest.mark.parametrize("attention", ["block", "window"])
def test_batch_gives_the_same_outputs_as_its_examples_one_by_one(attention):
    config = dataclasses.replace(TINY, attention=attention, events={"buy": EventPersonalization(width=8, num_layers=1, window=2)})
    model = build(config).eval()
    batch = random_batch(6, seed=3, max_events=3)
    assert int(batch.num_events()[0]) == 0 and int(batch.num_events().max()) > 0  # empty and non-empty histories
    together = model(batch).logits
    alone = torch.cat([model(select_example(batch, i)).logits for i in range(batch.batch_size)])
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)


def test_long_histories_keep_their_latest_events():
    config = dataclasses.replace(TINY, max_seq_len=4)
    model = build(config).eval()
    batch = random_batch(3, seed=4, max_events=9)
    assert int(batch.num_events().max()) > 4
    _, seq, offsets, positions = model.encoder(batch)
    assert (offsets[1:] - offsets[:-1]).tolist() == batch.num_events().clamp(max=4).tolist()
    # the latest event of every non-empty example has gap 0
    last = offsets[1:][offsets[1:] > offsets[:-1]] - 1
    assert torch.all(positions[last] == 0)


def test_compskip_removes_exactly_the_skipped_components_flops():
    batch = random_batch(8, seed=2)
    full = build().flops(batch)
    skipped = build(dataclasses.replace(TINY, skip=((), ("attention", "pffn")))).flops(batch)
    assert "layer1.attention" not in skipped and "layer1.pffn" not in skipped
    saved = full["layer1.attention"] + full["layer1.pffn"]
    assert sum(skipped.values()) == pytest.approx(sum(full.values()) - saved)


def test_a_skipped_component_passes_its_input_on():
    layer = KunlunLayer(dataclasses.replace(TINY, skip=(("pffn", "attention"),)), num_tokens_in=5, index=0)
    offsets = lengths_to_offsets(torch.tensor([3, 0, 2]))
    seq = torch.randn(5, 16)
    x = torch.randn(3, 5, 16)
    _, out, _, pending = layer(x, seq, offsets, torch.zeros(5), 8, None)
    assert torch.equal(out, seq) and pending is None
    update = torch.randn(5, 16)  # the previous layer's pending update: added by the summary's norm, passed on
    _, out, _, pending = layer(x, seq, offsets, torch.zeros(5), 8, None, update)
    torch.testing.assert_close(out, seq + update)
    assert pending is None
    with pytest.raises(ValueError, match="skip\\[0\\] cannot switch off 'summary'"):
        dataclasses.replace(TINY, skip=(("summary",),))


def test_event_personalization_changes_widths_and_flops():
    batch = random_batch(8, seed=5)
    plain = build()
    personal = build(dataclasses.replace(TINY, events={"buy": EventPersonalization(width=8, num_layers=2, num_heads=2, window=2)}))
    assert "events.buy" in personal.flops(batch) and "events.buy" not in plain.flops(batch)
    assert personal.encoder.embedding.events["width8"].embedding_configs()[0].embedding_dim == 8
    assert len(personal.encoder.event_encoders["buy"].layers) == 2
    with pytest.raises(ValueError, match="unknown event types"):
        KunlunModel(SPEC, dataclasses.replace(TINY, events={"click": EventPersonalization()}))
    # an event type's own attention layers are checked where the config is made, not at the first forward
    with pytest.raises(ValueError, match=r"events\['buy'\]: width \(6\) must be divisible by num_heads \(4\)"):
        dataclasses.replace(TINY, events={"buy": EventPersonalization(width=6, num_heads=4, num_layers=1)})
    with pytest.raises(ValueError, match=r"events\['buy'\]: ROTE needs an even head dim"):
        dataclasses.replace(TINY, events={"buy": EventPersonalization(width=10, num_heads=2, num_layers=1)})


def test_unknown_event_names_are_reported_under_the_field_that_set_them():
    from gem_kunlun.event_personalization import check_event_names

    check_event_names(["buy"], SPEC)
    with pytest.raises(ValueError, match=r"^model\.kunlun\.events names unknown event types \['click'\]; the data has"):
        check_event_names(["buy", "click"], SPEC, field="model.kunlun.events")


def test_attention_flops_count_real_pairs_only():
    model = build()
    attention = model.layers[0].attention  # blocks of 4, window of 2 blocks
    # a sequence of 6: tokens 0-3 see block 0 (4 keys); tokens 4-5 see blocks 0-1 (6 keys)
    assert attention.visible_pairs(torch.tensor([6, 0])) == 4 * 4 + 2 * 6
    window = build(dataclasses.replace(TINY, attention="window")).layers[0].attention  # |i-j| <= 3
    assert window.visible_pairs(torch.tensor([5])) == 4 + 5 + 5 + 5 + 4


def brute_force_pairs(lengths, mode, block_size, window_blocks, window):
    total = 0
    for n in lengths.tolist():
        for i in range(n):
            for j in range(n):
                if mode == "block":
                    total += i // block_size - window_blocks < j // block_size <= i // block_size
                else:
                    total += abs(i - j) <= window
    return total


@pytest.mark.parametrize("mode,block_size,window_blocks,window", [
    ("block", 4, 2, 0), ("block", 3, 1, 0), ("block", 5, 4, 0), ("window", 4, 1, 3), ("window", 4, 1, 0),
    ("window", 4, 1, 9)])
def test_visible_pairs_closed_form_equals_counting_every_pair(mode, block_size, window_blocks, window):
    config = dataclasses.replace(TINY, attention=mode, block_size=block_size, window_blocks=window_blocks, window=window)
    attention = build(config).layers[0].attention
    lengths = torch.randint(0, 30, (12,))
    lengths[0] = 0
    assert attention.visible_pairs(lengths) == brute_force_pairs(lengths, mode, block_size, window_blocks, window)


def test_rote_depends_on_time_differences_only():
    q, k = torch.randn(1, 2, 8), torch.randn(1, 2, 8)

    def score(pq, pk):
        return (rotary(q, q, torch.tensor([pq]), ROTE_BASE)[0] * rotary(k, k, torch.tensor([pk]), ROTE_BASE)[0]).sum(-1)

    torch.testing.assert_close(score(1.0, 3.5), score(4.0, 6.5))
    torch.testing.assert_close(rotary(q, k, torch.tensor([2.0]), ROTE_BASE)[0].norm(dim=-1), q.norm(dim=-1))
    positions = time_gap_positions(torch.tensor([0.0, 60.0, 120.0, 5.0]), torch.tensor([0, 3, 4]))
    torch.testing.assert_close(positions, torch.log1p(torch.tensor([2.0, 1.0, 0.0, 0.0])))


def test_time_gaps_of_events_in_time_order_read_each_latest_as_the_last():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 0, 1, 7, 0, 3])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    times = torch.cat([torch.rand(int(n), generator=g).mul(1e5).sort().values for n in lengths])
    torch.testing.assert_close(time_gap_positions(times, offsets, in_time_order=True), time_gap_positions(times, offsets),
                               rtol=0, atol=0)
    empty = time_gap_positions(torch.zeros(0), torch.zeros(3, dtype=torch.int64), in_time_order=True)
    assert empty.shape == (0,) and empty.dtype == torch.float32


def test_sum_kron_linear_equals_its_dense_matrix():
    layer = SumKronLinear(k_in=5, k_out=2, dim=3, dim_out=4, rank=3)
    z = torch.randn(7, 5, 3)
    # vec(A^T Z W) = (A^T kron W^T) vec(Z) for row-major vec
    dense = sum(torch.kron(layer.token[i].t(), layer.feature[i].t()) for i in range(3))
    expected = (z.reshape(7, -1) @ dense.t()).view(7, 2, 4)
    torch.testing.assert_close(layer(z), expected)


def test_tiny_overfits_a_small_batch():
    model = build(dataclasses.replace(TINY, d_model=32, hidden=(32,)))
    batch = random_batch(16, seed=9)
    first, last = overfit(model, batch, steps=120, lr=0.003)
    assert last < 0.1 * first


def test_built_on_meta_and_materialized():
    model = KunlunModel(SPEC, TINY, device=torch.device("meta"))
    assert all(p.is_meta for p in model.parameters())
    model = model.to_empty(device="cpu")
    torch.manual_seed(0)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    out = model(random_batch(4))
    assert torch.isfinite(out.logits).all()


def test_sizes_grow_in_parameters_and_flops():
    counts = {}
    for name, config in KUNLUN_SIZES.items():
        model = KunlunModel(SPEC, config, device=torch.device("meta"))
        counts[name] = sum(p.numel() for n, p in model.named_parameters() if "embedding" not in n)
    assert counts["tiny"] < counts["small"] < counts["base"] < counts["large"]


def test_newest_events_are_the_last_of_each_history_newest_first_zero_padded():
    from gem_kunlun.kunlun import newest_events

    seq = torch.arange(12, dtype=torch.float32).view(6, 2)  # events 0..5, event i = [2i, 2i + 1]
    offsets = torch.tensor([0, 3, 3, 4, 6])  # histories of 3, 0, 1 and 2 events
    got = newest_events(seq, offsets, 2)
    expected = torch.tensor([[[4, 5], [2, 3]], [[0, 0], [0, 0]], [[6, 7], [0, 0]], [[10, 11], [8, 9]]], dtype=torch.float32)
    assert torch.equal(got, expected)
    assert newest_events(seq[:0], torch.zeros(3, dtype=torch.int64), 2).shape == (2, 2, 2)


def test_dropout_acts_in_training_only_and_recent_tokens_widen_the_mlp():
    from gem_kunlun.testing import SPEC, random_batch

    torch.manual_seed(0)
    config = KunlunConfig(max_seq_len=8, block_size=4, window=4, dropout=0.3, recent_tokens=2)
    model = KunlunModel(SPEC, config)
    batch = random_batch(6, seed=1)
    assert not torch.equal(model(batch).logits, model(batch).logits)  # a fresh dropout mask per call
    model.eval()
    torch.testing.assert_close(model(batch).logits, model(batch).logits, rtol=0, atol=0)
    plain = KunlunModel(SPEC, KunlunConfig(max_seq_len=8, block_size=4, window=4))
    assert model.trunk.mlp[0].in_features == plain.trunk.mlp[0].in_features + 2 * config.d_model
    with pytest.raises(ValueError, match="dropout"):
        KunlunConfig(dropout=1.0)


@pytest.mark.parametrize("skip", [(), ((), ("pffn", "attention")), ((), ("summary",))])
def test_updates_left_to_the_next_norm_give_the_model_that_adds_them_at_once(skip, monkeypatch):
    """pFFN and attention hand their update to the next norm, which adds it in its own pass: the model computes what
    it computes when every block adds its update itself (outputs and every gradient), whatever CompSkip switches off."""
    from gem_kunlun.local_attention import LocalAttention
    from gem_kunlun.pffn import PersonalizedFFN

    config = dataclasses.replace(TINY, num_layers=3, skip=skip)
    batch = random_batch(6, seed=3)
    results = []
    for adds_at_once in (False, True):
        model = build(config)
        if adds_at_once:
            for cls in (LocalAttention, PersonalizedFFN):
                forward = cls.forward

                def settled(self, *args, pending=None, defer=False, _forward=forward, **normed):
                    assert pending is None
                    out = _forward(self, *args, **normed)
                    return (out, None) if defer else out

                monkeypatch.setattr(cls, "forward", settled)
        out = model(batch)
        loss = out.logits.square().sum() + out.aux_loss
        results.append((out.logits, torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)))
        monkeypatch.undo()
    (deferred, grads_deferred), (eager, grads_eager) = results
    torch.testing.assert_close(deferred, eager, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_deferred, grads_eager):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_event_types_added_as_a_product_equal_the_embedding_lookup():
    """The encoder adds each event's type vector through a product with one-hot rows: the values and the
    gradients (of the type vectors and of the events) of the embedding lookup it replaces, in float32 under
    autocast too."""
    encoder = build().encoder
    events = torch.randn(11, TINY.d_model, requires_grad=True)
    types = torch.randint(0, encoder.event_type.num_embeddings, (11,))
    seed = torch.randn(11, TINY.d_model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = encoder._with_event_types(events, types)
    assert got.dtype == torch.float32
    grads = torch.autograd.grad(got, (events, encoder.event_type.weight), seed)
    expected = events + encoder.event_type(types)
    torch.testing.assert_close(got, expected)
    for a, b in zip(grads, torch.autograd.grad(expected, (events, encoder.event_type.weight), seed)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("fp32_residual", [False, True])
def test_under_autocast_the_residual_stream_is_in_autocasts_dtype_unless_kept_in_float32(fp32_residual):
    """The history reaches the layers, and leaves the last one, in bfloat16 under bfloat16 autocast (float32 with
    fp32_residual); the logits stay close to float32's either way, and every parameter gets a gradient."""
    model = build(dataclasses.replace(TINY, fp32_residual=fp32_residual)).eval()
    batch = random_batch(6, seed=3)
    seen = []
    model.trunk.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[1].dtype))
    model.trunk.final_summary_norm.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    with torch.no_grad():
        exact = model(batch).logits
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(batch)
    assert seen == [torch.float32 if fp32_residual else torch.bfloat16] * 2
    torch.testing.assert_close(out.logits.float(), exact, rtol=0.1, atol=0.05)
    out.logits.float().sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "embedding" not in n and p.requires_grad)


def test_the_summary_and_pffn_norms_in_one_pass_give_the_model_of_two_norms(monkeypatch):
    """Each layer normalises its stream for the summary and for pFFN in one call (``LayerNorm(also=)``, gem-kernels'
    ``layer_norm_pair``): the same logits and gradients as two norms one after the other."""
    import gem_kunlun.norm as norm_module
    from gem_kernels import layer_norm, layer_norm_pair

    batch = random_batch(6, seed=4)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return layer_norm_pair(*args, **kwargs)

    def one_after_the_other(x, first, second, eps, residual=None, kernel="auto", skip=False, out_dtype=None):
        y1, stream = layer_norm(x, *first, eps, residual=residual, kernel=kernel, skip=skip, out_dtype=out_dtype)
        return y1, layer_norm(stream, *second, eps, kernel=kernel, out_dtype=out_dtype), stream

    results = []
    for pair in (counted, one_after_the_other):
        monkeypatch.setattr(norm_module, "layer_norm_pair", pair)
        model = build().eval()
        logits = model(batch).logits
        results.append((logits, torch.autograd.grad(logits.square().sum(), list(model.trunk.parameters()))))
    assert len(calls) == TINY.num_layers
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
