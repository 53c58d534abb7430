"""The model's input type: one batch of jagged recommendation examples.

Readers in gem-data produce it; models in gem-kunlun consume it. Sparse ids travel as torchrec
KeyedJaggedTensors; event sequences are jagged (values + offsets over the batch), never padded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torchrec import KeyedJaggedTensor

from gem_kunlun.features import FeatureSpec
from gem_kunlun.sequence import lengths_to_offsets


def with_host_counts(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """``kjt``, its ids per key counted while it is on the host (``to`` and ``pin_memory`` carry the counts).

    NOTE: a KJT moved to a GPU without them is counted there at its first lookup (TorchRec's split reads
    ``length_per_key`` back to the host): a copy that waits for everything queued on the GPU, which then idles
    while the host launches the step's first kernels.
    """
    if kjt.device().type == "cpu":
        kjt.length_per_key()
        kjt.offset_per_key()
    return kjt


@dataclass
class EventSequence:
    """The events of one type for every example of a batch, in time order within each example.

    ``ids`` has one key per id feature of the event type; all keys share the same lengths (events per
    example) and carry exactly one id per event. ``timestamps`` is ``[T]`` (seconds, float).
    """

    ids: KeyedJaggedTensor
    timestamps: torch.Tensor
    # the lengths as host ints, taken while the sequence was on the host and kept by ``to``: see host_lengths
    known_lengths: list[int] | None = field(default=None, compare=False, repr=False)

    def lengths(self) -> torch.Tensor:
        """Events per example, ``[B]`` int64."""
        stride = self.ids.stride()
        return self.ids.lengths()[:stride]

    def host_lengths(self) -> list[int] | None:
        """Events per example as host ints where known without reading the device: the sequence is on the
        host, or came from there by ``to`` / ``pin_memory``; None otherwise. A model sizes its jagged outputs
        from them instead of reading sizes back from the GPU, which would wait for its whole queue."""
        if self.known_lengths is None and self.timestamps.device.type == "cpu":
            self.known_lengths = self.lengths().tolist()
        known = self.known_lengths
        # a stale copy (the ids replaced after it was taken) no longer matches the host-known shapes
        if known is None or len(known) != self.ids.stride() or sum(known) != self.timestamps.shape[0]:
            return None
        return known

    def offsets(self) -> torch.Tensor:
        """``[B+1]`` int64 offsets into the event axis."""
        return lengths_to_offsets(self.lengths())

    def to(self, device: torch.device, non_blocking: bool = False) -> "EventSequence":
        return EventSequence(
            ids=self.ids.to(device, non_blocking=non_blocking),
            timestamps=self.timestamps.to(device, non_blocking=non_blocking),
            known_lengths=self.host_lengths(),
        )

    def pin_memory(self) -> "EventSequence":
        # the host lengths are taken here, on the reader's thread, rather than by the training step's `to`
        return EventSequence(ids=self.ids.pin_memory(), timestamps=self.timestamps.pin_memory(),
                             known_lengths=self.host_lengths())


@dataclass
class JaggedFloats:
    """A float-valued jagged feature: per example a sequence of ``d``-wide vectors, oldest first.

    ``values`` is ``[T, d]`` float32 (every example's vectors in batch order), ``lengths`` ``[B]`` int64
    (vectors per example, zero allowed). LoopFM's representation sequences travel in this form.
    """

    values: torch.Tensor
    lengths: torch.Tensor

    def offsets(self) -> torch.Tensor:
        """``[B+1]`` int64 offsets into ``values``."""
        return lengths_to_offsets(self.lengths)

    def to(self, device: torch.device, non_blocking: bool = False) -> "JaggedFloats":
        return JaggedFloats(values=self.values.to(device, non_blocking=non_blocking),
                            lengths=self.lengths.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "JaggedFloats":
        return JaggedFloats(values=self.values.pin_memory(), lengths=self.lengths.pin_memory())


def check_item_ids(where: str, ids: torch.Tensor, num_items: int | None = None) -> None:
    """A one-line error naming ``where`` for item ids below 0, or at or above ``num_items`` where given: a -1 (a
    common padding of ragged candidate lists) would index the last row of an item table without a word."""
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (num_items is not None and hi >= num_items):
        bound = "" if num_items is None else f" of [0, {num_items})"
        raise ValueError(f"{where} has item ids outside the catalogue{bound}: from {lo} to {hi}")


@dataclass
class NextItemTargets:
    """Retrieval training: each query of a batch scored against items, the true next item among them.

    - ``every``: False, one query per example (the state after its whole history, ``N = B``); True, one
      query per event of the history (the state right after that event, ``N = T`` events in batch order),
      which only a causal model can answer.
    - ``positives [N]``: the item that came next after each query.
    - ``negatives [N, K]``: sampled items each query is also scored against; None: every query is scored
      against the whole catalogue (``logits [N, num_items]``, a softmax over all items).
    - ``loss``: ``"binary"`` (the positive against each negative, as SASRec trains) or ``"softmax"``
      (cross-entropy of the positive among the scored items).
    - ``catalogue``: the candidate-side features of every item, row ``i`` for item ``i`` (the keys of
      ``FeatureSpec.candidate``), for models whose item side reads more than the id; the same object in
      every batch of a data set.
    """

    every: bool
    positives: torch.Tensor
    negatives: torch.Tensor | None
    loss: str
    catalogue: KeyedJaggedTensor | None = None

    def __post_init__(self) -> None:
        if self.loss not in ("binary", "softmax"):
            raise ValueError(f"NextItemTargets.loss must be 'binary' or 'softmax', got {self.loss!r}")
        if self.loss == "binary" and self.negatives is None:
            raise ValueError("NextItemTargets: the binary loss needs sampled negatives")
        if self.negatives is not None and (self.negatives.dim() != 2 or self.negatives.shape[0] != self.positives.shape[0]):
            raise ValueError(f"NextItemTargets.negatives must be [N, K] with N = {self.positives.shape[0]} positives, "
                             f"got {tuple(self.negatives.shape)}")
        # NOTE: ids on the host only (as the data pipeline builds them): a device tensor would be read back every step
        if self.positives.device.type == "cpu":
            num_items = None if self.catalogue is None else self.catalogue.stride()
            check_item_ids("batch.next_items.positives", self.positives, num_items)
            if self.negatives is not None:
                check_item_ids("batch.next_items.negatives", self.negatives, num_items)

    @property
    def num_queries(self) -> int:
        return self.positives.shape[0]

    def scored_items(self) -> torch.Tensor | None:
        """``[N, 1 + K]`` the items each query is scored against, its positive in column 0; None for the
        whole catalogue."""
        return None if self.negatives is None else torch.cat([self.positives[:, None], self.negatives], 1)

    def to(self, device: torch.device, non_blocking: bool = False) -> "NextItemTargets":
        return NextItemTargets(
            every=self.every,
            positives=self.positives.to(device, non_blocking=non_blocking),
            negatives=None if self.negatives is None else self.negatives.to(device, non_blocking=non_blocking),
            loss=self.loss,
            catalogue=None if self.catalogue is None else catalogue_on(self.catalogue, device, non_blocking),
        )

    def pin_memory(self) -> "NextItemTargets":
        return NextItemTargets(
            every=self.every,
            positives=self.positives.pin_memory(),
            negatives=None if self.negatives is None else self.negatives.pin_memory(),
            loss=self.loss,
            # NOTE: the catalogue is one object shared by every batch: pinning would copy it per batch
            catalogue=self.catalogue,
        )


# NOTE: a catalogue is one object per data set, shared by every batch: it goes to each device once, rather than
# with every batch (from pageable memory, a copy that also waits for the GPU to finish its queued work)
_catalogue_copies: dict[tuple[int, str], tuple[KeyedJaggedTensor, KeyedJaggedTensor]] = {}


def catalogue_on(catalogue: KeyedJaggedTensor, device: torch.device, non_blocking: bool = False) -> KeyedJaggedTensor:
    """``catalogue``'s copy on ``device``, made at its first request and the same object at every later one."""
    key = (id(catalogue), str(device))
    cached = _catalogue_copies.get(key)
    if cached is None or cached[0] is not catalogue:  # the source is held, so its id is never reused meanwhile
        cached = _catalogue_copies[key] = (catalogue, catalogue.to(device, non_blocking=non_blocking))
    return cached[1]


@dataclass
class Batch:
    """A batch of ``B`` examples.

    - ``dense``: ``[B, num_dense]`` float32 non-sequence dense features.
    - ``sparse``: KeyedJaggedTensor of non-sequence id features (several ids per example are pooled).
    - ``sequences``: event type name -> its jagged EventSequence.
    - ``labels``: ``[B, num_tasks]`` float32 in {0, 1}.
    - ``surface``: ``[B]`` int64 surface (domain) of each example.
    - ``next_items``: retrieval training targets (see ``NextItemTargets``); None for pointwise examples,
      which ``labels`` describe.
    - ``representations``: feature name -> its float vector sequences (``JaggedFloats``), one key per
      ``FeatureSpec.representations`` entry; empty for data without them.
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    sequences: dict[str, EventSequence]
    labels: torch.Tensor
    surface: torch.Tensor
    source: torch.Tensor | None = field(default=None)
    next_items: NextItemTargets | None = field(default=None)
    representations: dict[str, JaggedFloats] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.dense.shape[0]

    def num_events(self) -> torch.Tensor:
        """Total events per example over all event types, ``[B]`` int64."""
        total = torch.zeros(self.batch_size, dtype=torch.int64, device=self.dense.device)
        for seq in self.sequences.values():
            total = total + seq.lengths()
        return total

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=with_host_counts(self.sparse).to(device, non_blocking=non_blocking),
            sequences={k: v.to(device, non_blocking) for k, v in self.sequences.items()},
            labels=self.labels.to(device, non_blocking=non_blocking),
            surface=self.surface.to(device, non_blocking=non_blocking),
            source=None if self.source is None else self.source.to(device, non_blocking=non_blocking),
            next_items=None if self.next_items is None else self.next_items.to(device, non_blocking),
            representations={k: v.to(device, non_blocking) for k, v in self.representations.items()},
        )

    def count_on_host(self) -> "Batch":
        """This batch, with the host-side facts that ``to`` carries to a device taken now, in place (the sparse
        ids per key, each event sequence's host lengths): a copy made from it later (packed, pinned, moved)
        carries them, and whoever makes that copy need not count."""
        with_host_counts(self.sparse)
        for sequence in self.sequences.values():
            sequence.host_lengths()
        return self

    def pin_memory(self) -> "Batch":
        """A copy in page-locked host memory, from which ``to(cuda, non_blocking=True)`` does not wait for the
        GPU (torch's DataLoader calls this when asked to pin)."""
        return Batch(
            dense=self.dense.pin_memory(),
            sparse=with_host_counts(self.sparse).pin_memory(),
            sequences={k: v.pin_memory() for k, v in self.sequences.items()},
            labels=self.labels.pin_memory(),
            surface=self.surface.pin_memory(),
            source=None if self.source is None else self.source.pin_memory(),
            next_items=None if self.next_items is None else self.next_items.pin_memory(),
            representations={k: v.pin_memory() for k, v in self.representations.items()},
        )

    def validate(self, spec: FeatureSpec) -> None:
        """Check shapes, keys and id ranges against ``spec``; raise ValueError naming the bad field."""
        b = self.batch_size
        if self.dense.shape != (b, spec.num_dense):
            raise ValueError(f"batch.dense has shape {tuple(self.dense.shape)}, expected ({b}, {spec.num_dense})")
        if self.labels.shape != (b, len(spec.tasks)):
            raise ValueError(f"batch.labels has shape {tuple(self.labels.shape)}, expected ({b}, {len(spec.tasks)})")
        if self.surface.shape != (b,):
            raise ValueError(f"batch.surface has shape {tuple(self.surface.shape)}, expected ({b},)")
        if b and not bool(torch.isfinite(self.dense).all()):
            raise ValueError("batch.dense holds a non-finite value")
        if b and not bool(((self.labels >= 0) & (self.labels <= 1)).all()):  # NaN fails too
            raise ValueError("batch.labels must be probabilities in [0, 1] (click / conversion labels: 0 or 1)")
        if b and (int(self.surface.min()) < 0 or int(self.surface.max()) >= spec.num_surfaces):
            raise ValueError(f"batch.surface has values outside [0, {spec.num_surfaces})")
        _check_kjt("batch.sparse", self.sparse, spec.sparse, b)
        expected = {e.name for e in spec.events}
        if set(self.sequences) != expected:
            raise ValueError(f"batch.sequences has event types {sorted(self.sequences)}, expected {sorted(expected)}")
        for event in spec.events:
            seq = self.sequences[event.name]
            _check_kjt(f"batch.sequences[{event.name!r}].ids", seq.ids, event.features, b)
            lengths = seq.ids.lengths().view(len(event.features), b)
            if not bool((lengths == lengths[0]).all()):
                raise ValueError(f"batch.sequences[{event.name!r}]: every id feature must have one id per event")
            if seq.timestamps.shape != (int(lengths[0].sum()),):
                raise ValueError(f"batch.sequences[{event.name!r}].timestamps must have one entry per event")
            _check_timestamps(f"batch.sequences[{event.name!r}].timestamps", seq.timestamps, lengths[0])
        _check_representations(self.representations, spec, b)


def _check_representations(representations: dict[str, JaggedFloats], spec: FeatureSpec, batch_size: int) -> None:
    expected = [r.name for r in spec.representations]
    if sorted(representations) != sorted(expected):
        raise ValueError(f"batch.representations has features {sorted(representations)}, expected {sorted(expected)}")
    for feature in spec.representations:
        where, jagged = f"batch.representations[{feature.name!r}]", representations[feature.name]
        values, lengths = jagged.values, jagged.lengths
        if lengths.shape != (batch_size,) or lengths.dtype != torch.int64:
            raise ValueError(f"{where}.lengths must be int64 of shape ({batch_size},), got {lengths.dtype} {tuple(lengths.shape)}")
        if batch_size and int(lengths.min()) < 0:
            raise ValueError(f"{where}.lengths has negative entries")
        total = int(lengths.sum())
        if values.shape != (total, feature.dim) or not values.is_floating_point():
            raise ValueError(f"{where}.values must be float of shape ({total}, {feature.dim}) (lengths' sum x dim), "
                             f"got {values.dtype} {tuple(values.shape)}")
        if values.numel() and not bool(torch.isfinite(values).all()):
            raise ValueError(f"{where}.values has NaN or infinite entries")


def _check_timestamps(where: str, times: torch.Tensor, lengths: torch.Tensor) -> None:
    """Float seconds, finite, in time order within each example (its events as ``EventSequence`` holds them): a NaN
    made the example's prediction NaN, events out of order had truncation keep the wrong ones."""
    if not times.is_floating_point():
        raise ValueError(f"{where} must be float seconds, got {times.dtype}")
    if times.numel() and not bool(torch.isfinite(times).all()):
        raise ValueError(f"{where} has NaN or infinite entries")
    if times.numel() > 1:
        earlier = times[1:] < times[:-1]  # event i + 1 before event i
        starts = torch.cumsum(lengths, 0)[:-1] - 1  # each example's last event but the last example's
        earlier[starts[(starts >= 0) & (starts < earlier.numel())]] = False  # the next example may start earlier
        if bool(earlier.any()):
            raise ValueError(f"{where} must be in time order within each example")


def _check_kjt(where: str, kjt: KeyedJaggedTensor, features: tuple, batch_size: int) -> None:
    keys = [f.name for f in features]
    if list(kjt.keys()) != keys:
        raise ValueError(f"{where} has keys {kjt.keys()}, expected {keys}")
    if keys and kjt.stride() != batch_size:
        raise ValueError(f"{where} has stride {kjt.stride()}, expected batch size {batch_size}")
    if batch_size == 0:  # (a rank's empty share of a short last batch; torchrec cannot split it by key)
        if kjt.values().numel():
            raise ValueError(f"{where} holds ids for no examples")
        return
    if kjt.lengths().numel() and int(kjt.lengths().min()) < 0:
        raise ValueError(f"{where} has negative lengths")
    for feature, jt in zip(features, kjt.to_dict().values()):
        values = jt.values()
        if values.numel() and (int(values.min()) < 0 or int(values.max()) >= feature.num_embeddings):
            raise ValueError(f"{where}[{feature.name!r}] has ids outside [0, {feature.num_embeddings})")

