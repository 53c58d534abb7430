"""Knowledge transfer, measured on the CPU: ``benchmarks/results/transfer.json``.

    python -m gem_trainer.bench_transfer --out benchmarks/results/transfer.json [--sections synthetic]
        [--seeds 0 1 2] [--work /tmp/bench-transfer]    # sections: synthetic, synthetic_users, beauty, beauty_tail
        [--device cpu|cuda] [--jobs N]                  # beauty: the device of its runs, how many at once
    python -m gem_trainer.bench_transfer --out F --sections synthetic_users --merge A.json B.json
                                                        # one section from runs over other seeds (processes)

``synthetic`` (the embedded default data: three surfaces, click and conversion): a teacher (the default
Kunlun, trained ``TEACHER_STEPS``) and a student (the baseline ranker, ``STUDENT_STEPS``) on the same stream.
The teacher's pass is offline: ``posttrain`` writes its logits once per seed, and every distilled arm reads
them. Arms, same student, steps and data: the student alone; + distillation (an auxiliary head trained on
the teacher's logits, the serving head on true labels); + the student adapter (the teacher's logits corrected
on fresh labels before they are used). Held-out NE and AUC per task over all surfaces; the teacher's own
evaluation for reference. Every seed trains on the same synthetic data (``DATA_SEED``), as every seed of the
Beauty section reads the one Beauty data set: the seeds vary the models' initialisation, so their spread is the
training's and not that of three different data draws. Each section carries its provenance (machine, torch,
commit, date, command).

``synthetic_users``: the same, on the synthetic data drawn from a population of ``NUM_USERS`` users (a
``user_id`` feature, examples in time order), where a user's earlier events exist for LoopFM to remember, and
each user has a lasting click propensity (``USER_PROPENSITY``) that only the user's other examples reveal. The
teacher's pass also writes its representations (``[loopfm]``), and one more arm reads them: + LoopFM features
(distillation and adapter as before, plus each example's earlier representations of its user as an input).

``beauty`` (Amazon Beauty from ``../shared/data/beauty``, next-item retrieval, leave-one-out): the teacher is the
Beauty Kunlun config (``configs/beauty-kunlun.toml``, two-tower, softmax over the catalogue), trained
once with seed 0 (a finished run of the same config in the work folder is reused); the student is a narrower,
shallower Kunlun (``BEAUTY_STUDENT``: 6.9x fewer forward FLOPs per example, 4.9x fewer parameters) trained
``BEAUTY_STUDENT_STEPS``. The teacher's pass stores its top ``BEAUTY_TOP_K`` items of the
catalogue per query (``distillation.top_k``) and, for LoopFM, its query vector of every training prefix keyed by
user (``loopfm.key_only``: the user id keys the store, no model reads it), once per seed (each seed is another
stream). The LoopFM arms read each prefix's earlier vectors, in training and in ranking. Distillation needs
the student's own candidates sampled (``data.sequential.num_negatives >= 1``), so every arm trains the student
against ``BEAUTY_NEGATIVES`` uniform negatives; one more arm trains it alone against the whole catalogue, as the
teacher's config does. HR@10 and NDCG@10 on the test split, sampled-99 (mean of three draws) and full ranking,
each run evaluated once; no knob's value was chosen on the test split (k and the negatives were fixed before any
run; the teacher's weight and temperature, ``BEAUTY_WEIGHT`` and ``BEAUTY_TEMPERATURE``, on the validation split, with
the teacher and student configs of that time; LoopFM's width and memory are the config's defaults), though a test
run prompted the tail (``BEAUTY_TAIL``, its size chosen on the validation split). With ``--jobs N`` the seeds'
passes, then all their arms, run N at a time in separate processes (on one GPU, the small students leave it mostly
idle one at a time). A finished pass or arm of the same overrides at the same clean commit is kept (``pass.json``, ``<arm>.row.json`` in the work
folder): a section cut short by a time limit continues where it stopped when run again.

``beauty_tail``: on the validation split, the Beauty section's teacher (reused from the work folder) and students,
distilled from its top-k store and from one with a tail of the catalogue (``distillation.tail_samples``), with and
without the adapter (``beauty_tail``'s docstring): where ``BEAUTY_TAIL``, which the Beauty section's pass stores
with its top k, was chosen.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from gem_trainer.bench_runs import DATA_SEED, ROOT, evaluate, mean_std, paired_gains, provenance, train, write_section
from gem_trainer.evaluators import fixed_mmap_threshold
from gem_trainer.provenance import git_commit

SECTIONS = ("synthetic", "synthetic_users", "beauty", "beauty_tail")
NUM_USERS = 2000  # with 600 student steps of 256 examples: ~77 examples per user, ~380 in the teacher's stream
# spread of each user's click logit offset, as wide as the per-ad offsets': without it a label depends on its own
# example's features alone, and no memory of a user's other events can tell a model anything about it
USER_PROPENSITY = 0.5
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

BEAUTY_TEACHER = "beauty-kunlun.toml"
# a Kunlun a quarter as wide, with one layer and a 32-wide head: what a latency-bound serving model can afford
BEAUTY_STUDENT = ["--model.kunlun.d_model=16", "--model.kunlun.num_layers=1", "--model.kunlun.hidden=[32]"]
BEAUTY_STUDENT_STEPS = 1500  # about 3 passes over the 131k training prefixes (the teacher: its config's schedule.epochs)
BEAUTY_NEGATIVES, BEAUTY_TOP_K = 256, 100
# items drawn per query from the rest of the catalogue (~12,000 of them), distilled with the top k: chosen on the
# validation split (section beauty_tail: the tail lifts sampled and full ranking, the top k alone only full)
BEAUTY_TAIL = 100
# the teacher's weight and temperature in the distillation arms, chosen on the validation split (seed 0's store,
# the student alone and a grid of weight x temperature: transfer.json's beauty_validation_sweep, run before the
# teacher and student configs took their final form and before full ranking left out each user's history); 1 / 1
# before
BEAUTY_WEIGHT, BEAUTY_TEMPERATURE = 4.0, 3.0
BEAUTY_ARMS = ARMS  # the same three arms as on the synthetic data
# LoopFM: the user id travels with the data for the store's key only; the teacher's pass writes the store
BEAUTY_LOOPFM = ["--data.sequential.with_user_id=true", "--loopfm.key_only=true"]
BEAUTY_LOOPFM_ARMS = {"distillation_loopfm": ["--distillation.adapter=false"],
                      "distillation_adapter_loopfm": ["--distillation.adapter=true"]}
# the student trained against the whole catalogue, as the teacher is (no distillation: it needs sampled items)
BEAUTY_REFERENCE = {"student_alone_catalogue": ["--data.sequential.num_negatives=0"]}
BEAUTY_METRICS = ("full/hr@10", "full/ndcg@10", "sampled/hr@10", "sampled/ndcg@10")


def posttrain_pass(overrides: list[str], run_dir: Path, config_file: Path | None = None) -> float:
    """``gem-trainer posttrain`` of ``config_file`` (None: the default config) plus ``overrides``; returns the
    wall time."""
    import contextlib
    import io

    from gem_trainer.config import load_config
    from gem_trainer.distributed import init_distributed
    from gem_trainer.posttrain import posttrain

    config = load_config(config_file, [*overrides, f"--run_dir={run_dir}", "--metrics.progress_bar=false"])
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        posttrain(config, init_distributed(config.device, config.parallelism.collectives))  # as train / evaluate do
    return time.perf_counter() - started


def synthetic(seeds: list[int], work: Path, users: bool = False) -> dict:
    rows, teachers = [], []
    common = ["--device=cpu", "--metrics.tensorboard=false", "--metrics.progress_bar=false", f"--data.synthetic.seed={DATA_SEED}"]
    common += [f"--data.synthetic.num_users={NUM_USERS}", f"--data.synthetic.user_propensity={USER_PROPENSITY}"] if users else []
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
    return synthetic_result(rows, teachers, users)


def synthetic_result(rows: list[dict], teachers: list[dict], users: bool) -> dict:
    """The synthetic sections' document from their rows (one per arm and seed) and the teachers' rows (one per seed):
    summaries, each arm's paired gain over the student alone and over the arm before it, and whether the full
    transfer beats the student alone beyond the seeds' spread."""
    arms = {**ARMS, **LOOPFM_ARM} if users else ARMS
    summary = {arm: {m: mean_std([r for r in rows if r["arm"] == arm], m) for m in METRICS} for arm in arms}
    summary["teacher"] = {m: mean_std(teachers, m) for m in METRICS}
    alone, full = summary["student_alone"], summary[list(arms)[-1]]
    spread = {m: max(alone[m]["std"], full[m]["std"]) for m in METRICS}
    # lower NE and higher AUC are better; "beats" means by more than the larger of the two arms' seed spreads
    beats = {m: (alone[m]["mean"] - full[m]["mean"] if m.endswith("/ne") else full[m]["mean"] - alone[m]["mean"]) > spread[m]
             for m in METRICS}
    paired = paired_gains(rows, [arm for arm in arms if arm != "student_alone"], METRICS)
    order = list(arms)  # each transfer step adds to the one before it
    steps = {f"{arm} over {before}": paired_gains(rows, [arm], METRICS, base=before)[arm]
             for before, arm in zip(order, order[1:])}
    data = f" with data.synthetic.seed={DATA_SEED}" + (
        f", data.synthetic.num_users={NUM_USERS}, data.synthetic.user_propensity={USER_PROPENSITY}" if users else "")
    return {"teacher": {"config": f"embedded default (Kunlun tiny){data}", "steps": TEACHER_STEPS, "rows": teachers},
            "student": {"config": "embedded default with " + " ".join(STUDENT) + data, "steps": STUDENT_STEPS},
            "arms": {arm: extra + (["--loopfm.store=<the teacher pass's store>"] if arm in LOOPFM_ARM else []) for arm, extra in arms.items()},
            "rows": rows, "summary": summary, "paired_gain_over_student_alone": paired,
            "paired_gain_of_each_step_over_the_one_before": steps,
            "full_transfer_beats_student_alone_beyond_spread": beats}


