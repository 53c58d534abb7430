"""Shared plumbing of the attention ops: resolve defaults, pick the kernel, run it."""

from __future__ import annotations

import math

import torch

from gem_kernels.ops import _validation as V
from gem_kernels.ops.pytorch.pt_activations import ACTIVATIONS
from gem_kernels.ops.pytorch.pt_gdpa import pt_attention


def resolve_activations(activation: str | list[str] | tuple[str, ...], num_heads: int) -> tuple[str, ...]:
    if not isinstance(activation, (str, list, tuple)):
        raise ValueError(f"activation must be a name or a list of one per head, got {activation!r}")
    acts = (activation,) * num_heads if isinstance(activation, str) else tuple(activation)
    if len(acts) != num_heads:
        raise ValueError(f"activation has {len(acts)} entries but q has {num_heads} heads")
    for a in acts:
        if a not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {a!r}")
    return acts


def bounded_mask(max_q: int, max_kv: int, window_left: int | None, window_right: int | None, block_size: int | None,
                 window_blocks: int | None) -> tuple[int | None, int | None, int | None, int | None]:
    """The mask arguments with a window or block wider than the longest declared sequence cut to it: the same mask
    (such a window or block spans every sequence), in numbers the kernels' 32-bit index arithmetic (and the
    reference's 64-bit one) cannot overflow (a window of 2**31 - 1, meaning "unbounded", read out of bounds)."""
    longest = max(max_q, max_kv, 1)
    if block_size is not None:
        block_size = min(block_size, longest)
        if window_blocks is not None:
            window_blocks = min(window_blocks, -(-longest // block_size))
    return (None if window_left is None else min(window_left, longest),
            None if window_right is None else min(window_right, longest), block_size, window_blocks)


def run_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    kv_offsets: torch.Tensor,
    kv_index: torch.Tensor | None,
    *,
    max_q: int,
    max_kv: int,
    activations: tuple[str, ...],
    sm_scale: float,
    pw_scale: float,
    kernel: str,
    window_left: int | None = None,
    window_right: int | None = None,
    block_size: int | None = None,
    window_blocks: int | None = None,
    fp8: bool = False,
    kv: torch.Tensor | None = None,
) -> torch.Tensor:
    """kv: the ``[Tk, 2, H, D]`` tensor whose slots k and v are (a fused key-value projection); the Triton backward
    then writes their gradient in one buffer."""
    head_dim = q.shape[2]
    window_left, window_right, block_size, window_blocks = bounded_mask(max_q, max_kv, window_left, window_right,
                                                                        block_size, window_blocks)
    if fp8:
        return _run_fp8(q, k, v, kv_offsets, max_kv, sm_scale, kernel, window_left, window_right, block_size, window_blocks)
    if kernel == "builtin":
        from gem_kernels.ops.pytorch.builtin import builtin_attention

        return builtin_attention(
            q, k, v, q_offsets, kv_offsets, max_q, max_kv, list(activations), sm_scale, pw_scale,
            kv_index=kv_index, window_left=window_left, window_right=window_right, block_size=block_size,
            window_blocks=window_blocks,
        )
    use_triton = V.use_triton(kernel, q.device)
    if use_triton and kernel == "auto":
        try:
            V.check_triton_head_dim("q", head_dim)
        except ValueError:
            use_triton = False  # auto falls back to the reference for shapes the kernel does not cover
    empty = q.shape[0] == 0 or k.shape[0] == 0
    if use_triton and not empty:
        V.check_triton_head_dim("q", head_dim)
        V.check_triton_device("q", q)
        from gem_kernels.ops.triton.triton_attention import AttnSpec, triton_attention, triton_packed_kv_attention

        spec = AttnSpec(
            max_q=max_q, max_kv=max_kv, nq=None if q_offsets is not None else q.shape[0],
            activations=activations, sm_scale=float(sm_scale), pw_scale=float(pw_scale),
            window_left=window_left, window_right=window_right, block_size=block_size,
            window_blocks=window_blocks,
        )
        # the kernels read the index tensors with unit stride (a view with another stride passes every check)
        q_offsets, kv_offsets, kv_index = (None if t is None else t.contiguous() for t in (q_offsets, kv_offsets, kv_index))
        if kv is not None:
            return triton_packed_kv_attention(q, kv, q_offsets, kv_offsets, kv_index, spec)
        return triton_attention(q, k, v, q_offsets, kv_offsets, kv_index, spec)
    return pt_attention(
        q, k, v, q_offsets, kv_offsets, max_q, max_kv, list(activations), sm_scale, pw_scale,
        kv_index=kv_index, window_left=window_left, window_right=window_right, block_size=block_size,
        window_blocks=window_blocks,
    )


def fp8_attention_spec(max_len: int, heads: int, sm_scale: float, window_left: int | None = None,
                       window_right: int | None = None, block_size: int | None = None,
                       window_blocks: int | None = None):
    """The ``AttnSpec`` of FP8 self-attention: softmax heads over jagged sequences of at most ``max_len``."""
    from gem_kernels.ops.triton.triton_attention import AttnSpec

    return AttnSpec(max_q=max_len, max_kv=max_len, nq=None, activations=("softmax",) * heads, sm_scale=float(sm_scale),
                    pw_scale=1.0, window_left=window_left, window_right=window_right, block_size=block_size,
                    window_blocks=window_blocks)


def _run_fp8(q, k, v, offsets, max_len, sm_scale, kernel, window_left, window_right, block_size, window_blocks):
    """Softmax self-attention with FP8 Q, K, V (``ops/triton/triton_fp8_attention``), forward and backward (the
    exact gradient at the quantised operands, the quantiser passing gradients through unchanged); the reference
    twin (``kernel="pytorch"``, and ``"auto"`` off CUDA) runs the exact reference on the dequantised operands."""
    if kernel == "builtin":
        raise ValueError("fp8=True runs kernel 'auto', 'triton' or 'pytorch', not 'builtin'")
    spec = fp8_attention_spec(max_len, q.shape[1], sm_scale, window_left, window_right, block_size, window_blocks)
    use_triton = V.use_triton(kernel, q.device)
    if use_triton and kernel == "auto":
        try:
            V.check_triton_head_dim("q", q.shape[2])
        except ValueError:
            use_triton = False  # as run_attention: auto falls back to the reference for shapes the kernel does not cover
    if use_triton and q.shape[0]:
        V.check_triton_head_dim("q", q.shape[2])
        V.check_triton_device("q", q)
        from gem_kernels.ops.triton.triton_fp8_attention import triton_fp8_attention

        return triton_fp8_attention(q.contiguous(), k.contiguous(), v.contiguous(), offsets.contiguous(), max_len, spec)
    from gem_kernels.fp8 import fp8_attention_dequantize, fp8_attention_operands

    with torch.no_grad():
        quantized = fp8_attention_dequantize(fp8_attention_operands(q, k, v, kernel="pytorch"), q.shape, torch.float32,
                                             kernel="pytorch")
    # the quantiser's straight-through gradient: the values of the dequantised operands, the gradient of the inputs
    dq, dk, dv = (x.float() + (xq - x.float()).detach() for x, xq in zip((q, k, v), quantized))
    out = pt_attention(dq, dk, dv, offsets, offsets, max_len, max_len, list(spec.activations), spec.sm_scale, 1.0,
                       window_left=window_left, window_right=window_right, block_size=block_size,
                       window_blocks=window_blocks)
    return out.to(q.dtype)


def default_sm_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
