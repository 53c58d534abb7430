"""FP8 against bfloat16 on the GPU: checks, FP8 attention, then the MLP GEMMs at recommendation shapes.

Checks first: the Triton quantisation against the PyTorch reference (same bits), the FP8 linear against its
emulated twin (outputs and both gradients), and its error against the bfloat16 linear. Attention with FP8 Q, K, V
against our bf16 JFA on run_all's JFA cases, forward and forward+backward (quantisation included), with the output's
and the gradients' errors against fp32 on the first case. Then, for M tokens and
square K = N layers, one linear forward and forward+backward, quantisation included: bfloat16 (``F.linear``),
FP8 with the weight gradient in bfloat16 (the default recipe) and FP8 throughout, each with rowwise and with
blockwise scales (1 x 128 activations, 128 x 128 weights); and the quantisation alone (GB/s against the 4.2 TB/s
copy). The summary gives each FP8 variant's speed-up over bfloat16 and the crossover
(the narrowest layer where FP8 pays), from which ``Fp8Recipe``'s defaults come. Part ``mlp``: the block
LayerNorm -> Linear -> GELU -> Linear (hidden = K) forward and forward+backward, bfloat16 (our LayerNorm, ``F.linear``,
``F.gelu``) against ``fp8_norm_mlp`` (activations quantised by their producers), FP8 throughout, and the same block
with FP8 linears that quantise in passes of their own (the blockwise variants' block); each forward+backward row also
carries its kernels' GPU time by kind (``KERNEL_KINDS``: the GEMMs in FP8 and bf16, quantisation, norm, GELU, the bias
gradients' reductions, fills and copies), where the time beside the GEMMs goes. Checks: the producers' E4M3 bits on
the GPU and the block's error. Writes JSON with provenance.

    PYTHONPATH=packages/gem-kernels/src python -m gem_kernels.ops.benchmarks.bench_fp8 --out fp8.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
from torch.nn import functional as F

from gem_kernels.fp8 import (fp8_attention_operands, fp8_blockwise_quantize, fp8_blockwise_quantize_reference,
                             fp8_rowwise_quantize, fp8_rowwise_quantize_reference,
                             sequence_aligned_layout)
from gem_kernels.fp8_linear import Fp8Recipe, fp8_linear
from gem_kernels.ops.benchmarks.provenance import git_commit
from gem_kernels.ops.benchmarks.run_all import (Recorder, bench_ms, fwd_bwd, guarded, kernel_times, lognormal_lengths,
                                                offsets, pairs_self)

TOKENS = (16384, 65536, 262144, 1048576)
MLP_TOKENS = (65536, 262144, 1048576)
WIDTHS = (512, 1024, 2048, 4096)
TARGETS = {1024: 1.15, 2048: 1.3, 4096: 1.3}  # speed-up over bfloat16 asked at K = N
ATTENTION_CASES = [("jfa_self", 256, 512, 4096, {}), ("jfa_causal", 256, 512, 4096, {"causal": True}),
                   ("jfa_long", 64, 2048, 16384, {})]  # as run_all's: B, mean length, max length
ATTENTION_TARGET = 1.2  # FP8 forward over our bf16 forward, jfa_self
VARIANTS = {"fp8": Fp8Recipe(min_features=0, min_tokens=0),
            "fp8_wgrad_fp8": Fp8Recipe(weight_gradient="fp8", min_features=0, min_tokens=0),
            "fp8_blockwise": Fp8Recipe(scaling="blockwise", min_features=0, min_tokens=0),
            "fp8_blockwise_wgrad_fp8": Fp8Recipe(weight_gradient="fp8", scaling="blockwise", min_features=0, min_tokens=0)}
MLP_ONLY = ("fp8_unfused",)  # the MLP block with FP8 linears that quantise their inputs in passes of their own


class FP8Recorder(Recorder):
    def summary(self):
        out = self.attention_summary()
        cases = list(dict.fromkeys((r["op"], r["case"], r["pass"]) for r in self.rows if r["op"] in ("linear", "mlp")))
        for op, case, pas in cases:
            rows = {r["impl"]: r for r in self.rows if (r["op"], r["case"], r["pass"]) == (op, case, pas)}
            if "bf16" not in rows:
                continue
            entry = {"case": case, "pass": pas, "bf16_ms": rows["bf16"]["ms"], "target": rows["bf16"].get("target")}
            for impl in (*VARIANTS, *MLP_ONLY):
                if impl in rows:
                    entry[f"{impl}_ms"] = rows[impl]["ms"]
                    entry[f"{impl}_speedup"] = round(rows["bf16"]["ms"] / rows[impl]["ms"], 3)
            out.append(entry)
        return out

    def attention_summary(self):
        out = []
        for case, pas in dict.fromkeys((r["case"], r["pass"]) for r in self.rows if r["op"] == "attention"):
            rows = {r["impl"]: r for r in self.rows if (r["op"], r["case"], r["pass"]) == ("attention", case, pas)}
            if "bf16" in rows and "fp8" in rows:
                out.append({"case": case, "pass": pas, "bf16_ms": rows["bf16"]["ms"], "fp8_ms": rows["fp8"]["ms"],
                            "fp8_speedup": round(rows["bf16"]["ms"] / rows["fp8"]["ms"], 3),
                            "target": rows["bf16"].get("target")})
        return out


def relative_errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    """Each tensor's relative error (Frobenius) against its reference."""
    return [round(float((p - q).detach().norm() / q.detach().norm()), 5) for p, q in zip(got, ref)]