def merge_synthetic(parts: list[dict], users: bool) -> dict:
    """One synthetic section from ``parts``, the same section run over different seeds (each its own process):
    their rows together, the summaries computed anew, each part's provenance kept under ``parts``."""
    seeds = [row["seed"] for part in parts for row in part["teacher"]["rows"]]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"the parts share seeds: {sorted(seeds)}")
    key = lambda row: row["seed"]  # noqa: E731
    rows = sorted((row for part in parts for row in part["rows"]), key=key)  # stable: arms keep their order
    teachers = sorted((row for part in parts for row in part["teacher"]["rows"]), key=key)
    return {"parts": [part["meta"] for part in parts], **synthetic_result(rows, teachers, users)}


def beauty_data() -> Path:
    """The Beauty folder beside the repository (``../shared/data/beauty``)."""
    from gem_data.testing import find_repo_root, shared_data_dir

    return shared_data_dir(find_repo_root(Path(__file__))) / "beauty"


def finished_run(config_file: Path, overrides: list[str], run_dir: Path, steps: int | None = None) -> bool:
    """Whether ``run_dir`` already holds a run of ``config_file`` + ``overrides`` trained to ``steps`` (None: to its
    ``schedule.steps``, as ``schedule.epochs`` resolved them where set; the config as ``bench_runs.train`` would
    write it)."""
    from gem_trainer.checkpoint import CheckpointManager
    from gem_trainer.config import load_config, with_schedule_steps

    record = run_dir / "config.toml"
    if not record.is_file():
        return False
    recorded = load_config(record)
    wanted = load_config(config_file, [*overrides, f"--run_dir={run_dir}", "--checkpoint.resume=false"])
    if wanted.schedule.epochs is not None:  # the steps of epochs are known once the run has read its data
        wanted = with_schedule_steps(wanted, recorded.schedule.steps)
    steps = recorded.schedule.steps if steps is None else steps
    return (CheckpointManager(run_dir / "checkpoints", keep_latest=1).latest_step() == steps
            and _computed(recorded) == _computed(wanted))


