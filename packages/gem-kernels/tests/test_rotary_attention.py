"""qkv_rotary_attention: the fused Triton path (rotation in the projection's buffer, the gradient written whole and its
dq, dk rotated back where they lie; interpreter on CPU) against the composition it stands for, qkv_rotary then the
attention op, on the reference kernels."""

import pytest
import torch
from conftest import triton_on_cpu
from gem_kernels_testing import assert_close

from gem_kernels import block_attention, jagged_flash_attention, qkv_rotary, qkv_rotary_attention

TOL = {torch.float32: 2e-5, torch.float16: 1e-2}
OFFSETS = torch.tensor([0, 5, 45, 46, 80])


def _composed(qkv, positions, mode):
    q, k, v = qkv_rotary(qkv, positions, 10.0, kernel="pytorch")
    if mode == "block":
        return block_attention(q, k, v, OFFSETS, block_size=16, window_blocks=2, max_seq_len=40, kernel="pytorch")
    return jagged_flash_attention(q, k, v, OFFSETS, 40, window=mode, kernel="pytorch")


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["block", None, 7])
def test_fused_path_matches_rotary_then_attention(mode, dtype):
    torch.manual_seed(0)
    projection = (0.5 * torch.randn(80, 3, 2, 16)).to(dtype)
    positions = torch.rand(80) * 12
    seed = torch.randn(80, 2, 16).to(dtype)
    kwargs = dict(block_size=16, window_blocks=2) if mode == "block" else dict(window=mode)
    leaf = projection.clone().requires_grad_()
    # a projection's output reshaped, as models produce it: the fused path rotates it where it lies
    qkv = (leaf.view(80, -1) * 1.0).view(80, 3, 2, 16)
    out = qkv_rotary_attention(qkv, positions, OFFSETS, 40, **kwargs, kernel="triton")
    assert out.dtype == dtype and out.shape == (80, 2, 16)
    (grad,) = torch.autograd.grad(out, leaf, seed)
    reference = projection.float().requires_grad_()
    expected = _composed(reference, positions, mode)
    (expected_grad,) = torch.autograd.grad(expected, reference, seed.float())
    assert_close(out.float(), expected, TOL[dtype], "out")
    assert_close(grad.float(), expected_grad, TOL[dtype], "dqkv")
    # the buffer now holds the rotated q and k, and v as it was
    q_rot, k_rot, _ = qkv_rotary(projection, positions, 10.0, kernel="pytorch")
    assert_close(qkv[:, 0].detach(), q_rot, TOL[dtype], "q in place")
    assert torch.equal(qkv[:, 2].detach(), projection[:, 2])


@triton_on_cpu
def test_a_reference_saved_before_the_rotation_fails_in_backward():
    """The buffer is rotated in place: a tensor saved from it earlier would read rotated values, so its backward
    fails (autograd's version check) rather than computing with them."""
    qkv = (torch.randn(80, 3 * 32, requires_grad=True) * 1.0)
    saved_earlier = qkv.sin()  # sin's backward reads its input
    out = qkv_rotary_attention(qkv.view(80, 3, 2, 16), torch.rand(80), OFFSETS, 40, block_size=16, kernel="triton")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.sum() + saved_earlier.sum()).backward()


def test_reference_path_leaves_the_projection_and_bad_inputs_are_one_line_errors():
    projection = torch.randn(80, 3, 2, 16)
    positions = torch.rand(80)
    qkv = projection.clone()
    out = qkv_rotary_attention(qkv, positions, OFFSETS, 40, block_size=16, kernel="pytorch")
    assert torch.equal(qkv, projection) and out.shape == (80, 2, 16)
    with pytest.raises(ValueError, match=r"qkv must be \[T, 3, H, D\] with an even head dim D, got \(80, 2, 2, 16\)"):
        qkv_rotary_attention(projection[:, :2], positions, OFFSETS, 40, kernel="pytorch")
    with pytest.raises(ValueError, match="block_size and window exclude each other"):
        qkv_rotary_attention(qkv, positions, OFFSETS, 40, block_size=16, window=3, kernel="pytorch")
    with pytest.raises(ValueError, match=r"positions must be a tensor of shape \[80\]"):
        qkv_rotary_attention(qkv, positions[:5], OFFSETS, 40, kernel="pytorch")
    with pytest.raises(ValueError, match="max_seq_len must be a positive int, got 0"):
        qkv_rotary_attention(qkv, positions, OFFSETS, 0, kernel="pytorch")
