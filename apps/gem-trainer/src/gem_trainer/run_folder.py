"""The run folder as a contract: a ``run_dir`` holding checkpoints belongs to one model, and a run that would
resume from them with another model stops before touching anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gem_trainer.checkpoint import CheckpointManager
from gem_trainer.config import ConfigError, TrainerConfig, load_config

# What decides the shapes and kinds of the checkpointed tensors (data fields: through the feature spec).
STATE_FIELDS = ("model", "optimizer.sparse", "data.source", "data.path", "data.synthetic", "data.sequential.attributes_file",
                "data.sequential.attribute_slots", "data.sequential.with_user_id")


def check_same_run(config: TrainerConfig) -> None:
    """Refuse, in one line naming the differing fields, to resume a run folder written by another model."""
    run_dir = Path(config.run_dir)
    saved = run_dir / "config.toml"
    if not (config.checkpoint.enable and config.checkpoint.resume) or not saved.is_file():
        return
    if not CheckpointManager(run_dir / "checkpoints", keep_latest=1).complete_steps():
        return
    try:
        previous = load_config(saved)
    except ConfigError as error:
        raise ConfigError(f"run_dir: {run_dir} holds a run whose config no longer loads ({error}); use a new run_dir") from None
    before, after = _flatten(previous.model_dump(mode="json")), _flatten(config.model_dump(mode="json"))
    changed = [key for key in sorted(set(before) | set(after))
               if key.startswith(STATE_FIELDS) and before.get(key) != after.get(key)]
    if changed:
        shown = "; ".join(f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in changed[:4])
        more = f" (+{len(changed) - 4} more)" if len(changed) > 4 else ""
        raise ConfigError(f"run_dir: {run_dir} holds checkpoints of another model ({shown}{more}); use a new run_dir, "
                          f"or delete {run_dir / 'checkpoints'} to start afresh there")


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat
