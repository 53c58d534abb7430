"""One trainer config under several sets of overrides, timed in alternating rounds.

    python -m gem_trainer.bench_paired --config apps/gem-trainer/configs/beauty-kunlun.toml \\
        --variant "shipped" --variant "python-switch: data.read_ahead_switch_ms=0" \\
        [--override data.path=...] [--rounds 7] [--steps 60] --out results.json

A small model's step on a GPU waits on the host, whose speed drifts over a run (other tenants, clocks): two configs
timed one after the other can differ by more than the change between them. Here every variant's trainer is built
first (each with its own reader, CUDA graphs and optimizer state) and warmed up; then each round runs ``--steps``
back-to-back steps of every variant in turn, the order rotating from round to round. A variant's result is the median
over rounds of its step time and of its speed-up over the first variant (the reference) in the same round, so that
drift falls on every variant alike. Python's thread switch interval, the one process-wide setting a trainer makes
(``data.read_ahead_switch_ms``), is set to each variant's before its steps.

A variant is ``"NAME"`` or ``"NAME: section.field=value; section.field=value"``; ``--override`` applies to all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gem_trainer.bench import meta
from gem_trainer.config import load_config
from gem_trainer.distributed import init_distributed
from gem_trainer.trainer import Trainer, switch_interval


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``"NAME: a.b=1; c.d=2"`` -> ``("NAME", ["a.b=1", "c.d=2"])``."""
    name, _, rest = text.partition(":")
    name = name.strip()
    if not name:
        raise SystemExit(f"--variant {text!r}: give a name before the overrides (\"NAME: section.field=value; ...\")")
    overrides = [o.strip() for o in rest.split(";") if o.strip()]
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise SystemExit(f"--variant {name!r}: {bad[0]!r} is not section.field=value")
    return name, overrides


def run(args, argv: list[str]) -> dict:
    variants = dict(parse_variant(v) for v in args.variant)
    if len(variants) != len(args.variant):
        raise SystemExit("--variant: two variants have the same name")
    python_interval = sys.getswitchinterval()
    trainers: dict[str, Trainer] = {}
    with tempfile.TemporaryDirectory() as run_dir:
        try:
            for name, overrides in variants.items():
                config = load_config(args.config, [*args.override, *overrides, f"run_dir={Path(run_dir) / name}",
                                                   "checkpoint.enable=false", "metrics.tensorboard=false",
                                                   "metrics.progress_bar=false"])
                trainers[name] = Trainer(config, init_distributed(config.device, config.parallelism.collectives))
            device = next(iter(trainers.values())).env.device
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

            def window(name: str, steps: int) -> float:
                """Milliseconds a step over ``steps`` back-to-back steps of variant ``name``."""
                trainer = trainers[name]
                interval = switch_interval(trainer.config)
                sys.setswitchinterval(interval if interval is not None else python_interval)
                sync()
                start = time.perf_counter()
                for _ in range(steps):
                    trainer.train_step()
                sync()
                return 1e3 * (time.perf_counter() - start) / steps

            names = list(trainers)
            for name in names:
                window(name, args.warmup)
            rounds: list[dict[str, float]] = []
            for r in range(args.rounds):
                order = names[r % len(names):] + names[: r % len(names)]
                rounds.append({name: window(name, args.steps) for name in order})
                print(f"round {r}: " + ", ".join(f"{n} {rounds[-1][n]:.3f} ms" for n in names), flush=True)
        finally:
            for trainer in trainers.values():
                trainer.close()
            sys.setswitchinterval(python_interval)
    reference = names[0]
    result = {"meta": meta(device, argv, program="gem_trainer.bench_paired"), "config": str(args.config),
              "common_overrides": args.override, "reference": reference, "rounds": args.rounds,
              "steps_per_window": args.steps, "warmup_steps": args.warmup, "variants": {}}
    for name in names:
        times = [round(r[name], 4) for r in rounds]
        speedups = [round(r[reference] / r[name], 4) for r in rounds]
        batch = trainers[name].config.data.batch_size * trainers[name].env.world_size
        step_ms = statistics.median(times)
        result["variants"][name] = {
            "overrides": variants[name], "step_ms": round(step_ms, 4), "examples_per_s": round(batch / step_ms * 1e3, 1),
            "speedup_over_reference": round(statistics.median(speedups), 4),
            "step_ms_rounds": times, "speedup_rounds": speedups,
        }
    return result


def print_table(result: dict) -> None:
    print(f"\n{'variant':24s} {'ms/step':>9s} {'ex/s':>10s} {'speed-up':>9s} {'rounds':>17s}")
    for name, row in result["variants"].items():
        spread = f"{min(row['speedup_rounds']):.3f}-{max(row['speedup_rounds']):.3f}"
        print(f"{name:24s} {row['step_ms']:9.3f} {row['examples_per_s']:10.1f} {row['speedup_over_reference']:9.3f} "
              f"{spread:>17s}")
    print(f"(speed-up: the median over {result['rounds']} rounds of the reference's step time over the variant's, "
          f"reference {result['reference']!r})")


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m gem_trainer.bench_paired", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=None, help="trainer config (default: the embedded one)")
    p.add_argument("--variant", action="append", required=True, metavar='"NAME[: a.b=1; c.d=2]"',
                   help="a set of overrides, repeated; the first is the reference")
    p.add_argument("--override", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="for every variant")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=60, help="back-to-back steps of a variant in a round")
    p.add_argument("--warmup", type=int, default=20, help="steps of each variant before the rounds (graph captures, tuning)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        raise SystemExit("--rounds and --steps must be >= 1, --warmup >= 0")
    result = run(args, argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    return result


if __name__ == "__main__":
    main()
