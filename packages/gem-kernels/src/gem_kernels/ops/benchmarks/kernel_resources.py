"""Registers, spills, shared memory and occupancy of the attention kernels as built for Hopper, from any machine.

A kernel's speed on the GPU starts with what ptxas made of it: registers per thread (255 at most; past that, values
spill to local memory, which is slow), shared memory per program, and so how many programs an SM holds at once.
None of this needs a GPU: Triton compiles for sm_90 anywhere and its bundled CUDA tools read the binary. This
benchmark records the launches ``run_all``'s attention cases and ``bench_fp8``'s FP8 JFA make (each case family called
once, with a few rows but the case's sequence count and declared lengths, so that the ops plan the same kernels,
grids and constexprs), builds
each kernel with the tile config a device's shipped file gives its key (``tuned/<device>.json``; the first candidate
where the file has none) and the argument specialisation Triton would give the benchmark's tensors, and reports:

- ``regs`` (per thread), ``stack_bytes`` (per thread: the stack frame, where registers spill; 0 for a kernel that
  fits its registers), ``shared_bytes`` (per program, the pipeline's buffers included);
- ``ctas_per_sm``: the programs an SM holds at once, the least of what its registers (65,536, allocated per warp in
  steps of 256), its shared memory (228 KiB, 1 KiB reserved per program) and its warps (64) allow, and which limits;
- ``sass``: the instruction count of the binary and of its main kinds (Hopper's warpgroup MMAs, 16-bit and FP8, and
  the warp-level ones a tile under 64 rows takes, TMA loads and asynchronous pointer loads, stack stores and loads,
  selects).

    PYTHONPATH=packages/gem-kernels/src python -m gem_kernels.ops.benchmarks.kernel_resources \\
        --device "NVIDIA H100 80GB HBM3" --out kernel-resources.json

The launches are recorded in a process of their own under the Triton interpreter (the ops take their Triton path
on CPU tensors there, planning as on a GPU), none of them run; the builds happen in this one. A compile, not a
measurement: the numbers are a property of the code and the config, the same on every machine with the same Triton.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# sm_90 (H100, H200): per SM
REGISTERS = 65536
REGISTER_STEP = 256  # registers are handed to a warp in steps of this many
SHARED_BYTES = 233472  # 228 KiB
SHARED_RESERVED = 1024  # per program
WARPS = 64
PROGRAMS = 32
SASS_KINDS = ("HGMMA", "QGMMA", "HMMA", "UTMALDG", "LDGSTS", "STL", "LDL", "SEL", "FSEL", "BAR")
FAMILIES = ("jfa_self", "jfa_causal", "jfa_long", "jfa_self_fp8", "cross_kv16", "cross_kv64", "cross_kv128",
            "cross_kv256", "pma_q32", "block_w512", "block_w64")
H, D = 4, 128


def ctas_per_sm(regs: int, shared_bytes: int, num_warps: int) -> tuple[int, str]:
    """Programs of ``num_warps`` warps, ``regs`` registers per thread and ``shared_bytes`` of shared memory that an
    sm_90 SM holds at once, and what limits them (``registers``, ``shared memory``, ``warps``, ``programs``; those that
    allow the same, joined by `` + ``)."""
    per_warp = -(-regs * 32 // REGISTER_STEP) * REGISTER_STEP
    limits = {"registers": REGISTERS // (per_warp * num_warps) if regs else PROGRAMS,
              "shared memory": SHARED_BYTES // (shared_bytes + SHARED_RESERVED),
              "warps": WARPS // num_warps, "programs": PROGRAMS}
    least = min(limits.values())
    return least, " + ".join(name for name, n in limits.items() if n == least)


# --- recording (in a process under the Triton interpreter) -----------------------------------------------------

def _call_family(family: str) -> None:
    """Forward and backward of ``family``'s op on bf16 CPU tensors: few rows, the case's sequence count and declared
    lengths (``run_all``'s cases and ``bench_fp8``'s FP8 JFA: 256 sequences declared 4,096 long, 64 declared 16,384,
    kv sequences of exactly 16-256 keys, 32 broadcast queries, 8 sequences of 8,192 rows in blocks of 64)."""
    import torch

    from gem_kernels import block_attention, gdpa, jagged_flash_attention

    def rows(n: int) -> torch.Tensor:
        return torch.zeros(n, H, D, dtype=torch.bfloat16, requires_grad=True)

    def offsets(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])

    short = [1 + i % 4 for i in range(256)]  # far shorter than declared, as the benchmark's lengths are
    off = offsets(short)
    q = rows(int(off[-1]))
    if family in ("jfa_self", "jfa_causal"):
        out = jagged_flash_attention(q, rows(q.shape[0]), rows(q.shape[0]), off, 4096, causal=family == "jfa_causal",
                                     kernel="triton")
        inputs = [q]
    elif family == "jfa_self_fp8":  # E4M3 Q, K and V (bench_fp8's attention case)
        out = jagged_flash_attention(q, rows(q.shape[0]), rows(q.shape[0]), off, 4096, kernel="triton", fp8=True)
        inputs = [q]
    elif family == "jfa_long":
        off = offsets([1 + i % 4 for i in range(64)])
        q = rows(int(off[-1]))
        out = jagged_flash_attention(q, rows(q.shape[0]), rows(q.shape[0]), off, 16384, kernel="triton")
        inputs = [q]
    elif family.startswith("cross_kv"):
        nkv = int(family.removeprefix("cross_kv"))
        k, v = rows(256 * nkv), rows(256 * nkv)
        out = gdpa(q, k, v, off, offsets([nkv] * 256), max_seq_len_q=4096, max_seq_len_kv=nkv, kernel="triton")
        inputs = [q, k, v]
    elif family == "pma_q32":
        k, v = rows(q.shape[0]), rows(q.shape[0])
        out = gdpa(rows(32), k, v, None, off, max_seq_len_kv=4096, kernel="triton")
        inputs = [k, v]
    elif family in ("block_w512", "block_w64"):
        x = rows(8 * 8192)
        out = block_attention(x, rows(x.shape[0]), rows(x.shape[0]), offsets([8192] * 8), 64,
                              8 if family == "block_w512" else 1, max_seq_len=8192, kernel="triton")
        inputs = [x]
    else:
        raise ValueError(f"unknown case family {family!r}: one of {', '.join(FAMILIES)}")
    torch.autograd.grad(out, inputs, torch.zeros_like(out))


def record(families: list[str], device: str) -> list[dict]:
    """The launches of ``families``, each ``{"family", "module", "kernel", "signature", "constexprs", "attrs",
    "options", "config_from"}`` with the config ``device``'s shipped file gives (run in a process under the Triton
    interpreter: see ``record_here``)."""
    # (no autotuning there: it would take the first candidates, not the device's configs)
    env = {**{k: v for k, v in os.environ.items() if k != "GEM_KERNELS_AUTOTUNE"}, "TRITON_INTERPRET": "1"}
    script = "import json, sys; from gem_kernels.ops.benchmarks.kernel_resources import record_here; " \
             "print(json.dumps(record_here(sys.argv[1].split(','), sys.argv[2])))"
    done = subprocess.run([sys.executable, "-c", script, ",".join(families), device], env=env, capture_output=True,
                          text=True)
    if done.returncode:
        raise RuntimeError(f"recording the launches failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def record_here(families: list[str], device: str) -> list[dict]:
    """``record``'s work, in this process (which must run the Triton interpreter): every launch goes through
    ``_tuning.launch``, which is replaced for the calls by one that notes the launch and runs nothing."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    from gem_kernels.ops.triton import _tuning

    shipped_path = _tuning.device_file(device)
    if shipped_path.is_file():
        _tuning.load_tuned(str(shipped_path))  # each key's config as ``_tuning._preset`` gives it on that device
    launches, family = [], None

    def noted(kernel, grid_fn, args, consts, key, cands):
        cands = cands() if callable(cands) else cands
        cfg = _tuning._preset(key, cands)
        cfg, config_from = (cands[0], "first candidate") if cfg is None else (cfg, shipped_path.name)
        values = (args(cfg) if callable(args) else args)
        names = kernel.arg_names
        given = {**consts, **{k: v for k, v in cfg.items() if k in names}}
        signature, constexprs, attrs = {}, {}, {}
        free = [name for name in names if name not in given]
        for name, value in zip(free, values):
            kind, spec = native_specialize_impl(CUDABackend, value, False, True, True)
            if kind == "constexpr":  # Triton builds an argument equal to 1 (or None) as a constant
                constexprs[name] = spec
            if spec == "D":
                attrs[name] = 16
            signature[name] = kind
        for name, value in given.items():
            signature[name], constexprs[name] = "constexpr", value
        launches.append({"family": family, "module": kernel.fn.__module__, "kernel": kernel.fn.__name__,
                         "signature": signature, "constexprs": constexprs, "attrs": attrs,
                         "options": {k: v for k, v in cfg.items() if k not in names}, "config_from": config_from})
        return cfg, None

    # every module that took ``launch`` by name launches through the replacement too; and the ops plan as on a GPU,
    # not as under the interpreter (its small tile candidates, its exact FP8 casts)
    import gem_kernels.ops.triton as kernels

    replaced = {_tuning.launch: noted, _tuning.interpreting: lambda: False}
    for module in [_tuning, *(m for name, m in sys.modules.items() if name.startswith(kernels.__name__ + "."))]:
        for name in ("launch", "interpreting"):
            if getattr(module, name, None) in replaced:
                setattr(module, name, replaced[getattr(module, name)])
    # NOTE: FP8 attention's quantisers launch Triton themselves, not through ``launch``, so they would run here (under
    # the interpreter, which has no bfloat16): their PyTorch twins make the same operands for the attention kernel
    from gem_kernels.ops.triton import triton_fp8_attention

    for name in ("fp8_attention_operands", "fp8_attention_dequantize", "sequence_aligned_layout"):
        def reference(*args, _original=getattr(triton_fp8_attention, name), **kwargs):
            return _original(*args, **{**kwargs, "kernel": "pytorch"})
        setattr(triton_fp8_attention, name, reference)
    for family in families:
        _tuning._PLANS.clear()
        _tuning._TUNED.clear()
        _call_family(family)
    return launches


