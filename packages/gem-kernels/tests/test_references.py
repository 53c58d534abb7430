"""The PyTorch references against naive per-sequence loops (float64), edge cases included."""

import math

import pytest
import torch
from gem_kernels_testing import assert_close, grads, naive_attention, offsets_of, rand

from gem_kernels import ACTIVATIONS, block_attention, gdpa, jagged_flash_attention, layer_norm, rms_norm

EDGE_LENGTHS = [
    [0, 5, 1, 0, 19],  # empty sequences and length 1
    [1],  # B = 1, a single token
    [23],  # B = 1, not a multiple of any tile
    [0, 0, 3],
]


@pytest.mark.parametrize("lengths", EDGE_LENGTHS)
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 3), (True, 2)])
def test_jfa_reference_matches_naive(lengths, causal, window):
    H, D = 2, 8
    off = offsets_of(lengths)
    T = int(off[-1])
    q, k, v = (rand(T, H, D) for _ in range(3))
    max_len = max(lengths) + 7  # a declared max above the real one
    out = jagged_flash_attention(q, k, v, off, max_len, causal=causal, window=window, kernel="pytorch")
    ref = naive_attention(q, k, v, off, off, ["softmax"] * H, 1 / math.sqrt(D), 1.0, wl=window,
                          wr=0 if causal else window)
    assert_close(out, ref, 1e-5, "out")
    if T:
        do = torch.randn_like(out)
        for g, r, n in zip(grads(out, [q, k, v], do), grads(ref, [q, k, v], do.double()), "qkv"):
            assert_close(g, r, 1e-5, f"d{n}")


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("window", [None, 2])
def test_gdpa_self_reference_matches_naive(act, window):
    lengths, H, D = [4, 0, 11, 1], 2, 8
    off = offsets_of(lengths)
    T = int(off[-1])
    q, k, v = rand(T, H, D, scale=0.5), rand(T, H, D, scale=0.5), rand(T, H, D)
    out = gdpa(q, k, v, off, activation=act, max_seq_len_q=16, window=window, kernel="pytorch")
    ref = naive_attention(q, k, v, off, off, [act] * H, 1 / math.sqrt(D), 1 / 16, wl=window, wr=window)
    assert_close(out, ref, 1e-5, "out")
    do = torch.randn_like(out)
    for g, r, n in zip(grads(out, [q, k, v], do), grads(ref, [q, k, v], do.double()), "qkv"):
        assert_close(g, r, 1e-5, f"d{n}")


