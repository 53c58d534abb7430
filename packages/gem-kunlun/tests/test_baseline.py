import pytest
import torch
from gem_kunlun.testing import SPEC, overfit, random_batch, select_example

from gem_kunlun import BaselineConfig, BaselineRanker, multitask_loss


def test_forward_shape_and_all_parameters_get_gradients():
    torch.manual_seed(0)
    model = BaselineRanker(SPEC, BaselineConfig(dim=8, num_heads=2, hidden=(16,), max_seq_len=8))
    batch = random_batch(7)
    logits = model(batch).logits
    assert logits.shape == (7, 2)
    multitask_loss(logits, batch.labels, torch.ones(2)).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, missing


def test_batch_gives_the_same_outputs_as_its_examples_one_by_one():
    torch.manual_seed(1)
    model = BaselineRanker(SPEC, BaselineConfig(dim=8, num_heads=2, hidden=(16,), max_seq_len=32)).eval()
    batch = random_batch(6, seed=3, max_events=3)
    # the batch mixes empty and non-empty histories (example 0 has no events at all)
    assert int(batch.num_events()[0]) == 0 and int(batch.num_events().max()) > 0
    together = model(batch).logits
    alone = torch.cat([model(select_example(batch, i)).logits for i in range(batch.batch_size)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_empty_histories_give_finite_outputs():
    torch.manual_seed(2)
    model = BaselineRanker(SPEC, BaselineConfig(dim=8, num_heads=2, hidden=(16,)))
    batch = random_batch(4, max_events=0)
    assert int(batch.num_events().sum()) == 0
    assert torch.isfinite(model(batch).logits).all()


def test_flops_scale_with_real_lengths_only():
    model = BaselineRanker(SPEC, BaselineConfig(dim=8, num_heads=2, hidden=(16,), max_seq_len=64))
    short, long = random_batch(8, seed=0, max_events=2), random_batch(8, seed=0, max_events=9)
    assert model.flops(short)["mlp"] == model.flops(long)["mlp"]
    assert model.flops(short)["pma.attention"] < model.flops(long)["pma.attention"]
    events = float(long.num_events().sum())
    # 2 FLOPs per multiply-add, QK and AV, for every seed against every real key plus the null key
    assert model.flops(long)["pma.attention"] == 2 * 2 * 2 * 8 * (events + 8)


def test_built_on_meta_then_materialized():
    model = BaselineRanker(SPEC, BaselineConfig(dim=8, num_heads=2, hidden=(16,)), device=torch.device("meta"))
    assert all(p.is_meta for p in model.parameters())
    model = model.to_empty(device="cpu")
    torch.manual_seed(0)
    # as TorchRec's model parallel does: every module initialises its own parameters
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert torch.isfinite(model(random_batch(3)).logits).all()


def test_a_small_batch_can_be_overfit():
    torch.manual_seed(0)
    model = BaselineRanker(SPEC, BaselineConfig(dim=16, num_heads=2, hidden=(32,)))
    batch = random_batch(16, seed=9)
    first, last = overfit(model, batch, steps=150, lr=0.01)
    assert last < 0.1 * first


@pytest.mark.parametrize("config_type", ["BaselineConfig", "KunlunConfig", "InterFormerConfig"])
def test_a_hidden_layer_without_width_is_refused(config_type):
    """A 0-wide layer passes nothing on: the model's output would be a constant, trained without complaint."""
    import gem_kunlun

    with pytest.raises(ValueError, match=r"^hidden widths must be >= 1, got \[64, 0\]$"):
        getattr(gem_kunlun, config_type)(hidden=(64, 0))
