"""Bad arguments to the low-precision API (FP8 and MX quantisers, linears, the swap): each raises a one-line
ValueError naming the argument, where it once wrapped silently, read out of bounds or failed deep inside."""

import pytest
import torch
from conftest import triton_on_cpu
from torch import nn

from gem_kernels import Fp8Linear, Fp8Recipe, convert_to_low_precision, fp8_dequantize, fp8_linear, fp8_rowwise_quantize
from gem_kernels.fp8 import fp8_blockwise_dequantize, fp8_blockwise_quantize, fp8_rowwise_quantize_reference
from gem_kernels.mx import mx_dequantize, mx_quantize
from gem_kernels.mx_linear import MXLinear, MXRecipe, mx_matmul
from gem_kernels.ops import qkv_rotary_attention


def _one_line(err: pytest.ExceptionInfo) -> None:
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("dim", [2, -3, 5])
def test_mx_quantize_refuses_a_dim_outside_the_tensor(dim):
    """An out-of-range dim was wrapped (dim=2 of a 2-D tensor quantised along dim 0)."""
    with pytest.raises(ValueError, match=rf"^mx_quantize: dim must be an int in \[-2, 2\) for a tensor of shape "
                                         rf"\(4, 40\), got {dim}$"):
        mx_quantize(torch.randn(4, 40), dim)
    with pytest.raises(ValueError, match=r"dim must be an int in \[0, 0\)"):
        mx_quantize(torch.tensor(1.0))  # a 0-d tensor: a ZeroDivisionError before


@pytest.mark.parametrize("block", [0, -32, 32.0, "32", True])
def test_mx_block_sizes_are_positive_ints(block):
    with pytest.raises(ValueError, match=r"^mx_quantize: block must be a positive int, got ") as err:
        mx_quantize(torch.randn(4, 64), block=block)
    _one_line(err)
    with pytest.raises(ValueError, match=r"^MXRecipe.block must be a positive int, got "):
        MXRecipe(block=block)
    with pytest.raises(ValueError, match=r"^MXRecipe.block must be a positive int, got 16.5$"):
        MXRecipe(block=16.5)  # passed before, then failed in a reshape


def test_mx_matmul_and_dequantize_take_floats_and_an_mx_recipe():
    with pytest.raises(ValueError, match=r"^mx_matmul takes floating-point operands, got torch.int64 and torch.int64$"):
        mx_matmul(torch.ones(2, 32, dtype=torch.int64), torch.ones(32, 2, dtype=torch.int64))  # an int64 result before
    with pytest.raises(ValueError, match=r"^mx_matmul: recipe must be an MXRecipe, got Fp8Recipe$"):
        mx_matmul(torch.randn(2, 32), torch.randn(32, 2), Fp8Recipe())
    with pytest.raises(ValueError, match=r"^mx_dequantize: dtype must be a floating-point torch.dtype, got torch.int32$"):
        mx_dequantize(mx_quantize(torch.randn(2, 32)), torch.int32)


@pytest.mark.parametrize("kernel", ["pytorch", pytest.param("triton", marks=triton_on_cpu)])
def test_fp8_placed_must_hold_each_input_column_once(kernel):
    """A column past the input was read past x's row (the kernel) or an IndexError deep in the reference; a repeated
    or missing one duplicated or dropped data."""
    x = torch.randn(5, 40)
    bad = {
        "past the end": torch.cat([torch.arange(39), torch.tensor([45])]),
        "repeated": torch.arange(40) // 2,
        "below -1": torch.cat([torch.arange(40), torch.tensor([-2])]),
        "missing": torch.cat([torch.arange(39), torch.tensor([-1])]),
    }
    for what, placed in bad.items():
        with pytest.raises(ValueError, match=r"^fp8 rowwise quantisation: placed must hold each of the 40 input columns "
                                             r"once \(values in \[0, 40\), -1 for a zero column\)$"):
            fp8_rowwise_quantize(x, -1, kernel=kernel, placed=placed)
    with pytest.raises(ValueError, match="placed must hold each of the 40 input columns once"):
        fp8_rowwise_quantize_reference(x, -1, placed=bad["repeated"])
    placed = torch.cat([torch.full((8,), -1), torch.arange(40)])
    assert fp8_rowwise_quantize(x, -1, kernel=kernel, placed=placed)[0].shape == (5, 48)


@pytest.mark.parametrize("rows_to", [0, 16.0, "16"])
def test_fp8_padding_multiples_are_positive_ints(rows_to):
    with pytest.raises(ValueError, match=r"^fp8 rowwise quantisation: rows_to must be a positive int, got "):
        fp8_rowwise_quantize(torch.randn(4, 32), rows_to=rows_to)
    with pytest.raises(ValueError, match=r"^fp8 blockwise quantisation: rows_to must be a positive int, got "):
        fp8_blockwise_quantize(torch.randn(4, 128), (1, 128), rows_to=rows_to)


