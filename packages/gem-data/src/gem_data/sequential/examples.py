"""Next-item training examples and ranking-evaluation inputs built from a ``SequenceCorpus``.

Leave-one-out, as the data README prescribes: training uses ``items[:-2]`` of every user, where each prefix
``items[:k]`` (``k >= 1``) predicts ``items[k]``; the validation target is ``items[-2]`` (history
``items[:-2]``), the test target ``items[-1]`` (history ``items[:-1]``). Users with fewer than 3 items have no validation/test target and no training prefix.

Batch layout: the candidate item is a non-sequence sparse feature (``item_id`` plus ``item_<field>`` bags
of its attributes; ``user_<field>`` for user attributes, ``user_id`` on request); the history is one event
type ``history`` with ``history_item_id`` and, per item attribute field, ``history_<field>_<slot>`` ids (the
first ``attribute_slots`` attributes of the event's item, padded with id ``vocab_size``), because an event
feature carries exactly one id per event. Float fields become dense features (user's, then item's).

Two training objectives:

- ``pointwise``: a row per (prefix, candidate): the next item (label 1) and ``num_negatives`` sampled items
  (label 0), for any model that scores a (request, candidate) row.
- ``retrieval``: rows carry ``Batch.next_items`` for models with a candidate-independent request side
  (``gem_kunlun.retrieval``). ``queries = "last"``: a row per prefix, one query each; ``"every"``: a row
  per user (its training items but the last as history) with a query at every event, each predicting the
  item that follows it, SASRec's way of reading a sequence once per epoch. Each query is scored against
  ``num_negatives`` sampled items (``loss = "binary"`` or a sampled ``"softmax"``), or with
  ``num_negatives = 0`` and ``loss = "softmax"`` against the whole catalogue.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torchrec import KeyedJaggedTensor

from gem_kunlun import (
    Batch,
    EventSequence,
    EventType,
    FeatureSpec,
    NextItemTargets,
    SparseFeature,
    segment_ids,
    segment_positions,
)

from gem_data.batch_ops import gather_jagged, jagged_index
from gem_data.sequential.corpus import SequenceCorpus
from gem_data.sequential.sampling import NegativeSampler, salt_of

HISTORY = "history"


@dataclass(frozen=True)
class NextItemConfig:
    num_negatives: int = 1  # sampled negatives per positive in training (retrieval softmax: 0 = all items)
    objective: Literal["pointwise", "retrieval"] = "pointwise"
    queries: Literal["last", "every"] = "last"  # retrieval: one query per prefix, or one per history event
    loss: Literal["binary", "softmax"] = "binary"  # retrieval
    sampler: Literal["uniform", "popularity"] = "uniform"
    popularity_power: float = 1.0  # popularity weight = (training count) ** power
    max_history: int | None = None  # keep the most recent events only
    attribute_slots: int = 4  # per-event ids kept per item attribute field in the history
    with_user_id: bool = False  # add the user id as a sparse feature
    task: str = "next_item"
    surface: int = 0
    num_surfaces: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_negatives < 0:
            raise ValueError(f"num_negatives must be >= 0, got {self.num_negatives}")
        if self.max_history is not None and self.max_history < 1:
            raise ValueError(f"max_history must be >= 1 or None, got {self.max_history}")
        if self.objective not in ("pointwise", "retrieval"):
            raise ValueError(f"objective must be 'pointwise' or 'retrieval', got {self.objective!r}")
        if self.queries not in ("last", "every") or self.loss not in ("binary", "softmax"):
            raise ValueError(f"queries must be 'last' or 'every' and loss 'binary' or 'softmax', got {self.queries!r}, {self.loss!r}")
        if self.objective == "retrieval" and self.loss == "binary" and self.num_negatives < 1:
            raise ValueError("num_negatives must be >= 1 for the binary retrieval loss (0 means the whole catalogue, softmax only)")
        if not 0 <= self.surface < self.num_surfaces:
            raise ValueError(f"surface must lie in [0, num_surfaces), got {self.surface}, {self.num_surfaces}")


def seen_items(corpus: SequenceCorpus, users: torch.Tensor, history_length: torch.Tensor, target: torch.Tensor):
    """``(rows, items)``: each user's first ``history_length`` items (row ``i`` for ``users[i]``), the
    held-out ``target`` left out where the history repeats it."""
    rows = torch.repeat_interleave(torch.arange(users.numel()), history_length)
    items = corpus.items[jagged_index(corpus.offsets[users], history_length)]
    keep = items != target[rows]
    return rows[keep], items[keep]


@dataclass
class RankingExamples:
    """Ranking-evaluation inputs for ``U`` users.

    - ``users [U]`` user indices; ``history``: their histories as one jagged ``EventSequence`` (``U`` rows);
      ``history_length [U]``: the history is the user's first ``history_length`` items (the last
      ``max_history`` of them).
    - ``candidates [U, C]`` item indices; ``target_index [U]``: the column of the held-out item.
      ``sampled``: the target plus ``C - 1`` distinct items outside the user's sequence, target at a seeded
      random column; ``full``: every item (``C = num_items``, target column = target item).
    - ``full`` only: ``seen_rows [S]``, ``seen_columns [S]``: the candidates each user interacted with before
      (the user's whole history, not only the ``max_history`` the model reads), which the published full-ranking
      protocol leaves out (S3-Rec's and ICLRec's evaluations drop the training items from the ranking); the
      held-out item itself is never among them. ``mask_seen`` applies it to scores.
    """

    split: str
    protocol: str
    users: torch.Tensor
    history: EventSequence
    history_length: torch.Tensor
    candidates: torch.Tensor
    target_index: torch.Tensor
    seen_rows: torch.Tensor | None = None
    seen_columns: torch.Tensor | None = None

    @property
    def num_users(self) -> int:
        return self.users.numel()

    def mask_seen(self, scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``scores [len(rows), C]`` of the users ``rows`` with their seen candidates at -inf (in place; the
        sampled protocol's candidates are unseen by construction, so its scores come back unchanged)."""
        if self.seen_rows is None:
            return scores
        position = torch.full((self.num_users,), -1, dtype=torch.int64)
        position[rows] = torch.arange(rows.numel())
        at = position[self.seen_rows]
        mine = at >= 0
        scores[at[mine], self.seen_columns[mine]] = float("-inf")
        return scores

    def targets(self) -> torch.Tensor:
        """``[U]`` the held-out item of each user."""
        return self.candidates[torch.arange(self.num_users), self.target_index]


class NextItemDataset:
    """The next-item task over a corpus: ``spec``, the training ``ExampleTable`` and ranking inputs."""

    def __init__(self, corpus: SequenceCorpus, config: NextItemConfig = NextItemConfig()) -> None:
        self.corpus, self.config = corpus, config
        c = config
        self.item_fields = {k: v for k, v in corpus.item_fields.items() if v.vocab_size > 0}
        self.user_fields = {k: v for k, v in corpus.user_fields.items() if v.vocab_size > 0}
        self.slots = {f: bags.slots(min(c.attribute_slots, bags.max_length())) for f, bags in self.item_fields.items()}
        history_features = [SparseFeature("history_item_id", corpus.num_items)]
        for f, table in self.slots.items():
            vocab = self.item_fields[f].vocab_size + 1  # + the padding id
            history_features += [SparseFeature(f"history_{f}_{s}", vocab) for s in range(table.shape[1])]
        sparse = [SparseFeature("item_id", corpus.num_items)]
        sparse += [SparseFeature(f"item_{f}", b.vocab_size) for f, b in self.item_fields.items()]
        if c.with_user_id:
            sparse.append(SparseFeature("user_id", corpus.num_users))
        sparse += [SparseFeature(f"user_{f}", b.vocab_size) for f, b in self.user_fields.items()]
        self.spec = FeatureSpec(
            num_dense=corpus.user_dense.shape[1] + corpus.item_dense.shape[1],
            sparse=tuple(sparse),
            events=(EventType(HISTORY, tuple(history_features)),),
            tasks=(c.task,),
            num_surfaces=c.num_surfaces,
            candidate=tuple(f.name for f in sparse[: 1 + len(self.item_fields)]),
            # the item's float fields follow the user's in ``assemble``'s dense
            candidate_dense=tuple(range(corpus.user_dense.shape[1], corpus.user_dense.shape[1] + corpus.item_dense.shape[1])),
            shared_ids=(("item_id", "history_item_id"),),
        )
        lengths = corpus.lengths()
        # training prefixes: users with n >= 3 items train on items[:n-2], prefixes k = 1 .. n-3
        per_user = (lengths - 3).clamp(min=0)
        self.example_user = segment_ids(per_user)
        self.example_k = 1 + segment_positions(per_user)
        train_mask = torch.arange(corpus.items.numel()) < torch.repeat_interleave(corpus.offsets[1:] - 2, lengths)
        self.train_counts = torch.bincount(corpus.items[train_mask], minlength=corpus.num_items)
        self.owned_keys = corpus.owned_keys()
        self.sampler = NegativeSampler(corpus.num_items, self.owned_keys, c.sampler, self.train_counts, c.popularity_power)

        # users with a training pair: n >= 4 items, so items[:n-2] holds at least two
        self.sequence_users = (per_user > 0).nonzero().squeeze(1)
        self._catalogue: KeyedJaggedTensor | None = None

    @property
    def num_training_examples(self) -> int:
        """Positive training examples (prefixes); the pointwise table has ``1 + num_negatives`` rows per example."""
        return self.example_user.numel()

    def training_table(self) -> "NextItemTable | RetrievalTable":
        return NextItemTable(self) if self.config.objective == "pointwise" else RetrievalTable(self)

    def catalogue(self) -> KeyedJaggedTensor:
        """The candidate-side features (``spec.candidate``) of every item, row ``i`` for item ``i``."""
        if self._catalogue is None:
            items = torch.arange(self.corpus.num_items)
            values, lengths = [items], [torch.ones_like(items)]
            for bags in self.item_fields.values():
                v, n = gather_jagged(bags.values, bags.offsets, items)
                values.append(v)
                lengths.append(n)
            self._catalogue = KeyedJaggedTensor.from_lengths_sync(
                keys=list(self.spec.candidate), values=torch.cat(values), lengths=torch.cat(lengths))
        return self._catalogue

    # -- batch assembly -----------------------------------------------------------------------------------------
    def history_window(self, users: torch.Tensor, history_length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Start (into ``corpus.items``) and length of the kept history of the users' first ``history_length`` items."""
        kept = history_length if self.config.max_history is None else history_length.clamp(max=self.config.max_history)
        return self.corpus.offsets[users] + history_length - kept, kept

    def history(self, users: torch.Tensor, history_length: torch.Tensor) -> EventSequence:
        """The ``history`` event sequence of ``B`` examples (jagged, ``sum(kept lengths)`` events)."""
        start, kept = self.history_window(users, history_length)
        index = jagged_index(start, kept)
        items = self.corpus.items[index]
        # the item ids, then each attribute slot's ids, slot after slot: one gather per attribute table, not per slot
        values = torch.cat([items[None], *(table[items].t() for table in self.slots.values())]).view(-1)
        columns = 1 + sum(table.shape[1] for table in self.slots.values())
        ids = KeyedJaggedTensor.from_lengths_sync(
            keys=[f.name for f in self.spec.events[0].features], values=values, lengths=kept.repeat(columns)
        )
        return EventSequence(ids=ids, timestamps=self.corpus.timestamps[index].float())

    def assemble(self, users: torch.Tensor, history: EventSequence, candidates: torch.Tensor, labels: torch.Tensor) -> Batch:
        """A batch of ``B`` (user, history, candidate item, label) rows; every argument has ``B`` rows."""
        b = users.numel()
        values, lengths = [candidates], [torch.ones(b, dtype=torch.int64)]
        for bags in self.item_fields.values():
            v, n = gather_jagged(bags.values, bags.offsets, candidates)
            values.append(v)
            lengths.append(n)
        if self.config.with_user_id:
            values.append(users)
            lengths.append(torch.ones(b, dtype=torch.int64))
        for bags in self.user_fields.values():
            v, n = gather_jagged(bags.values, bags.offsets, users)
            values.append(v)
            lengths.append(n)
        return Batch(
            dense=torch.cat([self.corpus.user_dense[users], self.corpus.item_dense[candidates]], 1).float(),
            sparse=KeyedJaggedTensor.from_lengths_sync(keys=[f.name for f in self.spec.sparse], values=torch.cat(values), lengths=torch.cat(lengths)),
            sequences={HISTORY: history},
            labels=labels.float().view(b, 1),
            surface=torch.full((b,), self.config.surface, dtype=torch.int64),
        )

    # -- evaluation ---------------------------------------------------------------------------------------------
    def fewest_free_items(self, split: str = "test") -> int:
        """The most distinct sampled negatives every query of ``split`` can get: the fewest items a user has not
        interacted with."""
        return self.sampler.fewest_free_items()

    def ranking_examples(
        self, split: Literal["valid", "test"] = "test", protocol: Literal["sampled", "full"] = "sampled", num_negatives: int = 99, seed: int = 0
    ) -> RankingExamples:
        """Ranking inputs for every user with at least 3 items (see ``RankingExamples``); one fixed draw per seed."""
        if split not in ("valid", "test") or protocol not in ("sampled", "full"):
            raise ValueError(f"split must be 'valid' or 'test' and protocol 'sampled' or 'full', got {split!r}, {protocol!r}")
        if protocol == "sampled" and num_negatives < 1:
            raise ValueError(f"a sampled ranking needs num_negatives >= 1, got {num_negatives}")
        lengths = self.corpus.lengths()
        users = (lengths >= 3).nonzero().squeeze(1)
        history_length = lengths[users] - (2 if split == "valid" else 1)
        target = self.corpus.items[self.corpus.offsets[users] + history_length]
        if protocol == "full":
            candidates = torch.arange(self.corpus.num_items).expand(users.numel(), -1)
            seen = seen_items(self.corpus, users, history_length, target)
            return RankingExamples(split, protocol, users, self.history(users, history_length), history_length, candidates, target, *seen)
        generator = torch.Generator().manual_seed(salt_of(seed, 0 if split == "valid" else 1))
        negatives = self.sampler.draw_distinct(users, num_negatives, generator)
        target_index = torch.randint(num_negatives + 1, (users.numel(),), generator=generator)
        columns = torch.arange(num_negatives + 1)[None, :]
        # negatives fill every column but the target's, in order
        source = (columns - (columns > target_index[:, None]).long()).clamp(max=num_negatives - 1)
        candidates = torch.where(columns == target_index[:, None], target[:, None], negatives.gather(1, source.clamp(min=0)))
        return RankingExamples(split, protocol, users, self.history(users, history_length), history_length, candidates, target_index)

    def scoring_batches(self, ranking: RankingExamples, chunk_size: int = 8192) -> Iterator[tuple[int, Batch]]:
        """Expand users x candidates into batches of at most ``chunk_size`` rows, in row-major order.

        Yields ``(start, batch)``: the batch scores ``ranking.candidates.reshape(-1)[start : start + B]``, so
        ``scores.view(-1)[start : start + B] = model(batch)`` fills a ``[U, C]`` score matrix. Labels are 1 at
        each user's target. Each row repeats its user's history (the batch format has no request sharing).
        """
        u, c = ranking.candidates.shape
        for start in range(0, u * c, chunk_size):
            flat = torch.arange(start, min(start + chunk_size, u * c))
            row, column = flat // c, flat % c
            users = ranking.users[row]
            batch = self.assemble(users, self.history(users, ranking.history_length[row]), ranking.candidates[row, column], column == ranking.target_index[row])
            yield start, batch


@dataclass
class NextItemRows:
    """Rows of a ``NextItemTable`` before their features are gathered: each row's user, history length (its target
    is the user's item at that position), candidate item and label."""

    users: torch.Tensor
    history_length: torch.Tensor
    candidates: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.users.numel()

    def __getitem__(self, rows: slice) -> "NextItemRows":
        return NextItemRows(self.users[rows], self.history_length[rows], self.candidates[rows], self.labels[rows])


class NextItemTable:
    """The training rows as an ``ExampleTable``: example ``e`` owns rows ``e * G .. e * G + G - 1``
    (``G = 1 + num_negatives``), the positive first. Negatives are drawn per ``(seed, epoch, row)``.

    A ``PlannedTable`` too: ``plan`` finds the rows (the users, targets and drawn negatives), ``assemble`` gathers
    their features; ``take`` is both. Tables whose ``assembler`` is the same (data sets of one class over one corpus
    object with one config: a time split's periods) assemble each other's rows, as one batch."""

    def __init__(self, dataset: NextItemDataset) -> None:
        self.dataset, self.spec = dataset, dataset.spec
        self.group_size = 1 + dataset.config.num_negatives
        self.assembler = (type(dataset), id(dataset.corpus), dataset.config)

    def block_sizes(self) -> list[int]:
        return [self.dataset.num_training_examples * self.group_size]

    def take(self, block: int, rows: torch.Tensor, epoch: int) -> Batch:
        return self.assemble([self.plan(block, rows, epoch)])

    def plan(self, block: int, rows: torch.Tensor, epoch: int) -> NextItemRows:
        d = self.dataset
        example, slot = rows // self.group_size, rows % self.group_size
        users, k = d.example_user[example], d.example_k[example]
        target = d.corpus.items[d.corpus.offsets[users] + k]
        candidates = target.clone()
        negative = slot > 0
        if bool(negative.any()):
            candidates[negative] = d.sampler.draw(users[negative], rows[negative], salt_of(d.config.seed, epoch))
        return NextItemRows(users, k, candidates, ~negative)

    def assemble(self, plans: list[NextItemRows]) -> Batch:
        """One batch of the rows of ``plans``, in order (rows planned by tables of this ``assembler``)."""
        if len(plans) == 1:
            users, k, candidates, labels = plans[0].users, plans[0].history_length, plans[0].candidates, plans[0].labels
        else:
            users, k, candidates, labels = (torch.cat(field) for field in zip(*((p.users, p.history_length, p.candidates, p.labels)
                                                                                 for p in plans)))
        d = self.dataset
        return d.assemble(users, d.history(users, k), candidates, labels)


class RetrievalTable:
    """Training rows carrying ``Batch.next_items`` (see the module docstring): a row per prefix
    (``queries = "last"``) or per user (``"every"``). Negatives are a pure function of
    ``(seed, epoch, target position)``, so a resumed run draws the same ones."""

    group_size = 1

    def __init__(self, dataset: NextItemDataset) -> None:
        self.dataset, self.spec = dataset, dataset.spec

    def block_sizes(self) -> list[int]:
        d = self.dataset
        return [d.sequence_users.numel() if d.config.queries == "every" else d.num_training_examples]

    def take(self, block: int, rows: torch.Tensor, epoch: int) -> Batch:
        d, c = self.dataset, self.dataset.config
        if c.queries == "every":
            users = d.sequence_users[rows]
            history_length = d.corpus.lengths()[users] - 3  # items[:n-3]; their successors end at items[n-3]
            start, kept = d.history_window(users, history_length)
            positions = jagged_index(start + 1, kept)  # where in corpus.items each query's next item sits
            query_users = torch.repeat_interleave(users, kept)
        else:
            users, history_length = d.example_user[rows], d.example_k[rows]
            positions = d.corpus.offsets[users] + history_length
            query_users = users
        positives = d.corpus.items[positions]
        negatives = None
        if c.num_negatives:
            k = c.num_negatives
            keys = (positions[:, None] * k + torch.arange(k)).reshape(-1)
            negatives = d.sampler.draw(query_users.repeat_interleave(k), keys, salt_of(c.seed, epoch)).view(-1, k)
        last_target = d.corpus.items[d.corpus.offsets[users] + history_length]
        batch = d.assemble(users, d.history(users, history_length), last_target, torch.ones(users.numel()))
        batch.next_items = NextItemTargets(every=c.queries == "every", positives=positives, negatives=negatives,
                                           loss=c.loss, catalogue=d.catalogue())
        return batch
