import pytest
import torch

from gem_parallel import clip_grad_norm_


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