def _computed(config) -> dict:
    """What of a config decides what its run computes: all of it but how the batches were read (on a thread, in a
    process or in the step, under any thread switch interval: the same batches, in the same order)."""
    dump = config.model_dump()
    for how_read in ("read_ahead", "read_ahead_process", "read_ahead_switch_ms"):
        dump["data"].pop(how_read)
    return dump


def beauty(seeds: list[int], work: Path, student_steps: int = BEAUTY_STUDENT_STEPS, teacher_steps: int | None = None,
           top_k: int = BEAUTY_TOP_K, tail: int = BEAUTY_TAIL, extra: list[str] = (), device: str = "cpu",
           jobs: int = 1) -> dict:
    """The Beauty section (see the module docstring); ``teacher_steps`` None: as the config's ``schedule.epochs``
    resolve them. ``extra`` overrides every run (a test's shorter evaluation)."""
    data, config, common = beauty_setup(device, extra)
    folder = work / "beauty"
    teacher_dir = folder / "teacher"
    teacher_steps, teacher_row = beauty_teacher(config, common, teacher_dir, teacher_steps)
    arms = {**BEAUTY_ARMS, **BEAUTY_LOOPFM_ARMS, **BEAUTY_REFERENCE}
    students = {seed: [*common, *BEAUTY_STUDENT, f"--seed={seed}", f"--schedule.steps={student_steps}",
                       f"--data.sequential.num_negatives={BEAUTY_NEGATIVES}"] for seed in seeds}
    distilled = [arm for arm in arms if arm != "student_alone" and arm not in BEAUTY_REFERENCE]
    # each seed's stores: its teacher pass's soft labels and LoopFM representations
    stores = {seed: (folder / f"seed{seed}" / "soft-labels", folder / f"seed{seed}" / "loopfm") for seed in seeds}
    runs = []
    for seed in seeds:
        labels, memory = stores[seed]
        for arm, more in arms.items():
            overrides = [*students[seed], *more] + ([f"--distillation.soft_labels={labels}", f"--distillation.weight={BEAUTY_WEIGHT}",
                                                     f"--distillation.temperature={BEAUTY_TEMPERATURE}"] if arm in distilled else [])
            overrides += [*BEAUTY_LOOPFM, f"--loopfm.store={memory}"] if arm in BEAUTY_LOOPFM_ARMS else []
            runs.append((config, seed, arm, overrides, folder / f"seed{seed}" / arm))
    with _runner(jobs) as run:
        # one teacher pass per seed writes both stores; its view of the data (no user id) is every student's
        passes = run(_beauty_pass, [(config, [*students[seed], *BEAUTY_LOOPFM, f"--distillation.teacher_run_dir={teacher_dir}",
                                              f"--distillation.soft_labels={stores[seed][0]}", f"--distillation.top_k={top_k}",
                                              f"--distillation.tail_samples={tail}", f"--loopfm.store={stores[seed][1]}"],
                                     folder / f"seed{seed}") for seed in seeds])
        pass_s = dict(zip(seeds, passes))
        rows = [{**row, "posttrain_s": round(pass_s[row["seed"]], 1)} for row in run(_beauty_arm, runs)]
    summary = {arm: {m: mean_std([r for r in rows if r["arm"] == arm], m) for m in BEAUTY_METRICS} for arm in arms}
    summary["teacher"] = {m: {"mean": teacher_row[m], "std": 0.0} for m in BEAUTY_METRICS}  # one run, seed 0
    alone = summary["student_alone"]
    others = [arm for arm in arms if arm != "student_alone"]
    # higher is better; "beats" means by more than the larger of the two arms' seed spreads (population std)
    beats = {arm: {m: summary[arm][m]["mean"] - alone[m]["mean"] > max(alone[m]["std"], summary[arm][m]["std"])
                   for m in BEAUTY_METRICS} for arm in others}
    paired = paired_gains(rows, others, BEAUTY_METRICS)
    stored = "--distillation.soft_labels=<the seed's top-k store>"
    return {"data": f"Amazon Beauty 5-core ({data}), leave-one-out, test split; sampled = mean of the 3 fixed 99-negative draws",
            "device": device,
            "teacher": {"config": f"configs/{BEAUTY_TEACHER}", "steps": teacher_steps, "rows": [teacher_row]},
            "student": {"config": f"configs/{BEAUTY_TEACHER} with " + " ".join(BEAUTY_STUDENT)
                        + f" --data.sequential.num_negatives={BEAUTY_NEGATIVES}",
                        "steps": student_steps,
                        "cost": "1.04 forward MFLOP per example against the teacher's 7.20 (gem-trainer flops), 348k parameters "
                                "against 1.69M"},
            "transfer": {"soft_labels": f"the teacher's top {top_k} items of the catalogue per query (other than the "
                                        f"next item), {tail} more drawn from the rest, and the next item's logit, written by "
                                        "posttrain once per seed",
                         "tail_samples": tail, "tail_chosen_on": "the validation split (beauty_tail)",
                         "loopfm": "the same pass's query vector of every training prefix (loopfm defaults: projected to 16 "
                                   "values, the newest 32 earlier ones read), keyed by user id, which no model reads",
                         "weight": BEAUTY_WEIGHT, "temperature": BEAUTY_TEMPERATURE,
                         "chosen_on": "the validation split (beauty_validation_sweep, with the teacher and student configs "
                                      "of that time); k and the negatives fixed before any run"},
            "arms": {arm: more + ([stored] if arm in distilled else [])
                     + ([*BEAUTY_LOOPFM, "--loopfm.store=<the seed's LoopFM store>"] if arm in BEAUTY_LOOPFM_ARMS else [])
                     for arm, more in arms.items()},
            "rows": rows, "summary": summary, "paired_gain_over_student_alone": paired,
            "beats_student_alone_beyond_spread": beats}


