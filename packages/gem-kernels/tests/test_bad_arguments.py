"""Bad arguments to the attention ops and norms: each raises a one-line ValueError naming the argument."""

import math

import pytest
import torch
from conftest import triton_on_cpu
from gem_kernels_testing import offsets_of, rand

from gem_kernels import block_attention, gdpa, jagged_flash_attention, layer_norm, rms_norm
from gem_kernels.fp8_mlp import fp8_layer_norm
from gem_kernels.ops import layer_norm_pair, qkv_rotary_attention, rotary


TRITON = pytest.param("triton", marks=triton_on_cpu)  # kernels that run, not only check their arguments


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
@pytest.mark.parametrize("kernel", ["pytorch", TRITON])
def test_norm_eps_zero_allowed(kernel):
    x, w = torch.randn(3, 16), torch.ones(16)
    y = rms_norm(x, w, eps=0.0, kernel=kernel)
    assert torch.isfinite(y).all()
    y = layer_norm(x, w, None, eps=0, kernel=kernel)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "0.5", True, torch.tensor([0.5, 0.25])])
def test_attention_scale_must_be_a_finite_number(scale):
    q, k, v = _qkv(7)
    off = offsets_of([3, 4])
    for call in (lambda: jagged_flash_attention(q, k, v, off, 4, scale=scale, kernel="pytorch"),
                 lambda: gdpa(q, k, v, off, activation="relu", scale=scale, kernel="pytorch"),
                 lambda: block_attention(q, k, v, off, block_size=2, scale=scale, kernel="pytorch")):
        with pytest.raises(ValueError, match="scale must be None or a finite real number") as err:
            call()
        _one_line(err)


@pytest.mark.parametrize("base", [float("inf"), float("nan"), True, 1.0])
def test_rotary_base_must_be_finite_and_above_one(base):
    q, k, _ = _qkv(4)
    with pytest.raises(ValueError, match="base must be a finite number > 1") as err:
        rotary(q, k, torch.rand(4), base=base, kernel="pytorch")
    _one_line(err)


@pytest.mark.parametrize("kernel", ["pytorch", TRITON])
def test_strided_index_tensors_read_as_their_values(kernel):
    """Offsets and kv_index that are views with another stride (they pass every check on their values) give what
    their contiguous copies give: the kernels read index tensors with unit stride."""
    q, k, v = _qkv(7)
    offsets, strided = torch.tensor([0, 3, 7]), torch.tensor([0, 99, 3, 99, 7])[::2]
    assert strided.stride(0) == 2 and torch.equal(strided, offsets)
    ref = jagged_flash_attention(q, k, v, offsets, 4, kernel="pytorch")
    assert torch.allclose(jagged_flash_attention(q, k, v, strided, 4, kernel=kernel), ref, atol=1e-5)
    assert torch.allclose(block_attention(q, k, v, strided, block_size=2, kernel=kernel),
                          block_attention(q, k, v, offsets, block_size=2, kernel="pytorch"), atol=1e-5)
    qo, ko = torch.tensor([0, 2, 7]), torch.tensor([0, 3, 5])
    kv_index = torch.tensor([1, 7, 0, 7])[::2]  # [1, 0]
    cross = gdpa(q, k[:5], v[:5], qo, ko, kv_index=kv_index.contiguous(), kernel="pytorch")
    assert torch.allclose(gdpa(q, k[:5], v[:5], torch.tensor([0, 9, 2, 9, 7])[::2], ko, kv_index=kv_index,
                               kernel=kernel), cross, atol=1e-5)


@pytest.mark.parametrize("kernel", ["pytorch", "builtin", TRITON])
def test_a_non_finite_row_stays_in_its_own_sequence(kernel):
    """The references pad each sequence with other sequences' rows: a NaN there must not reach the shorter
    sequence's outputs (a product with the zero mask keeps NaN)."""
    q, k, v = _qkv(7)
    off = offsets_of([3, 4])
    v[3] = float("nan")  # the first row of sequence 1
    if kernel != "builtin":
        out = jagged_flash_attention(q, k, v, off, 4, kernel=kernel)
        assert out[:3].isfinite().all() and out[3:].isnan().any()
    qo, ko = offsets_of([3, 4]), offsets_of([2, 3])
    cross = gdpa(q, k[:5], v[:5].clone().index_fill_(0, torch.tensor([2]), float("nan")), qo, ko, activation="relu",
                 kernel=kernel)
    assert cross[:3].isfinite().all() and cross[3:].isnan().any()


