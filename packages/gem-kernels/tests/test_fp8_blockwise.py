"""Blockwise FP8 (1 x 128, 128 x 128 and 128 x 1 blocks): the Triton quantisation (interpreter on CPU) against the
reference, bit for bit; the reference's rules, block by block; the blockwise FP8 linear against its emulated twin and
float32; what takes only rowwise scales refuses blockwise ones."""

import pytest
import torch
from conftest import triton_on_cpu
from gem_kernels_testing import awkward_fp8_input as _awkward
from gem_kernels_testing import same_fp8 as _same

from gem_kernels import Fp8Linear, Fp8Recipe, convert_to_low_precision, fp8_blockwise_dequantize, fp8_blockwise_quantize
from gem_kernels.fp8 import blockwise_shapes, fp8_blockwise_quantize_reference, fp8_rowwise_quantize_reference
from gem_kernels.fp8_linear import fp8_linear
from gem_kernels.fp8_mlp import fp8_linear_gelu, fp8_norm_mlp

BLOCKS = [(1, 128), (128, 128), (128, 1)]


def _rel(a, b):
    return float((a.float() - b.float()).detach().norm() / b.float().detach().norm())


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("shape,rows_to,transpose", [
    ((130, 256), 1, False),  # a partial block of rows
    ((130, 256), 16, True),
    ((64, 200), 128, False),  # a partial block of columns, rows padded to a whole block
    ((300, 384), 128, True),
])
def test_triton_blockwise_quantisation_gives_the_reference_bits(block, shape, rows_to, transpose, dtype):
    x = _awkward(shape, dtype, seed=shape[0] + shape[1])
    fast = fp8_blockwise_quantize(x, block, rows_to, transpose, kernel="triton")
    reference = fp8_blockwise_quantize_reference(x, block, rows_to, transpose)
    assert _same(fast, reference)
    elements_shape, scales_shape = blockwise_shapes(shape, block, rows_to, transpose)
    assert fast[0].shape == elements_shape and fast[1].shape == scales_shape
    assert fast[1].stride() == reference[1].stride()  # laid out as the scaled GEMM reads them
    # a strided view quantises as its contiguous copy
    assert _same(fp8_blockwise_quantize(x.t().contiguous().t(), block, rows_to, transpose, kernel="triton"), fast)


def test_each_block_follows_the_rowwise_rule_on_its_own_values():
    x = _awkward((256, 256), torch.float32, seed=3)
    x[130:140, 10] = 1e30  # an outlier in one 128 x 128 block / in a few 1 x 128 blocks
    for block in BLOCKS:
        elements, scales = fp8_blockwise_quantize_reference(x, block)
        br, bc = block
        for i in range(scales.shape[0]):
            for j in range(scales.shape[1]):
                values = x[i * br : (i + 1) * br, j * bc : (j + 1) * bc].reshape(1, -1)
                q, s = fp8_rowwise_quantize_reference(values, -1)  # the block as one row
                got_q = elements[i * br : (i + 1) * br, j * bc : (j + 1) * bc].reshape(1, -1)
                assert _same((got_q, scales[i, j].reshape(1, 1)), (q, s)), (block, i, j)
    # scales laid out as the scaled GEMM reads them: 1 x 128 column-major, 128 x 128 row-major
    assert fp8_blockwise_quantize_reference(x, (1, 128))[1].stride() == (1, 256)
    assert fp8_blockwise_quantize_reference(x, (128, 128))[1].stride() == (2, 1)


def test_non_finite_values_spoil_their_block_only_and_padding_is_zero():
    x = torch.randn(140, 256)
    x[3, 200] = float("nan")
    x[129, 5] = float("inf")
    elements, scales = fp8_blockwise_quantize_reference(x, (128, 128), rows_to=16)
    assert elements.shape == (144, 256) and scales.shape == (2, 2)
    assert torch.isnan(scales[0, 1]) and torch.isnan(scales[1, 0]) and torch.isfinite(scales[[0, 1], [0, 1]]).all()
    assert (elements[:128, 128:].float() == 0).all() and (elements[128:, :128].float() == 0).all()
    assert (elements[140:].float() == 0).all()  # the padded rows
    values = fp8_blockwise_dequantize(elements, scales, (128, 128))
    assert torch.isnan(values[3, 200]) and torch.isfinite(values[:128, :128]).all()
    error = (values[:128, :128] - x[:128, :128]).abs()
    assert (error <= x[:128, :128].abs() * 2.0**-4 + 2.0**-9 * scales[0, 0]).all()  # half an E4M3 ulp, or subnormal
    zeros, zero_scales = fp8_blockwise_quantize_reference(torch.zeros(4, 128), (1, 128))
    assert (zeros.float() == 0).all() and torch.isfinite(zero_scales).all()


