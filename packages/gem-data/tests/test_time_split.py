"""The time split: offline / online / next periods, the online stream in time order, the two evaluation splits."""

import itertools
from pathlib import Path

import pytest
import torch

from gem_data import (
    MixedStream,
    MixingConfig,
    MixSource,
    NextItemConfig,
    TableStream,
    TimeSplit,
    TimeSplitDataset,
    concat_batches,
    read_atomic,
    select_examples,
)
from gem_data.testing import equal_batches, find_repo_root, shared_data_dir, small_corpus

DATA = shared_data_dir(find_repo_root(Path(__file__)))
SPLIT = TimeSplit(0.6, 0.85)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 users rating items at interleaved times (user u's k-th rating at time 1000 * k + 7 * u)."""
    folder = tmp_path_factory.mktemp("toy") / "toy"
    folder.mkdir()
    rows = [f"{u}\t{1 + (u * 5 + 3 * k) % 60}\t{1000 * k + 7 * u}" for u in range(1, 41) for k in range(2 + u % 9)]
    (folder / "toy.inter").write_text("user_id:token\titem_id:token\ttimestamp:float\n" + "\n".join(reversed(rows)) + "\n")
    return read_atomic(folder)


def dataset(corpus, period, **config):
    return TimeSplitDataset(corpus, NextItemConfig(num_negatives=0, **config), SPLIT, period)


def target_times(data):
    return data.corpus.timestamps[data.corpus.offsets[data.example_user] + data.example_k]


def test_periods_split_events_by_target_time_and_hold_out_the_last_offline_event(corpus):
    offline, online, both = dataset(corpus, "offline"), dataset(corpus, "online"), dataset(corpus, "before_next")
    t1, t2 = offline.online_from_time, offline.next_from_time
    assert 0 < t1 < t2
    assert bool((target_times(offline) < t1).all()) and bool(((target_times(online) >= t1) & (target_times(online) < t2)).all())
    assert bool((offline.example_k >= 1).all()) and bool((online.example_k >= 1).all())
    assert both.num_training_examples == offline.num_training_examples + online.num_training_examples
    times, users = corpus.timestamps, torch.repeat_interleave(torch.arange(corpus.num_users), corpus.lengths())
    for event in offline.held_out_events.tolist():
        user = int(users[event])
        later_offline = (users == user) & (times < t1) & (torch.arange(times.numel()) > event)
        assert not bool(later_offline.any())  # each user's last offline event
    trained = set(zip(offline.example_user.tolist(), offline.example_k.tolist()))
    held = set(zip(users[offline.held_out_events].tolist(), (offline.held_out_events - corpus.offsets[users[offline.held_out_events]]).tolist()))
    assert trained.isdisjoint(held) and held


def test_the_online_stream_is_read_in_time_order(corpus):
    online = dataset(corpus, "online")
    assert bool((target_times(online)[1:] >= target_times(online)[:-1]).all())
    batch = next(iter(TableStream(online.training_table(), online.num_training_examples, shuffle=False, num_epochs=1)))
    expected = corpus.items[corpus.offsets[online.example_user] + online.example_k]
    assert torch.equal(batch.sparse["item_id"].values(), expected)
    # mixed with the offline log, the online examples keep their order
    sources = {"offline": TableStream(dataset(corpus, "offline").training_table(), 8),
               "online": TableStream(online.training_table(), 8, shuffle=False)}
    mixed = MixedStream(sources, MixingConfig((MixSource("offline"), MixSource("online", online=True)), batch_size=8,
                                              online_share_start=0.2, online_share_end=0.8, ramp_steps=5))
    batches = list(itertools.islice(mixed, 6))
    read = concat_batches([select_examples(b, (b.source == 1).nonzero().squeeze(1)) for b in batches])
    assert torch.equal(read.sparse["item_id"].values(), expected[: read.batch_size])


def test_next_period_ranks_every_later_event_from_the_history_before_it(corpus):
    data = dataset(corpus, "offline")
    ranking = data.ranking_examples("next_period", "sampled", num_negatives=5, seed=1)
    times = corpus.timestamps[corpus.offsets[ranking.users] + ranking.history_length]
    assert bool((times >= data.next_from_time).all()) and bool((ranking.history_length >= 1).all())
    assert ranking.num_users == data.next_events.numel() > 0
    assert torch.equal(ranking.targets(), corpus.items[corpus.offsets[ranking.users] + ranking.history_length])
    others = ranking.candidates[torch.arange(ranking.num_users)[:, None], torch.arange(6)[None, :]]
    negatives = others[torch.arange(6)[None, :] != ranking.target_index[:, None]].view(-1, 5)
    assert not bool(data.sampler.is_owned(ranking.users[:, None], negatives).any())
    again = data.ranking_examples("next_period", "sampled", num_negatives=5, seed=1)
    assert torch.equal(again.candidates, ranking.candidates)
    forgetting = data.ranking_examples("offline_period", "full")
    users = torch.repeat_interleave(torch.arange(corpus.num_users), corpus.lengths())
    assert torch.equal(forgetting.users, users[data.held_out_events])
    assert forgetting.candidates.shape == (forgetting.num_users, corpus.num_items)
    # full ranking leaves out each user's items before the ranked event, and the items nobody had rated by then
    row = int(forgetting.history_length.argmax())
    scores = forgetting.mask_seen(torch.zeros(1, corpus.num_items), torch.tensor([row]))
    start = int(corpus.offsets[forgetting.users[row]])
    target = int(forgetting.targets()[row])
    before = set(corpus.items[start : start + int(forgetting.history_length[row])].tolist()) - {target}
    event_time = corpus.timestamps[start + int(forgetting.history_length[row])]
    unrated = set(range(corpus.num_items)) - set(corpus.items[corpus.timestamps < event_time].tolist()) - {target}
    assert set(torch.isinf(scores[0]).nonzero().squeeze(1).tolist()) == before | unrated and before and unrated


def test_time_split_rankings_draw_negatives_among_the_items_rated_before_the_event(corpus):
    data = dataset(corpus, "offline")
    first_rated = torch.full((corpus.num_items,), float("inf"), dtype=torch.float64)
    first_rated.scatter_reduce_(0, corpus.items, corpus.timestamps.double(), reduce="amin")
    for split in ("next_period", "offline_period"):
        ranking = data.ranking_examples(split, "sampled", num_negatives=5, seed=2)
        event_time = corpus.timestamps[corpus.offsets[ranking.users] + ranking.history_length].double()
        negative = torch.arange(6)[None, :] != ranking.target_index[:, None]
        assert bool((first_rated[ranking.candidates] < event_time[:, None])[negative].all())
        negatives = ranking.candidates[negative].view(-1, 5)
        assert not bool(data.sampler.is_owned(ranking.users[:, None], negatives).any())
        assert all(len(set(row)) == 5 for row in negatives.tolist())
    with pytest.raises(ValueError, match=r"^some user has fewer than 50 items outside their sequence among the items "
                                         r"rated before the ranked event to sample from$"):
        data.ranking_examples("offline_period", "sampled", num_negatives=50)
    for split in ("valid", "test"):
        with pytest.raises(ValueError, match=rf"^a time split evaluates next_period or offline_period, not the leave-one-out "
                                             rf"'{split}': its periods train on those targets$"):
            data.ranking_examples(split)


def test_the_fewest_free_items_of_a_period_is_the_most_negatives_its_ranking_can_draw(corpus):
    """Counted among the items rated before each ranked event, not over the whole catalogue (which the trainer's
    check before training read, to fail only at evaluation)."""
    data = dataset(corpus, "offline")
    assert data.fewest_free_items("offline_period") < data.sampler.fewest_free_items()
    for split in ("next_period", "offline_period"):
        fewest = data.fewest_free_items(split)
        data.ranking_examples(split, "sampled", num_negatives=fewest)
        with pytest.raises(ValueError, match="among the items rated before the ranked event"):
            data.ranking_examples(split, "sampled", num_negatives=fewest + 1)


@pytest.mark.parametrize("seed", range(4))
def test_distinct_negatives_among_a_catalogue_take_as_many_rounds_of_draws_as_they_need(seed):
    """A user owning a third of a small catalogue: the first round's draws rarely give 18 distinct unowned items,
    and the later rounds still draw from each row's catalogue (the first ``known[i]`` items of the order)."""
    from gem_data.sequential.sampling import NegativeSampler

    sampler = NegativeSampler(40, torch.arange(10))  # user 0 owns items 0-9
    g = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.arange(10), 10 + torch.randperm(30, generator=g)])
    known = torch.tensor([30, 28, 30, 29])
    negatives = sampler.draw_distinct(torch.zeros(4, dtype=torch.int64), 18, g, among=(order, known))
    for row, k in zip(negatives.tolist(), known.tolist()):
        assert len(set(row)) == 18 and set(row) <= set(order[:k].tolist()) - set(range(10))


