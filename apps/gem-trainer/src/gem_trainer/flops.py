"""The FLOP report: parameters and model FLOPs per component, on a sample batch of the configured data."""

from __future__ import annotations

import itertools
from collections import defaultdict

import torch

from gem_trainer import builders
from gem_trainer.config import TrainerConfig
from gem_trainer.distributed import DistributedEnv


def flop_report(config: TrainerConfig, sample_batches: int = 4) -> dict:
    """Forward and training (3x) FLOPs per example per component, averaged over a few real batches, with
    parameter counts per top-level module and embedding bytes read per example."""
    data = builders.build_data(config, DistributedEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    model = builders.build_model(config, data.spec, device=torch.device("meta"))
    forward: dict[str, float] = defaultdict(float)
    examples, embedding_bytes, events = 0, 0.0, 0.0
    for batch in itertools.islice(iter(data.train), sample_batches):
        events += float(batch.num_events().sum())
        for name, value in model.flops(batch).items():
            forward[name] += value
        embedding_bytes += model.embedding_bytes(batch)
        examples += batch.batch_size
    components = {name: {"forward": v / examples, "train": 3 * v / examples} for name, v in forward.items()}
    params = {name: sum(p.numel() for p in child.parameters()) for name, child in model.named_children()}
    return {
        "model": config.model.name,
        "examples_sampled": examples,
        "mean_events_per_example": events / examples,
        "parameters": params,
        "total_parameters": sum(params.values()),
        "flops_per_example": components,
        "total_forward_flops_per_example": sum(c["forward"] for c in components.values()),
        "total_train_flops_per_example": sum(c["train"] for c in components.values()),
        "embedding_bytes_per_example": embedding_bytes / examples,
    }


def format_flop_report(report: dict) -> str:
    lines = [f"model {report['model']}: {report['total_parameters']:,} parameters"]
    lines.append(f"{'module':<24}{'parameters':>14}")
    for name, count in report["parameters"].items():
        lines.append(f"{name:<24}{count:>14,}")
    lines.append("")
    lines.append(f"{'component':<24}{'fwd MFLOP/ex':>14}{'train MFLOP/ex':>16}")
    for name, value in report["flops_per_example"].items():
        lines.append(f"{name:<24}{value['forward'] / 1e6:>14.3f}{value['train'] / 1e6:>16.3f}")
    lines.append(
        f"{'total':<24}{report['total_forward_flops_per_example'] / 1e6:>14.3f}"
        f"{report['total_train_flops_per_example'] / 1e6:>16.3f}"
    )
    lines.append(
        f"embedding lookups: {report['embedding_bytes_per_example'] / 1e3:.1f} KB read per example "
        f"(mean {report['mean_events_per_example']:.1f} events), not counted as FLOPs"
    )
    return "\n".join(lines)