def run_checks(rec: Recorder) -> None:
    torch.manual_seed(0)
    for shape, dim, rows_to, cols_to in [((4097, 1024), -1, 16, 1), ((4097, 1024), 0, 1, 16), ((1024, 4096), -1, 1, 1),
                                         ((1024, 4096), 0, 1, 1), ((300, 12288), -1, 16, 1)]:
        x = (torch.randn(shape, device="cuda") * torch.logspace(-4, 4, shape[0], device="cuda")[:, None]).bfloat16()
        x[7, 3] = float("inf")
        fast = fp8_rowwise_quantize(x, dim, rows_to, cols_to)
        ref = fp8_rowwise_quantize_reference(x, dim, rows_to, cols_to)
        same = torch.equal(fast[0].float(), ref[0].float()) and torch.equal(fast[1].nan_to_num(-1.0), ref[1].nan_to_num(-1.0))
        rec.checks.append({"name": f"quantize {shape} dim={dim}", "same_bits": same, "ok": same})
        print(f"  quantize {shape} dim={dim}: same bits {same}", flush=True)
    for block, transpose in [((1, 128), False), ((128, 128), False), ((128, 1), True)]:
        x = (torch.randn(4097, 1024, device="cuda") * torch.logspace(-4, 4, 4097, device="cuda")[:, None]).bfloat16()
        x[7, 3] = float("inf")
        fast = fp8_blockwise_quantize(x, block, 128, transpose)
        ref = fp8_blockwise_quantize_reference(x, block, 128, transpose)
        same = torch.equal(fast[0].float(), ref[0].float()) and torch.equal(fast[1].nan_to_num(-1.0), ref[1].nan_to_num(-1.0))
        rec.checks.append({"name": f"quantize blockwise {block} transpose={transpose}", "same_bits": same, "ok": same})
        print(f"  quantize blockwise {block} transpose={transpose}: same bits {same}", flush=True)
    for weight_gradient, scaling in [("high", "rowwise"), ("fp8", "rowwise"), ("high", "blockwise"), ("fp8", "blockwise")]:
        recipe = Fp8Recipe(weight_gradient=weight_gradient, scaling=scaling, min_features=0, min_tokens=0)
        x = torch.randn(8195, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(2048, 1024, device="cuda") * 0.03).requires_grad_()
        g = torch.randn(8195, 2048, device="cuda", dtype=torch.bfloat16)
        got = {}
        for name, fn in [("fast", lambda: fp8_linear(x, w, recipe)), ("twin", lambda: fp8_linear(x, w, recipe, emulate=True)),
                         ("bf16", lambda: F.linear(x, w.bfloat16()))]:
            y = fn()
            got[name] = (y.float(), *(t.float() for t in torch.autograd.grad(y, (x, w), g)))

        twin, bf16 = relative_errors(got["fast"], got["twin"]), relative_errors(got["fast"], got["bf16"])
        ok = max(twin) < 0.01 and max(bf16) < 0.1
        rec.checks.append({"name": f"fp8_linear {scaling} weight_gradient={weight_gradient}",
                           "rel_err_vs_twin [y, dx, dw]": twin, "rel_err_vs_bf16 [y, dx, dw]": bf16, "ok": ok})
        print(f"  fp8_linear {scaling} wgrad={weight_gradient}: vs twin {twin}, vs bf16 {bf16}", flush=True)