def test_a_validation_fold_ends_the_next_period_early_and_trains_as_its_split(corpus):
    fold = TimeSplit(SPLIT.online_from, SPLIT.next_from, 0.95)
    whole, early = (TimeSplitDataset(corpus, NextItemConfig(num_negatives=0), split, "online") for split in (SPLIT, fold))
    assert torch.equal(whole.example_user, early.example_user) and torch.equal(whole.example_k, early.example_k)
    assert torch.equal(whole.held_out_events, early.held_out_events)
    times = corpus.timestamps
    assert early.next_until_time == torch.quantile(times.double(), 0.95).item()
    kept = whole.next_events[times[whole.next_events] < early.next_until_time]
    assert torch.equal(early.next_events, kept) and 0 < kept.numel() < whole.next_events.numel()
    ranking = early.ranking_examples("next_period", "full")
    assert ranking.users.numel() == kept.numel()
    assert "next_until_day" in early.describe() and "next_until_day" not in whole.describe()


def test_a_time_split_is_checked(tmp_path):
    with pytest.raises(ValueError, match="0 < online_from < next_from < next_until <= 1"):
        TimeSplit(0.9, 0.5)
    with pytest.raises(ValueError, match="0 < online_from < next_from < next_until <= 1"):
        TimeSplit(0.5, 0.8, 0.8)
    untimed = small_corpus(tmp_path, "shop", 10, 20, False)  # a sequence file: positions, no event times
    assert not untimed.timed
    with pytest.raises(ValueError, match=r"^a time split cuts at event times, and corpus 'shop' has none"):
        TimeSplitDataset(untimed, NextItemConfig(), SPLIT, "offline")
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "plain.inter").write_text("user_id:token\titem_id:token\n1\t2\n1\t3\n2\t2\n")
    assert not read_atomic(folder).timed  # atomic files without a timestamp field


