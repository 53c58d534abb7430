"""Amazon Beauty quality runs on one GPU: a group of trainer runs side by side, then the quality table.

    python -m gem_trainer.bench_quality run benchmarks/quality-beauty/valid-1.json --data ../shared/data/beauty --out DIR
    python -m gem_trainer.bench_quality table DIR1 DIR2 ... --out benchmarks/results/quality-beauty.json

A group (a JSON file) lists arms, each a config plus overrides, trained with ``gem-trainer train`` in parallel
processes on this machine's GPU (small models leave it mostly idle: one run alone is bound by its host). A
validation group may name the arms to ``choose`` from and the ``rule``; the chosen arm is then the recipe its
test group trains (``choose`` and ``rule`` are fixed before the group runs: the test split plays no part in a
choice). ``run`` writes ``results.json`` (provenance, each arm's command, wall time and ``eval.json``) and
``runs.tgz`` (each run's eval, resolved config, metrics and log). ``table`` adds the groups to the quality file's
section ``history_excluded`` (full ranking leaves each user's history out), keeping the groups already there, with
means over seeds per model, recipe (config and overrides) and version of the config file.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from gem_trainer.quality import PUBLISHED_BEAUTY

# what Kunlun must reach on the test split (S3-Rec's sampled-99, ICLRec's full ranking: PUBLISHED_BEAUTY)
TARGETS = {"sampled/hr@10": PUBLISHED_BEAUTY["sampled"]["S3-Rec"]["hr@10"],
           "sampled/ndcg@10": PUBLISHED_BEAUTY["sampled"]["S3-Rec"]["ndcg@10"],
           "full/hr@10": PUBLISHED_BEAUTY["full"]["ICLRec"]["hr@10"],
           "full/ndcg@10": PUBLISHED_BEAUTY["full"]["ICLRec"]["ndcg@10"]}
HEADLINE = tuple(TARGETS)


def ndcg_sum(metrics: dict[str, float]) -> float:
    """Both protocols' NDCG@10, each over its target."""
    return metrics["full/ndcg@10"] / TARGETS["full/ndcg@10"] + metrics["sampled/ndcg@10"] / TARGETS["sampled/ndcg@10"]


def min_ratio(metrics: dict[str, float]) -> float:
    """The smallest of the four metrics over its target: the arm that meets all four with the most margin."""
    return min(metrics[key] / target for key, target in TARGETS.items())


RULES = {"ndcg_sum": ndcg_sum, "min_ratio": min_ratio}


def run_group(group_file: Path, data: Path, out: Path, device: str = "cuda") -> dict:
    group = json.loads(group_file.read_text())
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    results = {"group": group_file.stem, "spec": group, "provenance": provenance(group_file), "arms": {}}
    # the runs record the commit this benchmark runs at (a copied tree's own git may not know it)
    env = dict(os.environ, GEM_COMMIT=results["provenance"]["commit"], PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    started = {}
    for arm in group["arms"]:
        command = [sys.executable, "-m", "gem_trainer.cli", "train", "--config", arm["config"], f"--data.path={data}",
                   f"--run_dir={runs / arm['name']}", f"--device={device}", "--metrics.tensorboard=false", *arm["overrides"]]
        log = open(runs / f"{arm['name']}.log", "w")  # closed when the run ends
        started[arm["name"]] = (subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log, command, time.time())
    while started:
        time.sleep(5)
        for name, (process, log, command, began) in list(started.items()):
            if process.poll() is None:
                continue
            del started[name]
            log.close()
            row = {"rc": process.returncode, "wall_s": round(time.time() - began, 1),
                   "command": " ".join(part if not part.startswith("--data.path") else "--data.path=<Beauty folder>"
                                       for part in command[2:])}
            eval_file = runs / name / "eval.json"
            if eval_file.is_file():
                row["eval"] = json.loads(eval_file.read_text())
            else:
                row["log_tail"] = (runs / f"{name}.log").read_text()[-3000:]
            results["arms"][name] = row
            print(name, row["rc"], row["wall_s"], {k: round(row["eval"][k], 4) for k in HEADLINE} if "eval" in row else "failed", flush=True)
            _write(results, runs, out)  # as each finishes: a run cut short by a time limit keeps what is done
    if group.get("choose"):
        rule = RULES[group["rule"]]
        scores = {name: rule(row["eval"]) for name, row in results["arms"].items() if "eval" in row and name in group["choose"]}
        scores.update(group.get("earlier_scores", {}))
        results["scores"] = scores
        results["chosen"] = max(scores, key=scores.get) if scores else None
        print("scores", {k: round(v, 4) for k, v in scores.items()}, "chosen", results["chosen"])
        _write(results, runs, out)
    return results


def provenance(group_file: Path) -> dict:
    """``bench_runs.provenance`` (machine, torch, Triton, commit, date, command) and the device it ran on."""
    import torch

    from gem_trainer.bench_runs import provenance as run_provenance

    return {**run_provenance("gem_trainer.bench_quality", ["run", str(group_file), "--data", "<Beauty folder>", "--out", "DIR"]),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}


def _write(results: dict, runs: Path, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1))
    with tarfile.open(out / "runs.tgz", "w:gz") as tar:
        for name in results["arms"]:
            for part in ("eval.json", "config.toml", "metrics.jsonl"):
                if (runs / name / part).is_file():
                    tar.add(runs / name / part, arcname=f"{name}/{part}")
            tar.add(runs / f"{name}.log", arcname=f"{name}.log")