def bench_linear(rec: Recorder, m: int, width: int) -> None:
    case = f"M={m} K=N={width}"
    x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(width, width, device="cuda") * width**-0.5).bfloat16().requires_grad_()
    g = torch.randn(m, width, device="cuda", dtype=torch.bfloat16)
    flops = 2.0 * m * width * width
    impls = {"bf16": lambda: F.linear(x, w)}
    for name, recipe in VARIANTS.items():
        impls[name] = lambda recipe=recipe: fp8_linear(x, w, recipe)
    for name, fn in impls.items():
        extra = {"target": TARGETS.get(width)} if name == "bf16" else {}
        if name == "bf16" or VARIANTS[name].weight_gradient != "fp8":  # an FP8 weight gradient: the same forward
            with torch.no_grad():
                rec.add("linear", case, name, "fwd", bench_ms(fn), flops, **extra)
        rec.add("linear", case, name, "fwd+bwd", bench_ms(lambda fn=fn: torch.autograd.grad(fn(), (x, w), g)), 3 * flops, **extra)
    for dim in (-1, 0):
        nbytes = m * width * 2 + m * width  # read bf16, write e4m3 (the chunked kernel reads twice: not counted)
        rec.add("quantize", case, "gem", f"dim={dim}", bench_ms(lambda dim=dim: fp8_rowwise_quantize(x.detach(), dim, 16, 16)),
                nbytes=nbytes)
    for block, transpose in [((1, 128), False), ((128, 1), True)]:  # activations; their transpose along the tokens
        rec.add("quantize", case, "gem", f"blockwise {block[0]}x{block[1]}{' transposed' if transpose else ''}",
                bench_ms(lambda block=block, transpose=transpose: fp8_blockwise_quantize(x.detach(), block, 128, transpose)),
                nbytes=m * width * 3)


def _mlp_params(width: int):
    """LayerNorm weight and bias, then the two linears' (hidden = width), bfloat16."""
    def linear():
        return ((torch.randn(width, width, device="cuda") * width**-0.5).bfloat16().requires_grad_(),
                (torch.randn(width, device="cuda") * 0.1).bfloat16().requires_grad_())

    norm = [(torch.randn(width, device="cuda") * 0.1 + 1).bfloat16().requires_grad_(),
            (torch.randn(width, device="cuda") * 0.1).bfloat16().requires_grad_()]
    return [*norm, *linear(), *linear()]


