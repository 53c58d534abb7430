"""Shared test helpers: jagged inputs, a naive per-sequence attention (float64), closeness checks, FP8 inputs and bits."""

from __future__ import annotations

import torch

from gem_kernels.ops.pytorch.pt_activations import pt_pointwise


def record_launches(monkeypatch, what) -> list:
    """``what(kernel, consts)`` of every kernel launched through ``_tuning`` from now on (the list fills as they
    launch); the launches run as before."""
    from gem_kernels.ops.triton import _tuning

    seen, launch = [], _tuning._launch
    monkeypatch.setattr(_tuning, "_launch", lambda kernel, grid, args, consts, cfg, key: (
        seen.append(what(kernel, consts)), launch(kernel, grid, args, consts, cfg, key))[1])
    return seen


def offsets_of(lengths: list[int]) -> torch.Tensor:
    off = [0]
    for n in lengths:
        off.append(off[-1] + n)
    return torch.tensor(off, dtype=torch.int64)


def rand(*shape, dtype=torch.float32, scale=1.0, grad=True) -> torch.Tensor:
    t = (torch.randn(*shape) * scale).to(dtype)
    return t.requires_grad_(grad)


def visible(Lq: int, Lk: int, wl=None, wr=None, block_size=None, window_blocks=None) -> torch.Tensor:
    m = torch.ones(Lq, Lk, dtype=torch.bool)
    for i in range(Lq):
        for j in range(Lk):
            if wl is not None and j < i - wl:
                m[i, j] = False
            if wr is not None and j > i + wr:
                m[i, j] = False
            if block_size is not None:
                bi, bj = i // block_size, j // block_size
                if not (bi - window_blocks < bj <= bi):
                    m[i, j] = False
    return m


def naive_attention(q, k, v, q_off, kv_off, acts, sm_scale, pw_scale, kv_index=None, wl=None, wr=None,
                    block_size=None, window_blocks=None):
    """Loop over examples and heads in float64: the obviously-correct twin of every attention op."""
    B = (kv_off.numel() - 1) if q_off is None else (q_off.numel() - 1)
    outs = []
    for b in range(B):
        qb = q if q_off is None else q[q_off[b]:q_off[b + 1]]
        r = b if kv_index is None else int(kv_index[b])
        kb, vb = k[kv_off[r]:kv_off[r + 1]], v[kv_off[r]:kv_off[r + 1]]
        Lq, Lk = qb.shape[0], kb.shape[0]
        mask = visible(Lq, Lk, wl, wr, block_size, window_blocks)
        heads = []
        for h, act in enumerate(acts):
            s = qb[:, h].double() @ kb[:, h].double().T
            if act == "softmax":
                p = torch.softmax((s * sm_scale).masked_fill(~mask, float("-inf")), -1)
                p = torch.where(mask, p, torch.zeros_like(p))
            else:
                p = pt_pointwise(act, s) * mask * pw_scale
            heads.append(p @ vb[:, h].double())
        outs.append(torch.stack(heads, 1) if heads else qb.new_zeros(Lq, 0, q.shape[2]).double())
    if q_off is None:
        return torch.stack(outs)
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], q.shape[2]).double()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.double(), expected.double()
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    if e.numel() == 0:
        return
    err = (a - e).abs().max().item()
    ref = max(e.abs().max().item(), 1.0)
    assert err <= tol * ref, f"{what}: max abs err {err:.3e} > {tol:.1e} * {ref:.3e}"


def grads(out: torch.Tensor, inputs: list[torch.Tensor], dout: torch.Tensor) -> list[torch.Tensor]:
    gs = torch.autograd.grad(out, inputs, dout, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, gs)]


def awkward_fp8_input(shape, dtype, seed):
    """Rows spanning 2^-40 .. 2^40, with a zero row, an infinity, a NaN and values at E4M3 rounding ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-40, 40, (shape[0], 1), generator=g).float())
    x[0] = 0.0
    x[1, 2] = float("inf")
    x[2, 0] = float("nan")
    x[3, : shape[1] // 2] = 1.0625 * 2.0 ** torch.arange(-8, -8 + shape[1] // 2).clamp(max=8)  # exact ties after scaling
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4).nan_to_num(nan=float("nan"), posinf=float("inf")) * 1e-6
        x[1, 2], x[2, 0] = float("inf"), float("nan")
    return x.to(dtype)


def same_fp8(a, b) -> bool:
    """Whether two ``(E4M3 elements, scales)`` pairs hold the same bits (NaN scales equal)."""
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1].nan_to_num(-1.0), b[1].nan_to_num(-1.0))
