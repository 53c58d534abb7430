"""The backward's partial-sum finish (interpreter on CPU) against torch's sum and cast."""

import pytest
import torch
from conftest import triton_on_cpu

from gem_kernels.ops.triton import _tuning, triton_sum_rows
from gem_kernels.ops.triton.triton_sum_rows import sum_rows

pytestmark = triton_on_cpu


@pytest.mark.parametrize("shape", [(1, 1), (5, 16), (33, 50), (130, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sum_rows_matches_torch(shape, dtype):
    g = torch.Generator().manual_seed(shape[0] * 100 + shape[1])
    x = torch.randn(*shape, generator=g)
    y = torch.randn(*shape, generator=g)
    assert torch.allclose(sum_rows(x, dtype).float(), x.sum(0).to(dtype).float(), rtol=1e-5, atol=1e-5)
    sx, sy = sum_rows(x, dtype, y, torch.float32)
    assert sx.dtype == dtype and sy.dtype == torch.float32
    assert torch.allclose(sx.float(), x.sum(0).to(dtype).float(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(sy, y.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", [dict(BLOCK_G=16, BLOCK_N=32, num_warps=4), dict(BLOCK_G=1, BLOCK_N=16, num_warps=4)])
def test_sum_rows_is_the_same_for_every_config(monkeypatch, cfg):
    x = torch.randn(70, 45, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(triton_sum_rows, "_candidates", lambda n: [cfg])
    monkeypatch.setattr(_tuning, "_TUNED", {})  # the config picked for the key by an earlier test
    assert torch.allclose(sum_rows(x, torch.float32), x.sum(0), rtol=1e-5, atol=1e-5)
