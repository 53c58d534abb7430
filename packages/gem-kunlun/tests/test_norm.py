"""The models' LayerNorm: nn.LayerNorm's parameters and values, written in autocast's dtype under autocast."""

import pytest
import torch
from torch import nn

from gem_kunlun.norm import LayerNorm


@pytest.mark.parametrize("skip", [False, True])
def test_layer_norm_writes_autocast_dtype_and_matches_nn_layer_norm(skip):
    torch.manual_seed(0)
    ours, theirs = LayerNorm(16), nn.LayerNorm(16)
    with torch.no_grad():
        for p in (ours, theirs):
            p.weight.copy_(1 + 0.1 * torch.arange(16.0))
            p.bias.copy_(0.01 * torch.arange(16.0))
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = torch.randn(5, 16, requires_grad=True)
    plain = ours(x, skip=skip)
    y = plain[0] if skip else plain
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, theirs(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours(x, skip=skip)
        y = out[0] if skip else out
        # the matmul reading it takes it as it is: the same product as from the float32 norm, cast by autocast
        torch.testing.assert_close(y @ torch.eye(16), theirs(x) @ torch.eye(16), atol=0, rtol=0)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, theirs(x).to(torch.bfloat16), atol=0, rtol=0)
    if skip:
        assert out[1] is x
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
