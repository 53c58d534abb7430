"""Self-attention over a fused projection ``qkv [T, 3, H, D]`` with rotary queries and keys, in the projection's
own buffer, forward and backward.

Rotating q and k into new tensors (``qkv_rotary``) reads the whole projection and writes it again (v copied
along), and its backward packs the three gradients into the projection's gradient in another such pass. Here q
and k are rotated where they lie (v is not touched), the attention kernels read q, k and v as strided views of
the buffer, and the backward kernels write dq, dk and dv straight into the slots of one ``[T, 3, H, D]`` gradient,
whose dq and dk are then rotated back where they lie: two passes over q and k instead of two over all three.

NOTE: rotating dq and dk back inside the backward kernels, before they store them, made those kernels slower on
the H200 than the separate pass costs, whether the pair swap was done in registers or by storing the tile and
re-reading it.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import increment_version

from gem_kernels.ops.triton._tuning import eager_under_compile
from gem_kernels.ops.triton.triton_attention import AttnSpec, attention_backward, attention_forward
from gem_kernels.ops.triton.triton_rotary import rotate_qk_in_place


class _TritonQkvRotaryAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, positions, offsets, spec: AttnSpec, base: float):
        positions = positions.contiguous()
        rotate_qk_in_place(qkv, positions, base)
        # NOTE: not mark_dirty: autograd refuses it on a view (a projection's output reshaped to [T, 3, H, D]) when
        # the Function returns another tensor. Bumping the version makes any earlier saved reference to the buffer
        # fail in backward instead of reading the rotated values.
        increment_version(qkv)
        q, k, v = qkv.unbind(1)
        o, lse = attention_forward(q, k, v, offsets, offsets, None, spec)
        ctx.save_for_backward(qkv, o, lse, offsets, positions)
        ctx.spec, ctx.base = spec, base
        return o

    @staticmethod
    def backward(ctx, do):
        qkv, o, lse, offsets, positions = ctx.saved_tensors
        dqkv = torch.empty_like(qkv)
        attention_backward(do, *qkv.unbind(1), o, lse, offsets, offsets, None, ctx.spec, grads=dqkv.unbind(1))
        rotate_qk_in_place(dqkv, positions, ctx.base, inverse=True)
        return dqkv, None, None, None, None


@eager_under_compile
def triton_qkv_rotary_attention(qkv: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor, spec: AttnSpec,
                                base: float) -> torch.Tensor:
    """``[T, H, D]``; qkv's q and k slots are left rotated (see the module docstring)."""
    return _TritonQkvRotaryAttention.apply(qkv, positions, offsets, spec, base)
