"""Self-attention over a fused projection ``qkv [T, 3, H, D]`` with rotary queries and keys, in the projection's
own buffer, forward and backward.

Rotating q and k into new tensors (``qkv_rotary``) reads and writes the whole projection once forward, and its
backward packs the three gradients into the projection's gradient in another pass. Here the rotation is done
where q and k lie (v is not touched), the attention kernels read q, k and v as strided views of the buffer, and
the backward kernels write dq, dk and dv straight into the slots of one ``[T, 3, H, D]`` gradient, dq and dk taken
back through the rotation just before they are stored.
"""

from __future__ import annotations

import torch

from gem_kernels.ops.triton.triton_attention import AttnSpec, attention_backward, attention_forward
from gem_kernels.ops.triton.triton_rotary import _rotate, rotate_qk_in_place


class _TritonQkvRotaryAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, positions, offsets, spec: AttnSpec, base: float):
        positions = positions.contiguous()
        rotate_qk_in_place(qkv, positions, base)
        ctx.mark_dirty(qkv)
        q, k, v = qkv.unbind(1)
        o, lse = attention_forward(q, k, v, offsets, offsets, None, spec)
        ctx.save_for_backward(qkv, o, lse, offsets, positions)
        ctx.spec, ctx.base = spec, base
        return o, qkv

    @staticmethod
    def backward(ctx, do, d_rotated):
        qkv, o, lse, offsets, positions = ctx.saved_tensors
        dqkv = torch.empty_like(qkv)
        grads = dqkv.unbind(1)
        attention_backward(do, *qkv.unbind(1), o, lse, offsets, offsets, None, ctx.spec, rotary=(positions, ctx.base),
                           grads=grads)
        if d_rotated is not None:  # the rotated projection was read beside the attention: its gradient, rotated back
            extra = torch.empty_like(dqkv)
            d_rotated = d_rotated.contiguous()
            _rotate(d_rotated[:, 0], d_rotated[:, 1], d_rotated[:, 2], extra.unbind(1), positions, ctx.base, -1.0)
            dqkv += extra
        return dqkv, None, None, None, None


def triton_qkv_rotary_attention(qkv: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor, spec: AttnSpec,
                                base: float) -> torch.Tensor:
    """``[T, H, D]``; qkv's q and k slots are left rotated (see the module docstring)."""
    o, _ = _TritonQkvRotaryAttention.apply(qkv, positions, offsets, spec, base)
    return o
