"""kernel="builtin" (PyTorch's own ops, the plain-PyTorch comparison point) against the exact references.

FlexAttention runs eagerly on CPU, so the block mask built from offsets is checked here; ``varlen_attn``
exists on CUDA only, so its routes are checked on the GPU (by the trainer's H200 benchmark) and skipped here.
"""

import pytest
import torch
from gem_kernels_testing import assert_close, grads, offsets_of, rand

from gem_kernels import block_attention, gdpa, layer_norm, rms_norm
from gem_kernels.ops.pytorch.builtin import FLEX_TILE, block_key_ranges, jagged_block_mask, varlen_available

pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.mark.parametrize("lengths,block_size,window_blocks", [
    ([0, 5, 130, 64, 200, 1], 16, 3),
    ([300, 0, 77], 64, 2),
    ([129, 128, 127], 32, 1),
])
def test_builtin_block_attention_matches_reference(lengths, block_size, window_blocks):
    torch.manual_seed(sum(lengths))
    H, D = 2, 16
    off = offsets_of(lengths)
    T = int(off[-1])
    # NOTE: forward only: FlexAttention has no backward on CPU (the GPU benchmark checks the gradients)
    q, k, v = (rand(T, H, D, grad=False) for _ in range(3))
    args = dict(block_size=block_size, window_blocks=window_blocks, max_seq_len=max(lengths))
    out = block_attention(q, k, v, off, kernel="builtin", **args)
    ref = block_attention(q, k, v, off, kernel="pytorch", **args)
    assert_close(out, ref, 1e-5, "out")


@pytest.mark.parametrize("lengths,block_size,window_blocks", [([0, 5, 130, 64, 200, 1, 400], 16, 3),
                                                              ([300, 0, 77, 1000], 64, 8)])
def test_jagged_block_mask_covers_every_visible_pair(lengths, block_size, window_blocks):
    # the eager FlexAttention path ignores the sparse tile lists, so check them here: every visible pair lies
    # in a listed tile
    off = offsets_of(lengths)
    T = int(off[-1])
    block_mask, padded = jagged_block_mask(off, T, block_size, window_blocks)
    listed = block_mask.to_dense()[0, 0].bool()  # [q tiles, kv tiles]
    lo, hi = block_key_ranges(off, T, block_size, window_blocks)
    key = torch.arange(T)
    visible = (key[None, :] >= lo[:, None]) & (key[None, :] < hi[:, None])
    q_tile, k_tile = visible.nonzero().unbind(1)
    assert bool(listed[q_tile // FLEX_TILE, k_tile // FLEX_TILE].all())
    assert padded % FLEX_TILE == 0 and padded >= T


def test_block_key_ranges_stay_inside_each_sequence_and_never_decrease():
    lengths = [3, 0, 70, 9]
    off = offsets_of(lengths)
    lo, hi = block_key_ranges(off, int(off[-1]), block_size=8, window_blocks=2)
    assert bool((lo[1:] >= lo[:-1]).all()) and bool((hi[1:] >= hi[:-1]).all())
    example = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    assert bool((lo >= off[:-1][example]).all()) and bool((hi <= off[1:][example]).all())
    row = int(off[2]) + 20  # position 20 of the 70-long sequence: block 2 sees blocks 1..2, rows 8..23
    assert (int(lo[row]) - int(off[2]), int(hi[row]) - int(off[2])) == (8, 24)


@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_builtin_pointwise_cross_matches_reference(act):
    torch.manual_seed(1)
    H, D, n = 2, 8, 4
    q_len = [5, 0, 17, 1]
    qo = offsets_of(q_len)
    ko = offsets_of([n, n, 2, n])
    q = rand(int(qo[-1]), H, D)
    k, v = rand(int(ko[-1]), H, D), rand(int(ko[-1]), H, D)
    args = dict(activation=act, max_seq_len_q=20, max_seq_len_kv=n)
    out = gdpa(q, k, v, qo, ko, kernel="builtin", **args)
    ref = gdpa(q, k, v, qo, ko, kernel="pytorch", **args)
    assert_close(out, ref, 1e-5, "out")
    do = torch.randn_like(out)
    for g, r, name in zip(grads(out, [q, k, v], do), grads(ref, [q, k, v], do), "qkv"):
        assert_close(g, r, 1e-5, f"d{name}")


def test_builtin_norms_match_reference():
    torch.manual_seed(2)
    x, r = torch.randn(7, 32), torch.randn(7, 32)
    w, b = torch.randn(32), torch.randn(32)
    assert_close(layer_norm(x, w, b, kernel="builtin"), layer_norm(x, w, b, kernel="pytorch"), 1e-5, "ln")
    y, h = layer_norm(x, w, b, residual=r, kernel="builtin")
    y_ref, h_ref = layer_norm(x, w, b, residual=r, kernel="pytorch")
    assert_close(y, y_ref, 1e-5, "ln+res")
    assert_close(h, h_ref, 1e-6, "residual sum")
    assert_close(rms_norm(x, w, kernel="builtin"), rms_norm(x, w, kernel="pytorch"), 1e-5, "rms")


def test_builtin_softmax_pma_and_self_fall_back_to_the_reference_off_cuda():
    if varlen_available(torch.device("cpu")):
        pytest.skip("varlen_attn ran on CPU here: the fallback is not exercised")
    torch.manual_seed(3)
    off = offsets_of([4, 9, 0])
    k, v = rand(13, 2, 8), rand(13, 2, 8)
    seeds = rand(3, 2, 8)
    out = gdpa(seeds, k, v, None, off, max_seq_len_kv=9, kernel="builtin")
    assert_close(out, gdpa(seeds, k, v, None, off, max_seq_len_kv=9, kernel="pytorch"), 1e-6, "pma")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen_attn (FlashAttention-2 varlen) is CUDA-only")
def test_builtin_varlen_routes_match_reference_on_cuda():
    torch.manual_seed(4)
    off = offsets_of([40, 1, 130]).cuda()
    q, k, v = (rand(171, 2, 64, dtype=torch.bfloat16).cuda() for _ in range(3))
    seeds = rand(4, 2, 64, dtype=torch.bfloat16).cuda()
    for a, b in [(gdpa(q, k, v, off, max_seq_len_q=130, kernel="builtin"),
                  gdpa(q, k, v, off, max_seq_len_q=130, kernel="pytorch")),
                 (gdpa(seeds, k, v, None, off, max_seq_len_kv=130, kernel="builtin"),
                  gdpa(seeds, k, v, None, off, max_seq_len_kv=130, kernel="pytorch"))]:
        assert_close(a.float(), b.float(), 2e-2, "varlen")
