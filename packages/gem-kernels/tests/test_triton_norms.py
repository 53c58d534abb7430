"""Fused norm kernels (interpreter on CPU) against the references: outputs, dx, dweight, dbias, dresidual."""

import pytest
import torch
from conftest import triton_on_cpu
from gem_kernels_testing import assert_close, rand

from gem_kernels import layer_norm, layer_norm_pair, rms_norm

pytestmark = triton_on_cpu

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("second", [None, "residual", "skip"])
@pytest.mark.parametrize("shape", [(7, 48), (2, 3, 100), (1, 16)])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "layer_norm_nobias"])
def test_norm_matches_reference(op, shape, second, dtype):
    """``second``: the norm's second output, h = x + residual or x itself (skip), each given its own gradient."""
    N = shape[-1]
    x = rand(*shape, dtype=dtype)
    r = rand(*shape, dtype=dtype) if second == "residual" else None
    w = (1.0 + 0.1 * torch.randn(N)).to(dtype).requires_grad_()
    b = rand(N, dtype=dtype) if op == "layer_norm" else None
    inputs = [t for t in (x, r, w, b) if t is not None]
    skip = second == "skip"

    def fn(kernel):
        if op == "rms_norm":
            return rms_norm(x, w, 1e-6, residual=r, kernel=kernel, skip=skip)
        return layer_norm(x, w, b, 1e-5, residual=r, kernel=kernel, skip=skip)

    outs = {k: fn(k) for k in ("triton", "pytorch")}
    seeds = [torch.randn(shape).to(dtype)] + ([torch.randn(shape).to(dtype)] if second else [])
    got = {}
    for kern, out in outs.items():
        out = out if isinstance(out, tuple) else (out,)
        assert len(out) == (2 if second else 1)
        for o_t in out:
            assert o_t.dtype == dtype
        if skip:
            assert torch.equal(out[1], x)
        got[kern] = (out, torch.autograd.grad(out, inputs, seeds))
    (o_t, g_t), (o_r, g_r) = got["triton"], got["pytorch"]
    for a, e in zip(o_t, o_r):
        assert_close(a, e, TOL[dtype], "out")
    for a, e, n in zip(g_t, g_r, ["x", "r", "w", "b"] if r is not None else ["x", "w", "b"]):
        # NOTE: dweight sums over rows; fp16 rounding of y/dy makes it looser than the elementwise outputs.
        assert_close(a, e, TOL[dtype] * (4 if n in "wb" else 1), f"d{n}")


def test_skip_and_residual_exclude_each_other():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="residual and skip exclude each other"):
        layer_norm(x, torch.ones(16), None, residual=x, skip=True)


@pytest.mark.parametrize("cfg", [dict(ROWS=4, num_warps=4, PREFETCH=True, PER_SM=1),
                                 dict(ROWS=4, num_warps=4, PREFETCH=False, PER_SM=1),
                                 dict(ROWS=1, num_warps=4, PREFETCH=True, PER_SM=1)])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norm_backward_configs_agree(op, cfg, monkeypatch):
    """Every backward config the tuner may pick (register prefetch or not, any tile height) gives the reference's
    gradients, with more row tiles than programs so that each program walks several (37 rows: a partial last
    tile)."""
    from gem_kernels.ops.triton import _tuning, triton_norms

    monkeypatch.setattr(triton_norms, "_bwd_cands", lambda block_n: [cfg])
    monkeypatch.setattr(_tuning, "_TUNED", {})
    x = rand(37, 100, dtype=torch.float32)
    w = (1.0 + 0.1 * torch.randn(100)).requires_grad_()
    b = rand(100, dtype=torch.float32) if op == "layer_norm" else None
    r = rand(37, 100, dtype=torch.float32)
    inputs = [t for t in (x, r, w, b) if t is not None]
    seeds = [torch.randn(37, 100), torch.randn(37, 100)]
    grads = {}
    for kern in ("triton", "pytorch"):
        out = (rms_norm(x, w, 1e-6, residual=r, kernel=kern) if op == "rms_norm"
               else layer_norm(x, w, b, 1e-5, residual=r, kernel=kern))
        grads[kern] = torch.autograd.grad(out, inputs, seeds)
    for a, e, n in zip(grads["triton"], grads["pytorch"], ["x", "r", "w", "b"]):
        assert_close(a, e, 1e-5 * (4 if n in "wb" else 1), f"d{n}")


