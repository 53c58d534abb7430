"""Knowledge transfer, measured on the CPU: ``benchmarks/results/transfer.json``.

    python -m gem_trainer.bench_transfer --out benchmarks/results/transfer.json [--sections synthetic]
        [--seeds 0 1 2] [--work /tmp/bench-transfer]    # sections: synthetic, synthetic_users

``synthetic`` (the embedded default data: three surfaces, click and conversion): a teacher (the default
Kunlun, trained ``TEACHER_STEPS``) and a student (the baseline ranker, ``STUDENT_STEPS``) on the same stream.
The teacher's pass is offline: ``posttrain`` writes its logits once per seed, and every distilled arm reads
them. Arms, same student, steps and data: the student alone; + distillation (an auxiliary head trained on
the teacher's logits, the serving head on true labels); + the student adapter (the teacher's logits corrected
on fresh labels before they are used). Held-out NE and AUC per task over all surfaces; the teacher's own
evaluation for reference. Each section carries its provenance (machine, torch, commit, date, command).

``synthetic_users``: the same, on the synthetic data drawn from a population of ``NUM_USERS`` users (a
``user_id`` feature, examples in time order), where a user's earlier events exist for LoopFM to remember. The
teacher's pass also writes its representations (``[loopfm]``), and one more arm reads them: + LoopFM features
(distillation and adapter as before, plus each example's earlier representations of its user as an input).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from gem_trainer.bench_runs import evaluate, mean_std, provenance, train, write_section

SECTIONS = ("synthetic", "synthetic_users")
NUM_USERS = 2000  # with 600 student steps of 256 examples: ~77 examples per user, ~380 in the teacher's stream
# the teacher sees five times the student's data: a foundation model trained on more than its serving models
TEACHER_STEPS, STUDENT_STEPS = 3000, 600
STUDENT = ["--model.name=baseline"]
ARMS = {
    "student_alone": [],
    "distillation": ["--distillation.adapter=false"],
    "distillation_adapter": ["--distillation.adapter=true"],
}
# the LoopFM arm: the full transfer plus the teacher's representations of the user's earlier events
LOOPFM_ARM = {"distillation_adapter_loopfm": ["--distillation.adapter=true"]}
METRICS = ("click/all/ne", "click/all/auc", "conversion/all/ne", "conversion/all/auc")


def posttrain_pass(overrides: list[str], run_dir: Path) -> float:
    """``gem-trainer posttrain`` of the default config plus ``overrides``; returns the wall time."""
    import contextlib
    import io

    from gem_trainer.config import load_config
    from gem_trainer.distributed import init_distributed
    from gem_trainer.posttrain import posttrain

    config = load_config(None, [*overrides, f"--run_dir={run_dir}", "--metrics.progress_bar=false"])
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        posttrain(config, init_distributed("cpu", "gloo"))
    return time.perf_counter() - started


def synthetic(seeds: list[int], work: Path, users: bool = False) -> dict:
    rows, teachers = [], []
    common = ["--device=cpu", "--metrics.tensorboard=false", "--metrics.progress_bar=false"]
    common += [f"--data.synthetic.num_users={NUM_USERS}"] if users else []
    arms = {**ARMS, **LOOPFM_ARM} if users else ARMS
    for seed in seeds:
        folder = work / ("synthetic_users" if users else "synthetic") / f"seed{seed}"
        teacher = folder / "teacher"
        wall = train(None, [*common, f"--seed={seed}", f"--schedule.steps={TEACHER_STEPS}"], teacher)
        result = evaluate(None, [*common, f"--seed={seed}", f"--schedule.steps={TEACHER_STEPS}"], teacher)
        teachers.append({"seed": seed, "train_s": round(wall, 1), **{m: result[m] for m in METRICS}})
        student = [*common, *STUDENT, f"--seed={seed}", f"--schedule.steps={STUDENT_STEPS}"]
        labels, memory = folder / "soft-labels", folder / "loopfm"
        stores = [f"--loopfm.store={memory}"] if users else []
        pass_s = posttrain_pass([*student, f"--distillation.teacher_run_dir={teacher}", f"--distillation.soft_labels={labels}", *stores],
                                folder / "posttrain")
        for arm, extra in arms.items():
            overrides = [*student, *extra] + ([f"--distillation.soft_labels={labels}"] if arm != "student_alone" else [])
            overrides += stores if arm in LOOPFM_ARM else []
            wall = train(None, overrides, folder / arm)
            result = evaluate(None, overrides, folder / arm)
            rows.append({"arm": arm, "seed": seed, "train_s": round(wall, 1), "posttrain_s": round(pass_s, 1),
                         **{m: result[m] for m in METRICS}})
        print(f"synthetic seed {seed}: teacher click auc {teachers[-1]['click/all/auc']:.4f}  " + "  ".join(
            f"{r['arm']} click ne {r['click/all/ne']:.4f} auc {r['click/all/auc']:.4f}" for r in rows if r["seed"] == seed), flush=True)
    summary = {arm: {m: mean_std([r for r in rows if r["arm"] == arm], m) for m in METRICS} for arm in arms}
    summary["teacher"] = {m: mean_std(teachers, m) for m in METRICS}
    alone, full = summary["student_alone"], summary[list(arms)[-1]]
    spread = {m: max(alone[m]["std"], full[m]["std"]) for m in METRICS}
    # lower NE and higher AUC are better; "beats" means by more than the larger of the two arms' seed spreads
    beats = {m: (alone[m]["mean"] - full[m]["mean"] if m.endswith("/ne") else full[m]["mean"] - alone[m]["mean"]) > spread[m]
             for m in METRICS}
    data = f" with data.synthetic.num_users={NUM_USERS}" if users else ""
    return {"teacher": {"config": f"embedded default (Kunlun tiny){data}", "steps": TEACHER_STEPS, "rows": teachers},
            "student": {"config": "embedded default with " + " ".join(STUDENT) + data, "steps": STUDENT_STEPS},
            "arms": {arm: extra + (["--loopfm.store=<the teacher pass's store>"] if arm in LOOPFM_ARM else []) for arm, extra in arms.items()},
            "rows": rows, "summary": summary, "full_transfer_beats_student_alone_beyond_spread": beats}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m gem_trainer.bench_transfer", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-transfer"), help="folder for the run folders")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    for section in args.sections:
        started, meta = time.perf_counter(), provenance("gem_trainer.bench_transfer", argv)
        result = synthetic(args.seeds, args.work, users=section == "synthetic_users")
        write_section(args.out, section, meta, started, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