def beauty_setup(device: str, extra: list[str]) -> tuple[Path, Path, list[str]]:
    """The Beauty data folder, the teacher's config file and the overrides of every run of a Beauty section."""
    data = beauty_data()
    if not (data / "Beauty.txt").is_file():
        raise FileNotFoundError(f"the Beauty data set is not at {data} (../shared/data/beauty beside the repository)")
    config = ROOT / "apps" / "gem-trainer" / "configs" / BEAUTY_TEACHER
    common = [f"--data.path={data}", f"--device={device}", "--metrics.tensorboard=false", "--metrics.progress_bar=false", *extra]
    return data, config, common


def beauty_teacher(config: Path, common: list[str], teacher_dir: Path, steps: int | None,
                   split: list[str] = ()) -> tuple[int, dict]:
    """The Beauty teacher (seed 0) trained into ``teacher_dir``, or its finished run there reused; returns its steps
    and its evaluation row (``split``: overrides that choose the evaluation's split, which training ignores)."""
    from gem_trainer.config import load_config

    teacher = [*common, "--seed=0"] + ([f"--schedule.steps={steps}"] if steps else [])
    reused = finished_run(config, teacher, teacher_dir)
    wall = None if reused else train(config, teacher, teacher_dir)
    steps = load_config(teacher_dir / "config.toml").schedule.steps  # as the run resolved them
    started = time.perf_counter()
    result = evaluate(config, [*teacher, *split], teacher_dir)
    row = {"seed": 0, "train_s": None if wall is None else round(wall, 1), "reused_finished_run": reused,
           "eval_s": round(time.perf_counter() - started, 1), **{m: result[m] for m in BEAUTY_METRICS}}
    print("beauty teacher: " + "  ".join(f"{m} {row[m]:.4f}" for m in BEAUTY_METRICS), flush=True)
    return steps, row


