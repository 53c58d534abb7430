"""Negative sampling: items a user has not interacted with, uniformly or weighted by popularity.

Training negatives are a pure function of ``(seed, epoch, row)`` through a counter-based hash, so a batch
can be rebuilt anywhere (another worker, a resumed run) without carrying generator state. Evaluation
negatives (sampled-99) come from one seeded ``torch.Generator`` draw over all users at once.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer mix of a tensor (or a Python int: the same function, for the salt)."""
    # NOTE: inputs stay below 2**32 and the multiplier below 2**27, so int64 products never overflow.
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def hash_uniform(keys: torch.Tensor, salt: int) -> torch.Tensor:
    """``[N]`` non-negative int64 keys -> ``[N]`` float64 in ``[0, 1)``, a fixed pseudo-random function of (key, salt)."""
    # the salt's mix in Python integers: the same bits as on a one-element tensor, without its tensor ops
    salt_mix = _mix32(salt & _MASK32) ^ ((salt >> 32) & _MASK32)
    h = _mix32((keys & _MASK32) ^ salt_mix)
    h = _mix32(h ^ ((keys >> 32) & _MASK32))
    return h.double() / 2.0**32


def salt_of(*parts: int) -> int:
    """Fold integers into one 62-bit salt."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part) + 1) % (2**62)
    return value


class NegativeSampler:
    """Draws items not in a user's sequence: ``uniform`` over all items or ``popularity`` (``count ** power``).

    ``owned_keys`` is the sorted ``user * num_items + item`` over every event (see SequenceCorpus.owned_keys).
    """

    def __init__(self, num_items: int, owned_keys: torch.Tensor, kind: str = "uniform", counts: torch.Tensor | None = None, power: float = 1.0) -> None:
        if kind not in ("uniform", "popularity"):
            raise ValueError(f"sampler must be 'uniform' or 'popularity', got {kind!r}")
        self.num_items, self.owned_keys, self.kind = num_items, owned_keys, kind
        if kind == "popularity":
            if counts is None:
                raise ValueError("the popularity sampler needs item counts")
            weights = counts.double().clamp(min=0) ** power
            weights[counts <= 0] = 0.0  # an item never seen in training is never a popularity negative
            self.cdf = torch.cumsum(weights, 0)
            if float(self.cdf[-1]) <= 0:
                raise ValueError("the popularity sampler needs at least one item with a positive count")

    def is_owned(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """Whether each ``(users[i], items[i])`` pair (any broadcastable shapes) is an interaction."""
        keys = users * self.num_items + items
        where = torch.searchsorted(self.owned_keys, keys).clamp(max=max(self.owned_keys.numel() - 1, 0))
        return self.owned_keys[where] == keys if self.owned_keys.numel() else torch.zeros_like(keys, dtype=torch.bool)

    def draw(self, users: torch.Tensor, keys: torch.Tensor, salt: int, max_rounds: int = 32) -> torch.Tensor:
        """One negative item per ``(users[i], keys[i])``; a pure function of ``(keys, salt)`` and the data."""
        items = torch.empty_like(users)
        pending = torch.arange(users.numel())
        for round_ in range(max_rounds):
            if pending.numel() == 0:
                return items
            u = hash_uniform(keys[pending], salt_of(salt, round_))
            if self.kind == "uniform":
                candidate = (u * self.num_items).long().clamp(max=self.num_items - 1)
            else:
                candidate = torch.searchsorted(self.cdf, u * float(self.cdf[-1]), right=True).clamp(max=self.num_items - 1)
            items[pending] = candidate
            pending = pending[self.is_owned(users[pending], candidate)]
        # NOTE: only users who own nearly every (popular) item get here; pick from their complement directly.
        for i in pending.tolist():
            user = int(users[i])
            owned = self.owned_keys[(self.owned_keys >= user * self.num_items) & (self.owned_keys < (user + 1) * self.num_items)]
            free = torch.ones(self.num_items, dtype=torch.bool)
            free[owned - user * self.num_items] = False
            choices = free.nonzero().squeeze(1)
            if choices.numel() == 0:
                raise ValueError(f"user index {user} has interacted with every item: no negative exists")
            items[i] = choices[int(hash_uniform(keys[i : i + 1], salt)[0] * choices.numel())]
        return items

    def fewest_free_items(self) -> int:
        """The fewest items any user has not interacted with: the most distinct negatives every user can get."""
        owned = torch.bincount(self.owned_keys // self.num_items)
        return self.num_items - int(owned.max()) if owned.numel() else self.num_items

    def draw_distinct(self, users: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
        """``[U, count]`` distinct items per user, none in the user's sequence, uniform over the rest."""
        owned_per_user = torch.bincount(self.owned_keys // self.num_items, minlength=int(users.max()) + 1 if users.numel() else 0)
        if users.numel() and int((self.num_items - owned_per_user[users]).min()) < count:
            raise ValueError(f"some user has fewer than {count} items outside their sequence to sample from")
        result = torch.full((users.numel(), count), -1, dtype=torch.int64)
        pending = torch.arange(users.numel())
        draws = 2 * count + 8
        while pending.numel():
            candidate = torch.randint(self.num_items, (pending.numel(), draws), generator=generator)
            usable = ~self.is_owned(users[pending, None], candidate)
            combined = torch.cat([result[pending], candidate], 1)
            keep = torch.cat([result[pending] >= 0, usable], 1)
            # drop repeats: a stable sort puts the first occurrence of a value before its repeats
            values, order = combined.sort(dim=1, stable=True)
            repeat = torch.zeros_like(keep)
            repeat.scatter_(1, order[:, 1:], values[:, 1:] == values[:, :-1])
            keep &= ~repeat
            first = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :count]
            picked = combined.gather(1, first)
            found = keep.sum(1)
            picked[torch.arange(count)[None, :] >= found[:, None]] = -1
            result[pending] = picked
            pending = pending[found < count]
        return result
