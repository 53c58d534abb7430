"""Fused norm kernels (interpreter on CPU) against the references: outputs, dx, dweight, dbias, dresidual."""

import pytest
import torch
from conftest import requires_triton
from gem_kernels_testing import assert_close, rand

from gem_kernels import layer_norm, rms_norm

pytestmark = requires_triton

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", [(7, 48), (2, 3, 100), (1, 16)])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "layer_norm_nobias"])
def test_norm_matches_reference(op, shape, residual, dtype):
    N = shape[-1]
    x = rand(*shape, dtype=dtype)
    r = rand(*shape, dtype=dtype) if residual else None
    w = (1.0 + 0.1 * torch.randn(N)).to(dtype).requires_grad_()
    b = rand(N, dtype=dtype) if op == "layer_norm" else None
    inputs = [t for t in (x, r, w, b) if t is not None]

    def fn(kernel):
        if op == "rms_norm":
            return rms_norm(x, w, 1e-6, residual=r, kernel=kernel)
        return layer_norm(x, w, b, 1e-5, residual=r, kernel=kernel)

    outs = {k: fn(k) for k in ("triton", "pytorch")}
    seeds = [torch.randn(shape).to(dtype)] + ([torch.randn(shape).to(dtype)] if residual else [])
    got = {}
    for kern, out in outs.items():
        out = out if isinstance(out, tuple) else (out,)
        for o_t in out:
            assert o_t.dtype == dtype
        got[kern] = (out, torch.autograd.grad(out, inputs, seeds))
    (o_t, g_t), (o_r, g_r) = got["triton"], got["pytorch"]
    for a, e in zip(o_t, o_r):
        assert_close(a, e, TOL[dtype], "out")
    for a, e, n in zip(g_t, g_r, ["x", "r", "w", "b"] if residual else ["x", "w", "b"]):
        # NOTE: dweight sums over rows; fp16 rounding of y/dy makes it looser than the elementwise outputs.
        assert_close(a, e, TOL[dtype] * (4 if n in "wb" else 1), f"d{n}")


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norm_writes_y_in_out_dtype(op, residual):
    """A float32 stream normalised straight into float16 (what the next matmul reads): y equals the reference
    rounded to float16, the residual sum stays float32, and the float16 gradient of y flows back to float32
    inputs as the reference's does."""
    shape, N = (37, 48), 48
    x = rand(*shape)
    r = rand(*shape) if residual else None
    w = (1.0 + 0.1 * torch.randn(N)).requires_grad_()
    b = rand(N) if op == "layer_norm" else None
    inputs = [t for t in (x, r, w, b) if t is not None]
    seeds = [torch.randn(shape).half()] + ([torch.randn(shape)] if residual else [])
    got = {}
    for kernel in ("triton", "pytorch"):
        if op == "rms_norm":
            out = rms_norm(x, w, 1e-6, residual=r, kernel=kernel, out_dtype=torch.float16)
        else:
            out = layer_norm(x, w, b, 1e-5, residual=r, kernel=kernel, out_dtype=torch.float16)
        out = out if isinstance(out, tuple) else (out,)
        assert out[0].dtype == torch.float16 and all(o.dtype == torch.float32 for o in out[1:])
        got[kernel] = (out, torch.autograd.grad(out, inputs, seeds))
    for a, e in zip(got["triton"][0], got["pytorch"][0]):
        assert_close(a, e, 1e-3, "out")
    for a, e in zip(got["triton"][1], got["pytorch"][1]):
        assert a.dtype == torch.float32
        assert_close(a, e, 1e-4, "grad")
    with pytest.raises(ValueError, match=r"out_dtype must be None, float16, bfloat16 or float32, got torch.int32"):
        layer_norm(x, w, b, out_dtype=torch.int32)