def beauty_tail(seeds: list[int], work: Path, student_steps: int = BEAUTY_STUDENT_STEPS, teacher_steps: int | None = None,
                top_k: int = BEAUTY_TOP_K, tail: int = BEAUTY_TAIL, extra: list[str] = (), device: str = "cpu",
                jobs: int = 1) -> dict:
    """Section ``beauty_tail``: the top-k store with and without a tail (``BEAUTY_TAIL`` items drawn from the rest of
    the catalogue), on the validation split (a knob is chosen there, never on the test split). Arms: the student
    alone; distillation from the top k; distillation from the top k and the tail; the same with the adapter. The
    Beauty section's teacher (reused from ``work``), students, weight and temperature; the other arguments as
    ``beauty``'s."""
    data, config, common = beauty_setup(device, extra)
    folder = work / "beauty"
    valid = ["--data.sequential.eval_split=valid"]
    teacher_steps, teacher_row = beauty_teacher(config, common, folder / "teacher", teacher_steps, valid)
    distill = [f"--distillation.weight={BEAUTY_WEIGHT}", f"--distillation.temperature={BEAUTY_TEMPERATURE}"]
    stores = {"top_k": [], "top_k_tail": [f"--distillation.tail_samples={tail}"]}
    arms = {"student_alone": (None, []), "distillation": ("top_k", ["--distillation.adapter=false"]),
            "distillation_tail": ("top_k_tail", ["--distillation.adapter=false"]),
            "distillation_adapter_tail": ("top_k_tail", ["--distillation.adapter=true"])}
    passes, runs = [], []
    for seed in seeds:
        student = [*common, *BEAUTY_STUDENT, f"--seed={seed}", f"--schedule.steps={student_steps}",
                   f"--data.sequential.num_negatives={BEAUTY_NEGATIVES}", *valid]
        where = folder / f"tail-seed{seed}"
        for store, more in stores.items():
            passes.append((config, [*student, f"--distillation.teacher_run_dir={folder / 'teacher'}",
                                    f"--distillation.soft_labels={where / store / 'soft-labels'}", f"--distillation.top_k={top_k}",
                                    *more], where / store))
        for arm, (store, more) in arms.items():
            labels = [] if store is None else [f"--distillation.soft_labels={where / store / 'soft-labels'}", *distill]
            runs.append((config, seed, arm, [*student, *more, *labels], where / arm))
    with _runner(jobs) as run:
        run(_beauty_pass, passes)
        rows = run(_beauty_arm, runs)
    summary = {arm: {m: mean_std([r for r in rows if r["arm"] == arm], m) for m in BEAUTY_METRICS} for arm in arms}
    return {"data": f"Amazon Beauty 5-core ({data}), leave-one-out, validation split (the second-to-last item); "
                    "sampled = mean of the 3 fixed 99-negative draws",
            "device": device, "teacher": {"config": f"configs/{BEAUTY_TEACHER}", "steps": teacher_steps, "rows": [teacher_row]},
            "student": {"config": f"configs/{BEAUTY_TEACHER} with " + " ".join(BEAUTY_STUDENT)
                        + f" --data.sequential.num_negatives={BEAUTY_NEGATIVES}", "steps": student_steps},
            "transfer": {"top_k": top_k, "tail_samples": tail, "weight": BEAUTY_WEIGHT, "temperature": BEAUTY_TEMPERATURE},
            "arms": {arm: more + ([f"--distillation.soft_labels=<the seed's {store} store>"] if store else [])
                     for arm, (store, more) in arms.items()},
            "rows": rows, "summary": summary,
            "paired_gain_over_student_alone": paired_gains(rows, [arm for arm in arms if arm != "student_alone"], BEAUTY_METRICS)}


