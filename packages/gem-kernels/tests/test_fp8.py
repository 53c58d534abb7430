"""Rowwise FP8: the Triton quantisation (interpreter on CPU) against the reference, bit for bit; the reference's
rules; the FP8 linear (``torch._scaled_mm``, which takes rowwise scales on CPU too from torch 2.13 on) against its
emulated twin; the swap."""

import importlib

import pytest
import torch
from conftest import triton_on_cpu
from gem_kernels_testing import awkward_fp8_input as _awkward
from gem_kernels_testing import record_launches
from gem_kernels_testing import same_fp8 as _same

from gem_kernels import Fp8Linear, Fp8Recipe, convert_to_low_precision, fp8_dequantize, fp8_linear, fp8_rowwise_quantize
from gem_kernels.fp8 import fp8_rowwise_quantize_reference
from gem_kernels.mx import FORMATS, _blocks, shared_exponents


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape,dim,rows_to,cols_to", [
    ((37, 48), -1, 16, 1),  # one pass, kept dimension padded
    ((37, 48), 0, 1, 16),  # chunked (a column's rows), reduced dimension padded
    ((70, 300), -1, 1, 1),
    ((300, 70), 0, 16, 16),  # several chunks along the reduced dimension
    ((5, 9000), -1, 16, 1),  # wider than one pass holds: chunked
])
def test_triton_quantisation_gives_the_reference_bits(shape, dim, rows_to, cols_to, dtype):
    x = _awkward(shape, dtype, seed=shape[0])
    fast = fp8_rowwise_quantize(x, dim, rows_to, cols_to, kernel="triton")
    assert _same(fast, fp8_rowwise_quantize_reference(x, dim, rows_to, cols_to))
    # a strided view quantises as its contiguous copy
    assert _same(fp8_rowwise_quantize(x.t().contiguous().t(), dim, rows_to, cols_to, kernel="triton"), fast)


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape,dim", [((300, 70), 0), ((70, 300), -1)])
def test_triton_quantisation_placed_gives_the_reference_bits(shape, dim, dtype):
    """The output's reduced dimension placed (each output column's input column, -1: zeros): the same bits as the
    reference, whose placed columns are the plain quantisation's."""
    x = _awkward(shape, dtype, seed=1)
    reduced = shape[dim]
    positions = torch.randperm(reduced + 50, generator=torch.Generator().manual_seed(0))[:reduced].sort().values
    placed = torch.full((reduced + 64,), -1).index_copy_(0, positions, torch.arange(reduced))
    fast = fp8_rowwise_quantize(x, dim, kernel="triton", placed=placed)
    reference = fp8_rowwise_quantize_reference(x, dim, placed=placed)
    assert fast[0].shape == (shape[1 - dim % 2], reduced + 64) and _same(fast, reference)
    assert _same((reference[0][:, positions], reference[1]), fp8_rowwise_quantize_reference(x, dim))
    assert not reference[0][:, placed < 0].float().any()
    with pytest.raises(ValueError, match="cols_to must stay 1"):
        fp8_rowwise_quantize(x, dim, cols_to=16, placed=placed)
    with pytest.raises(ValueError, match="placed must be a 1-D int64 map"):
        fp8_rowwise_quantize(x, dim, placed=placed.int())