@pytest.mark.parametrize("second", [None, "residual", "skip"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norm_output_in_out_dtype(op, second):
    """A float32 stream normalised straight into float16 (the dtype of the matmul reading y): y matches the
    reference rounded once to float16, the second output stays float32, and y's float16 gradient reaches the
    float32 inputs as the reference's does."""
    shape, N = (37, 48), 48
    x = rand(*shape)
    r = rand(*shape) if second == "residual" else None
    w = (1.0 + 0.1 * torch.randn(N)).requires_grad_()
    b = rand(N) if op == "layer_norm" else None
    inputs = [t for t in (x, r, w, b) if t is not None]
    seeds = [torch.randn(shape).half()] + ([torch.randn(shape)] if second else [])
    got = {}
    for kernel in ("triton", "pytorch"):
        kw = dict(residual=r, kernel=kernel, skip=second == "skip", out_dtype=torch.float16)
        out = rms_norm(x, w, 1e-6, **kw) if op == "rms_norm" else layer_norm(x, w, b, 1e-5, **kw)
        out = out if isinstance(out, tuple) else (out,)
        assert out[0].dtype == torch.float16 and all(o.dtype == torch.float32 for o in out[1:])
        got[kernel] = (out, torch.autograd.grad(out, inputs, seeds))
    for a, e in zip(got["triton"][0], got["pytorch"][0]):
        assert_close(a, e, 1e-3, "out")
    for a, e in zip(got["triton"][1], got["pytorch"][1]):
        assert a.dtype == torch.float32
        assert_close(a, e, 1e-4, "grad")


def test_out_dtype_must_be_floating():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"out_dtype must be None, float16, bfloat16 or float32, got torch.int32"):
        layer_norm(x, torch.ones(16), None, out_dtype=torch.int32)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_residual_of_another_dtype_is_added_in_float32(op):
    """A float32 stream plus a float16 update (a branch's matmul output): h stays float32, and the update's gradient
    comes back in float16, as the reference's."""
    x, r = rand(37, 48), rand(37, 48, dtype=torch.float16)
    w = (1.0 + 0.1 * torch.randn(48)).requires_grad_()
    b = rand(48) if op == "layer_norm" else None
    inputs = [t for t in (x, r, w, b) if t is not None]
    seeds = [torch.randn(37, 48), torch.randn(37, 48)]
    got = {}
    for kernel in ("triton", "pytorch"):
        y, h = (rms_norm(x, w, 1e-6, residual=r, kernel=kernel) if op == "rms_norm"
                else layer_norm(x, w, b, 1e-5, residual=r, kernel=kernel))
        assert y.dtype == h.dtype == torch.float32
        got[kernel] = ((y, h), torch.autograd.grad((y, h), inputs, seeds))
    torch.testing.assert_close(got["triton"][0][1], x + r.float(), rtol=0, atol=0)
    for a, e in zip(got["triton"][0], got["pytorch"][0]):
        assert_close(a, e, 1e-5, "out")
    for a, e, n in zip(got["triton"][1], got["pytorch"][1], "xrwb"):
        assert a.dtype == e.dtype == (torch.float16 if n == "r" else torch.float32)
        assert_close(a.float(), e.float(), 1e-3 if n == "r" else 4e-5, f"d{n}")


@pytest.mark.parametrize("out_dtype", [None, torch.float16])
@pytest.mark.parametrize("second", [None, "residual", "skip"])
@pytest.mark.parametrize("cfg", [dict(ROWS=4, num_warps=4, PREFETCH=True, PER_SM=1),
                                 dict(ROWS=1, num_warps=4, PREFETCH=False, PER_SM=1)])
def test_a_pair_of_norms_of_one_input_matches_its_reference_and_two_norms(cfg, second, out_dtype, monkeypatch):
    """layer_norm_pair: both outputs, the stream, and every gradient (x, residual, both weights and biases) as the
    reference computes them, and as two layer_norm calls on the same rows do (37 rows: several tiles per program)."""
    from gem_kernels.ops.triton import _tuning, triton_norms

    monkeypatch.setattr(triton_norms, "_bwd_cands", lambda block_n: [cfg])
    monkeypatch.setattr(_tuning, "_TUNED", {})
    shape, N = (37, 100), 100
    x = rand(*shape)
    r = rand(*shape) if second == "residual" else None
    w1, w2 = ((1.0 + 0.1 * torch.randn(N)).requires_grad_() for _ in range(2))
    b1, b2 = rand(N), rand(N)
    inputs = [t for t in (x, r, w1, b1, w2, b2) if t is not None]
    out_t = out_dtype or torch.float32
    seeds = [torch.randn(shape).to(out_t), torch.randn(shape).to(out_t)] + ([torch.randn(shape)] if second else [])
    got = {}
    for kernel in ("triton", "pytorch", "two norms"):
        kw = dict(residual=r, skip=second == "skip", out_dtype=out_dtype)
        if kernel == "two norms":
            first = layer_norm(x, w1, b1, 1e-5, kernel="pytorch", **kw)
            first = first if isinstance(first, tuple) else (first,)
            h = first[1] if second else x
            y2 = layer_norm(h, w2, b2, 1e-5, kernel="pytorch", out_dtype=out_dtype)
            out = (first[0], y2, *first[1:])
        else:
            out = layer_norm_pair(x, (w1, b1), (w2, b2), 1e-5, kernel=kernel, **kw)
        assert len(out) == (3 if second else 2)
        assert out[0].dtype == out[1].dtype == out_t
        if second == "skip":
            assert torch.equal(out[2], x)
        got[kernel] = (out, torch.autograd.grad(out, inputs, seeds))
    for reference in ("pytorch", "two norms"):
        for a, e in zip(got["triton"][0], got[reference][0]):
            assert_close(a, e, 1e-3 if out_dtype else 1e-5, f"out vs {reference}")
        for a, e in zip(got["triton"][1], got[reference][1]):
            assert_close(a, e, 1e-3 if out_dtype else 4e-5, f"grad vs {reference}")


def test_a_pair_of_norms_needs_two_weight_bias_pairs():
    x, w = torch.randn(4, 16), torch.ones(16)
    with pytest.raises(ValueError, match=r"^layer_norm_pair: second must be a \(weight, bias\) pair of tensors"):
        layer_norm_pair(x, (w, w), (w, None))
