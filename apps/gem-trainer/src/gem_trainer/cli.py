"""gem-trainer: train, eval, config, flops, plot, launch, posttrain / distill for offline distillation, precompute for Solaris.

Every subcommand takes --config FILE (the embedded default when omitted) and any number of
--section.field=value overrides (TOML values; "none" switches an optional field off).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path

from gem_trainer.config import ConfigError, TrainerConfig, dump_config, load_config
from gem_trainer.console import DropRecords

OVERRIDES_HELP = ("Any --section.field=value (or --section.field value) overrides the config, e.g. --optimizer.lr=3e-4 "
                  "--model.kunlun.d_model=64 --optimizer.grad_clip=none; `gem-trainer config` prints the result.")
RESUME_HELP = ("A run resumes from the newest intact checkpoint under run_dir/checkpoints (a damaged one is skipped "
               "with a warning). SIGTERM or Ctrl-C stops it after the current step with a checkpoint (on several ranks "
               "at the next logged step; a second signal stops at once). A run_dir that holds another model's run, or "
               "checkpoints that a run with --checkpoint.resume=false or --checkpoint.enable=false would not resume, "
               "is refused: use a new run_dir.")
EVAL_HELP = ("Without --config, eval reads the config the run trained with (run_dir/config.toml); a run_dir holding "
             "another model's checkpoints than the config describes is refused.")
COMMAND_HELP = {
    "train": "train (resuming from the newest intact checkpoint), then evaluate",
    "eval": "evaluate the newest (or a given) checkpoint on the held-out split",
    "config": "print the resolved config as TOML",
    "flops": "parameters and FLOPs per model component, as a table and JSON",
    "plot": "PNG curves of a run's metrics (run_dir/metrics.jsonl)",
    "launch": "start `train` (or --command distill / posttrain) through torchrun (processes from parallelism.nproc_per_node)",
    "posttrain": "run the teacher (distillation.teacher_run_dir) once over the training stream and write its logits "
                 "to distillation.soft_labels and/or its LoopFM representations to loopfm.store",
    "distill": "train the student on true labels plus the teacher's logits stored at distillation.soft_labels, then evaluate",
    "precompute": "Solaris: score candidate pairs with the teacher (distillation.teacher_run_dir) into the cache of "
                  "[solaris], then report the lookup's hit rate per fallback level, staleness and latency",
}
# exit codes of the one-line errors; a run stopped by a signal exits with 128 + its number, as one killed by it would
EXIT_CONFIG, EXIT_DIVERGED, EXIT_CHECKPOINT, EXIT_DATA, EXIT_SIGNAL = 2, 3, 4, 5, 128
ONE_LINE_EXITS = (EXIT_CONFIG, EXIT_DIVERGED, EXIT_CHECKPOINT, EXIT_DATA)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gem-trainer", description=__doc__.split("\n\n")[0], epilog=OVERRIDES_HELP)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMAND_HELP.items():
        notes = {"train": RESUME_HELP, "launch": RESUME_HELP, "distill": RESUME_HELP, "eval": EVAL_HELP}
        epilog = f"{OVERRIDES_HELP} {notes[name]}" if name in notes else OVERRIDES_HELP
        sub = commands.add_parser(name, help=help_text, description=help_text, epilog=epilog)
        sub.add_argument("--config", default=None, help="TOML config file (default: the run's own run_dir/config.toml, "
                                                        "else the embedded default)" if name == "eval" else
                         "TOML config file (default: the embedded default)")
        sub.add_argument("--debug", action="store_true", help="show the full traceback of an error")
        if name == "eval":
            sub.add_argument("--step", type=_step_number, default=None,
                             help="checkpoint step (default: the newest intact one); writes eval-step-N.json")
            sub.add_argument("--out", type=_output_file, default=None,
                             help="write the metrics to this file instead of run_dir/eval.json (or eval-step-N.json): "
                                  "evaluations of other splits or mixture sources side by side")
        if name == "flops":
            sub.add_argument("--out", type=_output_file, default=None, help="also write the table as JSON to this file")
        if name == "plot":
            sub.add_argument("--out", type=_output_folder, default=None, help="folder for the PNG files (default: run_dir)")
        if name == "launch":
            sub.add_argument("--nproc-per-node", type=_positive_number, default=None)
            sub.add_argument("--nnodes", default="1")
            sub.add_argument("--node-rank", type=int, default=None)
            sub.add_argument("--rdzv-endpoint", default=None, help="host:port of node 0 for multi-node runs")
            sub.add_argument("--command", dest="launched", choices=("train", "distill", "posttrain"), default="train",
                             help="the subcommand every process runs (default: train)")
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
        config = _eval_config(overrides) if args.command == "eval" and args.config is None else None
        config = config or load_config(args.config, overrides)
        return COMMANDS[args.command](config, args, overrides)
    except KeyboardInterrupt as interrupt:  # Ctrl-C outside training, or a second stop signal in it
        if args.debug:
            raise
        signum = getattr(interrupt, "signum", signal.SIGINT)
        print(f"gem-trainer: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        return EXIT_SIGNAL + signum
    except Exception as error:  # noqa: BLE001 - every known failure is one line; --debug shows the rest
        kind, code = _one_line_kind(error)
        if args.debug or kind is None:
            raise
        print(f"gem-trainer: {kind}: {error}", file=sys.stderr)
        return code


def _positive_number(text: str) -> int:
    """``--nproc-per-node``: a positive integer."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a number of processes is a positive integer, got {text!r}")
    return int(text)


