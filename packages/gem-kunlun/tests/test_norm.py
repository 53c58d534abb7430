"""The models' LayerNorm: nn.LayerNorm's parameters, gem-kernels' fused norm, autocast's dtype written directly."""

import torch

from gem_kunlun.norm import LayerNorm


def test_under_autocast_the_norm_writes_what_the_next_matmul_reads():
    torch.manual_seed(0)
    norm, linear = LayerNorm(32), torch.nn.Linear(32, 8)
    reference = torch.nn.LayerNorm(32)
    reference.load_state_dict(norm.state_dict())
    x = torch.randn(6, 32, requires_grad=True)
    plain = norm(x)
    assert plain.dtype == torch.float32
    torch.testing.assert_close(plain, reference(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm(x)
        out = linear(y)
        expected_out = linear(reference(x))  # autocast casts the float32 norm to bf16 itself
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, reference(x).bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out.float().sum(), x)
    (expected,) = torch.autograd.grad(expected_out.float().sum(), x)
    assert grad.dtype == torch.float32
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)
