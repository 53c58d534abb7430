import dataclasses

import pytest
import torch
from gem_kunlun.testing import SPEC, random_batch
from torchrec import KeyedJaggedTensor

from gem_kunlun import EventSequence, EventType, FeatureSpec, SparseFeature


def test_valid_batch_passes_validation():
    random_batch(6).validate(SPEC)


def test_lengths_and_offsets_of_event_sequence():
    batch = random_batch(5, seed=3)
    seq = batch.sequences["buy"]
    lengths = seq.lengths()
    assert lengths.shape == (5,)
    assert seq.offsets().tolist() == [0] + lengths.cumsum(0).tolist()
    assert batch.num_events().tolist() == (lengths + batch.sequences["view"].lengths()).tolist()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("dense", torch.zeros(6, 4), "batch.dense"),
        ("labels", torch.zeros(6, 3), "batch.labels"),
        ("surface", torch.full((6,), 2), "batch.surface"),
    ],
)
def test_bad_fields_are_named(field, value, message):
    batch = dataclasses.replace(random_batch(6), **{field: value})
    with pytest.raises(ValueError, match=message):
        batch.validate(SPEC)


@pytest.mark.parametrize("field, where, value, message", [
    ("dense", (1, 0), float("inf"), "batch.dense holds a non-finite value"),
    ("labels", (2, 1), float("nan"), r"batch.labels must be probabilities in \[0, 1\]"),
    ("labels", (0, 0), 3.0, r"batch.labels must be probabilities in \[0, 1\]"),
])
def test_bad_values_are_named(field, where, value, message):
    """A label outside [0, 1] or a non-finite feature would make the loss NaN without a word."""
    batch = random_batch(6)
    getattr(batch, field)[where] = value
    with pytest.raises(ValueError, match=message):
        batch.validate(SPEC)


def test_the_multitask_loss_takes_one_weight_per_task():
    from gem_kunlun import multitask_loss

    with pytest.raises(ValueError, match=r"^task_weights has shape \(1,\): one weight per task, 2 tasks$"):
        multitask_loss(torch.zeros(4, 2), torch.zeros(4, 2), torch.ones(1))


def test_out_of_range_ids_are_named():
    batch = random_batch(4)
    bad = KeyedJaggedTensor.from_lengths_sync(
        keys=["ad", "tags"], values=torch.tensor([1, 2, 3, 99]), lengths=torch.tensor([1, 1, 1, 0, 0, 0, 0, 1])
    )
    with pytest.raises(ValueError, match=r"batch.sparse\['tags'\] has ids outside \[0, 20\)"):
        dataclasses.replace(batch, sparse=bad).validate(SPEC)


def test_missing_event_type_is_named():
    batch = random_batch(4)
    with pytest.raises(ValueError, match="batch.sequences has event types"):
        dataclasses.replace(batch, sequences={"buy": batch.sequences["buy"]}).validate(SPEC)


def test_spec_rejects_duplicate_feature_names():
    with pytest.raises(ValueError, match="unique"):
        FeatureSpec(1, (SparseFeature("a", 3),), (EventType("e", (SparseFeature("a", 3),)),), ("click",))


def test_host_lengths_travel_with_the_batch_and_a_stale_copy_is_not_used():
    batch = random_batch(8, seed=3, max_events=5)
    sequence = batch.sequences["buy"]
    expected = sequence.lengths().tolist()
    moved = batch.to(torch.device("cpu")).sequences["buy"]
    assert moved.known_lengths == expected and moved.host_lengths() == expected
    # ids replaced after the copy was taken: the copy no longer matches the shapes the host knows
    other = random_batch(8, seed=4, max_events=5).sequences["buy"]
    stale = EventSequence(ids=other.ids, timestamps=other.timestamps, known_lengths=[n + 1 for n in other.lengths().tolist()])
    assert stale.host_lengths() is None


def test_sparse_counts_are_taken_on_the_host_and_travel_with_the_batch():
    # a KJT built from lengths alone has no per-key counts: moved to a GPU so, the first lookup would read them
    # back from the device
    batch = random_batch(8, seed=5)
    bare = KeyedJaggedTensor(keys=batch.sparse.keys(), values=batch.sparse.values(), lengths=batch.sparse.lengths())
    batch = dataclasses.replace(batch, sparse=bare)
    assert bare._length_per_key is None
    expected = [int(n) for n in bare.lengths().view(len(bare.keys()), -1).sum(1)]
    moved = batch.to(torch.device("cpu")).sparse
    assert moved._length_per_key == expected
    assert moved._offset_per_key == [0, *torch.tensor(expected).cumsum(0).tolist()]
    assert torch.equal(moved.values(), bare.values()) and torch.equal(moved.lengths(), bare.lengths())


def _with_times(batch, event, times):
    seq = batch.sequences[event]
    return dataclasses.replace(batch, sequences={**batch.sequences, event: dataclasses.replace(seq, timestamps=times)})


@pytest.mark.parametrize("change, message", [
    ("nan", "has NaN or infinite entries"),
    ("integer", "must be float seconds"),
    ("unordered", "must be in time order within each example"),
])
def test_bad_timestamps_are_named(change, message):
    """A NaN time made its example's prediction NaN; events out of order had truncation keep the wrong ones."""
    batch = random_batch(4, seed=1, max_events=5)
    event = next(name for name, seq in batch.sequences.items() if int(seq.lengths().max()) >= 2)
    times, lengths = batch.sequences[event].timestamps.clone(), batch.sequences[event].lengths()
    first = int(torch.nonzero(lengths >= 2)[0])  # an example with two events
    start = int(lengths[:first].sum())
    if change == "nan":
        times[start] = float("nan")
    elif change == "integer":
        times = times.long()
    else:
        times[start], times[start + 1] = float(times[start + 1]) + 1, float(times[start])
    with pytest.raises(ValueError, match=rf"batch.sequences\['{event}'\].timestamps {message}"):
        _with_times(batch, event, times).validate(SPEC)
    # a new example may start earlier than the last event of the one before (as here): only within one is it refused
    ends = batch.sequences[event].lengths().cumsum(0)
    assert any(times_[int(e)] < times_[int(e) - 1] for e, times_ in ((e, batch.sequences[event].timestamps)
                                                                      for e in ends[:-1] if 0 < int(e) < len(times)))
    batch.validate(SPEC)


def test_negative_lengths_are_named():
    batch = random_batch(3)
    sparse = batch.sparse
    lengths = sparse.lengths().clone()
    lengths[0], lengths[1] = lengths[0] + 1, lengths[1] - 1 - int(lengths[1])  # same total, one entry negative
    lengths[0] += int(batch.sparse.lengths()[1])
    bad = KeyedJaggedTensor.from_lengths_sync(keys=sparse.keys(), values=sparse.values(), lengths=lengths)
    with pytest.raises(ValueError, match=r"batch.sparse has negative lengths"):
        dataclasses.replace(batch, sparse=bad).validate(SPEC)
