"""Every kernel the ops launch lowers to Triton IR for the H200 (sm_90), from this CPU.

The interpreter runs a kernel's Python, not Triton's compiler front end, so a kernel can pass every interpreter test
and still not compile for a GPU (a module-level constant annotated ``tl.constexpr`` instead of built as one did).
Here the ops run once under the interpreter while their launches are recorded; each distinct (kernel, constexprs)
is then lowered to TTIR with the argument types of its recorded launch.
"""

import torch
from conftest import triton_on_cpu

from gem_kernels import block_attention, gdpa, jagged_flash_attention, layer_norm, qkv_rotary_attention, rms_norm
from gem_kernels.ops.triton import _tuning

pytestmark = triton_on_cpu

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
          torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv",
          torch.float8_e5m2: "fp8e5"}


def _type(arg) -> str:
    if isinstance(arg, _tuning.TensorDescriptor):
        return f"tensordesc<{_TYPES[arg.base.dtype]}{list(arg.block_shape)}>"
    if isinstance(arg, torch.Tensor):
        return "*" + _TYPES[arg.dtype]
    if isinstance(arg, bool):
        return "i1"
    if isinstance(arg, int):
        return "i32" if -(2**31) <= arg < 2**31 else "i64"
    if isinstance(arg, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(arg).__name__}")


def _record_launches(monkeypatch) -> dict:
    launches = {}
    run = _tuning._launch

    def recording(kernel, grid, args, consts, cfg, key):
        named = {**consts, **{k: v for k, v in cfg.items() if k in kernel.arg_names}}
        launches.setdefault((kernel.fn.__name__, repr(sorted(named.items()))), (kernel, args, named))
        return run(kernel, grid, args, consts, cfg, key)

    monkeypatch.setattr(_tuning, "_launch", recording)
    return launches


def _run_every_op():
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return (0.5 * torch.randn(*shape, generator=g)).to(dtype).requires_grad_()

    # NOTE: head dim 32: FP8 dots need K >= 32 on the GPU (the interpreter takes any)
    off = torch.tensor([0, 5, 40, 41, 70])
    q, k, v = r(70, 2, 32), r(70, 2, 32), r(70, 2, 32)
    outs = [jagged_flash_attention(q, k, v, off, 40, kernel="triton"),
            jagged_flash_attention(q, k, v, off, 40, causal=True, window=7, kernel="triton"),
            gdpa(q, k, v, off, activation=["softmax", "gelu"], max_seq_len_q=40, kernel="triton"),
            block_attention(q, k, v, off, 16, 1, kernel="triton"),
            block_attention(q, k, v, off, 16, 2, kernel="triton"),
            jagged_flash_attention(q, k, v, off, 40, kernel="triton", fp8=True)]
    # the delta pre-pass (PMA's backward when O and dO lie differently)
    from gem_kernels.ops.triton.triton_attention import softmax_delta

    softmax_delta(r(70, 2, 32).detach(), r(70, 2, 32).detach())
    # 16-bit inputs: the general kernels' tensor-descriptor variants where those are on
    q16, k16, v16 = (r(70, 2, 32, dtype=torch.float16) for _ in range(3))
    outs += [jagged_flash_attention(q16, k16, v16, off, 40, causal=True, kernel="triton"),
             block_attention(q16, k16, v16, off, 16, 2, kernel="triton"),
             block_attention(q16, k16, v16, off, 16, 1, kernel="triton")]
    ko = torch.tensor([0, 3, 19, 20, 36])
    kc, vc = r(36, 2, 32), r(36, 2, 32)
    outs.append(gdpa(q, kc, vc, off, ko, max_seq_len_q=40, max_seq_len_kv=16, kernel="triton"))
    outs.append(gdpa(q.half(), kc.half(), vc.half(), off, ko, max_seq_len_q=40, max_seq_len_kv=16, kernel="triton"))
    outs.append(gdpa(q, kc, vc, off, ko, max_seq_len_q=40, max_seq_len_kv=200, kernel="triton"))
    seeds = r(4, 2, 32)
    outs.append(gdpa(seeds, k, v, None, off, max_seq_len_kv=40, kernel="triton"))
    qkv = r(70, 3, 2, 32) * 1.0  # the fused rotary path rotates a projection output where it lies
    outs.append(qkv_rotary_attention(qkv, torch.rand(70), off, 40, block_size=16, window_blocks=2, kernel="triton"))
    x, res = r(9, 48, dtype=torch.float16), r(9, 48, dtype=torch.float16)
    w, b = r(48, dtype=torch.float16), r(48, dtype=torch.float16)
    outs += [layer_norm(x, w, b, residual=res, kernel="triton")[0], rms_norm(x, w, kernel="triton")]
    # a float32 stream, a float16 update: the update's gradient is written in float16 by the backward kernel
    x32 = r(9, 48)
    outs.append(layer_norm(x32, w.float(), b.float(), residual=res, kernel="triton", out_dtype=torch.float16)[0])
    # the FP8 MLP block's producers (LayerNorm and GELU with E4M3 epilogues), GEMMs emulated
    from gem_kernels import Fp8Recipe
    from gem_kernels.fp8_mlp import fp8_norm_mlp

    w1, w2 = r(64, 48, dtype=torch.float16), r(48, 64, dtype=torch.float16)
    outs.append(fp8_norm_mlp(x, w, b, 1e-5, w1, r(64, dtype=torch.float16), w2, None, Fp8Recipe(kernel="triton"),
                             emulate=True))
    sum(o.float().sum() for o in outs).backward()
    # the blockwise FP8 quantiser, each block shape (the weight gradient's transposed)
    from gem_kernels import fp8_blockwise_quantize

    for block, transpose in [((1, 128), False), ((128, 128), False), ((128, 1), True)]:
        fp8_blockwise_quantize(r(130, 256, dtype=torch.float16).detach(), block, 16, transpose, kernel="triton")