def test_reference_rules_scales_saturation_non_finite_and_padding():
    x = _awkward((24, 64), torch.float32, seed=1)
    q, s = fp8_rowwise_quantize_reference(x, -1, rows_to=32)
    assert q.shape == (32, 64) and s.shape == (32, 1)
    finite = torch.isfinite(x).all(1)
    # the scale is the smallest power of two bringing the row within 448: MX's "rceil" rule over the whole row
    exponent, _ = shared_exponents(_blocks(x[finite], -1, 64)[0], FORMATS["e4m3"], "rceil")
    expected = torch.exp2(exponent.float().squeeze(-1).clamp(min=-126))
    nonzero = x[finite].abs().amax(1) > 0
    assert torch.equal(s[:24][finite].squeeze(1)[nonzero], expected[nonzero])
    values = fp8_dequantize(q[:24], s[:24])
    assert (q[:24][finite].float().abs() <= 448).all()
    err = (values[finite] - x[finite]).abs()
    assert (err <= x[finite].abs() * 2.0**-4 + 2.0**-9 * s[:24][finite]).all()  # half an E4M3 ulp, or subnormal
    assert torch.isnan(s[1]) and torch.isnan(s[2]) and (q[1].float() == 0).all() and (q[2].float() == 0).all()
    assert (q[0].float() == 0).all() and torch.isfinite(s[0]).all()
    assert (q[24:].float() == 0).all() and (s[24:] == 1).all()
    # along dim 0: the transpose's rows
    qt, st = fp8_rowwise_quantize_reference(x, 0)
    assert _same((qt, st), fp8_rowwise_quantize_reference(x.t().contiguous(), -1))


def test_quantisation_rejects_what_it_cannot_take():
    with pytest.raises(ValueError, match="2-D float tensor"):
        fp8_rowwise_quantize(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="2-D float tensor"):
        fp8_rowwise_quantize(torch.zeros(2, 3, dtype=torch.int64))
    for kernel in ("pytorch", "triton"):
        with pytest.raises(ValueError, match="dim must be 0 or 1"):
            fp8_rowwise_quantize(torch.zeros(2, 3), dim=2, kernel=kernel)
        with pytest.raises(ValueError, match=r"^fp8 rowwise quantisation: rows_to must be a positive int, got 0$"):
            fp8_rowwise_quantize(torch.zeros(2, 3), rows_to=0, kernel=kernel)
        # a map narrower than the input would drop columns (and the kernels would write past their buffers)
        with pytest.raises(ValueError, match=r"^fp8 rowwise quantisation: placed \(128 columns\) must place each of the "
                                             r"256 input columns along dim 0$"):
            fp8_rowwise_quantize(torch.zeros(256, 8), 0, placed=torch.arange(128), kernel=kernel)
    q, s = fp8_rowwise_quantize(torch.randn(8, 8), -1)
    with pytest.raises(ValueError, match=r"^fp8_dequantize: scale must be \[rows, 1\] = \[8, 1\] \(one per row\), "
                                         r"got shape \(8,\)$"):
        fp8_dequantize(q, s.flatten())  # would scale columns