def test_transposed_blocks_are_the_transposes_blocks():
    x = torch.randn(200, 256)
    padded = torch.cat([x, torch.zeros(56, 256)])
    # x^T in 1 x 128 blocks along the tokens (the weight gradient's operand) from x's 128 x 1 blocks
    assert _same(fp8_blockwise_quantize_reference(x, (128, 1), rows_to=128, transpose=True),
                 fp8_blockwise_quantize_reference(padded.t().contiguous(), (1, 128)))
    # 128 x 128 blocks: the transposed weight takes the same blocks, transposed
    w = torch.randn(384, 256)
    elements, scales = fp8_blockwise_quantize_reference(w, (128, 128))
    assert _same((elements.t().contiguous(), scales.t().contiguous()),
                 fp8_blockwise_quantize_reference(w.t().contiguous(), (128, 128)))


def test_blockwise_quantisation_rejects_what_it_cannot_take():
    for kernel in ("pytorch", "triton"):
        with pytest.raises(ValueError, match="block must be one of"):
            fp8_blockwise_quantize(torch.zeros(4, 128), (1, 32), kernel=kernel)
        with pytest.raises(ValueError, match="2-D float tensor"):
            fp8_blockwise_quantize(torch.zeros(2, 3, 128), (1, 128), kernel=kernel)
        with pytest.raises(ValueError, match="rows_to must be a positive int, got 0"):
            fp8_blockwise_quantize(torch.zeros(4, 128), (1, 128), rows_to=0, kernel=kernel)
    # scales of other blocks would dequantise to a tensor of the right shape and wrong values
    elements, scales = fp8_blockwise_quantize(torch.randn(256, 256), (1, 128))
    with pytest.raises(ValueError, match=r"^fp8_blockwise_dequantize: 256 x 256 elements in 128 x 128 blocks take 2 x 2 "
                                         r"scales, got scales of shape \(256, 2\)$"):
        fp8_blockwise_dequantize(elements, scales, (128, 128))
    with pytest.raises(ValueError, match="fp8_blockwise_dequantize: block must be one of"):
        fp8_blockwise_dequantize(elements, scales, (1, 64))


@triton_on_cpu
@pytest.mark.parametrize("weight_gradient", ["high", "fp8"])
def test_blockwise_fp8_linear_matches_its_twin_and_stays_near_float32(weight_gradient):
    torch.manual_seed(0)
    x = torch.randn(203, 256, requires_grad=True)  # 203 rows: padded to 16 (forward) and 128 (weight gradient)
    w = (torch.randn(128, 256) * 0.1).requires_grad_()
    b = torch.randn(128, requires_grad=True)
    g = torch.randn(203, 128)
    fast_recipe = Fp8Recipe(weight_gradient=weight_gradient, scaling="blockwise", min_features=0, min_tokens=0,
                            kernel="triton")
    results = {}
    for name, fn in [("fast", lambda: fp8_linear(x, w, fast_recipe, bias=b)),
                     ("twin", lambda: fp8_linear(x, w, Fp8Recipe(weight_gradient=weight_gradient, scaling="blockwise"),
                                                 emulate=True, bias=b)),
                     ("exact", lambda: x @ w.t() + b)]:
        y = fn()
        assert y.dtype == torch.float32 and y.shape == (203, 128)
        results[name] = (y, *torch.autograd.grad(y, (x, w, b), g))
    for fast, twin, exact in zip(results["fast"], results["twin"], results["exact"]):
        assert torch.equal(fast, twin)  # the Triton quantiser's bits and, without a block-scaled GEMM, the same product
        assert _rel(fast, exact) < 0.1  # E4M3 keeps 3 mantissa bits
    if weight_gradient == "high":
        assert torch.allclose(results["fast"][2], results["exact"][2], rtol=1e-5, atol=1e-5)


def test_blocks_keep_an_outlier_from_coarsening_its_whole_row():
    torch.manual_seed(1)
    x = torch.randn(64, 512)
    x[:, 0] *= 1e6  # one outlier channel, beyond E4M3's range of the others: a row scale flushes them
    w = torch.randn(128, 512) * 0.05
    w[:, :128] = 0.0  # the product reads only the channels outside the outlier's block
    exact = x @ w.t()
    errors = {}
    for scaling in ("rowwise", "blockwise"):
        y = fp8_linear(x, w, Fp8Recipe(scaling=scaling, min_features=0, min_tokens=0), emulate=True)
        errors[scaling] = _rel(y, exact)
    assert errors["blockwise"] < 0.05 < errors["rowwise"]  # E4M3's error, against channels flushed towards zero


