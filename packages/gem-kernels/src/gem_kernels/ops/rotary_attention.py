"""Rotary self-attention over a fused projection: ``qkv_rotary`` and the local attention ops in one call."""

from __future__ import annotations

import torch

from gem_kernels.ops import _validation as V
from gem_kernels.ops._dispatch import bounded_mask, default_sm_scale
from gem_kernels.ops.block_attention import block_attention
from gem_kernels.ops.jagged_flash_attention import jagged_flash_attention
from gem_kernels.ops.rotary import _check_positions, qkv_rotary


def qkv_rotary_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    offsets: torch.Tensor,
    max_seq_len: int,
    base: float = 10.0,
    block_size: int | None = None,
    window_blocks: int = 1,
    window: int | None = None,
    kernel: str = "auto",
    validate: bool = True,
    fp8: bool = False,
) -> torch.Tensor:
    """Softmax self-attention of a fused projection ``qkv [T, 3, H, D]`` (jagged by ``offsets``), its queries and keys
    rotated at ``positions`` (``qkv_rotary``): ``block_attention`` when ``block_size`` is given, else
    ``jagged_flash_attention`` with ``window`` (None: every key of the sequence). Returns ``[T, H, D]``, what those
    ops return on ``qkv_rotary(qkv, positions, base)``.

    The Triton path (``kernel`` "triton", or "auto" on CUDA; not with ``fp8``) rotates q and k in qkv's own buffer:
    afterwards qkv holds the rotated q and k (v unchanged), so pass a projection nothing else reads. Its backward
    writes the projection's gradient in one buffer and rotates its q and k slots back where they lie. The other
    kernels compose ``qkv_rotary`` and the attention op and leave qkv as it was."""
    V.check_kernel(kernel)
    V.check_values("qkv", qkv, 4, "[T, 3, H, D]")
    if qkv.shape[1] != 3 or qkv.shape[-1] % 2:
        raise ValueError(f"qkv must be [T, 3, H, D] with an even head dim D, got {tuple(qkv.shape)}")
    _check_positions(positions, qkv, base)
    V.check_offsets_meta("offsets", offsets, qkv.device)
    V.check_max_len("max_seq_len", max_seq_len)
    if block_size is not None and window is not None:
        raise ValueError("block_size and window exclude each other: blocks (block_attention) or a window "
                         "(jagged_flash_attention)")
    if block_size is None and window_blocks != 1:
        raise ValueError(f"window_blocks={window_blocks} takes a block_size (blocks of block_attention)")
    fused = (V.use_triton(kernel, qkv.device) and kernel != "builtin" and not fp8 and qkv.shape[0] > 0
             and qkv.stride(-1) == 1 and _triton_head_dim(qkv.shape[-1], kernel))
    if not fused:
        q, k, v = qkv_rotary(qkv, positions, base, kernel=kernel)
        if block_size is not None:
            return block_attention(q, k, v, offsets, block_size=block_size, window_blocks=window_blocks,
                                   max_seq_len=max_seq_len, kernel=kernel, validate=validate, fp8=fp8)
        return jagged_flash_attention(q, k, v, offsets, max_seq_len, window=window, kernel=kernel, validate=validate,
                                      fp8=fp8)
    root = qkv if qkv._base is None else qkv._base  # (the tensor a view shares its memory with)
    if root.is_leaf and root.requires_grad:
        # NOTE: torch refuses an in-place op on such a tensor (a parameter, an input leaf) or a view of one; rotated
        # here, it would be changed for every later reader
        raise ValueError("qkv is a leaf that requires grad, or a view of one: the Triton path rotates qkv in place; pass "
                         "a projection's output (or kernel='pytorch')")
    if block_size is not None:
        V.check_positive_int("block_size", block_size)
        V.check_positive_int("window_blocks", window_blocks)
    else:
        V.check_window(window)
    if validate:
        V.check_offsets_values("offsets", offsets, qkv.shape[0], max_seq_len, "max_seq_len")
    V.check_triton_device("qkv", qkv)
    from gem_kernels.ops.triton.triton_attention import AttnSpec
    from gem_kernels.ops.triton.triton_rotary_attention import triton_qkv_rotary_attention

    heads, head_dim = qkv.shape[2], qkv.shape[3]
    window, _, block_size, window_blocks = bounded_mask(max_seq_len, max_seq_len, window, None, block_size,
                                                        window_blocks if block_size is not None else None)
    spec = AttnSpec(max_q=max_seq_len, max_kv=max_seq_len, nq=None, activations=("softmax",) * heads,
                    sm_scale=default_sm_scale(head_dim), pw_scale=1.0, window_left=window, window_right=window,
                    block_size=block_size, window_blocks=window_blocks)
    return triton_qkv_rotary_attention(qkv, positions, offsets.contiguous(), spec, float(base))  # read with unit stride


def _triton_head_dim(head_dim: int, kernel: str) -> bool:
    """Whether the Triton kernels take this head dim; "triton" raises where they do not, "auto" falls back."""
    try:
        V.check_triton_head_dim("qkv", head_dim)
    except ValueError:
        if kernel == "triton":
            raise
        return False
    return True