@pytest.mark.parametrize("weight_gradient", ["high", "fp8"])
def test_fp8_linear_takes_a_call_without_tokens(weight_gradient):
    """An expert given no rows still runs: no tokens give an empty output and zero weight and bias gradients."""
    linear = torch.nn.Linear(64, 32)
    layer = Fp8Linear.from_linear(linear, Fp8Recipe(weight_gradient=weight_gradient, min_features=0, min_tokens=0))
    x = torch.zeros(2, 0, 64, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == (2, 0, 32) and x.grad.shape == x.shape
    assert not linear.weight.grad.any() and not linear.bias.grad.any()


def test_fp8_linear_runs_where_the_cpu_scaled_gemm_takes_one_scale_per_tensor_only(monkeypatch):
    """torch 2.11's CPU ``_scaled_mm`` refuses rowwise scales (an internal assert): the product is then the
    dequantised operands', the emulated twin's, and the layer trains as that twin."""
    module = importlib.import_module("gem_kernels.fp8_linear")  # the package's fp8_linear is the function

    scaled_mm = torch._scaled_mm

    def per_tensor_only(a, b, scale_a, scale_b, **kwargs):
        if a.device.type == "cpu" and (scale_a.numel() > 1 or scale_b.numel() > 1):
            raise RuntimeError("Now _scaled_mm only supports per-tensor scaling for CPU backend.")
        return scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", per_tensor_only)
    module._rowwise_scaled_mm_on.cache_clear()
    try:
        recipe = Fp8Recipe(weight_gradient="fp8", min_features=0, min_tokens=0, kernel="pytorch")
        x = torch.randn(40, 64, requires_grad=True)
        w = (torch.randn(48, 64) * 0.1).requires_grad_()
        b = torch.randn(48, requires_grad=True)
        g = torch.randn(40, 48)
        fast = fp8_linear(x, w, recipe, bias=b)
        twin = fp8_linear(x, w, recipe, emulate=True, bias=b)
        assert torch.equal(fast, twin)
        for got, want in zip(torch.autograd.grad(fast, (x, w, b), g), torch.autograd.grad(twin, (x, w, b), g)):
            assert torch.equal(got, want)
    finally:
        module._rowwise_scaled_mm_on.cache_clear()  # the real torch's answer for the tests after this one


@pytest.mark.parametrize("weight_gradient", ["high", "fp8"])
def test_fp8_linear_matches_its_emulated_twin_and_stays_near_float32(weight_gradient):
    torch.manual_seed(0)
    recipe = Fp8Recipe(weight_gradient=weight_gradient, min_features=0, min_tokens=0)
    x = torch.randn(203, 64, requires_grad=True)  # 203 rows: the token count is padded to 16 inside
    w = (torch.randn(48, 64) * 0.1).requires_grad_()
    g = torch.randn(203, 48)
    results = {}
    for name, fn in [("fast", lambda: fp8_linear(x, w, recipe)), ("twin", lambda: fp8_linear(x, w, recipe, emulate=True)),
                     ("exact", lambda: x @ w.t())]:
        y = fn()
        assert y.dtype == torch.float32 and y.shape == (203, 48)
        results[name] = (y, *torch.autograd.grad(y, (x, w), g))

    def rel(a, b):
        return float((a - b).detach().norm() / b.detach().norm())

    for fast, twin, exact in zip(results["fast"], results["twin"], results["exact"]):
        assert rel(fast, twin) < 1e-2  # the same operands: only accumulation order and bf16 rounding differ
        assert rel(fast, exact) < 0.1  # E4M3 keeps 3 mantissa bits
    if weight_gradient == "high":  # the weight gradient is the plain product
        assert torch.allclose(results["fast"][2], results["exact"][2], rtol=1e-5, atol=1e-5)


def test_fp8_linear_rejects_unaligned_features():
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_linear(torch.randn(4, 40), torch.randn(32, 40))
    with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[N, K\]"):
        fp8_linear(torch.randn(4, 32), torch.randn(32, 48))
    with pytest.raises(ValueError, match="weight_gradient"):
        Fp8Recipe(weight_gradient="e5m2")
    with pytest.raises(ValueError, match=r"^Fp8Recipe\.kernel must be 'auto', 'triton' or 'pytorch', got 'tritonn'$"):
        Fp8Recipe(kernel="tritonn")


def test_swap_converts_wide_aligned_layers_only_and_short_calls_run_plain():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 40),
                                torch.nn.Linear(40, 64), torch.nn.Linear(64, 64))
    reference = [p.detach().clone() for p in model.parameters()]
    recipe = Fp8Recipe(min_features=64, min_tokens=32)
    converted = convert_to_low_precision(model, recipe, keep=lambda name: name == "4")
    assert converted == ["0"]  # 2 and 3 have 40 features (below 64, not a multiple of 16); 4 is kept
    assert isinstance(model[0], Fp8Linear) and all(type(model[i]) is torch.nn.Linear for i in (2, 3, 4))
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), reference))
    short = torch.randn(2, 8, 64)  # 16 rows: below min_tokens, a plain linear
    assert torch.equal(model[0](short), torch.nn.functional.linear(short, reference[0], reference[1]))
    long = torch.randn(4, 10, 64)
    y = model[0](long)
    exact = torch.nn.functional.linear(long, reference[0], reference[1])
    assert y.shape == exact.shape and not torch.equal(y, exact) and float((y - exact).norm() / exact.norm()) < 0.1
    y.sum().backward()
    assert model[0].weight.grad is not None and model[0].bias.grad is not None


# --- FP8 attention forward -----------------------------------------------------------------------------------------