def test_blockwise_recipe_converts_layers_of_whole_blocks_and_refuses_rowwise_producers():
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 48), torch.nn.Linear(48, 128),
                                torch.nn.Linear(128, 144))
    recipe = Fp8Recipe(scaling="blockwise", min_features=0, min_tokens=0)
    assert convert_to_low_precision(model, recipe, keep=lambda name: False) == ["0"]
    assert isinstance(model[0], Fp8Linear) and "fp8 blockwise" in repr(model[0])
    with pytest.raises(ValueError, match="multiples of 128"):
        fp8_linear(torch.randn(4, 144), torch.randn(128, 144), recipe)
    with pytest.raises(ValueError, match="blockwise recipe quantises x itself"):
        x = torch.randn(16, 128)
        fp8_linear(x, torch.randn(128, 128), recipe, x_fp8=fp8_rowwise_quantize_reference(x, -1, rows_to=16))
    with pytest.raises(ValueError, match="scaling must be 'rowwise' or 'blockwise'"):
        Fp8Recipe(scaling="tensorwise")
    x = torch.randn(32, 128)
    with pytest.raises(ValueError, match="fp8_norm_mlp: its producers write rowwise E4M3"):
        fp8_norm_mlp(x, torch.ones(128), None, 1e-5, torch.randn(128, 128), None, torch.randn(128, 128), None, recipe)
    with pytest.raises(ValueError, match="fp8_linear_gelu: its producers write rowwise E4M3"):
        fp8_linear_gelu(x, torch.randn(128, 128), None, recipe)


@pytest.mark.parametrize("m,k,n", [(256, 512, 512), (203, 384, 640), (300, 2048, 1408), (64, 128, 128)])
def test_the_block_scaled_gemm_takes_the_arguments_of_each_product(m, k, n, monkeypatch):
    """The three products' ``scaled_mm`` arguments (forward 1 x 128 by 128 x 128, input gradient the same with the
    weight's blocks transposed, weight gradient 1 x 128 by 1 x 128 along the tokens) pass the block-scaled GEMM's
    layout checks, which torch's meta kernel applies as on CUDA (contraction blocks not a multiple of 4 included)."""
    import importlib

    from torch.nn import functional as F

    module = importlib.import_module("gem_kernels.fp8_linear")  # the module (the package exports its function)

    products, blockwise_gemm = [], module._blockwise_gemm

    def recorded(a, a_scale, a_block, b, b_scale, b_block, emulate, bias=None):
        products.append((a, a_scale, a_block, b, b_scale, b_block))
        return blockwise_gemm(a, a_scale, a_block, b, b_scale, b_block, emulate, bias)

    monkeypatch.setattr(module, "_blockwise_gemm", recorded)
    x = torch.randn(m, k, requires_grad=True)
    w = (torch.randn(n, k) * 0.05).requires_grad_()
    y = fp8_linear(x, w, Fp8Recipe(weight_gradient="fp8", scaling="blockwise", min_features=0, min_tokens=0))
    y.backward(torch.randn_like(y))
    assert [(p[2], p[5]) for p in products] == [((1, 128), (128, 128)), ((1, 128), (128, 128)), ((1, 128), (1, 128))]

    def meta(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    for a, a_scale, a_block, b, b_scale, b_block in products:
        arguments = module.scaled_mm_arguments(meta(a), meta(a_scale), a_block, meta(b), meta(b_scale), b_block)
        out = F.scaled_mm(*arguments, output_dtype=torch.bfloat16)
        assert out.shape == (a.shape[0], b.shape[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the block-scaled GEMM needs a CUDA device")
def test_block_scaled_gemm_on_the_gpu_matches_the_dequantised_product():
    torch.manual_seed(0)
    x = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(2048, 1024, device="cuda") * 0.03).to(torch.bfloat16).requires_grad_()
    g = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    recipe = Fp8Recipe(weight_gradient="fp8", scaling="blockwise", min_features=0, min_tokens=0)
    fast = fp8_linear(x, w, recipe)
    twin = fp8_linear(x, w, recipe, emulate=True)
    for a, b in zip((fast, *torch.autograd.grad(fast, (x, w), g)), (twin, *torch.autograd.grad(twin, (x, w), g))):
        assert _rel(a, b) < 1e-2  # the same operands: accumulation order and bf16 rounding differ
