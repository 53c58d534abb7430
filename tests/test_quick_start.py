"""The README's quick start on a Python that refuses ``pip install`` outside a virtual environment (Debian 12,
Ubuntu 24.04: "externally-managed-environment"), with and without the venv module: ``tools/hatch`` still
gets a working hatch. Needs PyPI, as the quick start itself does."""

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)
# a python3 that behaves like a distribution's externally managed one
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1 $2" = "-m pip" ] && [ "${{PIP_BREAK_SYSTEM_PACKAGES:-}}" != "1" ]; then
    echo "error: externally-managed-environment" >&2; exit 1
fi
if [ "$1 $2" = "-m venv" ] && [ -n "${{NO_VENV_MODULE:-}}" ]; then
    echo "The virtual environment was not created successfully because ensurepip is not available." >&2; exit 1
fi
exec {python} "$@"
"""


INSTALL_CHOICES = {"PIP_BREAK_SYSTEM_PACKAGES", "PIP_NO_DEPS", "PIP_NO_BUILD_ISOLATION", "PIP_USER", "PIP_TARGET",
                   "PIP_PREFIX", "PIP_REQUIRE_VIRTUALENV"}


def fake_checkout(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    (tmp_path / "repo" / "tools").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "hatch", tmp_path / "repo" / "tools" / "hatch")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python3"
    python.write_text(FAKE_PYTHON.format(python=BASE_PYTHON))
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path / "home"), "LANG": "C.UTF-8"}
    # where this machine finds packages (indexes, certificates), nothing that would lift the refusal or change
    # what an install does (the hatch environment running these tests sets PIP_NO_DEPS for its own installs)
    env.update({k: v for k, v in os.environ.items() if k.startswith(("PIP_", "SSL_")) and k not in INSTALL_CHOICES})
    return tmp_path / "repo", env


@pytest.mark.slow
def test_the_fake_python_refuses_a_plain_pip_install(tmp_path):
    _, env = fake_checkout(tmp_path)
    refused = subprocess.run(["python3", "-m", "pip", "install", "hatch"], capture_output=True, text=True, env=env)
    assert refused.returncode == 1 and "externally-managed-environment" in refused.stderr


@pytest.mark.slow
@pytest.mark.parametrize("venv_module", [True, False])
def test_tools_hatch_works_on_an_externally_managed_python(tmp_path, venv_module):
    repo, env = fake_checkout(tmp_path)
    if not venv_module:
        env["NO_VENV_MODULE"] = "1"
    done = subprocess.run([str(repo / "tools" / "hatch"), "--version"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("Hatch, version")
    assert (repo / ".hatch-env" / "ready").exists() == venv_module


@pytest.mark.slow
def test_tools_hatch_rebuilds_a_private_environment_whose_install_was_cut_short(tmp_path):
    repo, env = fake_checkout(tmp_path)
    env["PIP_NO_DEPS"] = "1"  # as inside another hatch environment: tools/hatch still installs hatch's dependencies
    # what an interrupted first run leaves: a hatch entry point whose dependencies never arrived
    broken = repo / ".hatch-env" / "bin" / "hatch"
    broken.parent.mkdir(parents=True)
    broken.write_text("#!/usr/bin/env bash\necho \"ModuleNotFoundError: No module named 'click'\" >&2; exit 1\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    done = subprocess.run([str(repo / "tools" / "hatch"), "--version"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("Hatch, version")
    assert (repo / ".hatch-env" / "ready").exists()