def _jagged_qkv(lengths, heads=2, dim=32, dtype=torch.float32):
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    q, k, v = (torch.randn(int(offsets[-1]), heads, dim).to(dtype) for _ in range(3))
    return q, k, v, offsets


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@triton_on_cpu
@pytest.mark.parametrize("mask", [{}, {"causal": True}])
def test_fp8_attention_kernel_alone_on_prepared_inputs_gives_the_calls_output(mask):
    """bench_fp8's kernel-only row: the kernel on operands quantised beforehand, the same output as the call."""
    from gem_kernels import jagged_flash_attention
    from gem_kernels.ops.benchmarks.bench_fp8 import fp8_kernel_alone

    q, k, v, offsets = _jagged_qkv([5, 40, 17, 64, 1])
    out, lse = fp8_kernel_alone(q, k, v, offsets, 64, mask)()
    assert lse.shape == q.shape[:2]
    assert torch.equal(out, jagged_flash_attention(q, k, v, offsets, 64, kernel="triton", fp8=True, **mask))


@triton_on_cpu
@pytest.mark.parametrize("mask", [{}, {"causal": True}])
def test_fp8_attention_descriptor_loads_equal_pointer_loads(mask, monkeypatch):
    """K's and V^T's tiles through tensor descriptors give the pointer loads' output and log-sum-exp bit for bit,
    tiles crossing a sequence's end (into the next sequence's keys and V^T columns) included: a NaN key there stays
    out of the sequence before it."""
    from gem_kernels.ops.benchmarks.bench_fp8 import fp8_kernel_alone
    from gem_kernels.ops.triton import _tuning, triton_attention

    q, k, v, offsets = _jagged_qkv([5, 40, 17, 64, 1, 33], dtype=torch.float16)
    k[45] = float("nan")  # sequence 2's first key, read by sequence 1's last tile (rows 5..44, tiles of 32)
    launched = record_launches(monkeypatch, lambda kernel, consts: consts.get("TMA"))
    results = {}
    for tma in (True, False):
        monkeypatch.setattr(triton_attention, "TMA_LOADS", tma)
        monkeypatch.setattr(_tuning, "_TUNED", {})
        launched.clear()
        results[tma] = fp8_kernel_alone(q, k, v, offsets, 64, mask)()
        assert launched[-1] is tma  # the attention kernel's launch, after the quantisers'
    for got, want in zip(results[True], results[False]):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)) and torch.equal(got.isnan(), want.isnan())
    assert results[True][0][:45].isfinite().all() and results[True][0][45:].isnan().any()