@triton_on_cpu
@pytest.mark.parametrize("op", ["jfa causal", "blocks of 16", "relu window 2"])
def test_a_non_finite_row_stays_in_its_own_sequence_through_16_bit_tiles(op):
    """16-bit inputs take the kernels' descriptor (TMA) loads, which read whole tiles: a tile that runs past a
    sequence reads the next one's rows. An inf in the next sequence's V (forward) or a NaN in its output gradient
    (backward) must not reach this sequence through the zero probabilities that mask them (0 * inf = NaN)."""
    off = offsets_of([3, 5])
    calls = {"jfa causal": lambda q, k, v, kernel: jagged_flash_attention(q, k, v, off, 5, causal=True, kernel=kernel),
             "blocks of 16": lambda q, k, v, kernel: block_attention(q, k, v, off, block_size=16, kernel=kernel),
             "relu window 2": lambda q, k, v, kernel: gdpa(q, k, v, off, activation="relu", window=2, kernel=kernel)}
    call = calls[op]
    q, k, v = (rand(8, 1, 16, grad=True, dtype=torch.float16) for _ in range(3))
    with torch.no_grad():
        poisoned = v.clone()
        poisoned[3] = float("inf")  # the first row of sequence 1
        out = call(q, k, poisoned, "triton")
    assert out[:3].isfinite().all() and torch.allclose(out[:3], call(q, k, poisoned, "pytorch")[:3], atol=2e-2, rtol=2e-2)
    do = torch.randn(8, 1, 16, dtype=torch.float16)
    do[4] = float("nan")  # an output gradient of sequence 1
    grads = torch.autograd.grad(call(q, k, v, "triton"), (q, k, v), do)
    expected = torch.autograd.grad(call(q, k, v, "pytorch"), (q, k, v), do)
    for name, got, want in zip("qkv", grads, expected):
        assert got[:3].isfinite().all() and torch.allclose(got[:3], want[:3], atol=2e-2, rtol=2e-2), name


@pytest.mark.parametrize("kernel", ["pytorch", TRITON])
def test_windows_and_blocks_wider_than_every_sequence_mean_unbounded(kernel):
    """A window of 2**31 - 1 (a natural "unbounded") or a block span past 32 bits is the unbounded mask: the kernels'
    32-bit index arithmetic overflowed (reads before the sequence, or another mask), the reference's int64 one at
    2**63 - 1."""
    q, k, v = _qkv(9)
    off = offsets_of([4, 5])
    full = jagged_flash_attention(q, k, v, off, 5, kernel="pytorch")
    causal = jagged_flash_attention(q, k, v, off, 5, causal=True, kernel="pytorch")
    for window in (2**31 - 1, 2**63 - 1):
        assert torch.allclose(jagged_flash_attention(q, k, v, off, 5, window=window, kernel=kernel), full, atol=1e-5)
        assert torch.allclose(jagged_flash_attention(q, k, v, off, 5, window=window, causal=True, kernel=kernel), causal,
                              atol=1e-5)
    blocks = block_attention(q, k, v, off, block_size=2, window_blocks=3, kernel="pytorch")  # every earlier block
    assert torch.allclose(block_attention(q, k, v, off, block_size=2, window_blocks=2**27, kernel=kernel, scale=1 / 6),
                          block_attention(q, k, v, off, block_size=2, window_blocks=3, kernel=kernel, scale=1 / 6), atol=1e-5)
    assert torch.allclose(block_attention(q, k, v, off, block_size=2, window_blocks=2**29, kernel=kernel), blocks, atol=1e-5)
    one_block = block_attention(q, k, v, off, block_size=5, kernel="pytorch")  # a block the whole sequence
    assert torch.allclose(block_attention(q, k, v, off, block_size=2**30, window_blocks=2, kernel=kernel), one_block,
                          atol=1e-5)


@pytest.mark.parametrize("kernel", ["pytorch", TRITON])
@pytest.mark.parametrize("causal", [False, True])  # the one-key-tile kernel, the general one
def test_rows_whose_scores_are_all_very_negative_still_average_their_values(kernel, causal):
    """Softmax is shift-invariant: a row whose every scaled score is about -1e6 (a large scale, or activations of
    hundreds) averages its values as any other. The kernels took a running max below -5e5 for a row that saw no key
    and output 0."""
    q, k = torch.ones(5, 1, 16), -torch.ones(5, 1, 16)
    k[:, :, 0] -= torch.arange(5.0)[:, None]  # distinct scores: not a uniform average
    v = rand(5, 1, 16, grad=False)
    off = offsets_of([5])
    out = jagged_flash_attention(q, k, v, off, 5, causal=causal, scale=4e4, kernel=kernel)
    expected = torch.softmax(4e4 * (q[:, 0] @ k[:, 0].T).masked_fill(torch.ones(5, 5).triu(1).bool() & causal, -math.inf), -1)
    assert torch.allclose(out[:, 0], expected @ v[:, 0], atol=1e-5)


def test_an_activation_that_is_not_a_name_is_a_one_line_error():
    q, k, v = _qkv(7)
    with pytest.raises(ValueError, match="^activation must be a name or a list of one per head, got None$"):
        gdpa(q, k, v, offsets_of([3, 4]), activation=None)


