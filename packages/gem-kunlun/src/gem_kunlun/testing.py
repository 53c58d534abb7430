"""Helpers for tests of code that consumes batches: a small feature spec and random valid batches."""

import dataclasses

import torch
from torchrec import KeyedJaggedTensor

from gem_kunlun import Batch, EventSequence, EventType, FeatureSpec, JaggedFloats, RepresentationFeature, SparseFeature

SPEC = FeatureSpec(  # two surfaces, two tasks, one multi-id event type and one single-id type
    num_dense=3,
    sparse=(SparseFeature("ad", 50), SparseFeature("tags", 20)),
    events=(
        EventType("buy", (SparseFeature("buy_item", 40), SparseFeature("buy_shop", 10))),
        EventType("view", (SparseFeature("view_item", 30),)),
    ),
    tasks=("click", "conversion"),
    num_surfaces=2,
)


def random_batch(batch_size: int, seed: int = 0, max_events: int = 9, spec: FeatureSpec = SPEC) -> Batch:
    """A valid batch for ``spec``: random ids, 0..max_events events per type and example, sorted times."""
    g = torch.Generator().manual_seed(seed)
    # the first sparse feature has one id per example, every other one a bag of 0 to 3 ids
    sparse_lengths = torch.cat([torch.ones(batch_size, dtype=torch.int64)]
                               + [torch.randint(0, 4, (batch_size,), generator=g) for _ in spec.sparse[1:]])
    sparse_values = torch.cat(
        [
            torch.randint(f.num_embeddings, (int(n),), generator=g)
            for f, n in zip(spec.sparse, sparse_lengths.view(len(spec.sparse), batch_size).sum(1))
        ]
    )
    sequences = {}
    for event in spec.events:
        lengths = torch.randint(0, max_events + 1, (batch_size,), generator=g)
        total = int(lengths.sum())
        values = torch.cat([torch.randint(f.num_embeddings, (total,), generator=g) for f in event.features])
        times = torch.rand(total, generator=g) * 100
        # sorted within each example
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        times = torch.cat([times[offsets[i] : offsets[i + 1]].sort().values for i in range(batch_size)]) if total else times
        sequences[event.name] = EventSequence(
            ids=KeyedJaggedTensor.from_lengths_sync(
                keys=[f.name for f in event.features], values=values, lengths=lengths.repeat(len(event.features))
            ),
            timestamps=times,
        )
    batch = Batch(
        dense=torch.randn(batch_size, spec.num_dense, generator=g),
        sparse=KeyedJaggedTensor.from_lengths_sync(keys=[f.name for f in spec.sparse], values=sparse_values, lengths=sparse_lengths),
        sequences=sequences,
        labels=torch.randint(0, 2, (batch_size, len(spec.tasks)), generator=g).float(),
        surface=torch.randint(spec.num_surfaces, (batch_size,), generator=g),
    )
    # drawn last, so that a spec without representation features gets the batches it always got
    for feature in spec.representations:
        lengths = torch.randint(0, max_events + 1, (batch_size,), generator=g)
        batch.representations[feature.name] = JaggedFloats(torch.randn(int(lengths.sum()), feature.dim, generator=g), lengths)
    return batch


# SPEC with one LoopFM-style representation feature (4-wide vectors)
SPEC_WITH_REPRESENTATIONS = dataclasses.replace(SPEC, representations=(RepresentationFeature("loopfm", 4),))


def select_example(batch: Batch, i: int) -> Batch:
    """Example ``i`` of ``batch`` as a batch of one."""

    def one(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        parts = kjt.to_dict()
        values, lengths = [], []
        for jt in parts.values():
            o = jt.offsets()
            values.append(jt.values()[o[i] : o[i + 1]])
            lengths.append(jt.lengths()[i : i + 1])
        return KeyedJaggedTensor.from_lengths_sync(keys=list(parts), values=torch.cat(values), lengths=torch.cat(lengths))

    sequences = {}
    for name, seq in batch.sequences.items():
        o = seq.offsets()
        sequences[name] = EventSequence(ids=one(seq.ids), timestamps=seq.timestamps[o[i] : o[i + 1]])
    return Batch(
        dense=batch.dense[i : i + 1],
        sparse=one(batch.sparse),
        sequences=sequences,
        labels=batch.labels[i : i + 1],
        surface=batch.surface[i : i + 1],
        representations={name: JaggedFloats(r.values[int(r.offsets()[i]) : int(r.offsets()[i + 1])], r.lengths[i : i + 1])
                         for name, r in batch.representations.items()},
    )


def overfit(model: torch.nn.Module, batch: Batch, steps: int = 120, lr: float = 3e-3) -> tuple[float, float]:
    """Adam on a single batch for ``steps`` steps; returns the task loss before and after (a model that can
    learn drives it towards zero)."""
    from gem_kunlun.heads import multitask_loss

    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    weights = torch.ones(batch.labels.shape[1])
    losses = []
    for _ in range(steps):
        out = model(batch)
        loss = multitask_loss(out.logits, batch.labels, weights)
        losses.append(loss.item())
        optimizer.zero_grad()
        (loss + out.aux_loss).backward()
        optimizer.step()
    return losses[0], losses[-1]
