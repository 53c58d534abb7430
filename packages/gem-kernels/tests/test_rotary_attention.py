"""qkv_rotary_attention: the fused Triton path (rotation in the projection's buffer, dq and dk rotated back inside the
attention backward kernels; interpreter on CPU) against the composition it stands for, qkv_rotary then the attention
op, on the reference kernels."""

import pytest
import torch
from conftest import requires_triton
from gem_kernels_testing import assert_close

from gem_kernels import block_attention, jagged_flash_attention, qkv_rotary, qkv_rotary_attention

TOL = {torch.float32: 2e-5, torch.float16: 1e-2}
OFFSETS = torch.tensor([0, 5, 45, 46, 80])


def _composed(qkv, positions, mode):
    q, k, v = qkv_rotary(qkv, positions, 10.0, kernel="pytorch")
    if mode == "block":
        return block_attention(q, k, v, OFFSETS, block_size=16, window_blocks=2, max_seq_len=40, kernel="pytorch")
    return jagged_flash_attention(q, k, v, OFFSETS, 40, window=mode, kernel="pytorch")


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["block", None, 7])
def test_fused_path_matches_rotary_then_attention(mode, dtype):
    torch.manual_seed(0)
    projection = (0.5 * torch.randn(80, 3, 2, 16)).to(dtype)
    positions = torch.rand(80) * 12
    seed = torch.randn(80, 2, 16).to(dtype)
    kwargs = dict(block_size=16, window_blocks=2) if mode == "block" else dict(window=mode)
    leaf = projection.clone().requires_grad_()
    qkv = leaf * 1.0  # an intermediate, as a projection's output is: the fused path rotates it where it lies
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


@requires_triton
def test_gradient_of_the_rotated_projection_read_beside_the_attention():
    """The rotated projection the fused Function leaves behind carries its own gradient back (rotated back)."""
    from gem_kernels.ops.triton.triton_attention import AttnSpec
    from gem_kernels.ops.triton.triton_rotary_attention import _TritonQkvRotaryAttention

    torch.manual_seed(1)
    projection = 0.5 * torch.randn(80, 3, 2, 16)
    positions = torch.rand(80) * 12
    spec = AttnSpec(max_q=40, max_kv=40, nq=None, activations=("softmax", "softmax"), sm_scale=0.25, pw_scale=1.0,
                    block_size=16, window_blocks=2)
    seeds = torch.randn(80, 2, 16), torch.randn(80, 3, 2, 16)
    leaf = projection.clone().requires_grad_()
    out, rotated = _TritonQkvRotaryAttention.apply(leaf * 1.0, positions, OFFSETS, spec, 10.0)
    (grad,) = torch.autograd.grad((out, rotated), leaf, seeds)
    reference = projection.clone().requires_grad_()
    q, k, v = qkv_rotary(reference, positions, 10.0, kernel="pytorch")
    expected = block_attention(q, k, v, OFFSETS, 16, 2, max_seq_len=40, scale=0.25, kernel="pytorch")
    (expected_grad,) = torch.autograd.grad((expected, torch.stack([q, k, v], 1)), reference, seeds)
    assert_close(out, expected, 2e-5, "out")
    assert_close(grad, expected_grad, 2e-5, "dqkv")


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
