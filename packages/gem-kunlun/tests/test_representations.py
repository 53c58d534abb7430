"""Float-valued jagged features (``Batch.representations``): validation, transfer, and how models read them."""

import dataclasses

import pytest
import torch
from gem_kunlun.testing import SPEC, SPEC_WITH_REPRESENTATIONS, random_batch, select_example

from gem_kunlun import (
    BaselineRanker,
    EventType,
    FeatureSpec,
    JaggedFloats,
    KunlunConfig,
    KunlunModel,
    RepresentationFeature,
    RepresentationSummary,
    SasrecModel,
    SparseFeature,
)


def batch_with(seed: int = 0, size: int = 6):
    return random_batch(size, seed=seed, spec=SPEC_WITH_REPRESENTATIONS)


def test_a_batch_with_representations_validates_and_keeps_them_through_to_and_pin():
    batch = batch_with()
    batch.validate(SPEC_WITH_REPRESENTATIONS)
    moved = batch.to(torch.device("cpu"))
    assert torch.equal(moved.representations["loopfm"].values, batch.representations["loopfm"].values)
    assert torch.equal(moved.representations["loopfm"].offsets()[1:], batch.representations["loopfm"].lengths.cumsum(0))
    if torch.cuda.is_available():  # pinning needs an accelerator
        pinned = batch.pin_memory().representations["loopfm"]
        assert pinned.values.is_pinned() and pinned.lengths.is_pinned()


def test_the_batches_of_a_spec_without_representations_are_unchanged():
    plain, extended = random_batch(5, seed=4), random_batch(5, seed=4, spec=SPEC_WITH_REPRESENTATIONS)
    assert torch.equal(plain.dense, extended.dense) and torch.equal(plain.labels, extended.labels)
    assert plain.representations == {} and set(extended.representations) == {"loopfm"}


@pytest.mark.parametrize("change, message", [
    (lambda r: {}, r"batch.representations has features \[\], expected \['loopfm'\]"),
    (lambda r: {"loopfm": JaggedFloats(r.values, r.lengths[:-1])}, r"batch.representations\['loopfm'\].lengths must be int64 of shape \(6,\)"),
    (lambda r: {"loopfm": JaggedFloats(r.values, r.lengths.int())}, r"lengths must be int64"),
    (lambda r: {"loopfm": JaggedFloats(r.values[:, :3], r.lengths)}, r"batch.representations\['loopfm'\].values must be float of shape"),
    (lambda r: {"loopfm": JaggedFloats(r.values[1:], r.lengths)}, r"lengths' sum x dim"),
    (lambda r: {"loopfm": JaggedFloats(r.values.long(), r.lengths)}, r"values must be float"),
    (lambda r: {"loopfm": JaggedFloats(r.values * float("nan"), r.lengths)}, r"values has NaN or infinite entries"),
    (lambda r: {"loopfm": JaggedFloats(r.values, r.lengths - 10)}, r"lengths has negative entries"),
])
def test_bad_representations_are_one_line_naming_the_field(change, message):
    batch = batch_with()
    bad = dataclasses.replace(batch, representations=change(batch.representations["loopfm"]))
    with pytest.raises(ValueError, match=message) as error:
        bad.validate(SPEC_WITH_REPRESENTATIONS)
    assert "\n" not in str(error.value)


def test_spec_rejects_repeated_or_empty_representation_features():
    with pytest.raises(ValueError, match="representations names must be unique"):
        dataclasses.replace(SPEC, representations=(RepresentationFeature("a", 2), RepresentationFeature("a", 3)))
    with pytest.raises(ValueError, match="dim must be >= 1"):
        RepresentationFeature("a", 0)


