"""MXFP8 numerics: the reference quantiser against an independent brute-force one (bit-exact), scale rounding,
saturation, non-finite and zero blocks, both orientations; the emulated MX linear's three GEMMs."""

import math

import pytest
import torch

from gem_kernels.mx import FORMATS, mx_dequantize, mx_fake_quantize, mx_quantize
from gem_kernels.low_precision import convert_to_low_precision
from gem_kernels.mx_linear import MXLinear, MXRecipe, mx_matmul


def representable(elem: str) -> torch.Tensor:
    """Every finite value of the element format, from its 256 codes, sorted, with its code."""
    fmt = FORMATS[elem]
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(fmt.dtype).float()
    finite = torch.isfinite(values)
    return values[finite], codes[finite]


def brute_force(block: list[float], elem: str, rounding: str) -> tuple[int, list[float]]:
    """One block quantised by the definition: the E8M0 code and the dequantised values."""
    fmt = FORMATS[elem]
    if any(not math.isfinite(v) for v in block):
        return 255, [math.nan] * len(block)
    amax = max(abs(v) for v in block)
    if amax == 0:
        return 0, [0.0] * len(block)
    if rounding == "floor":
        exponent = math.frexp(amax)[1] - 1 - fmt.emax
    else:
        exponent = math.ceil(math.log2(amax / fmt.max_finite))
        if 2.0 ** (exponent - 1) * fmt.max_finite >= amax:  # log2 rounding: take the smallest that fits
            exponent -= 1
    exponent = max(-127, min(127, exponent))
    values, codes = representable(elem)
    out = []
    for v in block:
        x = max(-fmt.max_finite, min(fmt.max_finite, v / 2.0**exponent))
        distance = (values - x).abs()
        best = distance.min()
        ties = (distance == best).nonzero().flatten()
        pick = ties[0] if len(ties) == 1 else next(i for i in ties if int(codes[i]) % 2 == 0)  # ties to even
        out.append(float(values[pick]) * 2.0**exponent)
    return exponent + 127, out


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_quantisation_is_bit_exact_with_the_definition(elem, rounding):
    generator = torch.Generator().manual_seed(0)
    # blocks of very different magnitudes, values on and between grid points, exact ties, tiny values
    x = torch.randn(6, 64, generator=generator) * torch.tensor([1e-30, 1e-3, 1.0, 7.0, 3e4, 1e20]).view(6, 1)
    x[2, :4] = torch.tensor([1.0, 1.0625, -1.03125, 448.0 / 256])  # a tie between two E4M3 neighbours, among others
    x[3, 32:] = 0.0
    q = mx_quantize(x, -1, elem, rounding)
    back = mx_dequantize(q)
    for row in range(6):
        for block in range(2):
            values = x[row, 32 * block : 32 * (block + 1)].tolist()
            code, expected = brute_force(values, elem, rounding)
            assert int(q.scales[row, block]) == code, (row, block)
            assert back[row, 32 * block : 32 * (block + 1)].tolist() == pytest.approx(expected, rel=0, abs=0), (row, block)


def test_floor_saturates_the_top_binade_and_rceil_never_saturates():
    x = torch.full((1, 32), 1.0)
    x[0, 0] = 1.99  # amax: floor puts it at 1.99 x 2^8 = 509 > 448
    floor, rceil = mx_fake_quantize(x, rounding="floor"), mx_fake_quantize(x, rounding="rceil")
    assert floor[0, 0].item() == 448.0 / 256  # saturated to the largest finite E4M3
    assert abs(rceil[0, 0].item() - 1.99) < 1.99 / 16  # within E4M3's resolution, no clamp
    assert mx_quantize(x, rounding="rceil").scales.item() == 127 - 7


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_value_rounded_past_its_dtypes_largest_saturates_there(dtype):
    """rceil rounds 64000 (fp16) up to 65536, past fp16's 65504: the dequantised value is the largest, not inf."""
    largest = torch.finfo(dtype).max
    x = torch.full((1, 32), 1.0, dtype=dtype)
    x[0, 0] = 64000.0 if dtype == torch.float16 else largest
    back = mx_fake_quantize(x, rounding="rceil")
    assert back.dtype == dtype and torch.isfinite(back).all() and back[0, 0].item() == largest
    assert back[0, 1:].eq(mx_fake_quantize(x.float(), rounding="rceil")[0, 1:].to(dtype)).all()


