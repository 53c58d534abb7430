"""Side-by-side tables of finished runs: ``python -m gem_trainer.report --run NAME=RUN_DIR ... --out FILE``.

Reads each run's ``eval.json`` and ``config.toml`` and writes one JSON table (``meta`` with commit, date
and command; ``rows`` of ``{run, model, task, group, metrics}``) for binary tasks per surface, printing the
NE per task and surface of every run next to each other.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from gem_trainer.config import load_config
from gem_trainer.provenance import git_commit


def collect(runs: dict[str, Path]) -> list[dict]:
    rows = []
    for name, folder in runs.items():
        result_file = folder / "eval.json"
        if not result_file.is_file():
            raise FileNotFoundError(f"--run {name}={folder}: {result_file} does not exist (did the run finish?)")
        result = json.loads(result_file.read_text())
        config = load_config(folder / "config.toml")
        groups = sorted({k.rsplit("/", 1)[0] for k in result if k.endswith("/ne")})
        for group in groups:
            task, where = group.split("/", 1)
            metrics = {m: result[f"{group}/{m}"] for m in ("ne", "auc", "calibration", "count") if f"{group}/{m}" in result}
            rows.append({"run": name, "model": config.model.name, "task": task, "group": where, "step": result["step"],
                         "metrics": metrics})
    return rows


def _describe(folder: Path) -> dict:
    config = load_config(folder / "config.toml")
    model = config.model.model_dump(mode="json", include={"name", config.model.name}, exclude_none=True)
    return {"folder": str(folder), "model": model, "steps": config.schedule.steps,
            "batch_size": config.data.batch_size, "seed": config.seed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", action="append", required=True, help="NAME=RUN_DIR (repeat)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    runs = {}
    for item in args.run:
        name, sep, folder = item.partition("=")
        if not sep:
            parser.error(f"--run {item!r}: expected NAME=RUN_DIR")
        runs[name] = Path(folder)
    rows = collect(runs)
    meta = {
        # what each run was: enough to rerun it with `gem-trainer train --config <folder>/config.toml`
        "runs": {name: _describe(folder) for name, folder in runs.items()},
        "commit": git_commit(Path(__file__).resolve().parent),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m gem_trainer.report " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()} {platform.system()}",
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    names = list(runs)
    print(f"{'task/group':<26}" + "".join(f"{'NE ' + n:>24}" for n in names))
    for key in sorted({(r["task"], r["group"]) for r in rows}):
        cells = []
        for n in names:
            match = [r for r in rows if r["run"] == n and (r["task"], r["group"]) == key]
            cells.append(f"{match[0]['metrics']['ne']:>24.4f}" if match else f"{'-':>24}")
        print(f"{key[0] + '/' + key[1]:<26}" + "".join(cells))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