def _beauty_pass(config: Path, overrides: list[str], folder: Path) -> float:
    """The teacher's pass of one seed into ``folder`` (its stores, afresh); returns its wall time."""
    what = {"overrides": overrides, "commit": git_commit(ROOT)}
    done = _finished(folder / "pass.json", what)
    if done is not None:
        return done
    shutil.rmtree(folder, ignore_errors=True)  # stores of another pass, or of one cut short, are never reused
    wall = posttrain_pass(overrides, folder / "posttrain", config)
    _record(folder / "pass.json", what, wall)
    return wall


def _beauty_arm(config: Path, seed: int, arm: str, overrides: list[str], run_dir: Path) -> dict:
    """One student run of the Beauty section, trained then evaluated: its row."""
    what = {"overrides": overrides, "commit": git_commit(ROOT)}
    row = _finished(run_dir.with_name(f"{arm}.row.json"), what)
    if row is None:
        wall = train(config, overrides, run_dir)
        started = time.perf_counter()
        result = evaluate(config, overrides, run_dir)
        row = {"arm": arm, "seed": seed, "train_s": round(wall, 1), "eval_s": round(time.perf_counter() - started, 1),
               **{m: result[m] for m in BEAUTY_METRICS}}
        _record(run_dir.with_name(f"{arm}.row.json"), what, row)
    print(f"beauty seed {seed} {arm}: " + "  ".join(f"{m} {row[m]:.4f}" for m in BEAUTY_METRICS)
          + f"  ({row['train_s']:.0f} s + {row['eval_s']:.0f} s)", flush=True)
    return row


