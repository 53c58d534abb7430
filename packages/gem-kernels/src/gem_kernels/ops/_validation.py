"""Input checks shared by the public ops.

Shape, dtype and device checks are free (host metadata). Checks on offset *values* (monotonic, first 0,
last == T, max length <= the declared one) need one device-to-host sync; they run when ``validate=True``
and are batched into a single transfer.
"""

from __future__ import annotations

import math
import numbers

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KERNELS = ("auto", "triton", "pytorch", "builtin")  # builtin: PyTorch's own ops (pytorch/builtin.py)


def check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")


def check_values(name: str, x: torch.Tensor, ndim: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have rank {ndim} ({layout}), got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if x.shape[-2] < 1 or x.shape[-1] < 1:  # every layout ends in [..., H, D]
        raise ValueError(f"{name} must have at least one head and a non-empty head dim ({layout}), "
                         f"got shape {tuple(x.shape)}")


def check_same(names: list[str], tensors: list[torch.Tensor]) -> None:
    ref_name, ref = names[0], tensors[0]
    for name, t in zip(names[1:], tensors[1:]):
        if t.dtype != ref.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}")
        if t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def check_self_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Self-attention inputs: q, k, v of one shape [T, H, D], one dtype and device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_values(name, t, 3, "[T, H, D]")
    check_same(["q", "k", "v"], [q, k, v])
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must have the same shape [T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")


def check_offsets_meta(name: str, offsets: torch.Tensor, device: torch.device) -> None:
    if not isinstance(offsets, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(offsets).__name__}")
    # NOTE: a batch of no sequences ([0]) is a rank's empty share of a short last batch: its output is empty
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name} must be 1-D with batch+1 >= 1 entries, got shape {tuple(offsets.shape)}")
    if offsets.dtype != torch.int64:
        raise ValueError(f"{name} must be int64, got {offsets.dtype}")
    if offsets.device != device:
        raise ValueError(f"{name} is on {offsets.device} but the values are on {device}")


def check_offsets_values(
    name: str, offsets: torch.Tensor, total: int, max_len: int | None, max_len_name: str
) -> int:
    """Check offset values with one sync; returns the real maximum length (0 for a batch of no sequences)."""
    lengths = offsets[1:] - offsets[:-1]
    if lengths.numel():
        first, min_len, last, real_max = torch.stack([offsets[0], lengths.min(), offsets[-1], lengths.max()]).tolist()
    else:
        first = last = int(offsets[0])
        min_len = real_max = 0
    if first != 0:
        raise ValueError(f"{name} must start at 0, got {first}")
    if min_len < 0:
        raise ValueError(f"{name} must be non-decreasing (monotonic)")
    if last != total:
        raise ValueError(f"{name}[-1] must equal the number of tokens {total}, got {last}")
    check_max_len_covers(max_len_name, max_len, real_max)
    return int(real_max)


def check_max_len(name: str, max_len: int) -> None:
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        raise ValueError(f"{name} must be a positive int, got {max_len!r}")


def check_max_len_covers(max_len_name: str, max_len: int | None, real_max: int) -> None:
    """A declared maximum length against the real one (read from the offsets by ``check_offsets_values``)."""
    if max_len is not None and real_max > max_len:
        raise ValueError(f"{max_len_name}={max_len} is below the longest sequence ({real_max})")


def check_eps(eps: float) -> None:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")


def check_scale(scale: float | None) -> None:
    """An attention scale: None (the op's default) or a finite real number (both paths take it as a Python float)."""
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale)):
        raise ValueError(f"scale must be None or a finite real number, got {scale!r}")


def check_positive_int(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_window(window: int | None) -> None:
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 0):
        raise ValueError(f"window must be None or an int >= 0, got {window!r}")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the host
        return False
    return True


def use_triton(kernel: str, device: torch.device) -> bool:
    """``auto`` picks Triton on CUDA (or under the Triton interpreter on CPU only when asked explicitly)."""
    if kernel in ("pytorch", "builtin"):
        return False
    if kernel == "triton":
        if not triton_available():
            raise ValueError("kernel='triton' needs the triton package, which is not importable here")
        return True
    return device.type == "cuda" and triton_available()


def check_triton_head_dim(name: str, head_dim: int) -> None:
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(
            f"{name} head dim {head_dim} is unsupported by the triton kernel (needs a power of two in "
            "[16, 256]); use kernel='pytorch'"
        )


def check_triton_device(name: str, x: torch.Tensor) -> None:
    import os

    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{name} is on {x.device}: the triton kernel needs a CUDA tensor (or TRITON_INTERPRET=1 on CPU)"
        )
