"""What Solaris keys a candidate pair by, read from the model's input: each row of a ``Batch`` is one (user,
candidate item) pair, as a ranking data set is.

- item: the id of the sparse feature naming the candidate (``item_feature``, one id per row);
- group: the id of the sparse feature grouping items (``group_feature``: an advertiser, a category);
- user: the id of a user-id feature (``user_feature``) where the data has one, else a 64-bit fingerprint of the
  request side of the row (dense features, the sparse features other than the item and group, the event
  histories), so that two rows of the same request with different candidates share their user;
- behaviour: the user's behaviour vector ``[dim]``, a hashed bag of every id in their event histories,
  L2-normalised (zero for a user without events): what the nearest-neighbour level compares, computable at
  serving time from the request alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torchrec import KeyedJaggedTensor

from gem_kunlun import Batch, segment_ids
from gem_transfer.soft_labels import example_fingerprints


@dataclass
class PairKeys:
    """The keys of ``B`` candidate pairs: ``users``, ``items``, ``groups`` ``[B]`` int64, ``behaviour [B, dim]``."""

    users: np.ndarray
    items: np.ndarray
    groups: np.ndarray
    behaviour: np.ndarray

    def __len__(self) -> int:
        return len(self.users)

    def select(self, rows: np.ndarray) -> PairKeys:
        return PairKeys(self.users[rows], self.items[rows], self.groups[rows], self.behaviour[rows])

    def head(self, n: int) -> PairKeys:
        """The first ``n`` pairs (all of them where there are fewer)."""
        return self.select(np.arange(min(n, len(self))))

    @staticmethod
    def concat(parts: list[PairKeys]) -> PairKeys:
        return PairKeys(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("users", "items", "groups", "behaviour")))


def single_ids(kjt: KeyedJaggedTensor, name: str) -> np.ndarray:
    """``[B]`` the one id each row holds in feature ``name``; a row with none or several is a ``ValueError``."""
    if name not in kjt.keys():  # noqa: SIM118 - a KeyedJaggedTensor is not a mapping
        raise ValueError(f"no sparse feature {name!r} in the batch (it has {list(kjt.keys())})")
    jagged = kjt[name]
    lengths = jagged.lengths()
    if bool((lengths != 1).any()):
        raise ValueError(f"sparse feature {name!r} must hold exactly one id per row to key a pair, "
                         f"found rows with {sorted(set(lengths.tolist()) - {1})}")
    return jagged.values().long().numpy().copy()


def request_fingerprints(batch: Batch, candidate_features: tuple[str, ...]) -> np.ndarray:
    """``[B]`` int64: the fingerprint of each row's request side (labels, surface and the candidate's features
    left out), equal for every candidate of one request."""
    kept = {k: v for k, v in batch.sparse.to_dict().items() if k not in candidate_features}
    sparse = KeyedJaggedTensor.from_jt_dict(kept) if kept else KeyedJaggedTensor.empty()
    request = dataclasses.replace(batch, sparse=sparse, labels=torch.zeros(batch.batch_size, 0),
                                  surface=torch.zeros_like(batch.surface), next_items=None, source=None)
    return example_fingerprints(request).numpy()


def behaviour_vectors(batch: Batch, dim: int) -> np.ndarray:
    """``[B, dim]`` float32: each row's event-history ids hashed into ``dim`` buckets (salted per feature),
    counted and L2-normalised."""
    counts = torch.zeros(batch.batch_size, dim)
    salt = 0
    for name in sorted(batch.sequences):
        ids = batch.sequences[name].ids
        for key in ids.keys():  # noqa: SIM118 - a KeyedJaggedTensor is not a mapping
            jagged = ids[key]
            values = jagged.values().long()
            salt += 1
            if values.numel() == 0:
                continue
            owner = segment_ids(jagged.lengths().long(), values.numel())
            # a multiplicative hash modulo a prime spreads nearby ids over the buckets
            bucket = torch.remainder(values * 1_000_003 + salt * 7_919, 2_147_483_647) % dim
            counts.index_put_((owner, bucket), torch.ones(values.numel()), accumulate=True)
    norms = counts.norm(dim=1, keepdim=True)
    return torch.where(norms > 0, counts / norms.clamp(min=1e-12), counts).numpy()


def pair_keys(batch: Batch, item_feature: str, group_feature: str, user_feature: str | None = None,
              behaviour_dim: int = 64) -> PairKeys:
    """The keys of every row of ``batch``; see the module docstring."""
    items = single_ids(batch.sparse, item_feature)
    groups = single_ids(batch.sparse, group_feature)
    if user_feature is not None:
        users = single_ids(batch.sparse, user_feature)
    else:
        users = request_fingerprints(batch, (item_feature, group_feature))
    return PairKeys(users, items, groups, behaviour_vectors(batch, behaviour_dim))
