import pytest
import torch
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from gem_kunlun.batch import EventSequence
from gem_kunlun.embedding import IDS_PER_ROW, spread_events, spread_lengths


def _events(lengths: list[int], keys=("item", "author"), vocab=50, seed=0) -> EventSequence:
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    ids = KeyedJaggedTensor(keys=list(keys), values=torch.randint(0, vocab, (n * len(keys),), generator=g),
                            lengths=torch.tensor(lengths * len(keys)), stride=len(lengths))
    return EventSequence(ids=ids, timestamps=torch.arange(n, dtype=torch.float32))


@pytest.mark.parametrize("n,rows", [(0, 3), (5, 1), (7, 3), (130, 2), (64, 64), (3, 10)])
def test_spread_lengths_cover_every_id_once_and_differ_by_at_most_one(n, rows):
    lengths = spread_lengths(n, rows, "cpu")
    assert lengths.shape == (rows,) and lengths.dtype == torch.int64
    assert int(lengths.sum()) == n
    assert int(lengths.max() - lengths.min()) <= 1


def test_spread_events_look_up_the_same_vectors_and_gradients_as_one_row_per_example():
    events = _events([300, 0, 1, 517, 44])
    rows = -(-int(events.timestamps.shape[0]) // IDS_PER_ROW)
    spread = spread_events(events, rows)
    assert spread.stride() == rows and spread.keys() == events.ids.keys()
    assert torch.equal(spread.values(), events.ids.values())
    collection = EmbeddingCollection(tables=[EmbeddingConfig(name=f"t_{k}", embedding_dim=8, num_embeddings=50,
                                                             feature_names=[k]) for k in ("item", "author")])
    by_example = collection(events.ids)
    by_spread = collection(spread)
    grads = []
    for looked_up in (by_example, by_spread):
        collection.zero_grad()
        out = looked_up["item"].values() + 2 * looked_up["author"].values()
        (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads.append([p.grad.clone() for p in collection.parameters()])
    for k in ("item", "author"):
        assert torch.equal(by_example[k].values(), by_spread[k].values())
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_event_ids_that_are_not_one_per_feature_and_event_are_refused_in_one_line():
    events = _events([3, 2])
    short = EventSequence(ids=events.ids, timestamps=events.timestamps[:4])
    with pytest.raises(ValueError, match=r"^event ids: 10 ids for 2 features \['item', 'author'\] of 4 events"):
        spread_events(short, 2)