def _output_file(text: str) -> str:
    """``--out`` of a file (its folders made if missing): checked before the work whose result it receives."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; name the file to write")
    _no_file_above(path)
    return text


def _output_folder(text: str) -> str:
    """``--out`` of a folder (made if missing): not an existing file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; name a folder")
    _no_file_above(path)
    return text


def _no_file_above(path: Path) -> None:
    """``path``'s folders can be made: none of them is a file."""
    for folder in path.absolute().parents:
        if folder.exists():
            if not folder.is_dir():
                raise argparse.ArgumentTypeError(f"{folder} is a file, not a folder to write {path.name} in")
            return


def _step_number(text: str) -> int:
    """``--step``: a checkpoint's step, a non-negative integer (argparse reports anything else in one line)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a checkpoint step is a non-negative integer, got {text!r}")
    return int(text)


def _eval_config(overrides: list[str]) -> TrainerConfig | None:
    """``eval`` without ``--config``: the config the run trained with (``run_dir/config.toml``, as ``train`` recorded
    it) under the overrides, which only it has to accept; None where there is no record or it no longer loads (said
    in a note)."""
    run_dir = load_config(None, [item for item in overrides if item.startswith("--run_dir=")]).run_dir
    recorded = Path(run_dir) / "config.toml"
    if not recorded.is_file():
        return None
    try:
        load_config(recorded)
    except ConfigError as error:  # an older run's record (or a damaged one): the embedded default stands in
        print(f"note: {recorded} no longer loads ({error}): evaluating with the embedded default config and the "
              f"overrides given (--config FILE names the config the run trained with)", file=sys.stderr)
        return None
    return load_config(recorded, overrides)


def _one_line_kind(error: Exception) -> tuple[str | None, int]:
    """The label and exit code of an error that is reported in one line (None: an unexpected error)."""
    from gem_data import DataError

    from gem_trainer.checkpoint import CheckpointError
    from gem_trainer.trainer import TrainingDiverged
    from gem_transfer import RepresentationError, SoftLabelError

    if isinstance(error, ConfigError):
        return "config error", EXIT_CONFIG
    if isinstance(error, TrainingDiverged):
        return "diverged", EXIT_DIVERGED
    if isinstance(error, CheckpointError):
        return "checkpoint error", EXIT_CHECKPOINT
    if isinstance(error, (DataError, FileNotFoundError, SoftLabelError, RepresentationError)):
        return "data error", EXIT_DATA
    return None, 1


def _train(config: TrainerConfig, args, overrides) -> int:
    from gem_trainer.distributed import init_distributed, shutdown_distributed
    from gem_trainer.run_folder import check_same_run, resume_changes, write_run_record
    from gem_trainer.trainer import Trainer

    check_same_run(config)
    env = init_distributed(config.device, config.parallelism.collectives)
    trainer, handlers = None, {}
    try:
        trainer = Trainer(config, env)
        handlers = _stop_on_signals(trainer)

        def record_run() -> None:  # once resumed: a resume that fails leaves the run's record as it was
            latest = trainer.checkpoints.latest_step() if config.checkpoint.enable else None
            if env.rank == 0 and (latest is None or trainer.config.schedule.steps > latest):
                # NOTE: a finished run asked for fewer steps than it has trained keeps its record (nothing trains)
                for note in resume_changes(trainer.config) if latest is not None else ():
                    print(note, flush=True)
                write_run_record(trainer.config, trainer.spec)  # schedule.steps as resolved from schedule.epochs

        started = time.perf_counter()
        trainer.train(on_start=record_run)
        trained = time.perf_counter()
        if trainer.stop_signal is not None:
            if env.rank == 0:
                saved = (f"checkpoint {trainer.checkpoints.path(trainer.step)}; run the same command to resume"
                         if config.checkpoint.enable else "no checkpoint (checkpoint.enable = false)")
                print(f"gem-trainer: stopped by {signal.Signals(trainer.stop_signal).name} at step {trainer.step} of "
                      f"{trainer.config.schedule.steps}: {saved}", file=sys.stderr, flush=True)
            return EXIT_SIGNAL + trainer.stop_signal
        if config.eval.at_end:
            result = trainer.evaluate()
            # wall times of this process (a resumed run counts from its restart)
            timing = {"train_s": trained - started, "eval_s": time.perf_counter() - trained,
                      "steps_this_run": trainer.step - trainer.first_step}
            if env.rank == 0:
                _print_eval({**result, **timing, **trainer.data_report()}, trainer.step, trainer.evaluated_split(),
                            Path(config.run_dir) / "eval.json")
    finally:
        for signum, previous in handlers.items():
            signal.signal(signum, previous)
        if trainer is not None:
            trainer.close()
        shutdown_distributed()
    return 0


class Interrupted(KeyboardInterrupt):
    """A second stop signal: the run stops at once."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop_on_signals(trainer) -> dict:
    """SIGTERM (a preempted job) and SIGINT (Ctrl-C) ask ``trainer`` to stop after its current step, with a checkpoint;
    a second signal to this process stops it at once. Returns the handlers replaced, signal -> handler."""
    received = []

    def handler(signum, frame):
        received.append(signum)
        if len(received) > 1:
            raise Interrupted(signum)
        name = signal.Signals(signum).name
        if trainer.finishing:
            print(f"{name}: the run is past its last step and finishing (again: stop at once)", file=sys.stderr, flush=True)
            return
        trainer.request_stop(signum)
        print(f"{name}: stopping after this step with a checkpoint (again: stop at once)", file=sys.stderr, flush=True)

    return {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}


