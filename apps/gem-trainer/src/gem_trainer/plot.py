"""PNG curves of a run's ``metrics.jsonl``: one figure per training metric and one per evaluation metric."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write ``train.png`` and, when the run evaluated, ``eval.png`` into ``out_dir`` (default: the run folder)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    source = run_dir / "metrics.jsonl"
    if not source.is_file():
        raise FileNotFoundError(f"{source} does not exist: is {run_dir} a run folder?")
    series: dict[str, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for number, line in enumerate(source.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{source}:{number}: not a JSON line ({error.msg})") from None
        phase, step = record.pop("phase"), record.pop("step")
        record.pop("time", None)
        for key, value in record.items():
            if isinstance(value, (int, float)) and not key.endswith("/count"):
                series[phase][key].append((step, value))
    out_dir = out_dir or run_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for phase, metrics in series.items():
        names = sorted(metrics)
        cols = min(3, len(names))
        rows = (len(names) + cols - 1) // cols
        # NOTE: the constrained layout keeps room for the title above the first row's titles (tight_layout does not)
        figure, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3 * rows), squeeze=False, layout="constrained")
        for ax, name in zip(axes.flat, names):
            steps, values = zip(*sorted(metrics[name]))
            ax.plot(steps, values, marker="." if len(steps) < 30 else None)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(names):]:
            ax.axis("off")
        figure.suptitle(f"{run_dir.name}: {phase}")
        path = out_dir / f"{phase}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written
