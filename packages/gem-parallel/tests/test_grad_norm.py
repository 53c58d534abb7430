import pytest
import torch

from gem_parallel import clip_grad_norm_
from gem_parallel.grad_norm import _squared_norm


def parameters_with_grads(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape, dtype in
              (((7, 3), torch.float32), ((5,), torch.float64), ((2, 2, 2), torch.float32), ((4,), torch.float32))]
    for p in params[:-1]:  # the last one has no gradient
        p.grad = (torch.randn(p.shape, generator=g, dtype=torch.float64) * 3).to(p.dtype)
    return params


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_clipping_equals_torch_on_plain_tensors_of_several_dtypes(max_norm):
    ours, reference = parameters_with_grads(0), parameters_with_grads(0)
    total = clip_grad_norm_(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_([p for p in reference if p.grad is not None], max_norm)
    assert float(total) == pytest.approx(float(expected), rel=1e-6)
    for a, b in zip(ours, reference):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert a.grad.dtype == b.grad.dtype
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_no_gradients_give_a_zero_norm():
    params = [torch.nn.Parameter(torch.ones(3))]
    assert float(clip_grad_norm_(params, 1.0)) == 0.0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_norm", [1e-3, 1.0, 1e9])
def test_one_float32_group_gives_the_same_floats_as_summing_squared_norms(seed, max_norm):
    """The direct norm of plain float32 gradients is bit for bit the root of the summed squares (the general path)."""
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** (seed * 2 - 5)  # norms from ~1e-5 to ~1e5
    grads = [torch.randn(shape, generator=g) * magnitude for shape in ((64, 32), (32,), (7, 3, 5), (1,), (0, 4))]
    params = [torch.nn.Parameter(torch.zeros(x.shape)) for x in grads]
    for p, x in zip(params, grads):
        p.grad = x.clone()
    total = clip_grad_norm_(params, max_norm)
    expected = (_squared_norm(grads) + torch.zeros((), dtype=torch.float32)).sqrt()
    assert torch.equal(total, expected)
    scale = (max_norm / (expected + 1e-6)).clamp(max=1.0)
    assert all(torch.equal(p.grad, x * scale) for p, x in zip(params, grads))


@pytest.mark.parametrize("max_norm", [1e-3, 1e9])
def test_a_fused_adamw_given_the_clip_factor_steps_as_after_clipped_gradients(max_norm):
    def setup(seed):
        g = torch.Generator().manual_seed(seed)
        params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((64, 32), (32,), (7, 3, 5))]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 5
        return params, torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, fused=True)

    clipped, reference = setup(0)
    handed, fused = setup(0)
    for _ in range(3):  # a few steps: the factor is handed anew at each
        total = clip_grad_norm_(clipped, max_norm)
        reference.step()
        assert torch.equal(clip_grad_norm_(handed, max_norm, optimizer=fused), total)
        assert fused.grad_scale is not None  # handed over: the gradients are left as they were
        fused.step()
        assert fused.grad_scale is None  # for that step only: a step without clipping after it applies none
        for a, b in zip(handed, clipped):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # an optimizer that does not take a scale gets the gradients clipped
    plain = torch.optim.AdamW(handed, lr=0.1, fused=False)
    for p in handed:
        p.grad = torch.ones_like(p)
    total = clip_grad_norm_(handed, 1.0, optimizer=plain)
    assert getattr(plain, "grad_scale", None) is None
    assert all(torch.allclose(p.grad, torch.full_like(p, float(1.0 / (total + 1e-6)))) for p in handed)
