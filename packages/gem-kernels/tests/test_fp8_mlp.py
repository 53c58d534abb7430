"""The FP8 MLP block with producer-quantised activations: each Triton producer (interpreter on CPU) writes the
E4M3 bits that quantising its own output gives; the block against its PyTorch twin and against float32."""

import pytest
import torch
from conftest import triton_on_cpu
from gem_kernels_testing import same_fp8 as _same

from gem_kernels import Fp8Recipe, fp8_linear
from gem_kernels.fp8 import fp8_rowwise_quantize_reference
from gem_kernels.fp8_mlp import _gelu_gradient_reference, _gelu_reference, fp8_layer_norm, fp8_linear_gelu, fp8_norm_mlp


def _rel(a, b):
    return float((a.float() - b.float()).detach().norm() / b.float().detach().norm())


TRITON = Fp8Recipe(min_features=0, min_tokens=0, kernel="triton")
TWIN = Fp8Recipe(min_features=0, min_tokens=0, kernel="pytorch")


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,width,bias", [(37, 48, True), (64, 96, False)])
def test_layer_norm_writes_the_e4m3_of_its_output(rows, width, bias, dtype):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, width, generator=g) * 3).to(dtype)
    x[5, 7] = float("nan")  # a non-finite row: NaN scale, zero elements
    w = torch.randn(width, generator=g)
    b = torch.randn(width, generator=g) if bias else None
    y, (elements, scales) = fp8_layer_norm(x, w, b, 1e-5, TRITON)
    padded = -(-rows // 16) * 16  # rows padded to 16: zeros, scale 1
    assert elements.shape == (padded, width) and scales.shape == (padded, 1)
    assert _same((elements, scales), fp8_rowwise_quantize_reference(y, -1, 16))
    twin, twin_fp8 = fp8_layer_norm(x, w, b, 1e-5, TWIN)
    assert torch.allclose(y.float().nan_to_num(), twin.float().nan_to_num(), rtol=2e-3, atol=2e-3)


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gelu_and_its_gradient_write_the_e4m3_of_their_outputs(dtype):
    from gem_kernels.ops.triton.triton_fp8_gelu import triton_gelu_fp8, triton_gelu_fp8_backward

    g = torch.Generator().manual_seed(1)
    h = (torch.randn(45, 80, generator=g) * 2).to(dtype)
    a, elements, scales = triton_gelu_fp8(h, 16)
    assert torch.allclose(a.float(), _gelu_reference(h).float(), rtol=1e-3, atol=1e-6)
    assert _same((elements, scales), fp8_rowwise_quantize_reference(a, -1, 16))
    da = torch.randn(45, 80, generator=g).to(dtype)
    dh, elements, scales = triton_gelu_fp8_backward(da, h, 16)
    assert torch.allclose(dh.float(), _gelu_gradient_reference(da, h).float(), rtol=1e-3, atol=1e-5)
    hf = h.float().requires_grad_()
    (autograd,) = torch.autograd.grad(torch.nn.functional.gelu(hf), hf, da.float())
    assert torch.allclose(_gelu_gradient_reference(da.float(), hf.detach()), autograd, rtol=1e-5, atol=1e-6)
    assert _same((elements, scales), fp8_rowwise_quantize_reference(dh, -1, 16))


def _block_inputs(rows=50, width=64, hidden=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g, requires_grad=True)
    params = [torch.randn(width, generator=g).add_(1).requires_grad_(), torch.randn(width, generator=g).requires_grad_(),
              (torch.randn(hidden, width, generator=g) / width**0.5).requires_grad_(), torch.randn(hidden, generator=g).requires_grad_(),
              (torch.randn(width, hidden, generator=g) / hidden**0.5).requires_grad_(), torch.randn(width, generator=g).requires_grad_()]
    return x, params, torch.randn(rows, width, generator=g)


def _block(x, params, recipe, emulate):
    nw, nb, w1, b1, w2, b2 = params
    return fp8_norm_mlp(x, nw, nb, 1e-5, w1, b1, w2, b2, recipe, emulate=emulate)


def _exact(x, params):
    nw, nb, w1, b1, w2, b2 = params
    n = torch.nn.functional.layer_norm(x, (x.shape[-1],), nw, nb, 1e-5)
    return torch.nn.functional.gelu(n @ w1.t() + b1) @ w2.t() + b2


@triton_on_cpu
@pytest.mark.parametrize("weight_gradient", ["high", "fp8"])
def test_fp8_norm_mlp_matches_its_twin_and_stays_near_float32(weight_gradient):
    x, params, g = _block_inputs()
    inputs = [x, *params]
    results = {}
    for name, fn in [("triton", lambda: _block(x, params, Fp8Recipe(weight_gradient, 0, 0, "triton"), True)),
                     ("twin", lambda: _block(x, params, Fp8Recipe(weight_gradient, 0, 0, "pytorch"), True)),
                     ("scaled_mm", lambda: _block(x, params, Fp8Recipe(weight_gradient, 0, 0, "pytorch"), False)),
                     ("exact", lambda: _exact(x, params))]:
        y = fn()
        assert y.shape == x.shape and y.dtype == torch.float32
        results[name] = (y, *torch.autograd.grad(y, inputs, g))
    for triton, twin, scaled, exact in zip(*(results[k] for k in ("triton", "twin", "scaled_mm", "exact"))):
        # the same quantised operands up to the producers' last-bit differences (erf, reduction order)
        assert _rel(triton, twin) < 2e-2
        assert _rel(scaled, twin) < 2e-2  # torch._scaled_mm against the emulated product
        assert _rel(triton, exact) < 0.1  # E4M3 keeps 3 mantissa bits


def test_fp8_norm_mlp_of_leading_dims_and_the_quantised_input_path():
    """[..., K] inputs flatten and come back; ``x_fp8`` from a producer gives what quantising x gives."""
    x, params, _ = _block_inputs(rows=24)
    y = _block(x.detach().view(2, 12, 64), params, TWIN, True)
    assert y.shape == (2, 12, 64) and torch.allclose(y.view(24, 64), _block(x.detach(), params, TWIN, True))
    w = params[2].detach()
    n, n_fp8 = fp8_layer_norm(x.detach(), params[0].detach(), params[1].detach(), 1e-5, TWIN)
    assert torch.equal(fp8_linear(n, w, TWIN, x_fp8=n_fp8), fp8_linear(n, w, TWIN))
    a, _ = fp8_linear_gelu(n, w, None, TWIN, x_fp8=n_fp8)
    assert a.shape == (24, 96)


def test_quantised_inputs_of_the_wrong_shape_are_refused():
    x = torch.randn(20, 32)
    w = torch.randn(16, 32)
    elements, scales = fp8_rowwise_quantize_reference(x, -1, 1)  # rows not padded to 16
    with pytest.raises(ValueError, match=r"x_fp8 must be E4M3 elements \[32, 32\]"):
        fp8_linear(x, w, TWIN, x_fp8=(elements, scales))
    with pytest.raises(ValueError, match="x \\[M, K\\] and weight \\[N, K\\]"):
        fp8_linear_gelu(x, torch.randn(16, 48), None, TWIN)
    with pytest.raises(ValueError, match=r"fp8_linear_gelu: bias must be \[16\], got \(32,\)"):
        fp8_linear_gelu(x, w, torch.zeros(32), TWIN)
    with pytest.raises(ValueError, match="weight must be 1-D of size 32"):
        fp8_layer_norm(x, torch.ones(48), None, 1e-5, TWIN)


@triton_on_cpu
def test_no_zero_gradients_are_made_for_the_e4m3_outputs():
    """The producers' E4M3 outputs are constants to autograd: their gradients are not materialised (an [M, N]
    zero fill each in the backward, ~2% of the block's FP8 time on the H200), and the gradients are unchanged."""
    from torch.profiler import ProfilerActivity, profile

    # NOTE: deterministic algorithms (a trainer test may leave them on in this process) take other paths and fill
    # every new tensor: this test runs without them
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(37, 48, generator=g, requires_grad=True)  # E4M3 rows padded to 48
        nw, nb = torch.randn(48, generator=g).requires_grad_(), torch.randn(48, generator=g).requires_grad_()
        w = (torch.randn(80, 48, generator=g) / 48**0.5).requires_grad_()
        e4m3_shapes = [[48, 48], [48, 80], [48, 1]]
        grads = {}
        for kernel in ("triton", "pytorch"):
            recipe = Fp8Recipe("high", 0, 0, kernel)
            n, n_fp8 = fp8_layer_norm(x, nw, nb, 1e-5, recipe)
            a, a_fp8 = fp8_linear_gelu(n, w, None, recipe, x_fp8=n_fp8)
            assert [list(t.shape) for t in (*n_fp8, a_fp8[0])] == [[48, 48], [48, 1], [48, 80]]
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                grads[kernel] = torch.autograd.grad(a.square().sum(), [x, nw, nb, w])
            if kernel == "triton":
                fills = [(e.name, e.input_shapes) for e in prof.events() if e.name in (
                    "aten::zeros_like", "aten::zero_", "aten::fill_") and e.input_shapes[:1] in ([s] for s in e4m3_shapes)]
                assert not fills, fills
    finally:
        torch.use_deterministic_algorithms(deterministic)
    for got, ref in zip(grads["triton"], grads["pytorch"]):
        assert _rel(got, ref) < 2e-2


@triton_on_cpu
def test_a_norm_with_e4m3_rows_whose_output_reaches_no_loss():
    """With the E4M3 outputs' gradients unmaterialised, a norm whose output reaches no loss (only its residual sum
    does) gets no gradient for it: the sum's gradient passes through alone."""
    from gem_kernels.ops.triton.triton_norms import triton_layer_norm

    g = torch.Generator().manual_seed(4)
    x, r = (torch.randn(37, 48, generator=g, requires_grad=True) for _ in range(2))
    y, h, elements, scales = triton_layer_norm(x, torch.ones(48), None, 1e-5, residual=r, fp8_rows_to=16)
    assert elements.shape == (48, 48) and torch.equal(h, x + r)
    c = torch.randn(37, 48, generator=g)
    dx, dr = torch.autograd.grad((h * c).sum(), [x, r])
    assert torch.equal(dx, c) and torch.equal(dr, c)
