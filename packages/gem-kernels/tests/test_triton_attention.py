"""Triton attention kernels (through the interpreter on CPU) against the PyTorch references.

Outputs and every gradient, fp32 and fp16, on hypothesis-drawn jagged shapes with empty sequences, length-1
sequences, lengths that are no multiple of the 16-wide interpreter tiles and declared maxima above the real one.
"""

import pytest
import torch
from conftest import triton_on_cpu
from gem_kernels_testing import assert_close, grads, offsets_of, rand, record_launches
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gem_kernels import ACTIVATIONS, block_attention, gdpa, jagged_flash_attention

pytestmark = triton_on_cpu

FAST = settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
TOL = {torch.float32: 2e-5, torch.float16: 2e-2}


def _check_against_reference(fn, inputs, dtype, label=""):
    out_t = fn("triton")
    out_r = fn("pytorch")
    tol = TOL[dtype]
    assert out_t.dtype == dtype
    assert_close(out_t, out_r, tol, f"{label} out")
    if out_r.numel() == 0:
        return
    do = torch.randn_like(out_r)
    for g_t, g_r, n in zip(grads(out_t, inputs, do), grads(out_r, inputs, do), "qkv"):
        assert_close(g_t, g_r, tol, f"{label} d{n}")


lengths_st = st.lists(st.integers(0, 40), min_size=1, max_size=3)


