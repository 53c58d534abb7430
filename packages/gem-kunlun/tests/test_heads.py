"""The multi-task heads: one logit per task of the example's surface, in float32 under autocast too."""

import torch

from gem_kunlun.heads import MultiTaskHeads


def test_heads_pick_the_examples_surface_and_stay_float32_under_autocast():
    """bfloat16 logits tie scores within ~0.4% of each other (a ranking counts a tie against the target)."""
    torch.manual_seed(0)
    heads = MultiTaskHeads(16, num_tasks=2, num_surfaces=3)
    x = torch.randn(64, 16, requires_grad=True)
    surface = torch.randint(0, 3, (64,))
    expected = (x @ heads.proj.weight.T + heads.proj.bias).view(64, 3, 2)[torch.arange(64), surface]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = heads(x, surface)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    seed = torch.randn(64, 2)
    for a, b in zip(torch.autograd.grad(got, (x, heads.proj.weight), seed), torch.autograd.grad(expected, (x, heads.proj.weight), seed)):
        torch.testing.assert_close(a, b)