def _distill(config: TrainerConfig, args, overrides) -> int:
    if config.distillation.soft_labels is None:
        raise ConfigError("distill needs distillation.soft_labels (a store written by `gem-trainer posttrain`); "
                          "`train` with distillation.teacher_run_dir distils online instead")
    return _train(config, args, overrides)


def _posttrain(config: TrainerConfig, args, overrides) -> int:
    from gem_trainer.distributed import init_distributed, shutdown_distributed
    from gem_trainer.posttrain import posttrain

    env = init_distributed(config.device, config.parallelism.collectives)
    try:
        started = time.perf_counter()
        written = posttrain(config, env)
        if env.rank == 0 and written["folder"] is not None:
            print(f"wrote the teacher's logits (checkpoint step {written['teacher_step']}) for {written['rows']} examples "
                  f"of {written['steps']} steps to {written['folder']} in {time.perf_counter() - started:.0f} s")
        if env.rank == 0 and "representations" in written:
            r = written["representations"]
            resumed = f", continuing a pass cut short at step {r['resumed_at']}" if r["resumed_at"] else ""
            print(f"wrote the teacher's LoopFM representations of {r['rows']} examples to {r['folder']}{resumed}")
    finally:
        shutdown_distributed()
    return 0


def _precompute(config: TrainerConfig, args, overrides) -> int:
    from gem_trainer.distributed import init_distributed, shutdown_distributed
    from gem_trainer.precompute import precompute
    from gem_transfer.solaris import format_summary

    env = init_distributed(config.device, config.parallelism.collectives)
    try:
        report = precompute(config, env)
    finally:
        shutdown_distributed()
    w = report["worker"]
    print(f"precomputed {w['written_pairs']} pairs of {w['users']} users ({w['duplicate_rows']} repeated rows skipped) "
          f"with the teacher at step {report['teacher']['step']} into the {report['backend']} cache in {w['pass_s']:.0f} s "
          f"({w['pairs_per_s']:.0f} pairs/s)")
    for name, summary in report["lookup"].items():
        print("\n" + format_summary(summary, f"lookups of {name} pairs"))
    print(f"\nreport written to {Path(config.solaris.output) / 'report.json'}")
    return 0


