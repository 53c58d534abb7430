"""On a GPU, compiled: a NaN query or key makes the softmax rows NaN that the reference makes NaN, on every attention
path (the general and short-kv forwards, FP8, blocks), and the gradients carry it. ``tl.max`` drops NaNs on the GPU,
so a NaN query's row kept the mask's max and came out 0 (the interpreter's test in test_triton_attention shows the
same on CPU). Run with ``TRITON_INTERPRET=0`` where a CUDA device is."""

import os

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                 reason="compiled kernels only: run with TRITON_INTERPRET=0")]


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device="cuda")


@pytest.mark.parametrize("path", ["general", "short_kv", "fp8", "block"])
@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_nan_input_makes_the_rows_nan_the_reference_makes_nan(path, where, dtype):
    from gem_kernels import block_attention, gdpa, jagged_flash_attention

    if path == "fp8" and dtype != torch.bfloat16:
        pytest.skip("FP8 attention takes bfloat16 inputs")
    torch.manual_seed(0)
    q_lengths = [300, 700, 129]
    kv_lengths = [9, 40, 17] if path == "short_kv" else q_lengths
    qo, ko = _offsets(q_lengths), _offsets(kv_lengths)
    q = torch.randn(int(qo[-1]), 2, 128, device="cuda", dtype=dtype)
    k, v = (torch.randn(int(ko[-1]), 2, 128, device="cuda", dtype=dtype) for _ in range(2))
    (q if where == "q" else k)[310 if where == "q" else 40, 0, 0] = float("nan")
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def attention(kernel):
        if path == "short_kv":
            return gdpa(q, k, v, qo, ko, activation="softmax", max_seq_len_kv=40, kernel=kernel)
        if path == "block":
            return block_attention(q, k, v, qo, block_size=64, window_blocks=2, kernel=kernel)
        return jagged_flash_attention(q, k, v, qo, 700, kernel=kernel, fp8=path == "fp8")

    out, ref = attention("triton"), attention("pytorch")
    nan = ref.isnan().any(-1)
    assert nan.any() and torch.equal(out.isnan().any(-1), nan)
    tol = 0.05 if path == "fp8" else 0.02
    assert float((out[~nan].float() - ref[~nan].float()).abs().max()) < tol
    seed = torch.randn_like(ref)
    # the rows a NaN reaches through 0 * NaN in masked tiles follow the tiling: the NaN must not be hidden
    for got, want in zip(torch.autograd.grad(out, (q, k, v), seed), torch.autograd.grad(ref, (q, k, v), seed)):
        assert bool(got.isnan().any()) == bool(want.isnan().any())