def _finished(record: Path, what: dict):
    """What an earlier call recorded in ``record`` for the same work (``what``: its overrides and the commit; never
    from a tree with uncommitted changes), or None. A section cut short (a time limit) continues from there."""
    if what["commit"].endswith("+dirty") or what["commit"] == "unknown" or not record.is_file():
        return None
    stored = json.loads(record.read_text())
    return stored["result"] if stored.get("what") == what else None


def _record(record: Path, what: dict, result) -> None:
    record.write_text(json.dumps({"what": what, "result": result}, indent=1) + "\n")


@contextlib.contextmanager
def _runner(jobs: int) -> Iterator[Callable[[Callable, list[tuple]], list]]:
    """``run(function, argument_tuples)``: the results in order, computed here (``jobs`` 1) or by ``jobs``
    fresh processes at a time (spawned: CUDA cannot be forked)."""
    if jobs <= 1:
        yield lambda function, calls: [function(*arguments) for arguments in calls]
        return
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_one_thread) as pool:
        yield lambda function, calls: list(pool.map(_call, [(function, arguments) for arguments in calls]))


def _call(task: tuple[Callable, tuple]):
    function, arguments = task
    return function(*arguments)


def _one_thread() -> None:
    """A worker process as ``main`` sets up its own: one intra-op thread, glibc's fixed mmap threshold."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    fixed_mmap_threshold()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m gem_trainer.bench_transfer", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-transfer"), help="folder for the run folders")
    parser.add_argument("--beauty-student-steps", type=int, default=BEAUTY_STUDENT_STEPS)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the Beauty section's runs")
    parser.add_argument("--jobs", type=int, default=1, help="Beauty runs at once, each in its own process")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="FILE",
                        help="instead of running: put together the synthetic sections of these files (each run with "
                             "other --seeds) into --out")
    args = parser.parse_args(argv)
    if args.merge:
        for section in args.sections:
            if section not in ("synthetic", "synthetic_users"):
                parser.exit(2, f"--merge: {section} is not a synthetic section\n")
            parts = [json.loads(path.read_text()).get(section) for path in args.merge]
            if any(part is None for part in parts):
                missing = [str(path) for path, part in zip(args.merge, parts) if part is None]
                parser.exit(2, f"--merge: no section {section!r} in {', '.join(missing)}\n")
            try:
                result = merge_synthetic(parts, users=section == "synthetic_users")
            except ValueError as error:
                parser.exit(2, f"--merge: {section}: {error}\n")
            write_section(args.out, section, provenance("gem_trainer.bench_transfer", argv), time.perf_counter(), result)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    fixed_mmap_threshold()
    for section in args.sections:
        started, meta = time.perf_counter(), provenance("gem_trainer.bench_transfer", argv)
        if section in ("beauty", "beauty_tail"):
            try:
                result = (beauty(args.seeds, args.work, student_steps=args.beauty_student_steps, device=args.device, jobs=args.jobs)
                          if section == "beauty" else beauty_tail(args.seeds, args.work, device=args.device, jobs=args.jobs))
            except FileNotFoundError as error:
                parser.exit(2, f"{section}: {error}\n")
        else:
            result = synthetic(args.seeds, args.work, users=section == "synthetic_users")
        write_section(args.out, section, meta, started, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
