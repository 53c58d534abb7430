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


@pytest.mark.parametrize("scaling", ["rowwise", "blockwise"])
def test_norm_mlp_fuses_only_rowwise_fp8_linears(scaling, monkeypatch):
    from gem_kernels import Fp8Linear, Fp8Recipe

    from gem_kunlun import norm as norm_module

    fused = []
    block = norm_module.fp8_norm_mlp
    monkeypatch.setattr(norm_module, "fp8_norm_mlp", lambda *args, **kwargs: fused.append(1) or block(*args, **kwargs))
    torch.manual_seed(0)
    recipe = Fp8Recipe(scaling=scaling, min_features=0, min_tokens=0, kernel="pytorch")
    layer_norm = nn.LayerNorm(128)
    mlp = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    x = torch.randn(4, 8, 128)
    exact = mlp(layer_norm(x))
    mlp[0], mlp[2] = Fp8Linear.from_linear(mlp[0], recipe), Fp8Linear.from_linear(mlp[2], recipe)
    y = norm_module.norm_mlp(layer_norm, mlp, x)
    # the rowwise recipe runs the fused block; a blockwise recipe's linears quantise their own inputs
    assert fused == ([1] if scaling == "rowwise" else [])
    assert y.shape == exact.shape and float((y - exact).norm() / exact.norm()) < 0.1