def mlp_blocks(params) -> dict:
    """The MLP block's implementations: name -> function of x."""
    from gem_kernels import layer_norm
    from gem_kernels.fp8_mlp import fp8_norm_mlp

    nw, nb, w1, b1, w2, b2 = params

    def bf16(x):
        return F.linear(F.gelu(F.linear(layer_norm(x, nw, nb), w1, b1)), w2, b2)

    def unfused(x, recipe=VARIANTS["fp8"]):
        return fp8_linear(F.gelu(fp8_linear(layer_norm(x, nw, nb), w1, recipe, bias=b1)), w2, recipe, bias=b2)

    blocks = {"bf16": bf16, "fp8_unfused": unfused}
    for name, recipe in VARIANTS.items():
        if recipe.scaling == "rowwise":
            blocks[name] = lambda x, recipe=recipe: fp8_norm_mlp(x, nw, nb, 1e-5, w1, b1, w2, b2, recipe)
        else:  # the fused block's producers write rowwise E4M3: blockwise linears quantise their own inputs
            blocks[name] = lambda x, recipe=recipe: unfused(x, recipe)
    return blocks


def run_mlp_checks(rec: Recorder) -> None:
    """On the GPU in bfloat16: each producer's E4M3 against quantising its output (same bits), and the block's
    output and gradients against its emulated twin and against the bfloat16 block."""
    from gem_kernels.fp8_mlp import fp8_layer_norm, fp8_norm_mlp
    from gem_kernels.ops.triton.triton_fp8_gelu import triton_gelu_fp8, triton_gelu_fp8_backward

    torch.manual_seed(0)
    rows, width = 8195, 2048
    nw, nb, w1, b1, w2, b2 = params = _mlp_params(width)
    x = (torch.randn(rows, width, device="cuda") * 2).bfloat16().requires_grad_()
    n, n_fp8 = fp8_layer_norm(x.detach(), nw.detach(), nb.detach(), 1e-5, VARIANTS["fp8"])
    h = F.linear(n, w1.detach(), b1.detach())
    a, *a_fp8 = triton_gelu_fp8(h, 16)
    dh, *dh_fp8 = triton_gelu_fp8_backward(torch.randn_like(a), h, 16)
    for name, (out, fp8) in {"layer_norm": (n, n_fp8), "gelu": (a, a_fp8), "gelu_backward": (dh, dh_fp8)}.items():
        ref = fp8_rowwise_quantize_reference(out, -1, 16)
        same = torch.equal(fp8[0].float(), ref[0].float()) and torch.equal(fp8[1].nan_to_num(-1.0), ref[1].nan_to_num(-1.0))
        rec.checks.append({"name": f"mlp producer {name}: E4M3 of its output", "same_bits": same, "ok": same})
        print(f"  mlp producer {name}: same bits {same}", flush=True)
    g = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    inputs = [x, *params]
    got = {}
    blocks = mlp_blocks(params)
    runs = {"fast": blocks["fp8"], "bf16": blocks["bf16"],
            "twin": lambda x: fp8_norm_mlp(x, nw, nb, 1e-5, w1, b1, w2, b2, VARIANTS["fp8"], emulate=True)}
    for name, fn in runs.items():
        y = fn(x)
        got[name] = [y.float(), *(t.float() for t in torch.autograd.grad(y, inputs, g))]

    twin, bf16 = relative_errors(got["fast"], got["twin"]), relative_errors(got["fast"], got["bf16"])
    ok = max(twin) < 0.02 and max(bf16) < 0.1
    rec.checks.append({"name": "fp8_norm_mlp", "rel_err_vs_twin [y, dx, dnw, dnb, dw1, db1, dw2, db2]": twin,
                       "rel_err_vs_bf16 [y, dx, dnw, dnb, dw1, db1, dw2, db2]": bf16, "ok": ok})
    print(f"  fp8_norm_mlp: vs twin {twin}, vs bf16 {bf16}", flush=True)


def _is_gemm(name: str) -> bool:
    return name.startswith("nvjet") or any(w in name.lower() for w in ("gemm", "cutlass", "xmma"))