@FAST
@given(lengths=lengths_st, extra=st.integers(0, 9), heads=st.integers(1, 2), causal=st.booleans(),
       window=st.sampled_from([None, 0, 5, 17]), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_jfa_matches_reference(lengths, extra, heads, causal, window, dtype):
    off = offsets_of(lengths)
    T, D = int(off[-1]), 16
    q, k, v = (rand(T, heads, D, dtype=dtype) for _ in range(3))
    max_len = max(max(lengths), 1) + extra

    def fn(kernel):
        return jagged_flash_attention(q, k, v, off, max_len, causal=causal, window=window, kernel=kernel)

    _check_against_reference(fn, [q, k, v], dtype, f"jfa {lengths} causal={causal} window={window}")


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_gdpa_self_every_activation(act):
    off = offsets_of([19, 0, 1, 33])
    T, H, D = int(off[-1]), 2, 16
    # NOTE: q.k stays O(1) so that gelu_taylor6 is used where it is valid and relu2 does not blow up fp32 tolerances
    q, k, v = rand(T, H, D, scale=0.3), rand(T, H, D, scale=0.3), rand(T, H, D)

    def fn(kernel):
        return gdpa(q, k, v, off, activation=act, max_seq_len_q=40, window=6, kernel=kernel)

    _check_against_reference(fn, [q, k, v], torch.float32, act)


def test_gdpa_per_head_activations_fp16():
    off = offsets_of([21, 7])
    T, D = int(off[-1]), 32
    acts = ["softmax", "gelu_tanh", "relu", "softmax"]
    q, k, v = (rand(T, 4, D, dtype=torch.float16, scale=0.4) for _ in range(3))

    def fn(kernel):
        return gdpa(q, k, v, off, activation=acts, causal=True, kernel=kernel)

    _check_against_reference(fn, [q, k, v], torch.float16, "per-head")


@FAST
@given(q_lengths=lengths_st, kv_len=st.lists(st.integers(0, 20), min_size=3, max_size=3),
       act=st.sampled_from(["softmax", "gelu", "silu"]), use_index=st.booleans(),
       window=st.sampled_from([None, 3]), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_gdpa_cross_matches_reference(q_lengths, kv_len, act, use_index, window, dtype):
    H, D = 2, 16
    B = len(q_lengths)
    if use_index:
        kv_index = torch.tensor([(b + 1) % 2 for b in range(B)], dtype=torch.int64)  # shared, one unused
    else:
        kv_index, kv_len = None, kv_len[:B]
    qo, ko = offsets_of(q_lengths), offsets_of(kv_len)
    q = rand(int(qo[-1]), H, D, dtype=dtype, scale=0.5)
    k, v = rand(int(ko[-1]), H, D, dtype=dtype, scale=0.5), rand(int(ko[-1]), H, D, dtype=dtype)

    def fn(kernel):
        return gdpa(q, k, v, qo, ko, activation=act, kv_index=kv_index, window=window, kernel=kernel)

    _check_against_reference(fn, [q, k, v], dtype, f"cross {act} index={use_index}")


@pytest.mark.parametrize("act", ["softmax", "gelu", "identity"])
@pytest.mark.parametrize("nq", [1, 3, 20])
def test_gdpa_pma_matches_reference(act, nq):
    H, D = 2, 16
    ko = offsets_of([17, 0, 5, 40])
    q = rand(nq, H, D, scale=0.5)
    k, v = rand(int(ko[-1]), H, D, scale=0.5), rand(int(ko[-1]), H, D)

    def fn(kernel):
        return gdpa(q, k, v, None, ko, activation=act, max_seq_len_kv=45, kernel=kernel)

    _check_against_reference(fn, [q, k, v], torch.float32, f"pma {act}")


@pytest.mark.parametrize("scale", [-0.4, 0.0, 0.6])
def test_softmax_scale_of_either_sign_matches_reference(scale):
    """The forwards fold a scale > 0 into their exponents (the row max taken before scaling, exact for such a
    scale); a negative scale reverses the scores' order and a zero one scales a masked key's -inf to NaN, so those
    take the unfolded path. Each, on the general kernel (a declared max above the short-kv bound; causal: its masked
    diagonal tiles), short kv sequences (with an empty one) and diagonal blocks."""
    off, ko = offsets_of([70, 0, 1, 37]), offsets_of([9, 0, 16, 3])
    T, H, D = int(off[-1]), 2, 16
    q, k, v = rand(T, H, D, scale=0.5), rand(T, H, D, scale=0.5), rand(T, H, D)
    kc, vc = rand(int(ko[-1]), H, D, scale=0.5), rand(int(ko[-1]), H, D)
    calls = {
        "jfa": lambda kernel: jagged_flash_attention(q, k, v, off, 300, scale=scale, kernel=kernel),
        "jfa, short kv": lambda kernel: jagged_flash_attention(q, k, v, off, 80, scale=scale, kernel=kernel),
        "jfa causal": lambda kernel: jagged_flash_attention(q, k, v, off, 80, causal=True, scale=scale, kernel=kernel),
        "cross, short kv": lambda kernel: gdpa(q, kc, vc, off, ko, scale=scale, kernel=kernel),
        "blocks of 16": lambda kernel: block_attention(q, k, v, off, 16, 1, scale=scale, kernel=kernel),
    }
    for label, fn in calls.items():
        inputs = [q, kc, vc] if "cross" in label else [q, k, v]
        _check_against_reference(fn, inputs, torch.float32, f"{label} scale={scale}")


@pytest.mark.parametrize("block_size,window_blocks", [(16, 1), (32, 1), (16, 3), (32, 2), (20, 2), (20, 1)])
@pytest.mark.parametrize("act", ["softmax", "silu"])
def test_block_attention_matches_reference(block_size, window_blocks, act):
    off = offsets_of([70, 0, 1, 37])
    T, H, D = int(off[-1]), 1, 16
    q, k, v = rand(T, H, D, scale=0.5), rand(T, H, D, scale=0.5), rand(T, H, D)

    def fn(kernel):
        return block_attention(q, k, v, off, block_size=block_size, window_blocks=window_blocks, activation=act,
                               kernel=kernel)

    _check_against_reference(fn, [q, k, v], torch.float32, f"block {block_size}x{window_blocks}")


def test_block_attention_fp16():
    off = offsets_of([50, 13])
    q, k, v = (rand(63, 2, 32, dtype=torch.float16) for _ in range(3))

    def fn(kernel):
        return block_attention(q, k, v, off, block_size=16, window_blocks=2, kernel=kernel)

    _check_against_reference(fn, [q, k, v], torch.float16, "block fp16")


@pytest.mark.parametrize("head_dim", [32, 64])
def test_jfa_wider_heads(head_dim):
    off = offsets_of([18, 3])
    q, k, v = (rand(21, 1, head_dim) for _ in range(3))

    def fn(kernel):
        return jagged_flash_attention(q, k, v, off, 20, causal=True, kernel=kernel)

    _check_against_reference(fn, [q, k, v], torch.float32, f"D={head_dim}")


def test_all_sequences_empty():
    off = offsets_of([0, 0])
    q, k, v = (rand(0, 2, 16) for _ in range(3))
    out = jagged_flash_attention(q, k, v, off, 4, kernel="triton")
    assert out.shape == (0, 2, 16)
    ko = offsets_of([0, 0])
    out = gdpa(rand(3, 2, 16), k, v, None, ko, activation="gelu", max_seq_len_kv=1, kernel="triton")
    assert out.shape == (2, 3, 2, 16) and not out.any()


def test_backward_is_deterministic():
    off = offsets_of([33, 20])
    ko = offsets_of([9, 4])
    q, k, v = rand(53, 2, 16), rand(13, 2, 16), rand(13, 2, 16)
    kv_index = torch.tensor([1, 1])
    do = torch.randn(53, 2, 16)
    runs = []
    for _ in range(2):
        out = gdpa(q, k, v, off, ko, activation=["softmax", "gelu"], kv_index=kv_index, kernel="triton")
        runs.append(grads(out, [q, k, v], do))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("T,H,D", [(0, 2, 16), (1, 1, 16), (37, 3, 48), (70, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softmax_delta_pre_pass_matches_its_definition(T, H, D, dtype):
    """The backward's ``delta = rowsum(dO * O)`` kernel (row counts no multiple of its tile, D no power of two)."""
    from gem_kernels.ops.triton.triton_attention import softmax_delta

    do, o = rand(T, H, D, dtype=dtype), rand(T, H, D, dtype=dtype)
    delta = softmax_delta(do, o)
    assert delta.shape == (T, H) and delta.dtype == torch.float32
    assert_close(delta, (do.double() * o.double()).sum(-1).float(), 1e-5, "delta")


def test_views_of_a_fused_projection_are_read_in_place():
    """k and v split from one ``[T, 2, H, D]`` projection (PMA's layout), q from a ``[T, 3, H, D]`` one: the
    kernels read the strided views; outputs and gradients equal those of contiguous copies."""
    off = offsets_of([19, 0, 33, 5])
    T, H, D = int(off[-1]), 2, 16
    kv = rand(T, 2, H, D).requires_grad_()
    seeds = rand(4, H, D).requires_grad_()
    k, v = kv.unbind(1)
    assert not k.is_contiguous()
    out = gdpa(seeds, k, v, None, off, max_seq_len_kv=40, kernel="triton")
    copies = [x.detach().contiguous().requires_grad_() for x in (k, v)]
    expected = gdpa(seeds.detach(), *copies, None, off, max_seq_len_kv=40, kernel="triton")
    assert_close(out, expected, 1e-6, "out")
    do = torch.randn_like(out)
    dkv, = torch.autograd.grad(out, kv, do)
    for got, want, name in zip(dkv.unbind(1), torch.autograd.grad(expected, copies, do), "kv"):
        assert_close(got, want, 1e-6, f"d{name}")
    qkv = rand(T, 3, H, D)
    q, k, v = qkv.unbind(1)
    assert_close(jagged_flash_attention(q, k, v, off, 40, causal=True, kernel="triton"),
                 jagged_flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), off, 40, causal=True, kernel="triton"),
                 1e-6, "jfa out")


@pytest.mark.parametrize("act", ["softmax", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_lengths", [[9, 0, 16], [130, 0, 200]], ids=["kv16", "kv256"])
def test_short_kv_forward_equals_the_general_kernel(act, dtype, kv_lengths, monkeypatch):
    """Full attention to kv sequences of at most one key tile runs attn_fwd_short_kv_kernel (query tiles streamed
    through K / V loaded once, several per program): its outputs and LSE equal the general forward's, with empty
    kv sequences, empty and multi-tile query sequences and a shared kv sequence; up to SHORT_KV_MAX keys."""
    from gem_kernels.ops.triton import _tuning, triton_attention
    from gem_kernels.ops.triton.triton_attention import AttnSpec, attention_forward

    qo, ko = offsets_of([40, 0, 1, 35]), offsets_of(kv_lengths)
    kv_index = torch.tensor([0, 2, 1, 0])
    q = rand(int(qo[-1]), 2, 16, dtype=dtype, scale=0.5)
    k, v = rand(int(ko[-1]), 2, 16, dtype=dtype, scale=0.5), rand(int(ko[-1]), 2, 16, dtype=dtype)
    spec = AttnSpec(max_q=48, max_kv=max(kv_lengths), nq=None, activations=(act, act), sm_scale=0.25,
                    pw_scale=1 / 16)
    assert triton_attention._short_kv(spec, 16, q.element_size())
    short = attention_forward(q, k, v, qo, ko, kv_index, spec)
    monkeypatch.setattr(triton_attention, "_short_kv", lambda *args: False)
    monkeypatch.setattr(_tuning, "_TUNED", {})
    monkeypatch.setattr(_tuning, "_PLANS", {})  # a plan holds the kernels picked before
    general = attention_forward(q, k, v, qo, ko, kv_index, spec)
    assert_close(short[0], general[0], TOL[dtype], "out")
    if act == "softmax":
        assert torch.equal(short[1] >= 1e29, general[1] >= 1e29)  # the rows with no keys
        assert_close(short[1], general[1], TOL[torch.float32], "lse")


@pytest.mark.parametrize("act", ["softmax", "silu"])
def test_diagonal_block_forward_equals_the_general_kernel(act, monkeypatch):
    """Independent blocks of a tile's size run attn_fwd_short_kv_kernel with DIAGONAL (query tile i against key
    tile i, several per program): outputs and LSE equal the general forward's, with short last blocks and an
    empty sequence."""
    from gem_kernels.ops.triton import _tuning, triton_attention
    from gem_kernels.ops.triton.triton_attention import AttnSpec, attention_forward

    off = offsets_of([70, 0, 1, 37])
    q, k, v = rand(108, 2, 16, scale=0.5), rand(108, 2, 16, scale=0.5), rand(108, 2, 16)
    spec = AttnSpec(max_q=70, max_kv=70, nq=None, activations=(act, act), sm_scale=0.25, pw_scale=1 / 16,
                    block_size=16, window_blocks=1)
    assert triton_attention._diagonal_blocks(spec)
    diagonal = attention_forward(q, k, v, off, off, None, spec)
    monkeypatch.setattr(triton_attention, "_diagonal_blocks", lambda spec: False)
    monkeypatch.setattr(_tuning, "_TUNED", {})
    monkeypatch.setattr(_tuning, "_PLANS", {})  # a plan holds the kernels picked before
    general = attention_forward(q, k, v, off, off, None, spec)
    assert_close(diagonal[0], general[0], TOL[torch.float32], "out")
    if act == "softmax":
        assert_close(diagonal[1], general[1], TOL[torch.float32], "lse")


@pytest.mark.parametrize("act", ["softmax", "gelu"])
def test_descriptor_loads_equal_pointer_loads(act, monkeypatch):
    """The general kernels read their streamed tiles through tensor descriptors where the layouts allow (TMA on the
    GPU): the forward's K / V, dK / dV's Q and dO, dQ's K / V; whole tiles, rows past a sequence included, which
    only masked pairs may meet. Outputs, LSE and gradients equal the pointer loads' on windows, causal blocks and
    a shared kv sequence, with K / V the strided slots of one packed projection and sequences ending inside a tile
    or at the tensor's end."""
    from gem_kernels.ops.triton import _tuning, triton_attention
    from gem_kernels.ops.triton.triton_attention import AttnSpec, attention_backward, attention_forward

    dtype = torch.float16  # descriptors take 16-bit inputs (the interpreter runs no bfloat16)
    assert not triton_attention._tma_rows(rand(8, 2, 16))
    qo, ko = offsets_of([40, 0, 1, 35]), offsets_of([37, 0, 21])
    kv_index = torch.tensor([0, 2, 1, 0])
    q = rand(int(qo[-1]), 2, 16, dtype=dtype, scale=0.5)
    k, v = rand(int(ko[-1]), 2, 2, 16, dtype=dtype, scale=0.5).unbind(1)
    do = rand(int(qo[-1]), 2, 16, dtype=dtype)
    specs = [(AttnSpec(max_q=48, max_kv=40, nq=None, activations=(act, act), sm_scale=0.25, pw_scale=1 / 16,
                       window_left=5, window_right=9), ko, kv_index),
             (AttnSpec(max_q=48, max_kv=48, nq=None, activations=(act, act), sm_scale=0.25, pw_scale=1 / 16,
                       block_size=16, window_blocks=2), qo, None)]
    monkeypatch.setattr(triton_attention, "TMA_LOADS", True)
    launched = record_launches(monkeypatch, lambda kernel, consts: consts.get("TMA"))

    def run(keys, kv_offsets, index, spec):
        monkeypatch.setattr(_tuning, "_TUNED", {})
        monkeypatch.setattr(_tuning, "_PLANS", {})  # a plan holds the kernels picked before
        o, lse = attention_forward(q, *keys, qo, kv_offsets, index, spec)
        return (o, lse, *attention_backward(do, q, *keys, o, lse, qo, kv_offsets, index, spec))

    for spec, kv_offsets, index in specs:
        keys = (k, v) if index is not None else (rand(int(qo[-1]), 2, 16, dtype=dtype, scale=0.5),
                                                 rand(int(qo[-1]), 2, 16, dtype=dtype))
        launched.clear()
        tma = run(keys, kv_offsets, index, spec)
        assert launched == [True, True, True], launched  # forward, dQ (and delta), dK / dV
        monkeypatch.setattr(triton_attention, "TMA_LOADS", False)
        pointers = run(keys, kv_offsets, index, spec)
        monkeypatch.setattr(triton_attention, "TMA_LOADS", True)
        for got, want, name in zip(tma, pointers, ["out", "lse", "dq", "dk", "dv"]):
            if name != "lse" or act == "softmax":
                assert_close(got, want, TOL[dtype] if name != "lse" else TOL[torch.float32], f"{name} {spec}")


@pytest.mark.parametrize("act", ["softmax", "silu"])
def test_short_kv_forward_descriptor_loads_equal_pointer_loads(act, monkeypatch):
    """The one-key-tile forward streams its query tiles (and the diagonal's key tiles) through tensor descriptors:
    outputs and LSE equal the pointer loads', for short kv sequences (shared, empty) and independent blocks with a
    short last block."""
    from gem_kernels.ops.triton import _tuning, triton_attention
    from gem_kernels.ops.triton.triton_attention import AttnSpec, attention_forward

    monkeypatch.setattr(triton_attention, "TMA_LOADS", True)
    dtype = torch.float16
    qo, ko, off = offsets_of([40, 0, 1, 35]), offsets_of([9, 0, 16]), offsets_of([70, 0, 1, 37])
    cases = [(rand(int(qo[-1]), 2, 16, dtype=dtype, scale=0.5), rand(int(ko[-1]), 2, 16, dtype=dtype, scale=0.5),
              rand(int(ko[-1]), 2, 16, dtype=dtype), qo, ko, torch.tensor([0, 2, 1, 0]),
              AttnSpec(max_q=48, max_kv=16, nq=None, activations=(act, act), sm_scale=0.25, pw_scale=1 / 16)),
             (*(rand(108, 2, 16, dtype=dtype, scale=0.5) for _ in range(3)), off, off, None,
              AttnSpec(max_q=70, max_kv=70, nq=None, activations=(act, act), sm_scale=0.25, pw_scale=1 / 16,
                       block_size=16, window_blocks=1))]
    launched = record_launches(monkeypatch, lambda kernel, consts: (kernel.fn.__name__, consts.get("TMA")))
    for q, k, v, q_offsets, kv_offsets, index, spec in cases:
        monkeypatch.setattr(_tuning, "_TUNED", {})
        monkeypatch.setattr(_tuning, "_PLANS", {})  # a plan holds the kernels picked before
        launched.clear()
        tma = attention_forward(q, k, v, q_offsets, kv_offsets, index, spec)
        assert launched == [("attn_fwd_short_kv_kernel", True)], launched
        monkeypatch.setattr(triton_attention, "TMA_LOADS", False)
        monkeypatch.setattr(_tuning, "_TUNED", {})
        monkeypatch.setattr(_tuning, "_PLANS", {})  # a plan holds the kernels picked before
        pointers = attention_forward(q, k, v, q_offsets, kv_offsets, index, spec)
        monkeypatch.setattr(triton_attention, "TMA_LOADS", True)
        assert_close(tma[0], pointers[0], TOL[dtype], f"out {spec}")
        if act == "softmax":
            assert_close(tma[1], pointers[1], TOL[torch.float32], f"lse {spec}")


@pytest.mark.parametrize("mode", ["blocks", "short_kv"])
@pytest.mark.parametrize("act", ["softmax", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_launch_backward_equals_the_general_kernels(mode, act, dtype, monkeypatch):
    """Independent blocks of a tile's size and short kv sequences of their own run their whole backward as one
    launch of attn_bwd_short_kv_kernel (delta from O in the kernel, dK / dV summed over the query tiles in
    registers): dQ, dK and dV equal the dQ (which writes delta) + dK/dV kernels', with short last blocks, an empty
    sequence, queries without keys and keys without queries."""
    from gem_kernels.ops.triton import _tuning, triton_attention
    from gem_kernels.ops.triton.triton_attention import AttnSpec, attention_backward, attention_forward

    if mode == "blocks":
        qo = ko = offsets_of([70, 0, 1, 37])
        spec = AttnSpec(max_q=70, max_kv=70, nq=None, activations=(act, act), sm_scale=0.25, pw_scale=1 / 16,
                        block_size=16, window_blocks=1)
    else:
        qo, ko = offsets_of([40, 0, 1, 35, 6]), offsets_of([9, 4, 0, 16, 0])
        spec = AttnSpec(max_q=48, max_kv=16, nq=None, activations=(act, act), sm_scale=0.25, pw_scale=1 / 16)
    q = rand(int(qo[-1]), 2, 16, dtype=dtype, scale=0.5)
    k, v = rand(int(ko[-1]), 2, 16, dtype=dtype, scale=0.5), rand(int(ko[-1]), 2, 16, dtype=dtype)
    o, lse = attention_forward(q, k, v, qo, ko, None, spec)
    do = rand(*o.shape, dtype=dtype)
    launched = []
    launch = _tuning.launch
    monkeypatch.setattr(_tuning, "launch", lambda kernel, *a: launched.append(kernel) or launch(kernel, *a))
    monkeypatch.setattr(_tuning, "_PLANS", {})
    fused = attention_backward(do, q, k, v, o, lse, qo, ko, None, spec)
    assert launched == [triton_attention.attn_bwd_short_kv_kernel]
    monkeypatch.setattr(triton_attention, "_fused_backward", lambda spec, kv_index, head_dim: False)
    monkeypatch.setattr(_tuning, "_TUNED", {})
    monkeypatch.setattr(_tuning, "_PLANS", {})  # the plan of this shape holds the one-launch backward
    general = attention_backward(do, q, k, v, o, lse, qo, ko, None, spec)
    assert launched[1:] == [triton_attention.attn_bwd_dq_kernel, triton_attention.attn_bwd_dkdv_kernel]
    for got, want, name in zip(fused, general, ("dq", "dk", "dv")):
        assert got.dtype == dtype
        assert_close(got, want, TOL[dtype], name)


def record_grids(monkeypatch) -> list[tuple[str, tuple]]:
    """``(kernel name, grid)`` of every kernel launched from now on (the list is filled as they launch)."""
    from gem_kernels.ops.triton import _tuning

    grids, launch = [], _tuning._launch
    monkeypatch.setattr(_tuning, "_launch", lambda kernel, grid, *a: grids.append((kernel.fn.__name__, grid))
                        or launch(kernel, grid, *a))
    return grids


@pytest.mark.parametrize("mask", ["full", "causal", "window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grid_over_the_real_tiles_equals_the_declared_max_grid(mask, dtype, monkeypatch):
    """The general kernels' grid over the real tiles (each program finds its sequence and tile among the offsets)
    gives bit for bit the output and gradients of the grid sized by the declared max length: empty sequences first,
    in the middle and last, lengths no multiple of the tile, a declared max far above the real one. And it launches
    cdiv(T, tile) + B programs a head, where the other launches cdiv(max, tile) x B."""
    from gem_kernels.ops.triton import _tuning, triton_attention

    lengths = [0, 37, 0, 5, 16, 70, 0]
    off = offsets_of(lengths)
    T, B, max_len = int(off[-1]), len(lengths), 300
    q, k, v = (rand(T, 2, 16, dtype=dtype, scale=0.5) for _ in range(3))
    do = rand(T, 2, 16, dtype=dtype)
    grids = record_grids(monkeypatch)

    def run():
        monkeypatch.setattr(_tuning, "_PLANS", {})
        grids.clear()
        o = jagged_flash_attention(q, k, v, off, max_len, causal=mask == "causal", window=9 if mask == "window" else
                                   None, kernel="triton")
        return (o, *grads(o, [q, k, v], do)), dict(grids)

    compact, compact_grids = run()
    monkeypatch.setattr(triton_attention, "COMPACT_MAX_SEQS", 0)
    declared, declared_grids = run()
    for got, want, name in zip(compact, declared, ("out", "dq", "dk", "dv")):
        assert torch.equal(got, want), name
    tile = 16  # the interpreter's tiles
    real = -(-T // tile) + B
    assert {name: grid[:2] for name, grid in compact_grids.items()} == {
        "attn_fwd_kernel": (real, 1), "attn_bwd_dq_kernel": (real, 1), "attn_bwd_dkdv_kernel": (real, 1)}
    assert {name: grid[:2] for name, grid in declared_grids.items()} == {
        "attn_fwd_kernel": (-(-max_len // tile), B), "attn_bwd_dq_kernel": (-(-max_len // tile), B),
        "attn_bwd_dkdv_kernel": (-(-max_len // tile), B)}


@pytest.mark.parametrize("case", ["cross", "cross_index", "diagonal"])
def test_short_kv_forward_grid_over_the_real_runs_equals_the_declared_max_grid(case, monkeypatch):
    """The one-key-tile forward (short kv sequences, diagonal blocks), whose programs stream Q_TILES query tiles each,
    runs over the real runs of Q_TILES tiles: bit for bit the output and LSE of the grid sized by the declared max
    length (empty sequences first, in the middle and last, a shared kv sequence, lengths no multiple of the run),
    with cdiv(T, run) + B programs a head where the other launches cdiv(max, run) x B."""
    from gem_kernels.ops.triton import _tuning, triton_attention
    from gem_kernels.ops.triton.triton_attention import AttnSpec, attention_forward

    lengths = [0, 37, 0, 5, 16, 70, 0]
    qo = offsets_of(lengths)
    T, B, max_q = int(qo[-1]), len(lengths), 300
    q = rand(T, 2, 16, scale=0.5)
    if case == "diagonal":  # blocks of 16 tokens, each seeing itself
        k, v, ko, kv_index = rand(T, 2, 16, scale=0.5), rand(T, 2, 16), qo, None
        spec = AttnSpec(max_q=max_q, max_kv=max_q, nq=None, activations=("softmax", "gelu"), sm_scale=0.25,
                        pw_scale=1 / 16, block_size=16, window_blocks=1)
    else:
        kv_lengths = [3, 9, 0, 16, 1, 7, 2] if case == "cross" else [9, 0, 16]
        ko = offsets_of(kv_lengths)
        kv_index = None if case == "cross" else torch.tensor([0, 2, 1, 0, 2, 0, 1])
        k, v = rand(int(ko[-1]), 2, 16, scale=0.5), rand(int(ko[-1]), 2, 16)
        spec = AttnSpec(max_q=max_q, max_kv=16, nq=None, activations=("softmax", "gelu"), sm_scale=0.25,
                        pw_scale=1 / 16)
    grids = record_grids(monkeypatch)

    def run():
        monkeypatch.setattr(_tuning, "_PLANS", {})
        grids.clear()
        return attention_forward(q, k, v, qo, ko, kv_index, spec), list(grids)

    compact, compact_grids = run()
    monkeypatch.setattr(triton_attention, "COMPACT_MAX_SEQS", 0)
    declared, declared_grids = run()
    assert torch.equal(compact[0], declared[0]), "out"
    assert torch.equal(compact[1][:, 0], declared[1][:, 0]), "lse"  # (the softmax head's: a gelu head writes none)
    run_rows = 16 * 2  # the interpreter's query tile and Q_TILES
    one_head = ("attn_fwd_short_kv_kernel", 1)  # a launch per activation, of one head each
    assert [(name, grid[2]) for name, grid in compact_grids] == [one_head, one_head] == [
        (name, grid[2]) for name, grid in declared_grids]
    assert [grid[:2] for _, grid in compact_grids] == [(-(-T // run_rows) + B, 1)] * 2
    assert [grid[:2] for _, grid in declared_grids] == [(-(-max_q // run_rows), B)] * 2


def test_sequences_that_fill_their_declared_length_take_the_declared_grid(monkeypatch):
    """Sequences of the declared length (BlockAttention's equal lengths): a grid over the real tiles would save no
    program and cost each one its lookup, so the declared grid runs, the forward's and the backward's; sequences
    filling half of it take the real tiles. The outputs are the reference's either way."""
    from gem_kernels.ops.triton import _tuning
    from gem_kernels.ops.triton.triton_attention import COMPACT_FILL, _sparse_grid

    assert not _sparse_grid(96, 3, 32) and _sparse_grid(48, 3, 32) and COMPACT_FILL > 0.5
    grids = record_grids(monkeypatch)
    for lengths, expected in (([32, 32, 32], (2, 3)), ([16, 16, 16], (3 + 3, 1))):  # interpreter tiles of 16 rows
        off = offsets_of(lengths)
        q, k, v = (rand(int(off[-1]), 1, 16) for _ in range(3))
        monkeypatch.setattr(_tuning, "_PLANS", {})
        grids.clear()
        out = jagged_flash_attention(q, k, v, off, 32, causal=True, kernel="triton")  # causal: the general kernels
        do = rand(int(off[-1]), 1, 16)
        got = grads(out, [q, k, v], do)
        assert {name: grid[:2] for name, grid in grids} == {"attn_fwd_kernel": expected, "attn_bwd_dq_kernel": expected,
                                                           "attn_bwd_dkdv_kernel": expected}, lengths
        ref = jagged_flash_attention(q, k, v, off, 32, causal=True, kernel="pytorch")
        assert_close(out, ref, TOL[torch.float32], "out")
        for g, want, name in zip(got, grads(ref, [q, k, v], do), ("dq", "dk", "dv")):
            assert_close(g, want, TOL[torch.float32], name)


@pytest.mark.parametrize("case", ["general", "cross_short", "cross_index", "diagonal", "pma", "fp8"])
def test_sequence_major_grid_equals_the_tile_major_grid(case, monkeypatch):
    """Past CUDA's 65,535 programs along a grid's axis 1, a grid over the declared tiles numbers the sequences along
    axis 0 (SEQ_MAJOR): bit for bit the output and gradients of the tile-major grid, for every kernel whose grid runs
    over the sequences (the general forward, dQ and dK / dV; the one-key-tile forward; the one-launch and the
    broadcast queries' backward; the FP8 forward). The limit is lowered here to 6: the 7 sequences go on axis 0, and
    dK / dV over 3 shared kv sequences (kv_index) stays tile-major."""
    from gem_kernels.ops.triton import _tuning, triton_attention

    lengths = [0, 37, 5, 16, 70, 0, 23]
    off = offsets_of(lengths)
    T, B, H, D = int(off[-1]), len(lengths), 2, 16
    q, k, v = (rand(T, H, D, scale=0.5) for _ in range(3))
    own_kv = offsets_of([3, 9, 0, 16, 1, 7, 2])
    kv_short = [rand(int(own_kv[-1]), H, D, scale=0.5) for _ in range(2)]
    kv_index = torch.tensor([0, 2, 1, 0, 2, 0, 1])
    shared_kv = offsets_of([9, 0, 16])
    kv_shared = [rand(int(shared_kv[-1]), H, D, scale=0.5) for _ in range(2)]
    pq = rand(3, H, D, scale=0.5)
    calls = {
        "general": (lambda: jagged_flash_attention(q, k, v, off, 96, causal=True, kernel="triton"), [q, k, v]),
        "cross_short": (lambda: gdpa(q, *kv_short, off, own_kv, activation=["softmax", "gelu"], kernel="triton"),
                        [q, *kv_short]),
        "cross_index": (lambda: gdpa(q, *kv_shared, off, shared_kv, kv_index=kv_index, kernel="triton"),
                        [q, *kv_shared]),
        "diagonal": (lambda: block_attention(q, k, v, off, block_size=16, window_blocks=1, max_seq_len=96,
                                             kernel="triton"), [q, k, v]),
        "pma": (lambda: gdpa(pq, k, v, None, off, activation=["softmax", "gelu"], kernel="triton"), [pq, k, v]),
        "fp8": (lambda: jagged_flash_attention(q, k, v, off, 96, kernel="triton", fp8=True), [q, k, v]),
    }
    call, inputs = calls[case]
    do = None
    grids = record_grids(monkeypatch)
    monkeypatch.setattr(triton_attention, "COMPACT_MAX_SEQS", 0)  # the declared grids

    def run(axis_limit: int):
        nonlocal do
        monkeypatch.setattr(triton_attention, "MAX_GRID_YZ", axis_limit)
        monkeypatch.setattr(_tuning, "_PLANS", {})  # a plan holds the grids picked before
        grids.clear()
        out = call()
        do = torch.randn_like(out) if do is None else do
        return (out, *grads(out, inputs, do)), list(grids)

    tile_major, tile_grids = run(triton_attention.MAX_GRID_YZ)
    seq_major, seq_grids = run(6)
    for got, want, name in zip(seq_major, tile_major, ("out", "d0", "d1", "d2")):
        assert torch.equal(got, want), name
    swapped = [name for (name, grid), (_, other) in zip(seq_grids, tile_grids) if grid != other]
    general, short = {"attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"}, {"attn_fwd_short_kv_kernel"}
    one_launch = short | {"attn_bwd_short_kv_kernel"}
    assert set(swapped) == {"general": general | {"attn_fwd_kernel"}, "cross_short": one_launch,
                            "cross_index": {"attn_bwd_dq_kernel"} | short, "diagonal": one_launch,
                            "pma": short | {"attn_bwd_broadcast_q_kernel"}, "fp8": general | {"attn_fwd_fp8_kernel"}}[case]
    assert all(grid[0] == other[1] and grid[1] == other[0] and grid[2] == other[2]
               for (name, grid), (_, other) in zip(seq_grids, tile_grids) if name in swapped)
    assert all(grid[0] == B for name, grid in seq_grids if name in swapped), seq_grids


def test_a_grid_of_more_sequences_than_axis_1_holds_numbers_them_on_axis_0():
    """CUDA's limit of 65,535 programs on a grid's axes 1 and 2: more sequences go on axis 0; a grid that would
    exceed the limit either way is refused with the shape named."""
    from gem_kernels.ops.triton.triton_attention import MAX_GRID_YZ, _declared_grid, _seq_major

    assert MAX_GRID_YZ == 65535 and not _seq_major(65535) and _seq_major(65536)
    assert _declared_grid(4, 70000, 2, _seq_major(70000)) == (70000, 4, 2)
    assert _declared_grid(4, 300, 2, _seq_major(300)) == (4, 300, 2)
    with pytest.raises(ValueError, match="70000 sequences of 70000 tiles"):
        _declared_grid(70000, 70000, 2, True)


def test_the_short_kv_forward_takes_only_the_tiles_it_holds():
    """Up to SHORT_KV_MAX keys of full attention, where one K and one V tile fit SHORT_KV_BYTES: 256 keys in 16 bits
    at head dim 128, not in float32 nor at head dim 256; no blocks or windows."""
    from gem_kernels.ops.triton.triton_attention import AttnSpec, _short_kv

    def spec(**kw):
        return AttnSpec(**{**dict(max_q=4096, max_kv=256, nq=None, activations=("softmax",), sm_scale=1.0,
                                  pw_scale=1.0), **kw})

    assert _short_kv(spec(), 128, 2) and _short_kv(spec(max_kv=200), 128, 2) and _short_kv(spec(max_kv=16), 256, 4)
    assert not _short_kv(spec(), 128, 4) and not _short_kv(spec(), 256, 2)
    assert not _short_kv(spec(max_kv=257), 64, 2)
    assert not _short_kv(spec(window_left=3), 128, 2)
    assert not _short_kv(spec(max_kv=8192, block_size=64, window_blocks=1), 128, 2)


def test_the_one_launch_backward_takes_only_the_shapes_it_holds():
    """Short kv sequences up to FUSED_BWD_KV_MAX keys and independent blocks, without kv_index or broadcast queries,
    at head dims up to FUSED_BWD_HEAD_DIM_MAX (its five tiles at once would not fit wider heads)."""
    from gem_kernels.ops.triton.triton_attention import AttnSpec, _fused_backward

    def spec(**kw):
        return AttnSpec(**{**dict(max_q=4096, max_kv=64, nq=None, activations=("softmax",), sm_scale=1.0,
                                  pw_scale=1.0), **kw})

    assert _fused_backward(spec(), None, 128) and _fused_backward(spec(max_kv=8192, block_size=64, window_blocks=1),
                                                                  None, 64)
    assert not _fused_backward(spec(), None, 256)
    assert not _fused_backward(spec(max_kv=128), None, 128)
    assert not _fused_backward(spec(), torch.zeros(3, dtype=torch.int64), 128)
    assert not _fused_backward(spec(max_q=32, nq=32), None, 128)
    assert not _fused_backward(spec(max_kv=8192, block_size=64, window_blocks=2), None, 128)
    assert not _fused_backward(spec(window_left=3), None, 128)


def test_untuned_configs_fit_shared_memory(monkeypatch):
    """Every candidate of the streaming kernels plans its pipeline within SMEM_BUDGET, the first (the untuned
    default) included: a PMA dK/dV default with three 128-row K/V stages asked for more than the H200 has."""
    from gem_kernels.ops.triton import triton_attention as ta

    monkeypatch.setattr(ta, "interpreting", lambda: False)
    pma = ta.AttnSpec(max_q=32, max_kv=4096, nq=32, activations=("softmax",), sm_scale=1.0, pw_scale=1.0)
    for c in ta._broadcast_q_candidates(pma, 128, 2):
        assert 2 * 32 * 128 * 2 + c["num_stages"] * 2 * c["BLOCK_N"] * 128 * 2 <= ta.SMEM_BUDGET, c
    blocks = ta.AttnSpec(max_q=8192, max_kv=8192, nq=None, activations=("softmax",), sm_scale=1.0, pw_scale=1.0,
                         block_size=128, window_blocks=1)
    for c in ta._short_kv_candidates(blocks, 128, 2):
        assert c["num_stages"] * 3 * 128 * 128 * 2 <= ta.SMEM_BUDGET, c
    assert ta._fit_stages(3, 0, ta.SMEM_BUDGET) == 1  # one stage is the floor


def test_untuned_small_tiles_take_four_warps(monkeypatch):
    """A block size of 64 cuts the 128-row candidates to 64 x 64 tiles: they run four warps (what the H200's tuning
    picked for every tile this small), first candidate (the untuned default) included; wider tiles keep eight."""
    from gem_kernels.ops.triton import triton_attention as ta

    monkeypatch.setattr(ta, "interpreting", lambda: False)
    blocks = ta.AttnSpec(max_q=4096, max_kv=4096, nq=None, activations=("softmax",), sm_scale=1.0, pw_scale=1.0,
                         block_size=64, window_blocks=8)
    full = ta.AttnSpec(max_q=4096, max_kv=4096, nq=None, activations=("softmax",), sm_scale=1.0, pw_scale=1.0)
    for kind in ("fwd", "dkdv", "dq"):
        assert all(c["num_warps"] == 4 for c in ta._candidates(kind, blocks, 128)), kind
        assert any(c["num_warps"] == 8 for c in ta._candidates(kind, full, 128)), kind


@pytest.mark.parametrize("mode", ["pma", "cross", "self"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_key_values_match_the_references_split_ones(mode, dtype):
    """k and v passed packed (k ``[Tk, 2, H, D]``, v None: the Triton backward writes one gradient of the pack)
    give the reference's output and gradients on the split k and v."""
    off = offsets_of([19, 0, 33, 5])
    kv_off = offsets_of([3, 1, 4, 2]) if mode == "cross" else off
    T, H, D = int(off[-1]), 2, 16
    q = rand(4 if mode == "pma" else T, H, D, dtype=dtype).requires_grad_()
    kv = rand(int(kv_off[-1]), 2, H, D, dtype=dtype).requires_grad_()
    args = dict(pma=(None, off), cross=(off, kv_off), self=(off, None))[mode]
    kwargs = dict(max_seq_len_kv=40) if mode == "pma" else dict(max_seq_len_q=40, max_seq_len_kv=40, activation="gelu")
    out = gdpa(q, kv, None, *args, **kwargs, kernel="triton")
    reference = gdpa(q.float(), *kv.float().unbind(1), *args, **kwargs, kernel="pytorch")
    assert_close(out.float(), reference, TOL[dtype], "out")
    do = torch.randn(out.shape).to(dtype)
    got = torch.autograd.grad(out, (q, kv), do)
    want = torch.autograd.grad(reference, (q, kv), do.float())
    for a, e, name in zip(got, want, ("dq", "dkv")):
        assert a.dtype == dtype
        assert_close(a.float(), e, TOL[dtype], name)
    with pytest.raises(ValueError, match=r"k packed with v \(v None\) must be \[Tk, 2, H, D\], got \(57, 3, 2, 16\)"):
        gdpa(q, rand(T, 3, H, D, dtype=dtype), None, *args, **kwargs)


@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("path", ["general", "short_kv", "fp8"])
def test_a_nan_input_makes_the_rows_nan_the_reference_makes_nan(where, path):
    """A NaN in a query (every score of its row NaN) or a key: the softmax rows the reference makes NaN come out NaN
    (a NaN query's row once passed for a row that saw no key and came out 0), every other row as the reference's."""
    from gem_kernels.ops.triton import triton_attention

    lengths = [3, 17] if path != "short_kv" else [3, 9]
    q_off, kv_off = offsets_of([3, 17]), offsets_of(lengths)
    q, k, v = rand(20, 1, 16, grad=False), rand(int(kv_off[-1]), 1, 16, grad=False), rand(int(kv_off[-1]), 1, 16, grad=False)
    (q if where == "q" else k)[5, 0, 0] = float("nan")
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def fn(kernel):
        if path == "short_kv":
            return gdpa(q, k, v, q_off, kv_off, activation="softmax", max_seq_len_kv=9, kernel=kernel)
        return jagged_flash_attention(q, k, v, q_off, 17, kernel=kernel, fp8=path == "fp8")

    if path == "short_kv":
        spec = triton_attention.AttnSpec(max_q=17, max_kv=9, nq=None, activations=("softmax",), sm_scale=0.25, pw_scale=1.0)
        assert triton_attention._short_kv(spec, 16, q.element_size())
    out, ref = fn("triton"), fn("pytorch")
    nan = ref.isnan().any(-1).any(-1)
    assert nan.any() and not nan.all()
    assert torch.equal(out.isnan().any(-1).any(-1), nan)
    tol = 0.1 if path == "fp8" else TOL[torch.float32]  # FP8: the kernel against its twin, P rounded to E4M3 in one
    assert_close(out[~nan], ref[~nan], tol, f"{path} rows without NaN")
    # the backward: NaN gradients where the reference's are (a NaN row's LSE is NaN, not the no-key row's 1e30)
    do = torch.randn_like(ref)
    for g_t, g_r, name in zip(grads(out, [q, k, v], do), grads(ref, [q, k, v], do), "qkv"):
        assert torch.equal(g_t.isnan().any(-1).any(-1), g_r.isnan().any(-1).any(-1)), f"d{name}"
