"""A synthetic GEM-like data set drawn from a hidden ground-truth model, so that learning is measurable.

Every example is a (user, candidate ad) pair on one surface (feed, video, stories...). The user has a latent
interest cluster; their event histories (purchases: ad + account ids, posts: actor + object ids) have
power-law lengths and lean towards that cluster. Click and conversion labels are Bernoulli draws from
logits that combine the history's affinity to the candidate's cluster, a noisy user segment, per-ad
biases and dense features, with coefficients that differ per surface. Batches are a pure function of
(seed, split, batch index), which makes the stream shardable and exactly resumable.

By default every example is a new user. With ``num_users`` the examples come from a fixed population: each
carries a ``user_id`` sparse feature, the user's interest cluster is fixed (drawn once from the seed), and
examples happen in time: the example at row ``r`` of global batch ``i`` of ``B`` rows is at
``1e6 + (i + r / B) * 3600`` seconds (the held-out split starts ``EVAL_AFTER_BATCHES`` batches later, after
any training stream shorter than that), its history ending then. A user's examples are thus ordered in
time, which is what a per-user memory of earlier events (LoopFM) needs. Every stream of the data set
(``stream``: disjoint draws, such as a mixture's offline log and live stream) runs on that one clock: batch ``i``
of any stream is at the time above, so that the held-out split comes after every training stream's batches.
With ``user_propensity`` each user also has a fixed offset of the click logit (standard deviation
``user_propensity``): some users click more than others whatever they see. Without it every label is a function of its own example's features, and a
user's earlier events carry nothing about a new label that the example does not already show.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec import KeyedJaggedTensor

from gem_kunlun import Batch, EventSequence, EventType, FeatureSpec, SparseFeature, lengths_to_offsets, segment_ids

SPLITS = {"train": 0, "eval": 1}
# NOTE: torch's CPU generator keeps 32 bits of a seed, and the train and eval splits sit 2**31 batch indices apart:
# 128 streams of 2**24 batches each fit below that
BATCHES_PER_STREAM = 1 << 24
MAX_STREAMS = 128
# with num_users: examples are an hour of time per batch apart, held-out ones this many batches after the first
# training example (timestamps are float32: at ~6e7 s they resolve 4 s)
SECONDS_PER_BATCH = 3600.0
EVAL_AFTER_BATCHES = 1 << 14


@dataclass(frozen=True)
class SyntheticConfig:
    num_surfaces: int = 3
    num_dense: int = 8
    num_ads: int = 20_000
    num_clusters: int = 16
    min_events: int = 4
    max_events: int = 256
    length_alpha: float = 1.3  # Pareto tail index of history lengths: smaller means heavier tail
    interest_share: float = 0.6  # share of history events drawn from the user's own cluster
    seed: int = 0
    num_users: int = 0  # 0: every example is a new user; else a fixed population with user ids (module docstring)
    user_propensity: float = 0.0  # with num_users: standard deviation of each user's click logit offset

    def __post_init__(self) -> None:
        if not 1 <= self.min_events <= self.max_events:
            raise ValueError(f"need 1 <= min_events <= max_events, got {self.min_events}, {self.max_events}")
        if self.num_ads < self.num_clusters * 10:
            raise ValueError("num_ads must be at least 10 * num_clusters")
        if self.num_users < 0:
            raise ValueError(f"num_users must be >= 0, got {self.num_users}")
        if self.user_propensity < 0:
            raise ValueError(f"user_propensity must be >= 0, got {self.user_propensity}")
        if self.user_propensity and not self.num_users:
            raise ValueError("user_propensity needs num_users: without a population no user comes back")


class SyntheticGenerator:
    """Draws batches of the synthetic data set; see the module docstring."""

    def __init__(self, config: SyntheticConfig = SyntheticConfig()) -> None:
        self.config = c = config
        self.num_accounts = c.num_ads // 10
        self.num_objects = c.num_ads
        self.num_actors = c.num_ads // 4
        self.spec = FeatureSpec(
            num_dense=c.num_dense,
            sparse=(
                SparseFeature("ad_id", c.num_ads),
                SparseFeature("advertiser_id", self.num_accounts),
                SparseFeature("user_segment", c.num_clusters * 4),
                SparseFeature("device", 4),
                SparseFeature("hour", 24),
                SparseFeature("user_tags", 512),
                *((SparseFeature("user_id", c.num_users),) if c.num_users else ()),
            ),
            events=(
                EventType("purchase", (SparseFeature("purchase_ad_id", c.num_ads), SparseFeature("purchase_account_id", self.num_accounts))),
                EventType("post", (SparseFeature("post_object_id", self.num_objects), SparseFeature("post_actor_id", self.num_actors))),
            ),
            tasks=("click", "conversion"),
            num_surfaces=c.num_surfaces,
        )
        # The hidden ground truth: fixed by the seed, shared by every split.
        g = torch.Generator().manual_seed(c.seed)
        s = c.num_surfaces
        self.surface_bias = torch.randn(s, generator=g) * 0.3 - 1.0
        self.history_weight = 2.0 + 4.0 * torch.rand(s, generator=g)  # how much the history matters per surface
        self.segment_weight = 0.5 + torch.rand(s, generator=g)
        self.dense_weight = torch.randn(s, c.num_dense, generator=g) * 0.4
        self.ad_bias = torch.randn(c.num_ads, generator=g) * 0.5
        self.hour_bias = torch.randn(24, generator=g) * 0.2
        self.tag_bias = torch.randn(512, generator=g) * 0.3
        # drawn last, so that the ground truth without users is what it always was
        self.user_cluster = torch.randint(c.num_clusters, (c.num_users,), generator=g) if c.num_users else None
        self.user_bias = torch.randn(c.num_users, generator=g) * c.user_propensity if c.num_users else None

    def batch(self, index: int, batch_size: int, split: str = "train", stream: int = 0) -> Batch:
        """The batch at position ``index`` of ``split`` (of one of its disjoint ``stream``s): identical for identical
        arguments."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
        if not 0 <= stream < MAX_STREAMS:
            raise ValueError(f"stream must lie in [0, {MAX_STREAMS}), got {stream}")
        if not 0 <= index < BATCHES_PER_STREAM:  # past it, another stream's (or split's) draws would repeat
            raise ValueError(f"a synthetic stream holds {BATCHES_PER_STREAM:,} batches: index {index} is past its end")
        c = self.config
        drawn = stream * BATCHES_PER_STREAM + index  # the streams' draws are disjoint, their clock is one
        g = torch.Generator().manual_seed(((c.seed * 1_000_003 + SPLITS[split]) * 2_147_483_647 + drawn) % (2**63))
        b, k = batch_size, c.num_clusters
        surface = torch.randint(c.num_surfaces, (b,), generator=g)
        if c.num_users:
            user = torch.randint(c.num_users, (b,), generator=g)
            cluster = self.user_cluster[user]
            first = index + (EVAL_AFTER_BATCHES if split == "eval" else 0)
            now = 1e6 + (first + torch.arange(b, dtype=torch.float64) / b) * SECONDS_PER_BATCH
        else:
            cluster = torch.randint(k, (b,), generator=g)
            now = torch.full((b,), 1e6, dtype=torch.float64)
        ad = torch.randint(c.num_ads, (b,), generator=g)
        ad_cluster = ad % k
        # a noisy user segment: right cluster half of the time
        segment_cluster = torch.where(torch.rand(b, generator=g) < 0.5, cluster, torch.randint(k, (b,), generator=g))
        segment = segment_cluster * 4 + torch.randint(4, (b,), generator=g)
        device = torch.randint(4, (b,), generator=g)
        hour = torch.randint(24, (b,), generator=g)
        tag_lengths = torch.randint(1, 6, (b,), generator=g)
        tags = torch.randint(512, (int(tag_lengths.sum()),), generator=g)
        dense = torch.randn(b, c.num_dense, generator=g)

        purchases, purchase_match = self._events(g, cluster, ad_cluster, c.num_ads, lambda ids: ids // 10, now)
        posts, post_match = self._events(g, cluster, ad_cluster, self.num_objects, lambda ids: ids // 4, now)
        n_events = purchases[3] + posts[3]
        affinity = (purchase_match + post_match) / n_events.clamp(min=1) - 1.0 / k

        tag_effect = torch.segment_reduce(self.tag_bias[tags], "mean", lengths=tag_lengths)
        click_logit = (
            self.surface_bias[surface]
            + self.history_weight[surface] * affinity
            + self.segment_weight[surface] * (segment_cluster == ad_cluster).float()
            + (dense * self.dense_weight[surface]).sum(1)
            + self.ad_bias[ad]
            + self.hour_bias[hour]
            + tag_effect
            + (self.user_bias[user] if c.num_users else 0.0)
        )
        conversion_logit = 0.7 * click_logit + 0.8 * dense[:, 0] - 1.5
        probs = torch.sigmoid(torch.stack([click_logit, conversion_logit], 1))
        labels = torch.bernoulli(probs, generator=g)

        one = torch.ones(b, dtype=torch.int64)
        users = (user,) if c.num_users else ()
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=[f.name for f in self.spec.sparse],
            values=torch.cat([ad, ad // 10, segment, device, hour, tags, *users]),
            lengths=torch.cat([one, one, one, one, one, tag_lengths, *(one for _ in users)]),
        )
        return Batch(
            dense=dense,
            sparse=sparse,
            sequences={
                "purchase": self._sequence(["purchase_ad_id", "purchase_account_id"], purchases),
                "post": self._sequence(["post_object_id", "post_actor_id"], posts),
            },
            labels=labels,
            surface=surface,
        )

    def _events(self, g, cluster, ad_cluster, vocab, secondary, now):
        """Draw one event type's histories, each ending at its example's time ``now [B]``: (primary ids,
        secondary ids, timestamps, lengths) and per-example counts of events in the candidate's cluster."""
        c, b, k = self.config, cluster.numel(), self.config.num_clusters
        u = torch.rand(b, generator=g)
        lengths = (c.min_events * u.pow(-1.0 / c.length_alpha)).floor().clamp(max=c.max_events).long()
        # some users have no events of a given type at all: empty sequences are common in practice
        lengths = torch.where(torch.rand(b, generator=g) < 0.15, torch.zeros_like(lengths), lengths)
        owner = segment_ids(lengths)
        total = owner.numel()
        own = torch.rand(total, generator=g) < c.interest_share
        event_cluster = torch.where(own, cluster[owner], torch.randint(k, (total,), generator=g))
        ids = event_cluster + k * torch.randint(vocab // k, (total,), generator=g)
        match = torch.zeros(b).index_add_(0, owner, (event_cluster == ad_cluster[owner]).float())
        # timestamps: exponential gaps (mean one hour), the last event of every example at its time (default 1e6)
        cumulative = torch.cat([torch.zeros(1), torch.cumsum(torch.empty(total).exponential_(1 / 3600.0, generator=g), 0)])
        last = cumulative[lengths_to_offsets(lengths)[1:]]
        timestamps = now[owner] - (last[owner] - cumulative[1:]).double()
        return (ids, secondary(ids), timestamps, lengths), match

    @staticmethod
    def _sequence(keys: list[str], drawn) -> EventSequence:
        primary, secondary, timestamps, lengths = drawn
        return EventSequence(
            ids=KeyedJaggedTensor.from_lengths_sync(
                keys=keys, values=torch.cat([primary, secondary]), lengths=torch.cat([lengths, lengths])
            ),
            timestamps=timestamps.float(),
        )