def test_non_finite_blocks_become_nan_and_leave_other_blocks_alone():
    x = torch.randn(2, 64)
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    q = mx_quantize(x)
    assert q.scales.tolist() == [[255, q.scales[0, 1].item()], [q.scales[1, 0].item(), 255]]
    back = mx_dequantize(q)
    assert back[0, :32].isnan().all() and back[1, 32:].isnan().all()
    assert torch.isfinite(back[0, 32:]).all() and torch.isfinite(back[1, :32]).all()
    zero = mx_quantize(torch.zeros(1, 32))
    assert zero.scales.item() == 0 and mx_dequantize(zero).eq(0).all()


def test_blocks_run_along_either_dimension_and_ragged_lengths_are_padded():
    x = torch.randn(70, 45)
    along_rows = mx_fake_quantize(x, dim=0)
    assert torch.equal(along_rows, mx_fake_quantize(x.t().contiguous(), dim=-1).t())
    q = mx_quantize(x, dim=0)
    assert q.elements.shape == (96, 45) and q.scales.shape == (3, 45) and mx_dequantize(q).shape == (70, 45)
    assert not torch.equal(mx_fake_quantize(x, dim=0), mx_fake_quantize(x, dim=1))
    relative = ((mx_fake_quantize(x) - x).abs() / x.abs().clamp_min(1e-3)).median()
    assert relative < 2**-4  # E4M3 keeps 3 mantissa bits


def test_mx_matmul_quantises_each_gemms_operands_along_its_contraction():
    torch.manual_seed(0)
    recipe = MXRecipe(rounding="rceil")
    a = torch.randn(3, 40, 70, requires_grad=True)
    b = torch.randn(70, 50, requires_grad=True)
    y = mx_matmul(a, b, recipe)
    g = torch.randn_like(y)
    y.backward(g)
    q = lambda x, dim, elem="e4m3": mx_fake_quantize(x, dim, elem, "rceil")  # noqa: E731
    assert torch.equal(y, q(a.detach(), -1) @ q(b.detach(), -2))
    assert torch.allclose(a.grad, q(g, -1, "e5m2") @ q(b.detach(), -1).t(), rtol=0, atol=1e-5)
    expected_b = (q(a.detach(), -2).transpose(1, 2) @ q(g, -2, "e5m2")).sum(0)
    assert torch.allclose(b.grad, expected_b, rtol=1e-6, atol=1e-4)
    # and it stays close to the float32 product
    assert ((y - a.detach() @ b.detach()).norm() / (a.detach() @ b.detach()).norm()) < 0.05


def test_mx_linear_shares_the_linears_parameters_and_convert_keeps_what_it_is_told():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    reference = [p.detach().clone() for p in model.parameters()]
    converted = convert_to_low_precision(model, MXRecipe(), keep=lambda name: name == "2")
    assert converted == ["0"] and isinstance(model[0], MXLinear) and type(model[2]) is torch.nn.Linear
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), reference))
    x = torch.randn(16, 64)
    y = model(x)
    y.sum().backward()
    assert model[0].weight.grad is not None and model[0].bias.grad is not None
    exact = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, reference[0], reference[1])), reference[2], reference[3])
    assert ((y - exact).norm() / exact.norm()) < 0.1  # E4M3 keeps 3 mantissa bits; floor scales saturate a few


def test_empty_tensors_pass_through():
    x = torch.zeros(0, 32, 40)
    assert mx_fake_quantize(x, dim=-1).shape == (0, 32, 40) and mx_fake_quantize(x, dim=1).shape == (0, 32, 40)
    a = torch.zeros(0, 70, requires_grad=True)
    mx_matmul(a, torch.randn(70, 8)).sum().backward()
    assert a.grad.shape == (0, 70)
