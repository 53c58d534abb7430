"""Build a quality results table from finished next-item run folders (their ``eval.json`` and ``config.toml``).

    python -m gem_trainer.quality --run sasrec=runs/beauty-sasrec --run kunlun=runs/beauty-kunlun \\
        --wall sasrec=812 --command "hatch run trainer:launch --config ..." --out benchmarks/results/quality-beauty.json

Rows are ``{model, protocol, seed, metrics}``: one per negative draw for ``sampled`` (the seed of the draw)
and one for ``full`` (no draw: ``seed`` is null). ``summary`` holds the mean and spread (population std) over
the draws, the users evaluated and, when given, the run's wall time; ``published`` the reference numbers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import tomllib
from pathlib import Path
from typing import Any

from gem_trainer.provenance import git_commit

# for this exact data: S3-Rec's (CIKM 2020) tables, as quoted in ../shared/data/README.md; the full ranking (the
# user's history left out) of ICLRec (WWW 2022) and ICSRec (2024), the best published
PUBLISHED_BEAUTY = {
    "sampled": {"SASRec": {"hr@10": 0.4696, "ndcg@10": 0.3156}, "S3-Rec": {"hr@10": 0.5506, "ndcg@10": 0.3732}},
    "full": {"SASRec": {"hr@10": 0.0605, "ndcg@10": 0.0318}, "S3-Rec": {"hr@10": 0.0647, "ndcg@10": 0.0327},
             "ICLRec": {"hr@10": 0.0744, "ndcg@10": 0.0403}, "ICSRec": {"hr@10": 0.0959, "ndcg@10": 0.0578}},
}
_PER_SEED = re.compile(r"^(?P<protocol>sampled|full)/seed(?P<seed>\d+)/(?P<metric>[^/]+)$")


def rows_of_run(model: str, eval_result: dict[str, float]) -> list[dict[str, Any]]:
    """``{model, protocol, seed, metrics}`` rows from one run's flat ``eval.json``."""
    grouped: dict[tuple[str, int], dict[str, float]] = {}
    for key, value in eval_result.items():
        match = _PER_SEED.match(key)
        if match:
            grouped.setdefault((match["protocol"], int(match["seed"])), {})[match["metric"]] = value
    return [
        {"model": model, "protocol": protocol, "seed": seed if protocol == "sampled" else None, "metrics": metrics}
        for (protocol, seed), metrics in sorted(grouped.items())
    ]


def summary_of_run(model: str, eval_result: dict[str, float], wall_s: float | None) -> list[dict[str, Any]]:
    """Mean and std over the draws, per protocol, with the users evaluated."""
    summaries = []
    for protocol in ("sampled", "full"):
        users = eval_result.get(f"{protocol}/users")
        if users is None:
            continue
        mean = {k.split("/")[1]: v for k, v in eval_result.items() if re.fullmatch(rf"{protocol}/[^/]+", k)
                and k not in (f"{protocol}/users", f"{protocol}/queries")}
        std = {k.split("/")[1]: v for k, v in eval_result.items() if re.fullmatch(rf"{protocol}/[^/]+/std", k)}
        seeds = sorted({int(m["seed"]) for k in eval_result if (m := _PER_SEED.match(k)) and m["protocol"] == protocol})
        summaries.append({
            "model": model, "protocol": protocol, "seeds": seeds if protocol == "sampled" else [], "users": int(users),
            "step": int(eval_result.get("step", 0)), "wall_s": wall_s if wall_s is not None else _recorded_wall(eval_result),
            "mean": mean, "std": std,
        })
    return summaries


def _recorded_wall(eval_result: dict[str, float]) -> float | None:
    """Training plus evaluation seconds as the run recorded them (``gem-trainer train`` writes both)."""
    if "train_s" not in eval_result:
        return None
    return eval_result["train_s"] + eval_result.get("eval_s", 0.0)


def build_table(runs: dict[str, Path], wall: dict[str, float], commands: list[str]) -> dict[str, Any]:
    rows, summary, configs, splits = [], [], {}, set()
    for model, folder in runs.items():
        result = json.loads((folder / "eval.json").read_text())
        splits.add(result.get("split", "test split"))
        rows += rows_of_run(model, result)
        summary += summary_of_run(model, result, wall.get(model))
        config_path = folder / "config.toml"
        if config_path.is_file():
            configs[model] = tomllib.loads(config_path.read_text())
    return {
        "meta": {
            "commit": git_commit(Path(__file__).resolve().parent),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commands": commands,
            "data": f"Amazon Beauty 5-core (../shared/data/beauty), leave-one-out, {' / '.join(sorted(splits))}",
            "published": PUBLISHED_BEAUTY,
            "configs": configs,
        },
        "rows": rows,
        "summary": summary,
    }


def _pairs(items: list[str], what: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--{what} {item!r}: expected NAME=VALUE")
        name, value = item.split("=", 1)
        pairs[name] = value
    return pairs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gem_trainer.quality", description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", default=[], required=True, help="MODEL=RUN_DIR (repeatable)")
    parser.add_argument("--wall", action="append", default=[], help="MODEL=SECONDS of the run's wall time")
    parser.add_argument("--command", action="append", default=[], help="a command that produced the runs")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    runs = {name: Path(folder) for name, folder in _pairs(args.run, "run").items()}
    wall = {name: float(seconds) for name, seconds in _pairs(args.wall, "wall").items()}
    table = build_table(runs, wall, args.command)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {len(table['rows'])} rows to {args.out}")


if __name__ == "__main__":
    main()
