"""Each package builds a wheel that installs and imports alone, in a clean virtual environment holding the
CPU torch / fbgemm-gpu-cpu / torchrec stack (installed first, as the README tells users who pin single
packages) plus exactly the requirements that package declares."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from install_env import STACK, TORCHREC_REQUIREMENTS, requirement_name  # noqa: E402

FOLDERS = {
    "gem-kernels": "packages/gem-kernels",
    "gem-kunlun": "packages/gem-kunlun",
    "gem-data": "packages/gem-data",
    "gem-parallel": "packages/gem-parallel",
    "gem-transfer": "packages/gem-transfer",
    "gem-trainer": "apps/gem-trainer",
}
CONSTRAINTS = ROOT / "tools" / "constraints-cpu.txt"
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_NO_DEPS", "PIP_NO_BUILD", "PYTHONPATH", "VIRTUAL_ENV"))}


def run(*command, **kwargs):
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, env=CLEAN_ENV, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, command))}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def requirements(name: str) -> list[str]:
    return tomllib.loads((ROOT / FOLDERS[name] / "pyproject.toml").read_text())["project"]["dependencies"]


def closure(name: str) -> list[str]:
    """The package and every gem package it needs, transitively."""
    seen, todo = [], [name]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.append(current)
            todo += [requirement_name(r) for r in requirements(current) if requirement_name(r).startswith("gem-")]
    return seen


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheels")
    for folder in FOLDERS.values():
        run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", out, ROOT / folder)
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A virtual environment with only the CPU stack, shared by the per-package environments through a .pth."""
    venv = tmp_path_factory.mktemp("stack")
    run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "-c", CONSTRAINTS, "torch==2.13.0", "fbgemm-gpu-cpu")
    run(python, "-m", "pip", "install", "-q", "--no-deps", "torchrec==1.8.0")
    run(python, "-m", "pip", "install", "-q", "-c", CONSTRAINTS, *TORCHREC_REQUIREMENTS)
    return Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOLDERS))
def test_wheel_installs_and_imports_alone(name, wheels, stack, tmp_path):
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    (site / "stack.pth").write_text(f"{stack}\n")
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q"]
    needed = closure(name)
    run(*pip, "--no-deps", *[next(wheels.glob(f"{n.replace('-', '_')}-*.whl")) for n in needed])
    third_party = sorted({r for n in needed for r in requirements(n) if requirement_name(r) not in STACK and not requirement_name(r).startswith("gem-")})
    if third_party:
        run(*pip, "-c", CONSTRAINTS, *third_party)
    module = name.replace("-", "_")
    check = (
        "import importlib, importlib.metadata as md, sys;"
        f"m = importlib.import_module('{module}');"
        "assert 'site-packages' in m.__file__, m.__file__;"
        f"print(md.version('{name}'))"
    )
    version = run(python, "-I", "-c", check, cwd=tmp_path).strip()
    assert version, "the installed wheel reports no version"
    if name == "gem-trainer":
        run(venv / "bin" / "gem-trainer", "config", cwd=tmp_path)