def table(result_dirs: list[Path], out: Path, finding: str | None = None) -> dict:
    """Add the groups of ``result_dirs`` to ``out``'s section ``history_excluded``: a group already there is
    replaced by the folder of the same group, the others stay (their folders need not be at hand)."""
    groups, rows = [], []
    for folder in result_dirs:
        results = json.loads((folder / "results.json").read_text())
        group = {key: results[key] for key in ("group", "spec", "provenance", "scores", "chosen") if key in results}
        unfinished = [arm["name"] for arm in results["spec"]["arms"] if arm["name"] not in results["arms"]]
        if unfinished:  # cut short (a time limit): the group's file still names them
            group["unfinished"] = unfinished
        groups.append(group)
        for name, arm in results["arms"].items():
            if "eval" not in arm:
                continue
            e = arm["eval"]
            rows.append({"group": results["group"], "arm": name, "model": _model(arm["command"]), "recipe": _recipe(arm["command"]),
                         "split": "valid" if "eval_split=valid" in arm["command"] else "test", "seed": _seed(arm["command"]),
                         "step": int(e["step"]), "wall_s": arm["wall_s"], "train_s": round(e["train_s"], 1),
                         "commit": results["provenance"]["commit"], "command": arm["command"],
                         "metrics": {k: round(e[k], 5) for k in sorted(e) if k.startswith(("sampled/", "full/")) and "seed" not in k}})
    document = json.loads(out.read_text()) if out.is_file() else {}
    earlier, given = document.get("history_excluded", {}), {g["group"] for g in groups}
    groups = [g for g in earlier.get("groups", []) if g["group"] not in given] + groups
    rows = [r for r in earlier.get("rows", []) if r["group"] not in given] + rows
    for row in rows:
        row["config_version"] = _config_version(row)
    summary = []
    for key in sorted({(r["model"], r["recipe"], r["config_version"], r["split"]) for r in rows}):
        chosen = [r for r in rows if (r["model"], r["recipe"], r["config_version"], r["split"]) == key]
        if len(chosen) < 2:
            continue
        values = {m: [r["metrics"][m] for r in chosen] for m in HEADLINE}
        summary.append({"model": key[0], "recipe": key[1], "config_version": key[2], "split": key[3],
                        "seeds": sorted(r["seed"] for r in chosen),
                        "mean": {m: round(statistics.mean(v), 4) for m, v in values.items()},
                        "std": {m: round(statistics.pstdev(v), 4) for m, v in values.items()},
                        "meets_targets": {m: statistics.mean(v) >= TARGETS[m] for m, v in values.items()}})
    document["history_excluded"] = {
        "protocol": "leave-one-out; sampled-99: 99 uniform negatives outside the user's sequence, 3 draws; full: every item "
                    "but the user's earlier items (the held-out item never left out), as ICLRec, ICSRec and S3-Rec evaluate. "
                    "Earlier sections of this file rank the history's items too.",
        "published": PUBLISHED_BEAUTY, "targets": TARGETS, "rules": {name: rule.__doc__ for name, rule in RULES.items()},
        "groups": groups, "rows": rows, "summary": summary, **({"finding": finding} if finding else {}),
    }
    out.write_text(json.dumps(document, indent=1) + "\n")
    return document["history_excluded"]


def _option(command: str, name: str) -> str | None:
    found = [part.split("=", 1)[1] for part in command.split() if part.startswith(f"--{name}=")]
    return found[-1] if found else None


def _model(command: str) -> str:
    return "sasrec" if "beauty-sasrec.toml" in command else "kunlun"


def _recipe(command: str) -> str:
    """The overrides that change the model or its training (not the seed, split or run folder)."""
    skip = ("--seed=", "--data.sequential.eval_split=", "--run_dir=", "--device=", "--metrics.", "--data.path=")
    parts = command.split()
    config = parts[parts.index("--config") + 1].rsplit("/", 1)[-1]
    return " ".join([config, *(p for p in parts if p.startswith("--") and p != "--config" and not p.startswith(skip))])


def _config_version(row: dict) -> str:
    """The config file's git blob at the run's commit: a recipe names its config and overrides, and the same
    name may hold other settings at another commit (the commit itself when git cannot say)."""
    parts = row["command"].split()
    return _blob(row["commit"], parts[parts.index("--config") + 1])


@functools.cache  # NOTE: a group's rows share one commit and config: one git call each
def _blob(commit: str, path: str) -> str:
    found = subprocess.run(["git", "rev-parse", "--short", f"{commit}:{path}"], capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else commit[:12]


def _seed(command: str) -> int:
    return int(_option(command, "seed") or 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gem_trainer.bench_quality", description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    run = verbs.add_parser("run", help="train a group's arms side by side")
    run.add_argument("group", type=Path)
    run.add_argument("--data", type=Path, required=True, help="the Beauty folder (Beauty.txt, Beauty_item2attributes.json)")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--device", default="cuda")
    build = verbs.add_parser("table", help="add finished groups to the quality file")
    build.add_argument("results", type=Path, nargs="+", help="folders written by run")
    build.add_argument("--out", type=Path, default=Path("benchmarks/results/quality-beauty.json"))
    build.add_argument("--finding", help="what the groups show, in a sentence or two")
    args = parser.parse_args(argv)
    if args.verb == "run":
        run_group(args.group, args.data, args.out, args.device)
        return
    section = table(args.results, args.out, args.finding)
    print(f"{'model':8} {'recipe':70} {'config':9} {'split':6} " + " ".join(f"{m:>16}" for m in HEADLINE))
    for s in section["summary"]:
        print(f"{s['model']:8} {s['recipe'][:70]:70} {s['config_version']:9} {s['split']:6} "
              + " ".join(f"{s['mean'][m]:.4f}±{s['std'][m]:.4f}".rjust(16) for m in HEADLINE))
    print(f"wrote section history_excluded of {args.out}")


if __name__ == "__main__":
    main()
