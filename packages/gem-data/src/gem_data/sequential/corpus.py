"""The in-memory form of a sequential data set, shared by the text and RecBole atomic readers.

Raw tokens (user and item ids, attribute values) are mapped to contiguous indices ``0..V-1``; the
vocabularies keep the raw tokens so results can be mapped back. Each user's items are in time order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gem_kunlun import lengths_to_offsets, segment_ids



def vocabulary(tokens) -> list[str]:
    """Sorted distinct tokens: numerically when every token is an integer, else lexicographically."""
    distinct = set(tokens)
    digits = (t.removeprefix("-") for t in distinct)
    if all(d.isascii() and d.isdecimal() for d in digits):  # int() takes exactly these
        # tokens are strings, so "01" and "1" may both be here: the text breaks the tie, else the order (and the
        # indices) would follow the set's, which changes from run to run
        return sorted(distinct, key=lambda t: (int(t), t))
    return sorted(distinct)


@dataclass
class Bags:
    """A bag of ids per entity (item or user), jagged: ``values [T]`` in ``[0, vocab_size)``, ``offsets [N+1]``."""

    values: torch.Tensor
    offsets: torch.Tensor
    vocab_size: int
    tokens: list[str] = field(default_factory=list)

    @staticmethod
    def from_lists(lists: list[list[int]], vocab_size: int, tokens: list[str] | None = None) -> "Bags":
        lengths = torch.tensor([len(x) for x in lists], dtype=torch.int64)
        values = torch.tensor([v for x in lists for v in x], dtype=torch.int64)
        return Bags(values, lengths_to_offsets(lengths), vocab_size, tokens or [])

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def max_length(self) -> int:
        return int(self.lengths().max()) if self.offsets.numel() > 1 else 0

    def slots(self, num_slots: int) -> torch.Tensor:
        """``[N, num_slots]``: the first ``num_slots`` ids of each bag, padded with ``vocab_size``."""
        n = self.offsets.numel() - 1
        position = torch.arange(num_slots)
        lengths = self.lengths()
        index = (self.offsets[:-1, None] + position[None, :]).clamp(max=max(self.values.numel() - 1, 0))
        ids = self.values[index] if self.values.numel() else torch.zeros(n, num_slots, dtype=torch.int64)
        return torch.where(position[None, :] < lengths[:, None], ids, torch.full_like(ids, self.vocab_size))


@dataclass
class SequenceCorpus:
    """Users' item sequences plus per-item and per-user features.

    - ``items [E]`` item indices, user after user, each user's events in time order; ``offsets [U+1]``.
    - ``timestamps [E]`` float64 seconds since the data set's first event (positions ``0, 1, ...`` when the
      file has no times: then ``timed`` is False), so float32 batches resolve a second over the first 2^24 s
      (~194 days), and 2^k s over 2^(24 + k) s (~32 s over Beauty's 14 years): epoch seconds would resolve ~128 s.
    - ``item_fields`` / ``user_fields``: name -> ``Bags`` of token ids (one id for a ``token`` field).
    - ``item_dense [V, Di]`` / ``user_dense [U, Du]``: float fields.
    - ``bad_rows`` / ``bad_row_examples``: what ``skip_bad_rows=True`` skipped (0 and [] otherwise);
      ``ignored_fields``: input fields the batch schema has no place for.
    """

    name: str
    user_tokens: list[str]
    item_tokens: list[str]
    items: torch.Tensor
    offsets: torch.Tensor
    timestamps: torch.Tensor
    item_fields: dict[str, Bags] = field(default_factory=dict)
    user_fields: dict[str, Bags] = field(default_factory=dict)
    item_dense: torch.Tensor | None = None
    user_dense: torch.Tensor | None = None
    bad_rows: int = 0
    bad_row_examples: list[str] = field(default_factory=list)
    ignored_fields: list[str] = field(default_factory=list)
    timed: bool = True  # the timestamps are event times (not positions)

    def __post_init__(self) -> None:
        if self.item_dense is None:
            self.item_dense = torch.zeros(self.num_items, 0)
        if self.user_dense is None:
            self.user_dense = torch.zeros(self.num_users, 0)

    @property
    def num_users(self) -> int:
        return len(self.user_tokens)

    @property
    def num_items(self) -> int:
        return len(self.item_tokens)

    def lengths(self) -> torch.Tensor:
        """Events per user, ``[U]``."""
        return self.offsets[1:] - self.offsets[:-1]

    def owned_keys(self) -> torch.Tensor:
        """Sorted ``user * num_items + item`` over every event: membership tests for negative sampling."""
        users = segment_ids(self.lengths())
        return torch.unique(users * self.num_items + self.items)