def test_summary_is_the_attention_of_its_query_over_each_examples_vectors_and_the_null_entry():
    torch.manual_seed(0)
    summary = RepresentationSummary(SPEC_WITH_REPRESENTATIONS.representations, dim=8)
    batch = batch_with(size=5)
    batch.representations["loopfm"].lengths[1] = 0  # one example without vectors
    r = batch.representations["loopfm"]
    r.values = r.values[: int(r.lengths.sum())]
    got = summary(batch)[:, 0]
    key, value = summary.key_value[0](r.values).chunk(2, -1)
    null_key, null_value = summary.null_key_value[0]
    for i, (start, end) in enumerate(zip(r.offsets()[:-1].tolist(), r.offsets()[1:].tolist())):
        keys, values = torch.cat([null_key[None], key[start:end]]), torch.cat([null_value[None], value[start:end]])
        weights = torch.softmax(keys @ summary.query[0] / 8 ** 0.5, 0)
        torch.testing.assert_close(got[i], weights @ values)
    torch.testing.assert_close(got[1], null_value)  # nothing to attend to but the null entry


@pytest.mark.parametrize("build", [
    lambda spec: BaselineRanker(spec),
    lambda spec: KunlunModel(spec, KunlunConfig(d_model=16, num_heads=2, num_layers=1, num_experts=2, top_k=1, capacity_factor=0,
                                               hidden=(16,), num_seeds=2, num_summary_tokens=2, max_seq_len=16)),
])
def test_models_read_representations_per_example_and_learn_from_them(build):
    torch.manual_seed(0)
    model = build(SPEC_WITH_REPRESENTATIONS).eval()
    if isinstance(model, BaselineRanker):  # its representation columns start at zero; as after some training
        torch.nn.init.normal_(model.representation_input.weight, std=0.1)
    batch = batch_with(seed=1, size=4)
    out = model(batch).logits
    for i in range(4):  # an example's output depends on its own vectors only
        torch.testing.assert_close(model(select_example(batch, i)).logits, out[i : i + 1], rtol=1e-4, atol=1e-5)
    changed = dataclasses.replace(batch, representations={"loopfm": dataclasses.replace(
        batch.representations["loopfm"], values=batch.representations["loopfm"].values + 1.0)})
    assert not torch.allclose(model(changed).logits, out)  # the vectors reach the logits
    model.train()
    model(batch).logits.sum().backward()
    summary = model.representations if isinstance(model, BaselineRanker) else model.encoder.representations
    assert all(p.grad is not None for p in summary.parameters())
    assert any("representations.loopfm" in k for k in model.flops(batch))


@pytest.mark.parametrize("build", [
    lambda spec: BaselineRanker(spec),
    lambda spec: KunlunModel(spec, KunlunConfig(d_model=16, num_heads=2, num_layers=1, num_experts=2, top_k=2, capacity_factor=0,
                                               hidden=(16,), num_seeds=2, num_summary_tokens=2, max_seq_len=16,
                                               kernel="pytorch")),
])
def test_models_with_representations_run_under_autocast(build):
    """The summary pools in float32: under bf16 autocast its projection's output met the float32 null entry in
    index_add, which refused it (no model with representation features could train in bf16)."""
    torch.manual_seed(0)
    model = build(SPEC_WITH_REPRESENTATIONS)
    batch = batch_with(seed=1, size=4)
    exact = model.eval()(batch).logits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(batch).logits
        model.train()(batch).logits.float().sum().backward()
    assert torch.isfinite(low).all() and torch.allclose(low.float(), exact, atol=0.05, rtol=0.05)


def test_sasrec_refuses_representation_features_in_one_line():
    spec = FeatureSpec(num_dense=0, sparse=(SparseFeature("item_id", 10),),
                       events=(EventType("history", (SparseFeature("history_item_id", 10),)),), tasks=("click",),
                       representations=(RepresentationFeature("loopfm", 4),))
    with pytest.raises(ValueError, match="SASRec reads item ids only, not representation features"):
        SasrecModel(spec)


def test_the_baseline_with_representations_starts_as_the_same_function_as_without():
    """Its representation tokens join the first MLP layer through columns of their own that start at zero: given
    the shared weights, the model with LoopFM inputs computes what the model without them does, until it learns."""
    torch.manual_seed(0)
    plain, extended = BaselineRanker(SPEC), BaselineRanker(SPEC_WITH_REPRESENTATIONS)
    missing, unexpected = extended.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("representation") for k in missing)
    out = extended(random_batch(6, seed=2, spec=SPEC_WITH_REPRESENTATIONS)).logits
    torch.testing.assert_close(out, plain(random_batch(6, seed=2)).logits)