def test_movielens_time_split(tmp_path):
    path = DATA / "ml-100k"
    if not (path / "ml-100k.inter").is_file():
        pytest.skip(f"shared real data not found at {path} (expected ../shared/data beside the repository)")
    corpus = read_atomic(path)
    split = TimeSplit(0.7, 0.9)
    online = TimeSplitDataset(corpus, NextItemConfig(num_negatives=1), split, "online")
    offline = TimeSplitDataset(corpus, NextItemConfig(num_negatives=1), split, "offline")
    described = online.describe()
    assert 130 < described["online_from_day"] < described["next_from_day"] < 215
    assert 9_000 < described["next_period_events"] <= 10_000 and 600 < described["offline_held_out"] <= corpus.num_users
    assert 19_000 < online.num_training_examples <= 20_000 and 65_000 < offline.num_training_examples < 70_000
    assert bool((target_times(online)[1:] >= target_times(online)[:-1]).all())


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("epochs", [None, 3])
def test_a_time_splits_periods_are_assembled_straight_into_the_mixed_batch_as_gathered(corpus, world_size, epochs):
    """The periods' tables share one assembler: where a step is not gathered with others, the mixer plans each
    period's rows and assembles the mixed batch once; the batches are those gathered from the periods' own reads,
    to the step where a finite period runs out."""
    config = NextItemConfig(num_negatives=1, max_history=4)
    periods = {p: TimeSplitDataset(corpus, config, SPLIT, p) for p in ("offline", "online")}
    mixing = MixingConfig((MixSource("offline"), MixSource("online", online=True)), batch_size=300 // world_size,
                          online_share_start=0.2, online_share_end=0.8, ramp_steps=4, seed=1)

    def ranks():
        return [MixedStream({"offline": TableStream(periods["offline"].training_table(), 64, num_epochs=epochs),
                             "online": TableStream(periods["online"].training_table(), 64, shuffle=False)},
                            mixing, rank=r, world_size=world_size) for r in range(world_size)]

    assembled, gathered = ranks(), ranks()
    one_process = MixedStream({"offline": TableStream(periods["offline"].training_table(), 64, num_epochs=epochs),
                               "online": TableStream(periods["online"].training_table(), 64, shuffle=False)},
                              MixingConfig(**{**mixing.__dict__, "batch_size": 300}))
    assert all(s._assembler is not None for s in assembled + [one_process])
    for s in gathered:
        s._assembler = None  # the rows read and gathered from the sources' batches
    steps = 0
    for step in range(12):
        expected = [g.rank_batch(step) for g in gathered]
        got = [a.rank_batch(step) for a in assembled]
        if expected[0] is None:
            assert all(b is None for b in got + expected)
            break
        steps += 1
        for a, g in zip(got, expected):
            assert torch.equal(a.source, g.source) and equal_batches(a, g)
        assert equal_batches(concat_batches(got), one_process.global_batch(step))  # the ranks see what one process sees
    assert steps == 12 if epochs is None else 0 < steps < 12
