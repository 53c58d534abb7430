"""CompSkip: a per-layer schedule that switches Kunlun's sequence components off.

``skip[i]`` names the components layer ``i`` leaves out (layers past the end of the schedule keep all of
them). A skipped component passes its input on through the residual: a skipped pFFN or local attention
leaves the history as it came in, a skipped summary hands on the previous layer's. Later layers can drop
most of the sequence work at equal quality (~40% fewer FLOPs in the paper).
"""

from __future__ import annotations

SEQUENCE_COMPONENTS = ("summary", "pffn", "attention")


def check_skip_schedule(skip: tuple[tuple[str, ...], ...], num_layers: int) -> None:
    """Raise ``ValueError`` for a schedule longer than the model, an unknown component name, or a first layer
    without a summary (it has no earlier one to pass on)."""
    if len(skip) > num_layers:
        raise ValueError(f"skip lists {len(skip)} layers but the model has {num_layers}")
    for i, components in enumerate(skip):
        unknown = set(components) - set(SEQUENCE_COMPONENTS)
        if unknown:
            raise ValueError(f"skip[{i}] names unknown components {sorted(unknown)}; known: {SEQUENCE_COMPONENTS}")
    if skip and "summary" in skip[0]:
        raise ValueError("skip[0] cannot switch off 'summary': the first layer has no earlier summary to pass on")


def skipped_components(skip: tuple[tuple[str, ...], ...], layer: int) -> set[str]:
    """The components layer ``layer`` leaves out under the schedule ``skip``."""
    return set(skip[layer]) if layer < len(skip) else set()
