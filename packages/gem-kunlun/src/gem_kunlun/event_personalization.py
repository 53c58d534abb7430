"""Event-level personalization: each event type encoded on its own terms before the time-ordered merge.

Event types differ in how much they say (a purchase, a page view) and how many there are: each may get its own
embedding width, attention heads, window and depth. Its events are encoded alone at that width, then
projected to the model width so that all types can be merged into one sequence (OneSeq).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from gem_kunlun.config_checks import check_at_least
from gem_kunlun.features import FeatureSpec
from gem_kunlun.local_attention import LocalAttention
from gem_kunlun.norm import LayerNorm, norm_mlp


@dataclass(frozen=True)
class EventPersonalization:
    """How one event type is encoded before the merge."""

    width: int | None = None  # embedding width of its ids (None: the model width)
    num_layers: int = 0  # self-attention layers over this type's events alone
    num_heads: int = 2
    window: int = 32  # each event sees events within this many positions in those layers

    def __post_init__(self) -> None:
        check_at_least(self, {"width": 2, "num_layers": 0, "num_heads": 1, "window": 0})


def check_event_names(names: Iterable[str], spec: FeatureSpec, field: str = "events") -> None:
    """Raise ``ValueError`` when ``names`` (the keys of a personalization table set by ``field``) include an
    event type the data does not have: a misspelt name would otherwise leave its type silently unpersonalized."""
    unknown = sorted(set(names) - {e.name for e in spec.events})
    if unknown:
        raise ValueError(f"{field} names unknown event types {unknown}; the data has {[e.name for e in spec.events]}")


class EventEncoder(nn.Module):
    """Event-level personalization: a few windowed self-attention + FFN layers over one event type alone,
    at that type's own width, then a projection to the model width."""

    def __init__(self, width: int, dim: int, p: EventPersonalization, rote: bool, kernel: str, device=None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            LocalAttention(width, p.num_heads, "window", 64, 1, p.window, rote, kernel, device=device) for _ in range(p.num_layers)
        )
        self.ffn_norms = nn.ModuleList(LayerNorm(width, kernel=kernel, device=device) for _ in range(p.num_layers))
        self.ffns = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width, device=device), nn.GELU(), nn.Linear(2 * width, width, device=device))
            for _ in range(p.num_layers)
        )
        self.project = nn.Linear(width, dim, device=device) if width != dim else nn.Identity()
        self.width = width

    def forward(self, events, offsets, positions, max_len):
        for attention, norm, ffn in zip(self.layers, self.ffn_norms, self.ffns):
            events = attention(events, offsets, positions, max_len)
            events = events + norm_mlp(norm, ffn, events)
        return self.project(events)

    def flops(self, lengths: torch.Tensor, dim: int) -> float:
        tokens = float(lengths.sum())
        per_layer = sum(a.flops(lengths) for a in self.layers) + len(self.ffns) * 2.0 * (2 * self.width * self.width * 2) * tokens
        return per_layer + (2.0 * self.width * dim * tokens if self.width != dim else 0.0)
