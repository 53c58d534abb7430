"""The run folder as a contract: a ``run_dir`` holding checkpoints belongs to one model, and a run that would
resume from them with another model stops before touching anything. Beside its checkpoints a run keeps
``config.toml`` (the resolved config) and ``spec.json`` (the features it was trained on), which lets another
run use it as a teacher without reading its data again."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from gem_kunlun import FeatureSpec

from gem_trainer.checkpoint import CheckpointManager
from gem_trainer.config import ConfigError, TrainerConfig, load_config

# What decides the shapes and kinds of the checkpointed tensors beside the model's own section (data fields: through
# the feature spec); each a field or a whole section
STATE_FIELDS = ("model.name", "optimizer.sparse", "data.source", "data.path", "data.synthetic",
                "data.sequential.attributes_file", "data.sequential.attribute_slots", "data.sequential.with_user_id")
# the sections each model is built from (domain experts share Kunlun's layers)
MODEL_SECTIONS = {"domain_experts": ("model.domain_experts", "model.kunlun")}
# what a teacher adds to the model, named as a refusal says it (before the settings of what it adds)
TEACHER = "distillation (a teacher: the student's adapter and auxiliary head)"
LOOPFM_INPUT = "loopfm.store (the loopfm input)"
SOLARIS_INPUT = "solaris.student_input (the solaris input)"


def state_settings(config: TrainerConfig) -> dict[str, Any]:
    """The settings that decide the checkpointed tensors, name -> value: ``STATE_FIELDS``, the selected model's
    sections (not another model's, nor the loss's task weights), and what a teacher adds to the model: the
    distillation adapter and auxiliary head, LoopFM's and Solaris's input features."""
    flat = flatten(config.model_dump(mode="json"))
    name = config.model.name
    fields = STATE_FIELDS + MODEL_SECTIONS.get(name, (f"model.{name}",))
    settings = {k: v for k, v in flat.items() if any(k == f or k.startswith(f + ".") for f in fields)}
    if "synthetic" in config.data.readers() and config.data.synthetic.seed is None:
        settings["data.synthetic.seed"] = config.seed  # unset, the run's seed draws the synthetic data set
    d, loopfm = config.distillation, config.loopfm
    taught = d.teacher_run_dir is not None or d.soft_labels is not None
    settings[TEACHER] = taught
    settings["distillation.adapter"] = d.adapter if taught else None
    settings[LOOPFM_INPUT] = loopfm.store is not None
    for key in ("dim", "key_only", "user_feature"):
        settings[f"loopfm.{key}"] = getattr(loopfm, key) if loopfm.store is not None else None
    # fresh or served, the same input feature: a student trained on one is evaluated on the other
    settings[SOLARIS_INPUT] = config.solaris.student_input != "none"
    return settings


def check_same_run(config: TrainerConfig) -> None:
    """Before training into ``run_dir``: refuse, in one line, to resume a run folder written by another model
    (naming the differing fields), or to start a run that would not resume the checkpoints already there
    (``checkpoint.resume`` or ``checkpoint.enable`` false): its own checkpoints would be pruned among the earlier
    run's higher steps, and a later run would resume the earlier one."""
    run_dir = Path(config.run_dir)
    steps = CheckpointManager(run_dir / "checkpoints", keep_latest=1).complete_steps()
    if steps and not (config.checkpoint.enable and config.checkpoint.resume):
        off = "checkpoint.resume = false" if config.checkpoint.enable else "checkpoint.enable = false"
        raise ConfigError(f"{off}: run_dir {run_dir} holds checkpoints of an earlier run (steps {_listed(steps)}), which "
                          f"this run would not resume: use a new run_dir, or delete {run_dir / 'checkpoints'} to start "
                          f"afresh there")
    check_same_model(config)


