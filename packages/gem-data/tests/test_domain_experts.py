import dataclasses

import pytest
import torch

from gem_data import DomainExpertModel
from gem_kunlun import KunlunConfig, multitask_loss
from gem_kunlun.testing import SPEC, random_batch, select_example

CONFIG = KunlunConfig(d_model=16, num_heads=2, num_summary_tokens=2, num_seeds=2, num_experts=2, top_k=1,
                      expert_hidden=8, hidden=(16,), block_size=4, window_blocks=1, max_seq_len=16,
                      capacity_factor=0.0, kernel="pytorch")


def build(num_shared=1, num_specific=1, seed=0):
    torch.manual_seed(seed)
    return DomainExpertModel(SPEC, CONFIG, num_shared=num_shared, num_specific=num_specific)


def test_shapes_and_every_expert_of_a_present_domain_gets_gradients():
    model = build()
    batch = random_batch(10, seed=1)
    assert set(batch.surface.tolist()) == {0, 1}
    out = model(batch)
    assert out.logits.shape == (10, 2) and out.representation.shape == (10, model.representation_dim)
    (multitask_loss(out.logits, batch.labels, torch.ones(2)) + out.aux_loss).backward()
    for name in ("shared.0.mlp.0.weight", "specific.0.0.mlp.0.weight", "specific.1.0.mlp.0.weight", "gate.weight"):
        assert model.get_parameter(name).grad.abs().sum() > 0, name


def test_a_domain_specific_expert_learns_only_from_its_domain():
    model = build()
    batch = random_batch(10, seed=1)
    only_domain_0 = dataclasses.replace(batch, surface=torch.zeros_like(batch.surface))
    out = model(only_domain_0)
    (multitask_loss(out.logits, batch.labels, torch.ones(2)) + out.aux_loss).backward()
    assert model.get_parameter("specific.0.0.mlp.0.weight").grad.abs().sum() > 0
    # domain 1's experts ran on a stand-in row (the same modules on every rank), which teaches them nothing
    absent = [p.grad for name, p in model.named_parameters() if name.startswith("specific.1.")]
    assert absent and all(g is not None and not g.any() for g in absent)


def test_examples_are_scored_independently_of_their_batch():
    model = build(num_shared=2, num_specific=1).eval()
    batch = random_batch(6, seed=3, max_events=3)
    together = model(batch).logits
    alone = torch.cat([model(select_example(batch, i)).logits for i in range(6)])
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)


def test_specific_experts_cost_flops_only_on_their_domain():
    model = build(num_shared=1, num_specific=1)
    batch = random_batch(8, seed=4)
    flops = model.flops(batch)
    domain0 = sum(v for k, v in flops.items() if k.startswith("domain0."))
    shared = sum(v for k, v in flops.items() if k.startswith("shared0."))
    both = dataclasses.replace(batch, surface=torch.zeros_like(batch.surface))
    assert domain0 < shared
    assert sum(v for k, v in model.flops(both).items() if k.startswith("domain0.")) == pytest.approx(shared)


def test_at_least_one_expert_is_required():
    with pytest.raises(ValueError, match="at least one expert"):
        DomainExpertModel(SPEC, CONFIG, num_shared=0, num_specific=0)
