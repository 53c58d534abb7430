"""Negative sampling: items a user has not interacted with, uniformly or weighted by popularity.

Training negatives are a pure function of ``(seed, epoch, row)`` through a counter-based hash, so a batch
can be rebuilt anywhere (another worker, a resumed run) without carrying generator state. Evaluation
negatives (sampled-99) come from one seeded ``torch.Generator`` draw over all users at once.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF
# ``is_owned`` reads a bitmap of every (user, item) pair where it takes at most this many bytes (Beauty's 22,363 users
# x 12,101 items: 34 MB): one lookup a key instead of a binary search over every event's key (a training read of 4,096
# rows draws ~36,000 negatives); larger corpora search the sorted keys
OWNED_BITMAP_BYTES = 64 * 2**20


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


def is_owned_sorted(owned_keys: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Whether each of ``keys`` is in the sorted ``owned_keys``: a binary search (``owned_bitmap``'s reference)."""
    if not owned_keys.numel():
        return torch.zeros_like(keys, dtype=torch.bool)
    where = torch.searchsorted(owned_keys, keys).clamp(max=owned_keys.numel() - 1)
    return owned_keys[where] == keys


def owned_bitmap(owned_keys: torch.Tensor, max_bytes: int | None = None) -> np.ndarray | None:
    """Bit ``k`` set for each of the sorted, distinct, non-negative ``owned_keys``; None where the bitmap would take
    more than ``max_bytes`` (default ``OWNED_BITMAP_BYTES``) or there are no keys."""
    max_bytes = OWNED_BITMAP_BYTES if max_bytes is None else max_bytes
    if not owned_keys.numel() or (int(owned_keys[-1]) >> 3) + 1 > max_bytes:
        return None
    keys = owned_keys.numpy()
    byte, bit = keys >> 3, (np.uint8(1) << (keys & 7).astype(np.uint8))
    # the keys are sorted and distinct: each byte's bits are its run of keys OR-ed together
    starts = np.flatnonzero(np.diff(byte, prepend=-1))
    bitmap = np.zeros(int(byte[-1]) + 1, dtype=np.uint8)
    bitmap[byte[starts]] = np.bitwise_or.reduceat(bit, starts)
    return bitmap


def in_bitmap(bitmap: np.ndarray, keys: torch.Tensor) -> torch.Tensor:
    """Whether bit ``k`` of ``bitmap`` is set for each of the non-negative ``keys`` (any shape; keys past its end: no).
    In NumPy: a read draws in rounds, the later ones over a few keys, where torch's per-op cost would dominate."""
    k = keys.numpy()
    bits = bitmap.size * 8
    clipped = np.minimum(k, bits - 1)
    found = (bitmap[clipped >> 3] >> (clipped & 7).astype(np.uint8)) & np.uint8(1)
    return torch.from_numpy(found.astype(bool) & (k < bits))


class NegativeSampler:
    """Draws items not in a user's sequence: ``uniform`` over all items or ``popularity`` (``count ** power``).

    ``owned_keys`` is the sorted ``user * num_items + item`` over every event (see SequenceCorpus.owned_keys).
    """

    def __init__(self, num_items: int, owned_keys: torch.Tensor, kind: str = "uniform", counts: torch.Tensor | None = None, power: float = 1.0) -> None:
        if kind not in ("uniform", "popularity"):
            raise ValueError(f"sampler must be 'uniform' or 'popularity', got {kind!r}")
        self.num_items, self.owned_keys, self.kind = num_items, owned_keys, kind
        self._bitmap = owned_bitmap(owned_keys)
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
        if self._bitmap is None:
            return is_owned_sorted(self.owned_keys, keys)
        return in_bitmap(self._bitmap, keys)

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

    def free_items(self, users: torch.Tensor, among: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``[U]``: how many items outside each user's sequence ``draw_distinct`` can draw from (``among`` as there)."""
        if among is None:
            owned_per_user = torch.bincount(self.owned_keys // self.num_items, minlength=int(users.max()) + 1 if users.numel() else 0)
            return self.num_items - owned_per_user[users]
        item_order, known = among
        rank = torch.empty_like(item_order)
        rank[item_order] = torch.arange(item_order.numel())
        # the user's items among each row's first known[i]: owned (user, rank) keys counted below (user, known[i])
        owned_user, owned_item = self.owned_keys // self.num_items, self.owned_keys % self.num_items
        ranked = (owned_user * self.num_items + rank[owned_item]).sort().values
        base = users * self.num_items
        return known - (torch.searchsorted(ranked, base + known) - torch.searchsorted(ranked, base))

    def draw_distinct(self, users: torch.Tensor, count: int, generator: torch.Generator,
                      among: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``[U, count]`` distinct items per user, none in the user's sequence, uniform over the rest: of all items, or
        with ``among = (order, known)`` of row ``i``'s first ``known[i]`` items of ``order`` (a permutation of the
        items: a time split's catalogue at each ranked event, ``order`` by first appearance)."""
        free = self.free_items(users, among)
        if users.numel() and int(free.min()) < count:
            where = "their sequence" if among is None else "their sequence among the items rated before the ranked event"
            raise ValueError(f"some user has fewer than {count} items outside {where} to sample from")
        item_order, known = among if among is not None else (None, None)
        result = torch.full((users.numel(), count), -1, dtype=torch.int64)
        pending = torch.arange(users.numel())
        draws = 2 * count + 8
        while pending.numel():
            if among is None:
                candidate = torch.randint(self.num_items, (pending.numel(), draws), generator=generator)
            else:
                position = (torch.rand(pending.numel(), draws, generator=generator, dtype=torch.float64) * known[pending, None]).long()
                candidate = item_order[torch.minimum(position, known[pending, None] - 1)]
            usable = ~self.is_owned(users[pending, None], candidate)
            combined = torch.cat([result[pending], candidate], 1)
            keep = torch.cat([result[pending] >= 0, usable], 1)
            # drop repeats: a stable sort puts the first occurrence of a value before its repeats
            values, sorted_at = combined.sort(dim=1, stable=True)
            repeat = torch.zeros_like(keep)
            repeat.scatter_(1, sorted_at[:, 1:], values[:, 1:] == values[:, :-1])
            keep &= ~repeat
            first = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :count]
            picked = combined.gather(1, first)
            found = keep.sum(1)
            picked[torch.arange(count)[None, :] >= found[:, None]] = -1
            result[pending] = picked
            pending = pending[found < count]
        return result
