"""Bad inputs raise ValueError naming the argument; importing never needs a GPU or the interpreter."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gem_kernels_testing import offsets_of, rand

from gem_kernels import block_attention, gdpa, jagged_flash_attention, layer_norm, rms_norm


def _qkv(T=6, H=2, D=16, dtype=torch.float32):
    return rand(T, H, D, dtype=dtype, grad=False), rand(T, H, D, dtype=dtype, grad=False), \
        rand(T, H, D, dtype=dtype, grad=False)


@pytest.mark.parametrize("kernel", ["pytorch", "triton"])
@pytest.mark.parametrize("bad_offsets,match", [
    (torch.tensor([0, 4, 2, 6]), "monotonic"),
    (torch.tensor([0, 2, 5]), "number of tokens"),
    (torch.tensor([1, 3, 6]), "start at 0"),
    (torch.tensor([0, 6], dtype=torch.int32), "int64"),
    (torch.tensor([[0, 6]]), "1-D"),
    (torch.tensor([0]), "number of tokens 6, got 0"),  # a batch of no sequences, but 6 tokens
])
def test_bad_offsets(kernel, bad_offsets, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        jagged_flash_attention(q, k, v, bad_offsets, 8, kernel=kernel)


def test_max_len_below_real():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="max_seq_len"):
        jagged_flash_attention(q, k, v, offsets_of([6]), 4)
    with pytest.raises(ValueError, match="max_seq_len"):
        jagged_flash_attention(q, k, v, offsets_of([6]), 0)


def test_dtype_device_rank_mismatch():
    q, k, v = _qkv()
    off = offsets_of([2, 4])
    with pytest.raises(ValueError, match="k has dtype"):
        jagged_flash_attention(q, k.half(), v, off, 4)
    with pytest.raises(ValueError, match="rank 3"):
        jagged_flash_attention(q[:, 0], k, v, off, 4)
    with pytest.raises(ValueError, match="same shape"):
        jagged_flash_attention(q, k[:, :1], v, off, 4)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        jagged_flash_attention(q.double(), k.double(), v.double(), off, 4)
    with pytest.raises(ValueError, match="offsets is on"):
        jagged_flash_attention(q, k, v, off.to("meta"), 4)


def test_triton_head_dim_unsupported():
    q, k, v = _qkv(D=24)
    with pytest.raises(ValueError, match="head dim 24"):
        jagged_flash_attention(q, k, v, offsets_of([6]), 6, kernel="triton")
    jagged_flash_attention(q, k, v, offsets_of([6]), 6, kernel="pytorch")  # the reference takes any D


def test_bad_kernel_window_activation():
    q, k, v = _qkv()
    off = offsets_of([6])
    with pytest.raises(ValueError, match="kernel"):
        jagged_flash_attention(q, k, v, off, 6, kernel="cuda")
    with pytest.raises(ValueError, match="window"):
        jagged_flash_attention(q, k, v, off, 6, window=-1)
    with pytest.raises(ValueError, match="activation"):
        gdpa(q, k, v, off, activation="tanh")
    with pytest.raises(ValueError, match="activation has 3 entries"):
        gdpa(q, k, v, off, activation=["gelu"] * 3)


def test_gdpa_mode_errors():
    q, k, v = _qkv()
    off = offsets_of([2, 4])
    with pytest.raises(ValueError, match="kv_offsets is required"):
        gdpa(q, k, v, None)
    with pytest.raises(ValueError, match="kv_index needs kv_offsets"):
        gdpa(q, k, v, off, kv_index=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="kv_index has 3 entries"):
        gdpa(q, k, v, off, offsets_of([6]), kv_index=torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match="kv_index values"):
        gdpa(q, k, v, off, offsets_of([6]), kv_index=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="pass kv_index"):
        gdpa(q, k, v, off, offsets_of([6]))
    with pytest.raises(ValueError, match=r"\[H, D\]"):
        gdpa(q[:, :1], k, v, off, offsets_of([6]), kv_index=torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="self attention"):
        gdpa(q[:4], k, v, offsets_of([4]))


def test_block_attention_errors():
    q, k, v = _qkv()
    off = offsets_of([6])
    with pytest.raises(ValueError, match="block_size"):
        block_attention(q, k, v, off, block_size=0)
    with pytest.raises(ValueError, match="window_blocks"):
        block_attention(q, k, v, off, window_blocks=0)


def test_norm_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        layer_norm(x, torch.ones(7), None)
    with pytest.raises(ValueError, match="bias"):
        layer_norm(x, torch.ones(8), torch.ones(3))
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(8), residual=torch.randn(4, 7))
    # a residual of another float dtype is added in float32; anything else is refused
    y, h = rms_norm(x, torch.ones(8), residual=x.half())
    assert h.dtype == x.dtype
    with pytest.raises(ValueError, match="residual must be a float16, bfloat16 or float32 tensor on cpu, got torch.int64"):
        rms_norm(x, torch.ones(8), residual=x.long())
    with pytest.raises(ValueError, match="rank"):
        rms_norm(torch.tensor(1.0), torch.ones(1))


def test_import_without_gpu_or_interpreter():
    src = Path(__file__).resolve().parents[1] / "src"
    code = ("import sys, gem_kernels, torch; q = torch.randn(3, 1, 8); "
            "o = torch.tensor([0, 3]); gem_kernels.jagged_flash_attention(q, q, q, o, 3); "
            "assert 'triton' not in sys.modules")
    env = {"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