@pytest.mark.parametrize("with_index", [False, True])
def test_gdpa_cross_reference_matches_naive(with_index):
    H, D = 2, 8
    q_len = [5, 0, 9, 2]
    kv_len = [3, 4] if with_index else [3, 0, 6, 1]
    kv_index = torch.tensor([1, 0, 1, 1]) if with_index else None
    qo, ko = offsets_of(q_len), offsets_of(kv_len)
    q = rand(int(qo[-1]), H, D)
    k, v = rand(int(ko[-1]), H, D), rand(int(ko[-1]), H, D)
    acts = ["softmax", "silu"]
    out = gdpa(q, k, v, qo, ko, activation=acts, kv_index=kv_index, kernel="pytorch")
    ref = naive_attention(q, k, v, qo, ko, acts, 1 / math.sqrt(D), 1 / max(kv_len), kv_index=kv_index)
    assert_close(out, ref, 1e-5, "out")
    do = torch.randn_like(out)
    for g, r, n in zip(grads(out, [q, k, v], do), grads(ref, [q, k, v], do.double()), "qkv"):
        assert_close(g, r, 1e-5, f"d{n}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gdpa_reference_sums_shared_kv_gradients_in_fp32(dtype):
    """A kv sequence read by many examples (kv_index) gets its gradient summed in fp32, rounded once: the same as
    the fp32 reference's, rounded. Summed in the 16-bit dtype, 600 readers put dK / dV ~3% off."""
    H, D, B, R = 2, 16, 1200, 2
    g = torch.Generator().manual_seed(0)
    qo = offsets_of(torch.randint(1, 5, (B,), generator=g).tolist())
    ko = offsets_of([3, 5])
    kv_index = torch.arange(B) % R
    q, k, v = (rand(n, H, D, dtype=dtype) for n in (int(qo[-1]), int(ko[-1]), int(ko[-1])))
    wide = [x.detach().float().requires_grad_() for x in (q, k, v)]
    do = torch.randn(int(qo[-1]), H, D, generator=g).to(dtype)
    low = grads(gdpa(q, k, v, qo, ko, kv_index=kv_index, kernel="pytorch"), [q, k, v], do)
    exact = grads(gdpa(*wide, qo, ko, kv_index=kv_index, kernel="pytorch"), wide, do.float())
    for got, want, n in zip(low, exact, "qkv"):
        assert got.dtype == dtype
        assert_close(got, want.to(dtype), 1e-2, f"d{n}")


def test_gdpa_pma_reference_matches_naive():
    H, D, Nq = 2, 8, 3
    ko = offsets_of([5, 0, 7])
    q = rand(Nq, H, D)
    k, v = rand(int(ko[-1]), H, D), rand(int(ko[-1]), H, D)
    out = gdpa(q, k, v, None, ko, activation=["softmax", "gelu"], kernel="pytorch")
    assert out.shape == (3, Nq, H, D)
    ref = naive_attention(q, k, v, None, ko, ["softmax", "gelu"], 1 / math.sqrt(D), 1 / 7)
    assert_close(out, ref, 1e-5, "out")
    do = torch.randn_like(out)
    for g, r, n in zip(grads(out, [q, k, v], do), grads(ref, [q, k, v], do.double()), "qkv"):
        assert_close(g, r, 1e-5, f"d{n}")


@pytest.mark.parametrize("act", ["softmax", "relu2"])
@pytest.mark.parametrize("block_size,window_blocks", [(4, 1), (4, 3), (5, 2)])
def test_block_attention_reference_matches_naive(act, block_size, window_blocks):
    H, D = 2, 8
    off = offsets_of([13, 0, 4, 1, 9])
    T = int(off[-1])
    q, k, v = (rand(T, H, D, scale=0.5) for _ in range(3))
    out = block_attention(q, k, v, off, block_size=block_size, window_blocks=window_blocks, activation=act,
                          kernel="pytorch")
    ref = naive_attention(q, k, v, off, off, [act] * H, 1 / math.sqrt(D), 1 / (block_size * window_blocks),
                          block_size=block_size, window_blocks=window_blocks)
    assert_close(out, ref, 1e-5, "out")


def test_block_attention_window_one_is_independent_blocks():
    H, D, bs = 1, 8, 4
    off = offsets_of([8])
    q, k, v = (rand(8, H, D, grad=False) for _ in range(3))
    out = block_attention(q, k, v, off, block_size=bs, kernel="pytorch")
    for blk in range(2):
        sl = slice(blk * bs, (blk + 1) * bs)
        sub = jagged_flash_attention(q[sl], k[sl], v[sl], offsets_of([bs]), bs, kernel="pytorch")
        assert_close(out[sl], sub, 1e-6, "block")


@pytest.mark.parametrize("residual", [False, True])
def test_norm_references(residual):
    x, w, b = rand(3, 5, 32), rand(32), rand(32)
    r = rand(3, 5, 32) if residual else None
    out = layer_norm(x, w, b, 1e-5, residual=r, kernel="pytorch")
    h = x + r if residual else x
    ref = torch.nn.functional.layer_norm(h, (32,), w, b, 1e-5)
    assert_close(out[0] if residual else out, ref, 1e-5, "layer_norm")
    out = rms_norm(x, w, 1e-6, residual=r, kernel="pytorch")
    ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert_close(out[0] if residual else out, ref, 1e-5, "rms_norm")
    if residual:
        assert_close(out[1], h, 1e-6, "residual sum")


def test_kernel_auto_on_cpu_uses_reference():
    off = offsets_of([3, 2])
    q = rand(5, 1, 8, grad=False)
    a = jagged_flash_attention(q, q, q, off, 3)
    b = jagged_flash_attention(q, q, q, off, 3, kernel="pytorch")
    assert torch.equal(a, b)