def _eval(config: TrainerConfig, args, overrides) -> int:
    from gem_trainer.checkpoint import CheckpointManager
    from gem_trainer.distributed import init_distributed, shutdown_distributed
    from gem_trainer.run_folder import check_same_model
    from gem_trainer.trainer import Trainer

    checkpoints = CheckpointManager(Path(config.run_dir) / "checkpoints", config.checkpoint.keep_latest)
    if not checkpoints.complete_steps():
        # NOTE: checked before anything is created: evaluating a mistyped run_dir must not leave a folder behind
        raise ConfigError(f"run_dir: no complete checkpoint under {checkpoints.folder}")
    check_same_model(config, evaluating=True)
    env = init_distributed(config.device, config.parallelism.collectives)
    trainer = None
    try:
        # NOTE: the run's own config.toml given as --config keeps its global batch too; only an explicit
        # --data.batch_size sets another
        if not any(item == "--data.batch_size" or item.startswith("--data.batch_size=") for item in overrides):
            config = _with_the_runs_global_batch(config, checkpoints, args.step, env.world_size)
        trainer = Trainer(config, env, training=False)
        if not trainer.resume(args.step, training=False):
            raise ConfigError(f"run_dir: no intact checkpoint under {checkpoints.folder}")
        result = trainer.evaluate()
        if env.rank == 0:
            name = "eval.json" if args.step is None else f"eval-step-{args.step}.json"
            out = Path(args.out) if args.out else Path(config.run_dir) / name
            _print_eval({**result, **trainer.data_report()}, trainer.step, trainer.evaluated_split(), out)
    finally:
        if trainer is not None:
            trainer.close()
        shutdown_distributed()
    return 0