@triton_on_cpu
def test_norms_read_strided_affine_parameters_as_their_values():
    x = rand(4, 16, grad=False)
    w, b = rand(32, grad=False)[::2], rand(32, grad=False)[::2]
    assert torch.allclose(layer_norm(x, w, b, kernel="triton"), layer_norm(x, w, b, kernel="pytorch"), atol=1e-5)
    assert torch.allclose(rms_norm(x, w, kernel="triton"), rms_norm(x, w, kernel="pytorch"), atol=1e-5)
    pair = layer_norm_pair(x, (w, b), (w.contiguous(), b), kernel="triton")
    assert torch.allclose(pair[0], layer_norm_pair(x, (w, b), (w.contiguous(), b), kernel="pytorch")[0], atol=1e-5)


@pytest.mark.parametrize("kernel", ["pytorch", "builtin", TRITON])
def test_rms_norm_returns_x_dtype_with_a_wider_weight(kernel):
    x = rand(4, 16, grad=False).half()
    assert rms_norm(x, torch.randn(16), kernel=kernel).dtype == torch.float16


def test_fp8_attention_auto_falls_back_for_head_dims_the_kernel_does_not_take(monkeypatch):
    """As without fp8: "auto" runs the reference twin where the Triton kernels do not cover the shape."""
    from gem_kernels.ops import _validation as V

    q, k, v = _qkv(7, D=24)
    off = offsets_of([3, 4])
    ref = jagged_flash_attention(q, k, v, off, 4, kernel="pytorch", fp8=True)
    monkeypatch.setattr(V, "use_triton", lambda kernel, device: kernel in ("auto", "triton"))  # as on CUDA
    assert torch.equal(jagged_flash_attention(q, k, v, off, 4, kernel="auto", fp8=True), ref)
    with pytest.raises(ValueError, match="head dim 24 is unsupported"):
        jagged_flash_attention(q, k, v, off, 4, kernel="triton", fp8=True)


def test_qkv_rotary_reference_returns_v_as_its_own_tensor():
    from gem_kernels.ops import qkv_rotary

    qkv = rand(7, 3, 2, 16, grad=False)
    out = qkv_rotary(qkv, torch.rand(7), kernel="pytorch")
    assert all(t.is_contiguous() for t in out) and out[2].data_ptr() != qkv[:, 2].data_ptr()
    assert torch.equal(out[2], qkv[:, 2])


@pytest.mark.parametrize("kernel", ["pytorch", TRITON, "auto"])
def test_a_batch_of_no_sequences_gives_empty_outputs_and_gradients(kernel):
    """offsets [0]: a rank's empty share of a short last batch (several ranks evaluating). Every attention op returns
    its empty output ([0, Nq, H, D] for PMA's learned queries) and a backward through it runs."""
    none = torch.zeros(1, dtype=torch.int64)

    def empty(*shape):
        return rand(0, *shape).requires_grad_()

    seeds = rand(3, 2, 16).requires_grad_()
    cases = [
        (gdpa(empty(2, 16), empty(2, 16), empty(2, 16), none, kernel=kernel), (0, 2, 16)),
        (gdpa(empty(2, 16), empty(2, 16), empty(2, 16), none, none, max_seq_len_q=4, max_seq_len_kv=4, kernel=kernel),
         (0, 2, 16)),
        (gdpa(seeds, empty(2, 16), empty(2, 16), None, none, kernel=kernel), (0, 3, 2, 16)),
        (jagged_flash_attention(empty(2, 16), empty(2, 16), empty(2, 16), none, 4, causal=True, kernel=kernel), (0, 2, 16)),
        (jagged_flash_attention(empty(2, 16), empty(2, 16), empty(2, 16), none, 4, kernel=kernel, fp8=True), (0, 2, 16)),
        (block_attention(empty(2, 16), empty(2, 16), empty(2, 16), none, 4, 1, max_seq_len=None, kernel=kernel), (0, 2, 16)),
        (qkv_rotary_attention(empty(3, 2, 16) * 1.0, torch.zeros(0), none, 4, block_size=4, kernel=kernel), (0, 2, 16)),
    ]
    for out, shape in cases:
        assert tuple(out.shape) == shape
        out.sum().backward()
    assert seeds.grad is None or not seeds.grad.any()
    with pytest.raises(ValueError, match=r"offsets must be 1-D with batch\+1 >= 1 entries"):
        jagged_flash_attention(empty(2, 16), empty(2, 16), empty(2, 16), torch.zeros(0, dtype=torch.int64), 4, kernel=kernel)
    with pytest.raises(ValueError, match=r"offsets must start at 0, got 3"):
        jagged_flash_attention(empty(2, 16), empty(2, 16), empty(2, 16), torch.tensor([3]), 4, kernel=kernel)
    with pytest.raises(ValueError, match=r"offsets\[-1\] must equal the number of tokens 3, got 0"):
        jagged_flash_attention(rand(3, 2, 16), rand(3, 2, 16), rand(3, 2, 16), none, 4, kernel=kernel)
