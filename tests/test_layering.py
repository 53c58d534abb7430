"""The layering of DESIGN.md holds in the code: no package imports one above or beside it, and every
package declares, in its pyproject.toml, each package it imports."""

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "gem_kernels": ROOT / "packages" / "gem-kernels",
    "gem_kunlun": ROOT / "packages" / "gem-kunlun",
    "gem_data": ROOT / "packages" / "gem-data",
    "gem_parallel": ROOT / "packages" / "gem-parallel",
    "gem_transfer": ROOT / "packages" / "gem-transfer",
    "gem_trainer": ROOT / "apps" / "gem-trainer",
}
# What each package may import: everything below it in the layering, nothing beside or above.
ALLOWED = {
    "gem_kernels": set(),
    "gem_kunlun": {"gem_kernels"},
    "gem_data": {"gem_kernels", "gem_kunlun"},
    "gem_parallel": {"gem_kernels", "gem_kunlun"},
    "gem_transfer": {"gem_kernels", "gem_kunlun", "gem_data", "gem_parallel"},
    "gem_trainer": {"gem_kernels", "gem_kunlun", "gem_data", "gem_parallel", "gem_transfer"},
}
# Import name -> distribution name, where they differ.
DISTRIBUTION = {"gem_kernels": "gem-kernels", "gem_kunlun": "gem-kunlun", "gem_data": "gem-data",
                "gem_parallel": "gem-parallel", "gem_transfer": "gem-transfer", "gem_trainer": "gem-trainer",
                "yaml": "pyyaml"}


# Requirements needed at run time without an import statement of their own.
RUNTIME_ONLY = {"gem_trainer": {"tensorboard"}}  # loaded by torch.utils.tensorboard


def imported_modules(package: str) -> dict[str, list[str]]:
    """Top-level module -> the files (with line) importing it, over the package's shipped sources."""
    found: dict[str, list[str]] = {}
    for path in sorted((PACKAGES[package] / "src" / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                found.setdefault(name.split(".")[0], []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def declared(package: str) -> set[str]:
    project = tomllib.loads((PACKAGES[package] / "pyproject.toml").read_text())["project"]
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in project.get("dependencies", [])}


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_package_imports_one_above_or_beside_it(package):
    gem = {m: where for m, where in imported_modules(package).items() if m.startswith("gem_") and m != package}
    forbidden = {m: where for m, where in gem.items() if m not in ALLOWED[package]}
    assert not forbidden, f"{package} imports {forbidden}"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_imported_third_party_or_gem_package_is_declared(package):
    deps = declared(package)
    missing = {}
    for module, where in imported_modules(package).items():
        if module == package or module in sys.stdlib_module_names or module == "__future__":
            continue
        if DISTRIBUTION.get(module, module).replace("_", "-") not in deps:
            missing[module] = where
    assert not missing, f"{package} imports undeclared packages: {missing}"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_declared_package_is_imported(package):
    imported = {DISTRIBUTION.get(m, m).replace("_", "-") for m in imported_modules(package)}
    unused = sorted(declared(package) - imported - RUNTIME_ONLY.get(package, set()))
    assert not unused, f"{package} declares {unused} but never imports them"


def test_the_layering_table_covers_every_package_folder():
    folders = {p.name for p in (ROOT / "packages").iterdir() if p.is_dir()} | {"gem-trainer"}
    assert {DISTRIBUTION[p] for p in PACKAGES} == folders
