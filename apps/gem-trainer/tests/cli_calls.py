"""The trainer's command line as the tests call it: in a process of its own (``cli``: what trains, evaluates or
launches ranks), or in the test's process (``cli_here``: what the command line answers before any work, or work
that needs no process of its own, as plotting a run's metrics)."""

import contextlib
import io
import os
import subprocess
import sys


def cli(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gem_trainer.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def cli_here(*args) -> subprocess.CompletedProcess:
    """``cli``'s exit code and output without an interpreter's start-up (seconds: it imports torch)."""
    from gem_trainer.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse's errors and --help
            code = exit_.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
