"""Rotary embedding: the Triton kernel (interpreter on CPU) against the reference, gradients included, and the
embedding's defining properties."""

import math

import pytest
import torch
from conftest import triton_on_cpu
from gem_kernels_testing import assert_close

from gem_kernels import qkv_rotary, rotary
from gem_kernels.ops.pytorch.pt_rotary import pt_rotary

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,H,D", [(1, 1, 2), (37, 4, 16), (70, 2, 12), (5, 3, 128)])
def test_triton_matches_reference(T, H, D, dtype):
    """q and k are strided views of one projection output [T, 3, H, D], as attention layers produce them."""
    projection = torch.randn(T, 3, H, D).to(dtype)
    positions = torch.rand(T) * 15
    seeds = (torch.randn(T, H, D).to(dtype), torch.randn(T, H, D).to(dtype))
    outs, grads = {}, {}
    for kernel in ("triton", "pytorch"):
        qkv = projection.clone().requires_grad_()
        q, k, _ = qkv.unbind(1)
        q_rot, k_rot = rotary(q, k, positions, kernel=kernel)
        assert q_rot.dtype == dtype and q_rot.shape == (T, H, D)
        outs[kernel] = (q_rot, k_rot)
        grads[kernel] = torch.autograd.grad((q_rot, k_rot), qkv, seeds)[0]
    for a, e in zip(outs["triton"], outs["pytorch"]):
        assert_close(a, e, TOL[dtype], "out")
    assert_close(grads["triton"], grads["pytorch"], TOL[dtype], "dqkv")
    assert grads["triton"][:, 2].abs().max() == 0  # v is untouched


@triton_on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,H,D", [(1, 1, 2), (37, 4, 16), (70, 2, 12)])
def test_fused_qkv_rotary_matches_rotary_on_the_split_projection(T, H, D, dtype):
    """``qkv_rotary`` (one pass: q, k rotated and v copied contiguous; one pass back into the projection's
    gradient) against the reference ``rotary`` on ``qkv.unbind(1)``, outputs and gradients; an output that
    reaches no loss gets a zero gradient."""
    projection = torch.randn(T, 3, H, D).to(dtype)
    positions = torch.rand(T) * 15
    seeds = [torch.randn(T, H, D).to(dtype) for _ in range(3)]
    outs, grads = {}, {}
    for kernel in ("triton", "pytorch"):
        qkv = projection.clone().requires_grad_()
        out = qkv_rotary(qkv, positions, kernel=kernel)
        assert all(o.dtype == dtype and o.shape == (T, H, D) for o in out)
        outs[kernel] = out
        grads[kernel] = torch.autograd.grad(out, qkv, seeds)[0]
    assert all(o.is_contiguous() for o in outs["triton"])
    for a, e, name in zip(outs["triton"], outs["pytorch"], "qkv"):
        assert_close(a, e, TOL[dtype], f"{name} out")
    assert_close(grads["triton"], grads["pytorch"], TOL[dtype], "dqkv")
    assert torch.equal(outs["triton"][2], projection[:, 2])  # v travels unchanged
    qkv = projection.clone().requires_grad_()
    q, _, v = qkv_rotary(qkv, positions, kernel="triton")
    (q.float().sum() + v.float().sum()).backward()
    assert qkv.grad[:, 1].abs().max() == 0 and torch.equal(qkv.grad[:, 2], torch.ones_like(v))


def test_qkv_rotary_bad_shapes_are_one_line_errors():
    with pytest.raises(ValueError, match=r"qkv must be \[T, 3, H, D\] with an even head dim D, got \(4, 2, 1, 8\)"):
        qkv_rotary(torch.randn(4, 2, 1, 8), torch.zeros(4), kernel="pytorch")
    with pytest.raises(ValueError, match=r"positions must be a tensor of shape \[4\]"):
        qkv_rotary(torch.randn(4, 3, 1, 8), torch.zeros(5), kernel="pytorch")


@triton_on_cpu
def test_triton_contiguous_inputs_and_empty():
    q, k = torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    positions = torch.linspace(0, 12, 9)
    for a, e in zip(rotary(q, k, positions, base=100.0, kernel="triton"), rotary(q, k, positions, base=100.0, kernel="pytorch")):
        assert_close(a, e, 1e-5, "out")
    empty = torch.empty(0, 2, 8)
    q_rot, k_rot = rotary(empty, empty, torch.empty(0), kernel="triton")
    assert q_rot.shape == (0, 2, 8) and k_rot.shape == (0, 2, 8)


def test_reference_definition():
    """Channel pair i of a token at position p turns by p * base ** (-2i / D); position 0 is the identity."""
    D, base = 6, 10.0
    x = torch.randn(1, 1, D, dtype=torch.float64)
    p = 2.5
    out = pt_rotary(x, torch.tensor([p]), base)
    for i in range(D // 2):
        a = p * base ** (-2 * i / D)
        x0, x1 = float(x[0, 0, 2 * i]), float(x[0, 0, 2 * i + 1])
        assert math.isclose(float(out[0, 0, 2 * i]), x0 * math.cos(a) - x1 * math.sin(a), rel_tol=1e-5, abs_tol=1e-6)
        assert math.isclose(float(out[0, 0, 2 * i + 1]), x0 * math.sin(a) + x1 * math.cos(a), rel_tol=1e-5, abs_tol=1e-6)
    torch.testing.assert_close(pt_rotary(x, torch.zeros(1), base), x)


def test_scores_depend_on_position_differences_only():
    q, k = torch.randn(1, 2, 8), torch.randn(1, 2, 8)

    def score(pq, pk):
        q_rot, _ = rotary(q, q, torch.tensor([pq]), kernel="pytorch")
        k_rot, _ = rotary(k, k, torch.tensor([pk]), kernel="pytorch")
        return (q_rot * k_rot).sum(-1)

    torch.testing.assert_close(score(3.0, 1.0), score(7.5, 5.5), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(3.0, 1.0), score(3.0, 2.0))


def test_builtin_is_the_reference_on_cpu():
    q, k, positions = torch.randn(11, 2, 8), torch.randn(11, 2, 8), torch.rand(11) * 5
    for a, e in zip(rotary(q, k, positions, kernel="builtin"), rotary(q, k, positions, kernel="pytorch")):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("bad,match", [
    (dict(q=torch.randn(4, 2, 7), k=torch.randn(4, 2, 7)), "even head dim"),
    (dict(k=torch.randn(5, 2, 8)), "same shape"),
    (dict(positions=torch.rand(3)), r"positions must be a tensor of shape \[4\]"),
    (dict(positions=torch.arange(4)), "floating tensor"),
    (dict(positions=torch.rand(4, requires_grad=True)), "positions require grad"),
    (dict(base=1.0), "base must be a finite number > 1"),
    (dict(kernel="cuda"), "kernel must be one of"),
    (dict(q=torch.randn(4, 8)), r"q must have rank 3"),
])
def test_bad_inputs(bad, match):
    args = dict(q=torch.randn(4, 2, 8), k=torch.randn(4, 2, 8), positions=torch.rand(4), base=10.0, kernel="pytorch")
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        rotary(**args)
