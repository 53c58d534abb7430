import torch

from gem_kunlun import InterFormerConfig, InterFormerModel, multitask_loss
from gem_kunlun.testing import SPEC, overfit, random_batch, select_example

CONFIG = InterFormerConfig(d_model=16, num_heads=2, num_seeds=2, hidden=(16,), max_seq_len=16, kernel="pytorch")


def build(seed=0):
    torch.manual_seed(seed)
    return InterFormerModel(SPEC, CONFIG)


def test_forward_shapes_and_every_parameter_gets_a_gradient():
    model = build()
    batch = random_batch(8, seed=1)
    out = model(batch)
    assert out.logits.shape == (8, 2) and out.representation.shape == (8, 16)
    multitask_loss(out.logits, batch.labels, torch.ones(2)).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, missing


def test_batch_gives_the_same_outputs_as_its_examples_one_by_one():
    model = build().eval()
    batch = random_batch(6, seed=3, max_events=3)
    assert int(batch.num_events()[0]) == 0  # an empty history among them
    together = model(batch).logits
    alone = torch.cat([model(select_example(batch, i)).logits for i in range(6)])
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)


def test_self_attention_is_full_and_counted_on_real_lengths():
    model = build()
    attention = model.layers[0].attention
    assert attention.visible_pairs(torch.tensor([5, 0, 3])) == 5 * 5 + 3 * 3


def test_a_small_batch_can_be_overfit():
    model = build()
    batch = random_batch(16, seed=9)
    first, last = overfit(model, batch, steps=120, lr=0.003)
    assert last < 0.1 * first