# --- building and reading the binaries ---------------------------------------------------------------------------

def build(launch: dict) -> dict:
    """``launch`` compiled for sm_90: registers, stack (spills) and shared memory, programs per SM, SASS counts."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    names = fn.arg_names
    source = ASTSource(fn=fn, signature=launch["signature"],
                       constexprs={(names.index(k),): v for k, v in launch["constexprs"].items()},
                       attrs={(names.index(k),): [["tt.divisibility", v]] for k, v in launch["attrs"].items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch["options"])
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([tools / "nvdisasm", "-c", cubin], capture_output=True, text=True, check=True).stdout
    regs, stack = (int(re.search(rf"{field}:(\d+)", usage).group(1)) for field in ("REG", "STACK"))
    shared = compiled.metadata.shared
    num_warps = compiled.metadata.num_warps
    ctas, limit = ctas_per_sm(regs, shared, num_warps)
    # an instruction: /*offset*/ [predicate] OPCODE.modifiers ...
    opcodes = collections.Counter(m.group(1) for m in re.finditer(
        r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)", sass))
    return {"regs": regs, "stack_bytes": stack, "shared_bytes": shared, "num_warps": num_warps,
            "num_stages": compiled.metadata.num_stages, "ctas_per_sm": ctas, "limited_by": limit,
            "sass": {"total": sum(opcodes.values()), **{kind: opcodes[kind] for kind in SASS_KINDS}}}


def _label(launch: dict) -> str:
    tiles = {k: v for k, v in launch["constexprs"].items() if k.startswith(("BLOCK_M", "BLOCK_N", "Q_TILES"))}
    return " ".join(f"{k}={v}" for k, v in tiles.items())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="NVIDIA H100 80GB HBM3",
                   help="whose shipped tile configs to build with (tuned/<device>.json)")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated subset of {', '.join(FAMILIES)}")
    a = p.parse_args(argv)
    import triton

    from gem_kernels.ops.benchmarks.provenance import git_commit

    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("TRITON_INTERPRET=1 is set: the kernels are built for sm_90 here, which the interpreter replaces "
                "(the launches are recorded under it in a process of their own)")
    families = a.families.split(",")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        p.error(f"--families: unknown {unknown}; choose from {', '.join(FAMILIES)}")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    ptxas_version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    meta = {"target": "sm_90", "configs_of": a.device, "triton": triton.__version__, "ptxas": ptxas_version,
            "built_on": "no GPU needed: a compile for the target, read from the binary", "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m gem_kernels.ops.benchmarks.kernel_resources " + " ".join(argv or sys.argv[1:]),
            "sm90_per_sm": {"registers": REGISTERS, "shared_bytes": SHARED_BYTES, "warps": WARPS}}
    rows, built = [], {}
    print(f"{'family':12s} {'kernel':26s} {'tiles':30s} {'warps':>5s} {'regs':>5s} {'stack B':>7s} {'shared B':>8s} "
          f"{'CTAs/SM':>7s} {'limit':26s} {'SASS':>6s} {'HGMMA':>5s} {'QGMMA':>5s} {'HMMA':>4s} {'STL':>4s} "
          f"{'SEL':>4s}", flush=True)
    for launch in record(families, a.device):
        key = json.dumps([launch["kernel"], launch["signature"], launch["constexprs"], launch["options"]],
                         sort_keys=True, default=str)
        if key not in built:
            built[key] = build(launch)
        r = {"family": launch["family"], "kernel": launch["kernel"], "tiles": _label(launch),
             "config_from": launch["config_from"], "constexprs": launch["constexprs"], **built[key]}
        if r in rows:
            continue
        rows.append(r)
        print(f"{r['family']:12s} {r['kernel']:26s} {r['tiles']:30s} {r['num_warps']:5d} {r['regs']:5d} "
              f"{r['stack_bytes']:7d} {r['shared_bytes']:8d} {r['ctas_per_sm']:7d} {r['limited_by']:26s} "
              f"{r['sass']['total']:6d} {r['sass']['HGMMA']:5d} {r['sass']['QGMMA']:5d} {r['sass']['HMMA']:4d} "
              f"{r['sass']['STL']:4d} {r['sass']['SEL']:4d}", flush=True)
    Path(a.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
