"""Bad arguments to the attention ops and norms: each raises a one-line ValueError naming the argument."""

import math

import pytest
import torch
from gem_kernels_testing import offsets_of, rand

from gem_kernels import block_attention, gdpa, jagged_flash_attention, layer_norm, rms_norm
from gem_kernels.fp8_mlp import fp8_layer_norm
from gem_kernels.ops import layer_norm_pair, qkv_rotary_attention, rotary


def _qkv(T=10, H=2, D=16):
    return tuple(rand(T, H, D, grad=False) for _ in range(3))


def _one_line(err: pytest.ExceptionInfo) -> None:
    assert "\n" not in str(err.value)


# gdpa self attention (kv_offsets None: the keys share q_offsets): a max_seq_len_kv below the longest sequence
# would drop the keys past it without a word.
@pytest.mark.parametrize("kernel", ["pytorch", "triton"])
@pytest.mark.parametrize("activation", ["softmax", "relu"])
@pytest.mark.parametrize("max_seq_len_q", [None, 8])
def test_gdpa_self_max_seq_len_kv_below_real(kernel, activation, max_seq_len_q):
    q, k, v = _qkv()
    off = offsets_of([8, 2])
    with pytest.raises(ValueError, match=r"max_seq_len_kv=2 is below the longest sequence \(8\)") as err:
        gdpa(q, k, v, off, activation=activation, max_seq_len_q=max_seq_len_q, max_seq_len_kv=2, kernel=kernel)
    _one_line(err)
    # the packed key-value form takes the same path
    with pytest.raises(ValueError, match="max_seq_len_kv=2"):
        gdpa(q, torch.stack([k, v], 1), None, off, max_seq_len_q=max_seq_len_q, max_seq_len_kv=2, kernel=kernel)


def test_gdpa_self_max_seq_len_kv_at_or_above_real_is_accepted():
    q, k, v = _qkv()
    off = offsets_of([8, 2])
    ref = gdpa(q, k, v, off, kernel="pytorch")
    for m in (8, 12):
        torch.testing.assert_close(gdpa(q, k, v, off, max_seq_len_kv=m, kernel="pytorch"), ref)
    # validate=False with both lengths given reads no device value: the caller vouches for them
    gdpa(q, k, v, off, max_seq_len_q=8, max_seq_len_kv=8, kernel="pytorch", validate=False)


def test_gdpa_pma_and_cross_max_seq_len_kv_still_checked():
    q, k, v = _qkv()
    off = offsets_of([8, 2])
    with pytest.raises(ValueError, match="max_seq_len_kv=2 is below"):
        gdpa(q[:3], k, v, None, off, max_seq_len_kv=2, kernel="pytorch")  # PMA
    with pytest.raises(ValueError, match="max_seq_len_kv=2 is below"):
        gdpa(q, k, v, off, off, max_seq_len_kv=2, kernel="pytorch")  # cross


# empty heads (H=0) or head dims (D=0): otherwise a ZeroDivisionError or torch.cat's error from deep inside.
_EMPTY = [pytest.param((10, 2, 0), id="D=0"), pytest.param((10, 0, 16), id="H=0")]


@pytest.mark.parametrize("kernel", ["pytorch", "triton"])
@pytest.mark.parametrize("shape", _EMPTY)
def test_empty_heads_or_head_dim_rejected(kernel, shape):
    q, k, v = (torch.randn(shape) for _ in range(3))
    off = offsets_of([8, 2])
    match = r"q must have at least one head and a non-empty head dim"
    with pytest.raises(ValueError, match=match) as err:
        jagged_flash_attention(q, k, v, off, 8, kernel=kernel)
    _one_line(err)
    with pytest.raises(ValueError, match=match):
        gdpa(q, k, v, off, kernel=kernel)
    with pytest.raises(ValueError, match=match):
        gdpa(q[:3], k, v, None, off, kernel=kernel)  # PMA
    with pytest.raises(ValueError, match=r"k must have at least one head.*\[Tk, 2, H, D\] with v None"):
        gdpa(q, torch.stack([k, v], 1), None, off, kernel=kernel)
    with pytest.raises(ValueError, match=match):
        block_attention(q, k, v, off, block_size=4, kernel=kernel)
    with pytest.raises(ValueError, match="must have at least one head"):
        rotary(q, k, torch.arange(10).float(), kernel=kernel)
    with pytest.raises(ValueError, match="qkv must have at least one head"):
        qkv_rotary_attention(torch.stack([q, k, v], 1), torch.arange(10).float(), off, 8, kernel=kernel)


# a negative or non-finite eps would give NaN outputs; eps = 0 is allowed (the norms divide by sqrt(var + eps)).
@pytest.mark.parametrize("kernel", ["pytorch", "triton", "builtin"])
@pytest.mark.parametrize("eps", [-1.0, -1e-6, math.nan, math.inf, -math.inf])
def test_norm_bad_eps_rejected(kernel, eps):
    x, w, b = torch.randn(3, 16), torch.ones(16), torch.zeros(16)
    with pytest.raises(ValueError, match="eps must be a finite float >= 0") as err:
        rms_norm(x, w, eps=eps, kernel=kernel)
    _one_line(err)
    with pytest.raises(ValueError, match="eps must be"):
        layer_norm(x, w, b, eps=eps, kernel=kernel)
    with pytest.raises(ValueError, match="eps must be"):
        layer_norm_pair(x, (w, b), (w, b), eps=eps, kernel=kernel)
    with pytest.raises(ValueError, match="eps must be"):
        fp8_layer_norm(x, w, b, eps=eps)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computes the masked padding rows too
@pytest.mark.parametrize("kernel", ["pytorch", "triton"])
def test_norm_eps_zero_allowed(kernel):
    x, w = torch.randn(3, 16), torch.ones(16)
    y = rms_norm(x, w, eps=0.0, kernel=kernel)
    assert torch.isfinite(y).all()
    y = layer_norm(x, w, None, eps=0, kernel=kernel)
    assert torch.isfinite(y).all()