def test_fp8_blockwise_block_and_dequantised_elements_are_checked():
    with pytest.raises(ValueError, match=r"^fp8 blockwise quantisation: block must be one of .*, got 128$"):
        fp8_blockwise_quantize(torch.randn(4, 128), 128)
    with pytest.raises(ValueError, match=r"^fp8_dequantize: elements must be 2-D E4M3 rows, got torch.float8_e4m3fn of "
                                         r"shape \(4,\)$"):
        fp8_dequantize(torch.zeros(4, dtype=torch.float8_e4m3fn), torch.ones(4, 1))  # broadcast to [4, 4] before
    with pytest.raises(ValueError, match=r"^fp8_dequantize: elements must be 2-D E4M3 rows, got torch.float32"):
        fp8_dequantize(torch.zeros(4, 4), torch.ones(4, 1))
    with pytest.raises(ValueError, match=r"^fp8_blockwise_dequantize: elements must be 2-D E4M3, got torch.float8_e4m3fn "
                                         r"of shape \(128,\)$"):
        fp8_blockwise_dequantize(torch.zeros(128, dtype=torch.float8_e4m3fn), torch.ones(1, 1), (1, 128))


def test_fp8_linear_recipe_and_producer_operands_are_checked():
    x, w = torch.randn(16, 32), torch.randn(16, 32)
    for recipe, name in ((None, "NoneType"), (MXRecipe(), "MXRecipe")):
        with pytest.raises(ValueError, match=rf"^fp8_linear: recipe must be an Fp8Recipe, got {name}$"):
            fp8_linear(x, w, recipe)
    elements, scales = fp8_rowwise_quantize(x, -1, rows_to=16)
    with pytest.raises(ValueError, match=r"float32 scales \[16, 1\], got torch.float8_e4m3fn \(16, 32\) and "
                                         r"torch.float16 \(16, 1\)$"):
        fp8_linear(x, w, x_fp8=(elements, scales.half()))
    with pytest.raises(ValueError, match=r"^fp8_linear: x_fp8 must be a pair \(elements, scales\), got tuple$"):
        fp8_linear(x, w, x_fp8=(elements, scales, scales))
    with pytest.raises(ValueError, match=r"^fp8_linear: x_fp8 must be on x's device cpu, got meta and cpu$"):
        fp8_linear(x, w, x_fp8=(elements.to("meta"), scales))
    for name, value in (("min_features", 1.5), ("min_tokens", None), ("min_tokens", -1)):
        with pytest.raises(ValueError, match=rf"^Fp8Recipe.{name} must be an int >= 0, got "):
            Fp8Recipe(**{name: value})


@pytest.mark.parametrize("twin", ["fp8", "mx"])
def test_low_precision_linears_name_a_wrong_input_width(twin):
    linear = nn.Linear(32, 16)
    layer = Fp8Linear.from_linear(linear, Fp8Recipe(min_tokens=0)) if twin == "fp8" else \
        MXLinear.from_linear(linear, MXRecipe())
    with pytest.raises(ValueError, match=rf"^{type(layer).__name__}: input of shape \(3, 33\) does not end in "
                                         rf"in_features = 32$"):
        layer(torch.randn(3, 33))
    assert layer(torch.randn(2, 3, 32)).shape == (2, 3, 16)


def test_convert_to_low_precision_checks_its_recipe_and_keep():
    model = nn.Sequential(nn.Linear(32, 32))
    with pytest.raises(ValueError, match=r"^convert_to_low_precision: recipe must have linear and matmul .*got NoneType$"):
        convert_to_low_precision(model, None, keep=lambda name: False)
    with pytest.raises(ValueError, match=r"^convert_to_low_precision: keep must be a callable of a module's name, got "
                                         r"NoneType$"):
        convert_to_low_precision(model, MXRecipe(), keep=None)


@triton_on_cpu
def test_qkv_rotary_attention_refuses_to_rotate_a_leaf_in_place():
    """The fused path rotates qkv in its own buffer: a parameter (or an input leaf) would be changed for every later
    reader, an in-place op torch itself refuses on such a tensor."""
    offsets, positions = torch.tensor([0, 40, 80]), torch.rand(80)
    qkv = nn.Parameter(torch.randn(80, 3, 2, 16))
    before = qkv.detach().clone()
    with pytest.raises(ValueError, match=r"^qkv is a leaf that requires grad, or a view of one: the Triton path rotates"):
        qkv_rotary_attention(qkv, positions, offsets, 40, kernel="triton")
    flat = nn.Parameter(torch.randn(80, 3 * 2 * 16))  # a view of a leaf is not a leaf itself
    with pytest.raises(ValueError, match=r"^qkv is a leaf that requires grad, or a view of one"):
        qkv_rotary_attention(flat.view(80, 3, 2, 16), positions, offsets, 40, kernel="triton")
    assert torch.equal(qkv.detach(), before)
    out = qkv_rotary_attention(qkv, positions, offsets, 40, kernel="pytorch")  # the composed path leaves it
    assert out.shape == (80, 2, 16) and torch.equal(qkv.detach(), before)


def test_qkv_rotary_attention_window_blocks_needs_a_block_size():
    with pytest.raises(ValueError, match=r"^window_blocks=4 takes a block_size \(blocks of block_attention\)$"):
        qkv_rotary_attention(torch.randn(80, 3, 2, 16), torch.rand(80), torch.tensor([0, 40, 80]), 40, window_blocks=4,
                             kernel="pytorch")
