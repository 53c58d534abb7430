"""``gem-trainer``: train, eval, config, flops, plot and launch.

Every subcommand takes ``--config FILE`` (the embedded default when omitted) and any number of
``--section.field=value`` overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from gem_trainer.config import ConfigError, TrainerConfig, dump_config, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gem-trainer", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in [
        ("train", "train (resuming from the latest checkpoint), then evaluate"),
        ("eval", "evaluate the latest (or a given) checkpoint on the held-out split"),
        ("config", "print the resolved config as TOML"),
        ("flops", "parameters and FLOPs per model component, as a table and JSON"),
        ("plot", "PNG curves of a run's metrics"),
        ("launch", "start `train` through torchrun (processes from parallelism.nproc_per_node)"),
    ]:
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--config", default=None, help="TOML config file (default: the embedded default)")
        if name == "eval":
            sub.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
        if name in ("flops", "plot"):
            sub.add_argument("--out", default=None, help="output file (flops: JSON) or folder (plot: PNGs)")
        if name == "launch":
            sub.add_argument("--nproc-per-node", type=int, default=None)
            sub.add_argument("--nnodes", default="1")
            sub.add_argument("--node-rank", type=int, default=None)
            sub.add_argument("--rdzv-endpoint", default=None, help="host:port of node 0 for multi-node runs")
    args, rest = parser.parse_known_args(argv)
    overrides = []
    for item in rest:
        # `--section.field value` is the same override as `--section.field=value`
        if not item.startswith("--") and overrides and "=" not in overrides[-1]:
            overrides[-1] = f"{overrides[-1]}={item}"
        elif item.startswith("--"):
            overrides.append(item)
        else:
            parser.error(f"unexpected argument {item!r}; overrides look like --section.field=value")
    try:
        config = load_config(args.config, overrides)
    except ConfigError as error:
        print(f"gem-trainer: config error: {error}", file=sys.stderr)
        return 2
    return COMMANDS[args.command](config, args, overrides)


def _train(config: TrainerConfig, args, overrides) -> int:
    from gem_trainer.distributed import init_distributed, shutdown_distributed
    from gem_trainer.trainer import Trainer, TrainingDiverged

    try:
        env = init_distributed(config.device, config.parallelism.collectives)
        trainer = Trainer(config, env)
    except ConfigError as error:
        print(f"gem-trainer: config error: {error}", file=sys.stderr)
        shutdown_distributed()
        return 2
    if env.rank == 0:
        Path(config.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(config.run_dir) / "config.toml").write_text(dump_config(config))
    try:
        started = time.perf_counter()
        trainer.train()
        trained = time.perf_counter()
        if config.eval.at_end:
            result = trainer.evaluate()
            # wall times of this process (a resumed run counts from its restart)
            timing = {"train_s": trained - started, "eval_s": time.perf_counter() - trained}
            if env.rank == 0:
                _print_eval({**result, **timing}, trainer.step, Path(config.run_dir))
    except TrainingDiverged as error:
        print(f"gem-trainer: {error}", file=sys.stderr)
        return 3
    except ConfigError as error:
        print(f"gem-trainer: config error: {error}", file=sys.stderr)
        return 2
    finally:
        trainer.close()
        shutdown_distributed()
    return 0


def _eval(config: TrainerConfig, args, overrides) -> int:
    from gem_trainer.distributed import init_distributed, shutdown_distributed
    from gem_trainer.trainer import Trainer

    try:
        env = init_distributed(config.device, config.parallelism.collectives)
        trainer = Trainer(config, env)
    except ConfigError as error:
        print(f"gem-trainer: config error: {error}", file=sys.stderr)
        shutdown_distributed()
        return 2
    try:
        if not trainer.resume(args.step):
            print(f"gem-trainer: no checkpoint under {trainer.checkpoints.folder}", file=sys.stderr)
            return 1
        result = trainer.evaluate()
        if env.rank == 0:
            _print_eval(result, trainer.step, Path(config.run_dir))
    except ConfigError as error:
        print(f"gem-trainer: config error: {error}", file=sys.stderr)
        return 2
    finally:
        trainer.close()
        shutdown_distributed()
    return 0


def _print_eval(result: dict[str, float], step: int, run_dir: Path) -> None:
    (run_dir / "eval.json").write_text(json.dumps({"step": step, **result}, indent=2) + "\n")
    if "train_s" in result:
        print(f"\ntrained {step} steps in {result['train_s']:.0f} s, evaluated in {result['eval_s']:.0f} s")
    print(f"\nevaluation at step {step} (held-out split):")
    if any(k.endswith("/auc") for k in result):
        print(f"{'task/group':<28}{'AUC':>8}{'NE':>8}{'calib':>8}{'count':>9}")
        for key in sorted(k for k in result if k.endswith("/auc")):
            prefix = key[: -len("/auc")]
            print(
                f"{prefix:<28}{result[key]:>8.4f}{result[prefix + '/ne']:>8.4f}"
                f"{result[prefix + '/calibration']:>8.3f}{int(result[prefix + '/count']):>9}"
            )
    for protocol in ("sampled", "full"):
        names = [k.split("/")[1] for k in result if k.startswith(f"{protocol}/") and k.count("/") == 1 and not k.endswith("/users")]
        if names:
            users = int(result[f"{protocol}/users"])
            cells = "  ".join(f"{n} {result[f'{protocol}/{n}']:.4f}±{result[f'{protocol}/{n}/std']:.4f}" for n in names)
            print(f"{protocol} ({users} users): {cells}")
    print(f"metrics written to {run_dir / 'eval.json'}")


def _config(config: TrainerConfig, args, overrides) -> int:
    print(dump_config(config), end="")
    return 0


def _flops(config: TrainerConfig, args, overrides) -> int:
    from gem_trainer.flops import flop_report, format_flop_report

    report = flop_report(config)
    print(format_flop_report(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _plot(config: TrainerConfig, args, overrides) -> int:
    from gem_trainer.plot import plot_run

    written = plot_run(Path(config.run_dir), Path(args.out) if args.out else None)
    for path in written:
        print(path)
    return 0 if written else 1


def _launch(config: TrainerConfig, args, overrides) -> int:
    nproc = args.nproc_per_node or config.parallelism.nproc_per_node
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={args.nnodes}"]
    if args.rdzv_endpoint:
        command += ["--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}"]
        if args.node_rank is not None:
            command.append(f"--node-rank={args.node_rank}")
    else:
        command.append("--standalone")
    command += ["-m", "gem_trainer.cli", "train"]
    if args.config:
        command += ["--config", args.config]
    command += overrides
    print("launching:", " ".join(command), flush=True)
    os.execv(sys.executable, command)
    return 0  # not reached


COMMANDS = {"train": _train, "eval": _eval, "config": _config, "flops": _flops, "plot": _plot, "launch": _launch}

if __name__ == "__main__":
    sys.exit(main())