def _listed(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 4 else f"{steps[0]}, ..., {steps[-1]}"


def check_same_model(config: TrainerConfig, evaluating: bool = False) -> None:
    """Refuse, in one line naming the differing fields, to load a run folder's checkpoints into another model:
    to resume them (a training run that resumes), or to evaluate them (``evaluating``: always loaded)."""
    run_dir = Path(config.run_dir)
    saved = run_dir / "config.toml"
    loads = evaluating or (config.checkpoint.enable and config.checkpoint.resume)
    if not loads or not saved.is_file():
        return
    if not CheckpointManager(run_dir / "checkpoints", keep_latest=1).complete_steps():
        return
    try:
        previous = load_config(saved)
    except ConfigError as error:
        if evaluating:  # nothing to compare against: the checkpoint's own load decides
            return
        raise ConfigError(f"run_dir: {run_dir} holds a run whose config no longer loads ({error}); use a new run_dir") from None
    before, after = state_settings(previous), state_settings(config)
    headline = ("model.name", TEACHER, LOOPFM_INPUT, SOLARIS_INPUT)  # said first
    changed = sorted((key for key in set(before) | set(after) if before.get(key) != after.get(key)),
                     key=lambda key: (key not in headline, key))
    if changed:
        shown = "; ".join(f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in changed[:4])
        more = f" (+{len(changed) - 4} more)" if len(changed) > 4 else ""
        advice = ("evaluate it with the config it trained with (without --config, eval reads its config.toml)"
                  if evaluating else f"use a new run_dir, or delete {run_dir / 'checkpoints'} to start afresh there")
        raise ConfigError(f"run_dir: {run_dir} holds checkpoints of another model ({shown}{more}); {advice}")


def resume_changes(config: TrainerConfig) -> list[str]:
    """Lines telling what a resumed run changed against the config it recorded (nothing when nothing changed or
    nothing resumes): another ``schedule.steps`` (as resolved: its learning rate then follows the new length from
    the resumed step on), and any other setting (a mixture's weights or ramp: what the record said of the steps
    already trained no longer holds once it records the new config)."""
    saved = Path(config.run_dir) / "config.toml"
    if not (config.checkpoint.enable and config.checkpoint.resume) or not saved.is_file():
        return []
    previous = load_config(saved)
    lines = []
    if previous.schedule.steps != config.schedule.steps:
        lines.append(f"note: schedule.steps is {config.schedule.steps}, the run recorded {previous.schedule.steps}: the "
                     f"learning-rate schedule follows the new length from the resumed step on")
    if previous.seed != config.seed:
        lines.append(f"note: seed is {config.seed}, the run recorded {previous.seed}: the data is read in another order from "
                     f"the resumed step on (a shuffled table's current epoch is drawn again: examples already trained on "
                     f"in it may come again, others not in it at all; a mixture draws other sources)")
    before, after = _settings(previous), _settings(config)
    # NOTE: not run_dir: a run folder moved or copied elsewhere is the same run
    changed = [key for key in sorted(set(before) | set(after))
               if key not in ("schedule.steps", "run_dir") and before.get(key) != after.get(key)]
    if changed:
        shown = "; ".join(f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in changed[:4])
        more = f" (+{len(changed) - 4} more)" if len(changed) > 4 else ""
        lines.append(f"note: resuming with settings other than the run recorded ({shown}{more}): they apply from the "
                     f"resumed step on, and config.toml now records them")
    return lines


def _settings(config: TrainerConfig) -> dict[str, Any]:
    """Every setting of ``config`` by dotted name, a mixture's sources by their names."""
    tree = config.model_dump(mode="json")
    tree["data"]["mixture"]["sources"] = {s["name"]: s for s in tree["data"]["mixture"]["sources"]}
    return flatten(tree)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``tree``'s leaves by dotted name (an empty mapping is a leaf)."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def write_run_record(config: TrainerConfig, spec: FeatureSpec) -> None:
    """Write ``config.toml`` and ``spec.json`` into the run folder (rank 0, once the run has started)."""
    from gem_trainer.config import dump_config

    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_config(config))
    (run_dir / "spec.json").write_text(json.dumps(spec_record(spec), indent=1) + "\n")


def spec_record(spec: FeatureSpec) -> dict[str, Any]:
    """``spec`` as plain JSON values (tuples as lists), comparable with a stored ``spec.json``."""
    record = json.loads(json.dumps(dataclasses.asdict(spec)))
    if not record["representations"]:
        del record["representations"]  # a spec without them reads as the records written before they existed
    return record


def stored_spec(run_dir: str | Path) -> dict[str, Any] | None:
    """The features a run folder was trained on (None for a run written before ``spec.json`` existed)."""
    path = Path(run_dir) / "spec.json"
    return json.loads(path.read_text()) if path.is_file() else None
