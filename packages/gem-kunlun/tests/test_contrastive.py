import pytest
import torch

from gem_kunlun import KunlunConfig, KunlunModel
from gem_kunlun.contrastive import two_views, view_contrastive_loss
from gem_kunlun.testing import SPEC, random_batch

CONFIG = KunlunConfig(max_seq_len=8, block_size=4, window=4, dropout=0.3, capacity_factor=0.0)


def reference_view_loss(first, second, temperature):
    """InfoNCE written one vector at a time: its other view against every vector but itself."""
    vectors = torch.cat([first, second]).double()
    n, b = vectors.shape[0], first.shape[0]
    total = 0.0
    for i in range(n):
        sims = torch.stack([torch.cosine_similarity(vectors[i], vectors[j], dim=0) for j in range(n) if j != i]) / temperature
        positive = torch.cosine_similarity(vectors[i], vectors[(i + b) % n], dim=0) / temperature
        total += -(positive - torch.logsumexp(sims, 0))
    return total / n


@pytest.mark.parametrize("temperature", [0.1, 1.0])
def test_view_loss_matches_its_definition_on_random_vectors(temperature):
    g = torch.Generator().manual_seed(0)
    first, second = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    got = view_contrastive_loss(first, second, temperature)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference_view_loss(first, second, temperature), rtol=1e-5, atol=1e-5)
    # identical views far apart from the rest: the loss goes to zero at a low temperature
    apart = torch.eye(5, 7) * 10
    assert view_contrastive_loss(apart, apart, 0.01) < 1e-6 < view_contrastive_loss(first, second, 0.01)


def test_two_views_are_the_examples_twice_through_the_trunk():
    torch.manual_seed(0)
    model = KunlunModel(SPEC, CONFIG).eval()
    inputs = model.encoder(random_batch(6, seed=2))
    once, _ = model.trunk(*inputs)
    twice, _ = model.trunk(*two_views(*inputs))
    torch.testing.assert_close(twice, torch.cat([once, once]), rtol=1e-5, atol=1e-5)


def test_training_adds_the_weighted_view_loss_and_evaluation_is_unchanged():
    batch = random_batch(6, seed=3)
    torch.manual_seed(0)
    plain = KunlunModel(SPEC, CONFIG)
    torch.manual_seed(0)
    contrastive = KunlunModel(SPEC, KunlunConfig(**{**CONFIG.__dict__, "contrastive_weight": 0.5}))
    plain.eval(), contrastive.eval()
    torch.testing.assert_close(contrastive(batch).logits, plain(batch).logits, rtol=0, atol=0)

    contrastive.train()
    out = contrastive(batch)
    assert out.logits.shape == (6, len(SPEC.tasks))
    # the added term is the weighted loss of two different dropout views (balance loss: MoE's, same in both)
    assert out.aux_loss > 0.5 * 0.9 * torch.log(torch.tensor(2 * 6 - 1.0))  # far from collapsed views at init
    out.aux_loss.backward()
    grads = [p.grad for p in contrastive.trunk.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


def test_contrastive_weight_needs_dropout_and_a_positive_temperature():
    with pytest.raises(ValueError, match="contrastive_weight needs dropout"):
        KunlunConfig(contrastive_weight=0.1)
    with pytest.raises(ValueError, match="contrastive_temperature"):
        KunlunConfig(dropout=0.1, contrastive_weight=0.1, contrastive_temperature=0.0)
    with pytest.raises(ValueError, match="contrastive_weight"):
        KunlunConfig(dropout=0.1, contrastive_weight=-1.0)


def test_the_flop_count_takes_the_trunk_twice_for_two_views():
    batch = random_batch(6, seed=3)
    model = KunlunModel(SPEC, CONFIG)
    plain = model.flops(batch)
    contrastive = KunlunModel(SPEC, KunlunConfig(**{**CONFIG.__dict__, "contrastive_weight": 0.5})).flops(batch)
    trunk = set(model.trunk.flops(model.encoder.merged_lengths(batch)))  # not the encoder, not the heads (one view)
    assert contrastive.keys() == plain.keys() and trunk and "heads" in plain
    assert all(contrastive[k] == (2 * plain[k] if k in trunk else plain[k]) for k in plain)
    # in eval mode (a teacher's forward, an evaluation) the forward takes one view, and so does the count
    evaluated = KunlunModel(SPEC, KunlunConfig(**{**CONFIG.__dict__, "contrastive_weight": 0.5})).eval().flops(batch)
    assert evaluated == plain


def test_the_view_loss_stays_float32_under_autocast():
    """Its similarity product ran in bf16 under autocast (the gradient was off by a few percent at low temperature):
    the loss under autocast equals the float32 one."""
    g = torch.Generator().manual_seed(0)
    first, second = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
    exact = view_contrastive_loss(first, second, 0.05)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = view_contrastive_loss(first, second, 0.05)
    assert low.dtype == torch.float32 and torch.allclose(low, exact, rtol=1e-6)