_LOWER = """
import json, sys, importlib
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton._C.libtriton import ir
target = GPUTarget("cuda", 90, 32)
backend = CUDABackend(target)
options = backend.parse_options({})
failed = []
for module, name, signature, constexprs in json.load(sys.stdin):
    fn = getattr(importlib.import_module(module), name)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    try:
        ASTSource(fn=fn, signature=signature, constexprs=constexprs).make_ir(
            target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    except Exception as e:
        failed.append(f"{name} with {constexprs}: {type(e).__name__}: {e} {e.__cause__!r}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_launched_kernel_lowers_for_sm90(monkeypatch):
    import json
    import os
    import subprocess
    import sys

    from gem_kernels.ops.triton import triton_attention

    launches = _record_launches(monkeypatch)
    _run_every_op()
    # and the attention kernels' tensor-descriptor variants
    monkeypatch.setattr(triton_attention, "TMA_LOADS", True)
    _run_every_op()
    # and the grids that number the sequences along axis 0 (more sequences than a grid's axis 1 holds), with the
    # FP8 layout's starts from a cumulative sum (large batches)
    from gem_kernels.ops.triton import triton_fp8, triton_fp8_attention

    for module in (triton_attention, triton_fp8_attention):
        monkeypatch.setattr(module, "_seq_major", lambda n_seqs: True)
    monkeypatch.setattr(triton_fp8, "IN_KERNEL_STARTS_MAX", 0)
    monkeypatch.setattr(triton_attention, "COMPACT_MAX_SEQS", 0)
    monkeypatch.setattr(_tuning, "_PLANS", {})  # a plan holds the grids picked before
    _run_every_op()
    names = {name for name, _ in launches}
    assert any(named.get("TMA") for _, _, named in launches.values())
    assert {name for (name, _), (_, _, named) in launches.items() if named.get("SEQ_MAJOR")} >= {
        "attn_fwd_kernel", "attn_fwd_short_kv_kernel", "attn_bwd_short_kv_kernel", "attn_bwd_dkdv_kernel",
        "attn_bwd_dq_kernel", "attn_bwd_broadcast_q_kernel", "attn_fwd_fp8_kernel"}
    assert any(name == "sequence_aligned_layout_kernel" and named["STARTS_GIVEN"]
               for (name, _), (_, _, named) in launches.items())
    assert {"attn_fwd_kernel", "attn_fwd_short_kv_kernel", "attn_bwd_short_kv_kernel", "attn_bwd_dkdv_kernel",
            "attn_bwd_dq_kernel",
            "attn_bwd_broadcast_q_kernel", "attn_bwd_delta_kernel", "attn_fwd_fp8_kernel", "norm_fwd_kernel",
            "norm_bwd_kernel", "sum_rows_kernel", "fp8_dequantize_rows_kernel",
            "fp8_dequantize_transposed_kernel", "sequence_aligned_layout_kernel", "gelu_fp8_fwd_kernel",
            "gelu_fp8_bwd_kernel", "fp8_blocks_kernel"} <= names, names
    jobs = []
    for (name, _), (kernel, args, named) in launches.items():
        params = kernel.arg_names
        signature = {p: "constexpr" if p in named else _type(a) for p, a in zip(params, args)}
        signature.update({p: "constexpr" for p in params[len(args):]})
        if "EXACT_CAST" in named:  # an interpreter-only rounding fix; the GPU launches the kernel without it
            named = dict(named, EXACT_CAST=False)
        jobs.append((kernel.fn.__module__, name, signature, named))
    # NOTE: in a fresh process: the interpreter patches triton.language while it runs kernels, and the front end
    # must see it unpatched
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _LOWER], input=json.dumps(jobs), capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


_SHARED = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gem_kernels.ops.triton import triton_attention as ta
from gem_kernels.ops.triton.triton_attention_kernels import attn_bwd_dkdv_kernel as kernel

spec = ta.AttnSpec(max_q=4096, max_kv=4096, nq=None, activations=("softmax",), sm_scale=1.0, pw_scale=1.0)
cfg = ta._candidates("dkdv", spec, 128, 4)[0]
named = dict(ACT=0, MASK_KIND=0, Q_JAGGED=True, HAS_CAND=False, PREC="ieee", TMA=False, COMPACT=True, SEQS=1024,
             BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=128)
types = {}
for p in kernel.arg_names:
    if p in named:
        types[p] = "constexpr"
    elif p in ("LSE", "DELTA"):
        types[p] = "*fp32"
    elif p in ("Q_OFF", "KV_OFF", "CAND_OFF", "CAND_IDS"):
        types[p] = "*i64"
    elif p == "HEAD_IDS":
        types[p] = "*i32"
    elif p.endswith("scale"):
        types[p] = "fp32"
    elif p.startswith("stride") or p in ("NQ", "NR", "Wl", "Wr", "BS", "KB"):
        types[p] = "i32"
    else:
        types[p] = "*fp32"
compiled = triton.compile(ASTSource(fn=kernel, signature=types, constexprs=named), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
print(cfg, compiled.metadata.shared)
sys.exit(0 if compiled.metadata.shared <= ta.SMEM_LIMIT else 1)
"""


def test_the_fp32_dkdv_default_fits_the_h200s_shared_memory():
    """Compiled for sm_90 (ptxas included, no GPU needed): the untuned dK/dV config for fp32 inputs at head dim 128
    must fit, as the first candidate is what runs without tuning (the earlier default asked for 256.5 KiB)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _SHARED], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