# a kernel's kind for the block's breakdown, by its name (cuBLAS's FP8 kernels: "_qq" types): the first that matches
KERNEL_KINDS = (
    ("gemm_fp8", lambda n: _is_gemm(n) and ("_qq" in n or "e4m3" in n.lower())),
    ("gemm_bf16", _is_gemm),
    ("quantize", lambda n: n.startswith("fp8_")),
    ("norm", lambda n: "norm" in n.lower() or n.startswith("sum_rows")),
    ("gelu", lambda n: "gelu" in n.lower()),
    ("reduce (bias gradients)", lambda n: "reduce_kernel" in n),
    ("fill / copy", lambda n: any(w in n for w in ("Fill", "copy", "elementwise_kernel"))),
)


def kernel_breakdown(run, calls: int = 5) -> dict:
    """GPU milliseconds of one ``run()`` per kernel kind (``KERNEL_KINDS``, else "other") and in all, from the
    profiler: where the FP8 block's time goes beside its GEMMs."""
    kinds: dict[str, float] = {}
    for name, ms in kernel_times(run, calls).items():
        kind = next((k for k, test in KERNEL_KINDS if test(name)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + ms
    return {"kernel_ms": round(sum(kinds.values()), 4),
            "kernel_kinds_ms": {k: round(v, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}}


def bench_mlp(rec: Recorder, m: int, width: int) -> None:
    case = f"mlp M={m} K=N={width}"
    params = _mlp_params(width)
    x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(m, width, device="cuda", dtype=torch.bfloat16)
    flops = 4.0 * m * width * width  # two GEMMs
    for name, fn in mlp_blocks(params).items():
        extra = {"target": TARGETS.get(width)} if name == "bf16" else {}
        if name not in VARIANTS or VARIANTS[name].weight_gradient != "fp8":  # an FP8 weight gradient: the same forward
            with torch.no_grad():
                rec.add("mlp", case, name, "fwd", bench_ms(lambda fn=fn: fn(x)), flops, **extra)
        run = lambda fn=fn: torch.autograd.grad(fn(x), [x, *params], g)  # noqa: E731
        rec.add("mlp", case, name, "fwd+bwd", bench_ms(run), 3 * flops, **extra, **kernel_breakdown(run))


def fp8_kernel_alone(q, k, v, off, longest: int, mask: dict):
    """A call of the FP8 attention kernel on operands quantised beforehand: what quantising in the producer of
    Q, K, V (instead of in the attention call) would leave."""
    from gem_kernels.ops._dispatch import default_sm_scale, fp8_attention_spec
    from gem_kernels.ops.triton.triton_fp8_attention import fp8_attend, fp8_attention_inputs

    # causal keeps keys j <= i, as jagged_flash_attention passes it
    spec = fp8_attention_spec(longest, q.shape[1], default_sm_scale(q.shape[2]),
                              window_right=0 if mask.get("causal", False) else None)
    inputs = fp8_attention_inputs(q, k, v, off)
    return lambda: fp8_attend(*inputs, off, longest, spec, q.shape, q.dtype)


def bench_attention(rec: Recorder) -> None:
    """FP8 against our bf16 JFA forward (H=4, D=128, log-normal lengths as run_all's cases), the quantisation of
    Q, K, V included; with the relative error against the fp32 reference on the first case."""
    from gem_kernels import jagged_flash_attention

    heads, dim = 4, 128
    for case, batch, mean, longest, mask in ATTENTION_CASES:
        lengths = lognormal_lengths(batch, mean, longest)
        off = offsets(lengths)
        tokens = int(off[-1])
        q, k, v = (torch.randn(tokens, heads, dim, device="cuda").bfloat16() for _ in range(3))
        name = f"{case} B={batch} mean={mean} max={longest} T={tokens}"
        flops = 4 * heads * dim * pairs_self(lengths, mask.get("causal", False))
        with torch.no_grad():
            for impl, fp8 in (("bf16", False), ("fp8", True)):
                run = lambda fp8=fp8: jagged_flash_attention(q, k, v, off, longest, kernel="triton", validate=False,  # noqa: E731
                                                             fp8=fp8, **mask)
                extra = {"target": ATTENTION_TARGET} if impl == "bf16" and case == "jfa_self" else {}
                rec.add("attention", name, impl, "fwd", bench_ms(run), flops, **extra)
            def quantise():  # as the FP8 call does: V^T in sequence-aligned columns
                return fp8_attention_operands(q, k, v, v_placed=sequence_aligned_layout(off, tokens)[1])

            rec.add("attention", name, "fp8: quantising q, k, v alone", "fwd", bench_ms(quantise),
                    nbytes=3 * q.numel() * 3)
            rec.add("attention", name, "fp8: the kernel alone (operands quantised before)", "fwd",
                    bench_ms(fp8_kernel_alone(q, k, v, off, longest, mask)), flops)
            if case == "jfa_self":
                exact = jagged_flash_attention(q.float(), k.float(), v.float(), off, longest, kernel="triton", validate=False)
                def rel(out, ref):
                    return round(float((out.float() - ref.float()).norm() / ref.float().norm()), 5)

                fp8_out = jagged_flash_attention(q, k, v, off, longest, kernel="triton", validate=False, fp8=True)
                # the twin's reference materialises every sequence's scores: compared on the first 16 sequences
                few = int(off[16])
                head = [t[:few] for t in (q, k, v)]
                twin = jagged_flash_attention(*head, off[:17], longest, kernel="pytorch", validate=False, fp8=True)
                fast = jagged_flash_attention(*head, off[:17], longest, kernel="triton", validate=False, fp8=True)
                errors = {"bf16": rel(jagged_flash_attention(q, k, v, off, longest, kernel="triton", validate=False), exact),
                          "fp8": rel(fp8_out, exact), "fp8_vs_twin": rel(fast, twin)}
                rec.checks.append({"name": f"attention {name}: relative error against fp32", **errors,
                                   "ok": errors["fp8"] < 0.1 and errors["fp8_vs_twin"] < 0.03})
                print(f"  attention error vs fp32: {errors}", flush=True)
        # forward + backward: the FP8 backward runs the bf16 kernels on the dequantised operands
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        for impl, fp8 in (("bf16", False), ("fp8", True)):
            run = lambda fp8=fp8: jagged_flash_attention(*leaves, off, longest, kernel="triton", validate=False,  # noqa: E731
                                                         fp8=fp8, **mask)
            rec.add("attention", name, impl, "fwd+bwd", bench_ms(fwd_bwd(run, leaves)), 3.5 * flops)
        if case == "jfa_self":
            do = torch.randn_like(q)
            exact = [x.float().detach().requires_grad_() for x in (q, k, v)]
            ref = torch.autograd.grad(jagged_flash_attention(*exact, off, longest, kernel="triton", validate=False),
                                      exact, do.float())
            errors = {}
            for impl, fp8 in (("bf16", False), ("fp8", True)):
                grads = torch.autograd.grad(jagged_flash_attention(*leaves, off, longest, kernel="triton",
                                                                   validate=False, fp8=fp8), leaves, do)
                errors[impl] = {f"d{n}": round(float((g.float() - r).norm() / r.norm()), 5)
                                for n, g, r in zip("qkv", grads, ref)}
            rec.checks.append({"name": f"attention {name}: gradients' relative error against fp32", **errors,
                               "ok": max(errors["fp8"].values()) < 0.1})
            print(f"  attention gradient error vs fp32: {errors}", flush=True)


def crossover(summary: list[dict], impl: str, prefix: str = "") -> dict:
    """Per token count: the narrowest K = N whose forward+backward is faster in ``impl`` than in bfloat16
    (``prefix``: "mlp " for the MLP block's cases, "" for one linear's)."""
    out = {}
    for m in TOKENS:
        wins = [w for w in WIDTHS for e in summary
                if e["case"] == f"{prefix}M={m} K=N={w}" and e["pass"] == "fwd+bwd" and e.get(f"{impl}_speedup", 0) > 1.0]
        out[str(m)] = min(wins) if wins else None
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="the smallest token count only")
    p.add_argument("--parts", default="attention,linear,mlp", help="a comma list of attention, linear, mlp")
    p.add_argument("--tuned", help="JSON of launch configs from an earlier --save-tuned run (used before the shipped ones)")
    p.add_argument("--save-tuned", help="write the launch configs picked in this run to this JSON (with "
                                        "GEM_KERNELS_AUTOTUNE=1: the ones to ship in ops/triton/tuned)")
    a = p.parse_args(argv)
    t0 = time.time()
    import triton

    commit = git_commit()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m gem_kernels.ops.benchmarks.bench_fp8 " + " ".join(argv or sys.argv[1:]),
            "dtype": "bfloat16 activations, float8_e4m3fn rowwise or blockwise (power-of-two scales)",
            "flops_note": "2*M*K*N forward, 3x that forward+backward; quantisation included in the FP8 times",
            "peak_bw_TBps": 4.2}
    from gem_kernels.ops.triton import _tuning

    if a.tuned:
        _tuning.load_tuned(a.tuned)
        meta["tuned_from"] = a.tuned
    rec = FP8Recorder(a.out, meta)
    print("== checks ==", flush=True)
    guarded(rec, "checks", lambda: run_checks(rec))
    parts = a.parts.split(",")
    if "attention" in parts:
        print("== attention: bf16 vs fp8, forward and forward+backward ==", flush=True)
        guarded(rec, "attention", lambda: bench_attention(rec))
    print("== linear: bf16 vs fp8 ==", flush=True)
    for m in (TOKENS[:1] if a.quick else TOKENS) if "linear" in parts else ():
        for width in WIDTHS:
            guarded(rec, f"linear M={m} K=N={width}", lambda m=m, width=width: bench_linear(rec, m, width))
            torch.cuda.empty_cache()  # the next shape's tensors differ in size
    if "mlp" in parts:
        print("== mlp block: bf16 vs fp8 with producer-quantised activations ==", flush=True)
        guarded(rec, "mlp checks", lambda: run_mlp_checks(rec))
        for m in MLP_TOKENS[:1] if a.quick else MLP_TOKENS:
            for width in WIDTHS[1:]:
                guarded(rec, f"mlp M={m} K=N={width}", lambda m=m, width=width: bench_mlp(rec, m, width))
                torch.cuda.empty_cache()
    summary = rec.summary()
    rec.meta["crossover_fwd_bwd"] = {impl: crossover(summary, impl) for impl in VARIANTS}
    rec.meta["crossover_fwd_bwd_mlp"] = {impl: crossover(summary, impl, "mlp ") for impl in VARIANTS}

    rec.meta["autotune"] = os.environ.get("GEM_KERNELS_AUTOTUNE", "0")
    rec.meta["tuned_configs"] = {repr(k): v for k, v in _tuning.tuned_configs().items()}
    rec.meta["wall_s"] = round(time.time() - t0, 1)
    rec.write()
    if a.save_tuned:
        _tuning.save_tuned(a.save_tuned)
    for e in rec.attention_summary():
        print(f"{e['case']:44s} {e['pass']:8s} bf16 {e['bf16_ms']:.3f} ms  fp8 {e['fp8_ms']:.3f} ms  "
              f"x{e['fp8_speedup']}  target {e['target']}")
    impls = (*VARIANTS, *MLP_ONLY)
    print(f"\n{'case':28s} {'pass':8s} {'bf16 ms':>9s} " + " ".join(f"{v + ' x':>16s}" for v in impls) + "  target")
    for e in summary:
        if "K=N" not in e["case"]:  # the attention rows, printed above
            continue
        print(f"{e['case']:28s} {e['pass']:8s} {e['bf16_ms']:9.3f} "
              + " ".join(f"{e.get(f'{v}_speedup', float('nan')):16.3f}" for v in impls) + f"  {e['target']}")
    print("crossover (narrowest K=N where fp8 fwd+bwd beats bf16):", rec.meta["crossover_fwd_bwd"])


if __name__ == "__main__":
    main()