@triton_on_cpu
@pytest.mark.parametrize("starts_given", [False, True])
@pytest.mark.parametrize("lengths", [[5, 40, 0, 17, 64, 1], [16], [0, 0, 3], [1] * 70 + [1100]])
def test_sequence_aligned_layout_kernel_gives_the_reference_layout(lengths, starts_given, monkeypatch):
    """Every sequence starts at a multiple of 16, its tokens in order, -1 elsewhere; one Triton launch gives the
    reference's layout (sequences before a program summed in blocks: the last case needs two), and so does the
    launch after a cumulative sum of the starts (batches of more than IN_KERNEL_STARTS_MAX sequences)."""
    from gem_kernels.fp8 import sequence_aligned_layout
    from gem_kernels.ops.triton import triton_fp8

    if starts_given:
        monkeypatch.setattr(triton_fp8, "IN_KERNEL_STARTS_MAX", 0)

    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    total = int(offsets[-1])
    starts, token = sequence_aligned_layout(offsets, total, kernel="pytorch")
    spans = [-(-n // 16) * 16 for n in lengths]
    assert starts.tolist() == [sum(spans[:b]) for b in range(len(lengths))]
    assert token.shape[0] == -(-(total + 15 * len(lengths)) // 16) * 16
    expected = torch.full_like(token, -1)
    for s, first, n in zip(starts.tolist(), offsets.tolist(), lengths):
        expected[s : s + n] = torch.arange(first, first + n)
    assert torch.equal(token, expected)
    fast_starts, fast_token = sequence_aligned_layout(offsets, total, kernel="triton")
    assert torch.equal(fast_starts, starts) and torch.equal(fast_token, token)


@triton_on_cpu
def test_fp8_attention_operands_with_sequence_aligned_v_hold_the_same_values():
    """V^T laid out with every sequence at a multiple of 16 (the kernel's wide loads) holds the dense layout's
    values and scales, zeros between sequences, and dequantises to the same V."""
    from gem_kernels.fp8 import fp8_attention_dequantize, fp8_attention_operands, sequence_aligned_layout

    q, k, v, offsets = _jagged_qkv([5, 40, 0, 17, 64, 1])
    _, placed = sequence_aligned_layout(offsets, q.shape[0], kernel="pytorch")
    dense = fp8_attention_operands(q, k, v, kernel="pytorch")
    aligned = fp8_attention_operands(q, k, v, kernel="pytorch", v_placed=placed)
    fast = fp8_attention_operands(q, k, v, kernel="triton", v_placed=placed)
    assert all(_same(a, b) for a, b in zip(fast, aligned))
    (vt8, vs), (vt8_aligned, vs_aligned) = dense[2], aligned[2]
    assert vt8_aligned.shape == (q.shape[1] * q.shape[2], placed.shape[0]) and torch.equal(vs_aligned, vs)
    held = placed >= 0
    assert torch.equal(vt8_aligned[:, held].view(torch.uint8), vt8.view(torch.uint8))
    assert not vt8_aligned[:, ~held].float().any()
    for x, y in zip(fp8_attention_dequantize(dense, q.shape, torch.float32, kernel="pytorch"),
                    fp8_attention_dequantize(aligned, q.shape, torch.float32, placed, kernel="pytorch")):
        assert torch.equal(x, y)


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("aligned", [False, True])
def test_fp8_attention_dequantisation_kernels_give_the_reference_bits(aligned, dtype):
    """One Triton pass per operand (V^T transposed back, gathered from its sequence-aligned columns): the
    reference's bits, a NaN scale's row included; float16 rounds the same as torch's conversion."""
    from gem_kernels.fp8 import fp8_attention_dequantize, fp8_attention_operands, sequence_aligned_layout

    q, k, v, offsets = _jagged_qkv([5, 40, 0, 17, 64, 1], dim=32)
    v[3, 1, 2] = float("nan")  # its channel's scale is NaN: that whole channel dequantises to NaN
    q = q * 2.0 ** 20  # beyond float16: infinities after rounding, as torch's conversion gives them
    placed = sequence_aligned_layout(offsets, q.shape[0], kernel="pytorch")[1] if aligned else None
    operands = fp8_attention_operands(q, k, v, kernel="pytorch", v_placed=placed)
    fast = fp8_attention_dequantize(operands, q.shape, dtype, placed, kernel="triton")
    reference = fp8_attention_dequantize(operands, q.shape, dtype, placed, kernel="pytorch")
    for name, f, r in zip("qkv", fast, reference):
        assert f.dtype == dtype and f.shape == q.shape, name
        assert torch.equal(f.nan_to_num(0.5), r.nan_to_num(0.5)) and torch.equal(f.isnan(), r.isnan()), name
    assert fast[2][:, 1, 2].isnan().all() and torch.isinf(fast[0]).any() == (dtype == torch.float16)


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mask", [{}, {"causal": True}, {"window": 7}, "block"])
def test_fp8_attention_kernel_matches_its_twin_and_stays_near_the_exact_attention(mask, dtype):
    from gem_kernels import block_attention, jagged_flash_attention

    q, k, v, offsets = _jagged_qkv([5, 40, 17, 64, 1], dtype=dtype)
    with torch.no_grad():
        if mask == "block":
            run = lambda kernel, fp8: block_attention(q, k, v, offsets, block_size=16, window_blocks=2,  # noqa: E731
                                                      max_seq_len=64, kernel=kernel, fp8=fp8)
        else:
            run = lambda kernel, fp8: jagged_flash_attention(q, k, v, offsets, 64, kernel=kernel, fp8=fp8, **mask)  # noqa: E731
        fast, twin, exact = run("triton", True), run("pytorch", True), run("pytorch", False)
    assert fast.dtype == dtype and fast.shape == q.shape
    # the twin rounds Q, K, V as the kernel does but keeps P exact: P's E4M3 rounding is the difference
    assert _rel(fast, twin) < 0.03
    assert _rel(twin, exact) < 0.1 and _rel(fast, exact) < 0.1


@triton_on_cpu
@pytest.mark.parametrize("scale", [-0.2, 0.0])
def test_fp8_attention_kernel_takes_a_scale_of_either_sign(scale):
    """A scale > 0 is folded into the kernel's exponents (with P's scale, the row max taken before scaling), a
    negative or zero one is not: both match the twin as the default scale does."""
    from gem_kernels import jagged_flash_attention

    q, k, v, offsets = _jagged_qkv([5, 40, 17, 64, 1])
    with torch.no_grad():
        fast, twin = (jagged_flash_attention(q, k, v, offsets, 64, scale=scale, kernel=kernel, fp8=True)
                      for kernel in ("triton", "pytorch"))
    assert _rel(fast, twin) < 0.03


def test_fp8_attention_is_softmax_only():
    from gem_kernels import block_attention

    q, k, v, offsets = _jagged_qkv([4, 8])
    with pytest.raises(ValueError, match="softmax heads only"):
        block_attention(q, k, v, offsets, block_size=4, activation="silu", max_seq_len=8, kernel="pytorch", fp8=True)


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mask", [{}, {"causal": True}, "block"])
def test_fp8_attention_backward_is_the_exact_gradient_at_the_quantised_operands(mask, dtype):
    """The FP8 kernel's gradients equal the bf16 kernel's at the dequantised Q, K, V, fed the FP8 forward's output
    (the straight-through estimate; the output's P rounding enters through delta = rowsum(dO * O) only), and
    its twin's, which differentiates the exact reference at the same operands."""
    from gem_kernels import block_attention, jagged_flash_attention
    from gem_kernels.fp8 import fp8_attention_dequantize, fp8_attention_operands

    q, k, v, offsets = _jagged_qkv([5, 40, 17, 64, 0, 1], dtype=dtype)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def run(q, k, v, kernel, fp8):
        if mask == "block":
            return block_attention(q, k, v, offsets, block_size=16, window_blocks=2, max_seq_len=64, kernel=kernel,
                                   fp8=fp8)
        return jagged_flash_attention(q, k, v, offsets, 64, kernel=kernel, fp8=fp8, **mask)

    do = torch.randn_like(q)
    fast = torch.autograd.grad(run(q, k, v, "triton", True), (q, k, v), do)
    twin = torch.autograd.grad(run(q, k, v, "pytorch", True), (q, k, v), do)
    with torch.no_grad():
        qd, kd, vd = fp8_attention_dequantize(fp8_attention_operands(q, k, v, kernel="pytorch"), q.shape, dtype)
    at_operands = torch.autograd.grad(run(*(x.requires_grad_() for x in (qd, kd, vd)), "pytorch", False),
                                      (qd, kd, vd), do)
    for name, f, t, e in zip("qkv", fast, twin, at_operands):
        assert f.dtype == dtype and f.shape == q.shape
        assert torch.isfinite(f).all()
        assert _rel(t, e) < 1e-5 if dtype == torch.float32 else _rel(t, e) < 2e-2, name
        assert _rel(f, e) < 0.02, name  # P's E4M3 rounding in the output the backward reads (~0.009 measured)
    # the exact gradient at the input (no quantisation) is further: the quantiser's error
    exact = torch.autograd.grad(run(q, k, v, "pytorch", False), (q, k, v), do)
    assert all(_rel(f, e) < 0.08 for f, e in zip(fast, exact))  # ~0.05 measured