def _with_the_runs_global_batch(config: TrainerConfig, checkpoints, step: int | None, world_size: int) -> TrainerConfig:
    """``config`` (the run's record) with the per-rank batch that keeps the global batch the run trained with on
    ``world_size`` ranks: a synthetic held-out set is drawn in global batches, so the evaluation of a run trained
    on other ranks would otherwise read other examples than its own evaluations did."""
    step = checkpoints.complete_steps()[-1] if step is None else step
    trained_on = checkpoints.local_state(step).get("world_size", world_size)
    global_batch = config.data.batch_size * trained_on
    if global_batch % world_size:
        if not _held_out_in_global_batches(config) and config.loopfm.store is None:
            return config  # held-out files and next-item users read the same examples in batches of any size
        raise ConfigError(f"data.batch_size: the run trained on global batches of {global_batch} examples ({trained_on} "
                          f"ranks), which {world_size} ranks cannot split evenly: evaluate on a number of ranks dividing "
                          f"it, or pass --data.batch_size (a synthetic held-out set is then drawn in other batches)")
    return config.model_copy(update={"data": config.data.model_copy(update={"batch_size": global_batch // world_size})})


def _held_out_in_global_batches(config: TrainerConfig) -> bool:
    """Whether the held-out examples depend on the global batch: a synthetic held-out set (the data's, or the
    evaluated source's of a mixture) is drawn in global batches."""
    d = config.data
    reader = next((s.reader or d.source for s in d.mixture.sources if s.name == d.mixture.evaluated), d.source)
    return reader == "synthetic"


def _print_eval(result: dict[str, float], step: int, split: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"step": step, "split": split, **result}, indent=2) + "\n")
    if "train_s" in result:
        if result["steps_this_run"]:
            print(f"\ntrained {int(result['steps_this_run'])} steps (to step {step}) in {result['train_s']:.0f} s, "
                  f"evaluated in {result['eval_s']:.0f} s")
        else:
            print(f"\nalready trained to step {step} (nothing left to train); evaluated in {result['eval_s']:.0f} s")
    if result.get("data/bad_rows"):
        print(f"data: {int(result['data/bad_rows'])} bad rows were skipped (data.skip_bad_rows = true)")
    print(f"\nevaluation at step {step} ({split}):")
    if any(k.endswith("/auc") for k in result):
        print(f"{'task/group':<28}{'AUC':>8}{'NE':>8}{'calib':>8}{'count':>9}")
        for key in sorted(k for k in result if k.endswith("/auc")):
            prefix = key[: -len("/auc")]
            print(
                f"{prefix:<28}{result[key]:>8.4f}{result[prefix + '/ne']:>8.4f}"
                f"{result[prefix + '/calibration']:>8.3f}{int(result[prefix + '/count']):>9}"
            )
    for protocol in ("sampled", "full"):
        names = [k.split("/")[1] for k in result if k.startswith(f"{protocol}/") and k.count("/") == 1
                 and not k.endswith(("/users", "/queries"))]
        if names:
            users, queries = int(result[f"{protocol}/users"]), int(result.get(f"{protocol}/queries", 0))
            counted = f"{queries} queries of {users} users" if queries and queries != users else f"{users} users"
            cells = "  ".join(f"{n} {result[f'{protocol}/{n}']:.4f}±{result[f'{protocol}/{n}/std']:.4f}" for n in names)
            print(f"{protocol} ({counted}): {cells}")
    print(f"metrics written to {out}")


def _config(config: TrainerConfig, args, overrides) -> int:
    print(dump_config(config), end="")
    if config.schedule.epochs is not None:
        # (a comment: the printed config still loads)
        print(f"# schedule.steps = {config.schedule.steps} stands in: schedule.epochs = {config.schedule.epochs} decides the "
              f"steps once the data is read (the run's config.toml records them)")
    return 0


def _flops(config: TrainerConfig, args, overrides) -> int:
    from gem_trainer.flops import flop_report, format_flop_report

    report = flop_report(config)
    print(format_flop_report(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _plot(config: TrainerConfig, args, overrides) -> int:
    from gem_trainer.plot import plot_run

    written = plot_run(Path(config.run_dir), Path(args.out) if args.out else None)
    for path in written:
        print(path)
    return 0 if written else 1


def _launch(config: TrainerConfig, args, overrides) -> int:
    """Runs ``args.launched`` in ``nproc`` processes per node under torchrun's elastic agent, in this process: a
    process's one-line error (config, data, checkpoint, divergence) ends the launch with that error's exit code,
    without the agent's report of a failed child around it."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    nproc = args.nproc_per_node if args.nproc_per_node is not None else config.parallelism.nproc_per_node
    # the run's record says how many processes per node trained it (evaluation keeps its global batch from it)
    overrides = [*overrides, f"--parallelism.nproc_per_node={nproc}"]
    if args.launched == "train":
        from gem_trainer.run_folder import check_same_run

        # what every process would refuse before its first step, refused once here (the processes' config differs
        # from this one in parallelism.nproc_per_node only, which the check does not read)
        check_same_run(config)
    torchrun = [f"--nproc-per-node={nproc}", f"--nnodes={args.nnodes}"]
    if args.rdzv_endpoint:
        torchrun += ["--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}"]
        if args.node_rank is not None:
            torchrun.append(f"--node-rank={args.node_rank}")
    else:
        torchrun.append("--standalone")
    torchrun += ["-m", "gem_trainer.cli", args.launched]
    if args.config:
        torchrun += ["--config", args.config]
    if args.debug:
        torchrun.append("--debug")
    torchrun += overrides
    print("launching:", sys.executable, "-m torch.distributed.run", " ".join(torchrun), flush=True)
    # the agent's line on a failed rank: the rank printed its one-line error, or the launch prints a line of its own
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(DropRecords("failed (exitcode"))
    try:
        run(parse_args(torchrun))
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        if failure.exitcode < 0:  # killed by a signal
            name = signal.Signals(-failure.exitcode).name
            print(f"gem-trainer: process {rank} was killed by {name}", file=sys.stderr)
            return EXIT_SIGNAL - failure.exitcode
        if failure.exitcode not in ONE_LINE_EXITS and failure.exitcode < EXIT_SIGNAL:
            # an unexpected error: the process printed its traceback
            print(f"gem-trainer: process {rank} failed with exit code {failure.exitcode}", file=sys.stderr)
        return failure.exitcode
    except SignalException as stop:  # the launcher was stopped: its processes were sent the same signal
        print(f"gem-trainer: launch stopped by {signal.Signals(stop.sigval).name}", file=sys.stderr)
        return EXIT_SIGNAL + stop.sigval
    return 0


COMMANDS = {"train": _train, "eval": _eval, "config": _config, "flops": _flops, "plot": _plot, "launch": _launch,
            "posttrain": _posttrain, "distill": _distill, "precompute": _precompute}

if __name__ == "__main__":
    sys.exit(main())
