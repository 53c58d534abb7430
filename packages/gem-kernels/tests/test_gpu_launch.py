"""On a GPU: every attention entry point gives bit for bit the same outputs and gradients through its planned direct
launches as through Triton's own launch path, jagged lengths changing between calls (one plan for all). Run where a
CUDA device is, compiled: ``TRITON_INTERPRET=0`` (the package's conftest turns the interpreter on otherwise, and the
interpreter launches through Triton's path only, so there would be nothing to compare); on CPU the interpreter runs
the same plans through Triton's path in the other tests."""

import os

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                 reason="compiled kernels only: run with TRITON_INTERPRET=0")]

H, D = 4, 64


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device="cuda")


def _calls():
    """name -> function of a generator: (output, inputs to differentiate)."""
    from gem_kernels import block_attention, gdpa, jagged_flash_attention, qkv_rotary_attention

    def rand(g, *shape):
        return torch.randn(*shape, generator=g, device="cuda").bfloat16().requires_grad_()

    def lengths(g, n, top):
        return torch.randint(1, top, (n,), generator=g, device="cuda").tolist()

    def jfa(g):
        off = _offsets(lengths(g, 6, 100))
        q, k, v = (rand(g, int(off[-1]), H, D) for _ in range(3))
        return jagged_flash_attention(q, k, v, off, 128, causal=True, validate=False, kernel="triton"), [q, k, v]

    def cross(g):
        qo, ko = _offsets(lengths(g, 6, 100)), _offsets(lengths(g, 6, 17))
        q, k, v = rand(g, int(qo[-1]), H, D), rand(g, int(ko[-1]), H, D), rand(g, int(ko[-1]), H, D)
        return gdpa(q, k, v, qo, ko, max_seq_len_q=128, max_seq_len_kv=16, validate=False, kernel="triton"), [q, k, v]

    def packed(g):
        qo, ko = _offsets(lengths(g, 6, 100)), _offsets(lengths(g, 6, 200))
        q, kv = rand(g, int(qo[-1]), H, D), rand(g, int(ko[-1]), 2, H, D)
        return gdpa(q, kv, None, qo, ko, activation="gelu", max_seq_len_q=128, max_seq_len_kv=256,
                    validate=False, kernel="triton"), [q, kv]

    def pma(g):
        ko = _offsets(lengths(g, 6, 300))
        q, k, v = rand(g, 8, H, D), rand(g, int(ko[-1]), H, D), rand(g, int(ko[-1]), H, D)
        return gdpa(q, k, v, None, ko, max_seq_len_kv=512, validate=False, kernel="triton"), [q, k, v]

    def blocks(g):
        off = _offsets(lengths(g, 4, 500))
        q, k, v = (rand(g, int(off[-1]), H, D) for _ in range(3))
        return block_attention(q, k, v, off, 64, 3, max_seq_len=512, validate=False, kernel="triton"), [q, k, v]

    def rotary(g):
        off = _offsets(lengths(g, 4, 300))
        qkv = rand(g, int(off[-1]), 3, H, D)
        positions = torch.cat([torch.arange(int(n), device="cuda") for n in off.diff().tolist()]).float()
        # the op rotates q and k inside its input: a copy per call keeps the leaf as drawn
        return qkv_rotary_attention(qkv * 1, positions, off, 512, block_size=64, validate=False, kernel="triton"), [qkv]

    return {"jfa": jfa, "cross": cross, "packed kv": packed, "pma": pma, "blocks": blocks, "qkv rotary": rotary}


def _run(call, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out, inputs = call(g)
    grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
    return [out.detach(), *grads]


@pytest.mark.parametrize("name", ["jfa", "cross", "packed kv", "pma", "blocks", "qkv rotary"])
def test_planned_launches_equal_tritons_own_launch_path(name, monkeypatch):
    from gem_kernels.ops.triton import _tuning

    call = _calls()[name]
    monkeypatch.setattr(_tuning, "_PLANS", {})
    for seed in range(3):  # other lengths each call: the plan made by the first serves them all
        monkeypatch.setattr(_tuning, "FAST_LAUNCH", False)
        want = _run(call, seed)
        monkeypatch.setattr(_tuning, "FAST_LAUNCH", True)
        _run(call, seed)  # keeps the compiled kernels of launches not seen before
        got = _run(call, seed)
        for a, b in zip(got, want):
            assert torch.equal(a, b), name
    assert 1 <= len(_tuning._PLANS) <= 2  # the forward's plan and the backward's
