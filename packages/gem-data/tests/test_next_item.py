"""Next-item examples (leave-one-out, sampled negatives) and ranking-evaluation inputs."""

from pathlib import Path

import pytest
import torch

from gem_data import NextItemConfig, NextItemDataset, TableStream, read_atomic, read_sequence_text
from gem_data.testing import find_repo_root, shared_data_dir

DATA = shared_data_dir(find_repo_root(Path(__file__)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("toy")
    lines = [f"{u} " + " ".join(str(1 + (u * 7 + 3 * k) % 40) for k in range(3 + u % 6)) for u in range(1, 31)]
    (folder / "s.txt").write_text("\n".join(lines) + "\n")
    (folder / "a.json").write_text("{" + ", ".join(f'"{i}": [{i % 5}, {5 + i % 3}]' for i in range(1, 41)) + "}")
    return read_sequence_text(folder / "s.txt", folder / "a.json")


def sequence(corpus, user):
    return corpus.items[corpus.offsets[user] : corpus.offsets[user + 1]].tolist()


def test_every_training_prefix_predicts_its_next_item_from_items_before_the_last_two(corpus):
    dataset = NextItemDataset(corpus, NextItemConfig(num_negatives=0))
    batch = next(iter(TableStream(dataset.training_table(), 10_000, shuffle=False, num_epochs=1)))
    batch.validate(dataset.spec)
    history = batch.sequences["history"]
    hist_items = history.ids["history_item_id"].values().split(history.lengths().tolist())
    expected = [(u, seq[:k], seq[k]) for u in range(corpus.num_users) for seq in [sequence(corpus, u)] for k in range(1, len(seq) - 2)]
    got = list(zip(hist_items, batch.sparse["item_id"].values().tolist()))
    assert [(h, t) for _, h, t in expected] == [(h.tolist(), t) for h, t in got]
    assert bool((batch.labels == 1).all()) and dataset.num_training_examples == len(expected)
    assert history.timestamps.tolist() == [float(i) for _, h, _ in expected for i in range(len(h))]


def test_negatives_are_outside_the_users_sequence_and_fixed_per_epoch(corpus):
    dataset = NextItemDataset(corpus, NextItemConfig(num_negatives=3, seed=5))
    table = dataset.training_table()
    rows = torch.arange(table.block_sizes()[0])
    batch = table.take(0, rows, epoch=0)
    users = dataset.example_user[rows // 4]
    items = batch.sparse["item_id"].values()
    negative = rows % 4 > 0
    assert not bool(dataset.sampler.is_owned(users[negative], items[negative]).any())
    assert torch.equal(batch.labels[:, 0], (~negative).float())
    assert torch.equal(table.take(0, rows, epoch=0).sparse.values(), batch.sparse.values())
    assert not torch.equal(table.take(0, rows, epoch=1).sparse["item_id"].values(), items)
    # the candidate's attributes ride along as a bag
    bags = batch.sparse["item_attributes"]
    assert bags.lengths().tolist() == corpus.item_fields["attributes"].lengths()[items].tolist()


def test_popularity_sampler_follows_training_counts():
    from gem_data.sequential.sampling import NegativeSampler

    counts = torch.tensor([0, 1, 2, 4, 8, 16])
    sampler = NegativeSampler(6, torch.tensor([5]), "popularity", counts)  # user 0 owns item 5
    users = torch.cat([torch.zeros(20_000, dtype=torch.int64), torch.ones(20_000, dtype=torch.int64)])
    drawn = sampler.draw(users, torch.arange(40_000), salt=1)
    own = torch.bincount(drawn[:20_000], minlength=6).double() / 20_000
    other = torch.bincount(drawn[20_000:], minlength=6).double() / 20_000
    assert own[5] == 0 and other[0] == 0
    expected = counts[1:].double() / counts.sum()
    assert torch.allclose(other[1:], expected, atol=4 * (expected * (1 - expected) / 20_000).sqrt().max())
    assert torch.allclose(own[1:5], counts[1:5].double() / counts[1:5].sum(), atol=0.02)


@pytest.mark.parametrize("seed", range(4))
def test_the_owned_pairs_bitmap_answers_as_the_binary_search_over_the_sorted_keys(seed):
    from gem_data.sequential.sampling import in_bitmap, is_owned_sorted, owned_bitmap

    g = torch.Generator().manual_seed(seed)
    num_keys = int(torch.randint(1, 5_000, (1,), generator=g))
    owned = torch.unique(torch.randint(0, 40_000, (num_keys,), generator=g))  # sorted and distinct
    # keys owned, not owned, on the bitmap's last byte and past its end
    keys = torch.cat([owned[torch.randint(owned.numel(), (500,), generator=g)], torch.randint(0, 50_000, (2_000,), generator=g),
                      owned[-1:] + torch.arange(-8, 24)])
    bitmap = owned_bitmap(owned)
    assert bitmap.size == int(owned[-1]) // 8 + 1
    assert torch.equal(in_bitmap(bitmap, keys), is_owned_sorted(owned, keys))
    assert torch.equal(in_bitmap(bitmap, keys.view(-1, 1)[:, [0, 0]]), is_owned_sorted(owned, keys.view(-1, 1)[:, [0, 0]]))
    assert owned_bitmap(owned, max_bytes=bitmap.size - 1) is None and owned_bitmap(owned[:0]) is None


def test_negatives_drawn_through_the_bitmap_are_those_of_the_binary_search(corpus):
    from gem_data.sequential.sampling import NegativeSampler

    owned = corpus.owned_keys()
    fast, reference = NegativeSampler(corpus.num_items, owned), NegativeSampler(corpus.num_items, owned)
    reference._bitmap = None  # the binary search over the sorted keys
    assert fast._bitmap is not None
    users = torch.randint(int(owned[-1]) // corpus.num_items + 1, (20_000,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(fast.draw(users, torch.arange(20_000), salt=7), reference.draw(users, torch.arange(20_000), salt=7))
    candidates = torch.randint(corpus.num_items, (users.numel(), 30), generator=torch.Generator().manual_seed(1))
    assert torch.equal(fast.is_owned(users[:, None], candidates), reference.is_owned(users[:, None], candidates))


def test_sampled_ranking_holds_the_target_and_99_distinct_unseen_items(corpus):
    dataset = NextItemDataset(corpus)
    ranking = dataset.ranking_examples("test", "sampled", num_negatives=20, seed=3)
    u = ranking.num_users
    assert ranking.candidates.shape == (u, 21) and u == corpus.num_users
    targets = ranking.targets()
    assert targets.tolist() == [sequence(corpus, int(user))[-1] for user in ranking.users]
    others = ranking.candidates.clone()
    others[torch.arange(u), ranking.target_index] = -1
    for row, user in zip(others.tolist(), ranking.users.tolist()):
        negatives = [i for i in row if i >= 0]
        assert len(set(negatives)) == 20 and not set(negatives) & set(sequence(corpus, user))
    again = dataset.ranking_examples("test", "sampled", num_negatives=20, seed=3)
    assert torch.equal(again.candidates, ranking.candidates)
    assert not torch.equal(dataset.ranking_examples("test", "sampled", num_negatives=20, seed=4).candidates, ranking.candidates)
    assert len(set(ranking.target_index.tolist())) > 1  # the target is not always in the same column
    with pytest.raises(ValueError, match=r"^a sampled ranking needs num_negatives >= 1, got 0$"):
        dataset.ranking_examples("test", "sampled", num_negatives=0)


def test_validation_history_stops_before_the_second_to_last_item(corpus):
    dataset = NextItemDataset(corpus, NextItemConfig(max_history=2))
    ranking = dataset.ranking_examples("valid", "full")
    assert ranking.candidates.shape == (corpus.num_users, corpus.num_items)
    assert torch.equal(ranking.target_index, ranking.targets())
    seq = sequence(corpus, int(ranking.users[0]))
    kept = ranking.history.ids["history_item_id"].values()[: int(ranking.history.lengths()[0])].tolist()
    assert ranking.targets()[0] == seq[-2] and kept == seq[:-2][-2:]


@pytest.mark.parametrize("split", ["valid", "test"])
def test_full_ranking_leaves_out_every_item_of_the_whole_history_but_the_target(corpus, split):
    # max_history=2: the model reads two events, the protocol still leaves out the whole history
    dataset = NextItemDataset(corpus, NextItemConfig(max_history=2))
    ranking = dataset.ranking_examples(split, "full")
    rows = ranking.history_length.argsort(descending=True)[:3]  # the longest histories, beyond max_history
    scores = ranking.mask_seen(torch.randn(3, corpus.num_items), rows)
    for i, row in enumerate(rows.tolist()):
        seq = sequence(corpus, int(ranking.users[row]))
        history, target = seq[: int(ranking.history_length[row])], int(ranking.targets()[row])
        masked = set(torch.isinf(scores[i]).nonzero().squeeze(1).tolist())
        assert masked == set(history) - {target} and len(history) > 2
    # the sampled protocol's candidates are outside the sequence already: nothing to leave out
    sampled = dataset.ranking_examples(split, "sampled", num_negatives=5)
    assert sampled.seen_rows is None and torch.equal(sampled.mask_seen(torch.ones(2, 6), rows[:2]), torch.ones(2, 6))


def test_a_target_repeating_an_earlier_item_stays_rankable(tmp_path):
    (tmp_path / "s.txt").write_text("1 5 6 5 7 5\n2 1 2 3 4\n")
    corpus = read_sequence_text(tmp_path / "s.txt")
    ranking = NextItemDataset(corpus).ranking_examples("test", "full")
    scores = ranking.mask_seen(torch.zeros(2, corpus.num_items), torch.arange(2))
    target = ranking.targets()
    assert bool(torch.isfinite(scores[torch.arange(2), target]).all())
    assert int(torch.isinf(scores[0]).sum()) == 2  # user 1's history 5 6 5 7: 6 and 7 left out, 5 is the target


def test_scoring_batches_cover_users_times_candidates(corpus):
    dataset = NextItemDataset(corpus, NextItemConfig(with_user_id=True))
    ranking = dataset.ranking_examples("test", "sampled", num_negatives=9)
    scores = torch.full(ranking.candidates.shape, -1.0)
    for start, batch in dataset.scoring_batches(ranking, chunk_size=64):
        batch.validate(dataset.spec)
        scores.view(-1)[start : start + batch.batch_size] = batch.sparse["item_id"].values().float()
        assert torch.equal(batch.sparse["user_id"].values(), ranking.users[torch.arange(start, start + batch.batch_size) // 10])
    assert torch.equal(scores.long(), ranking.candidates)


def test_beauty_leave_one_out_sizes():
    if not (DATA / "beauty").exists():
        pytest.skip(f"shared real data not found at {DATA / 'beauty'}")
    corpus = read_sequence_text(DATA / "beauty" / "Beauty.txt", DATA / "beauty" / "Beauty_item2attributes.json")
    dataset = NextItemDataset(corpus, NextItemConfig(num_negatives=1))
    assert dataset.num_training_examples == 198502 - 3 * 22363  # every user trains on n-3 prefixes
    ranking = dataset.ranking_examples("test", "sampled", seed=0)
    assert ranking.candidates.shape == (22363, 100)
    assert not bool(dataset.sampler.is_owned(ranking.users[:, None], ranking.candidates).sum(1).ne(1).any())
    next(iter(TableStream(dataset.training_table(), 512))).validate(dataset.spec)


def test_ml100k_examples_carry_user_and_item_attributes():
    if not (DATA / "ml-100k").exists():
        pytest.skip(f"shared real data not found at {DATA / 'ml-100k'}")
    dataset = NextItemDataset(read_atomic(DATA / "ml-100k"), NextItemConfig(sampler="popularity", max_history=50))
    batch = next(iter(TableStream(dataset.training_table(), 256)))
    batch.validate(dataset.spec)
    assert {"user_gender", "user_occupation", "item_class"} <= set(batch.sparse.keys())
    assert int(batch.sequences["history"].lengths().max()) <= 50


def test_every_event_queries_predict_the_item_that_follows_them(corpus):
    dataset = NextItemDataset(corpus, NextItemConfig(num_negatives=2, objective="retrieval", queries="every", max_history=4, seed=3))
    table = dataset.training_table()
    users = [u for u in range(corpus.num_users) if len(sequence(corpus, u)) >= 4]
    assert table.block_sizes() == [len(users)]
    batch = table.take(0, torch.arange(len(users)), epoch=0)
    batch.validate(dataset.spec)
    history = batch.sequences["history"]
    hist_items = history.ids["history_item_id"].values().split(history.lengths().tolist())
    positives = batch.next_items.positives.split(history.lengths().tolist())
    for u, h, p in zip(users, hist_items, positives):
        train = sequence(corpus, u)[:-2]  # the last two items are validation and test
        assert h.tolist() == train[:-1][-4:]  # the newest max_history items of all but the last
        assert p.tolist() == train[1:][-4:]  # each event's successor, the last training item last
    t = batch.next_items
    assert t.every and t.loss == "binary" and t.negatives.shape == (t.num_queries, 2)
    owners = torch.repeat_interleave(torch.tensor(users), history.lengths())
    assert not bool(dataset.sampler.is_owned(owners[:, None], t.negatives).any())
    again = table.take(0, torch.arange(len(users)), epoch=0).next_items.negatives
    assert torch.equal(again, t.negatives)
    assert not torch.equal(table.take(0, torch.arange(len(users)), epoch=1).next_items.negatives, t.negatives)
    # the catalogue row of item i describes item i
    catalogue = t.catalogue
    assert catalogue.keys() == list(dataset.spec.candidate) == ["item_id", "item_attributes"]
    assert catalogue["item_id"].values().tolist() == list(range(corpus.num_items))
    assert catalogue["item_attributes"].lengths().tolist() == corpus.item_fields["attributes"].lengths().tolist()


def test_last_queries_are_the_training_prefixes_and_batches_concatenate_and_select(corpus):
    from gem_data.batch_ops import concat_batches, select_examples

    dataset = NextItemDataset(corpus, NextItemConfig(num_negatives=0, objective="retrieval", queries="last", loss="softmax"))
    table = dataset.training_table()
    assert table.block_sizes() == [dataset.num_training_examples]
    batch = table.take(0, torch.arange(dataset.num_training_examples), epoch=0)
    assert batch.next_items.negatives is None and not batch.next_items.every
    assert torch.equal(batch.next_items.positives, batch.sparse["item_id"].values())  # the row's candidate is its target
    every = NextItemDataset(corpus, NextItemConfig(objective="retrieval", queries="every")).training_table()
    a, b = every.take(0, torch.tensor([0, 1]), 0), every.take(0, torch.tensor([2, 3, 4]), 0)
    joined = concat_batches([a, b])
    assert torch.equal(joined.next_items.positives, torch.cat([a.next_items.positives, b.next_items.positives]))
    picked = select_examples(joined, torch.tensor([3, 0]))
    direct = every.take(0, torch.tensor([3, 0]), 0)
    assert torch.equal(picked.next_items.positives, direct.next_items.positives)
    assert torch.equal(picked.next_items.negatives, direct.next_items.negatives)
    with pytest.raises(ValueError, match="differ in kind"):
        concat_batches([a, batch])


def test_retrieval_options_are_checked():
    with pytest.raises(ValueError, match="binary retrieval loss"):
        NextItemConfig(num_negatives=0, objective="retrieval", loss="binary")
    with pytest.raises(ValueError, match="queries must be"):
        NextItemConfig(objective="retrieval", queries="all")


def test_hash_uniform_mixes_the_salt_as_a_one_element_tensor_would():
    """The salt's mix runs on Python integers: the same bits as the tensor mix it replaced (negatives of runs
    and checkpoints from before must not change), for salts across the 62-bit range."""
    from gem_data.sequential.sampling import _MASK32, _mix32, hash_uniform

    def on_a_tensor(keys, salt):
        salt_mix = _mix32(torch.tensor([salt & _MASK32], dtype=torch.int64)) ^ ((salt >> 32) & _MASK32)
        h = _mix32((keys & _MASK32) ^ salt_mix)
        return _mix32(h ^ ((keys >> 32) & _MASK32)).double() / 2.0**32

    g = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 2**62, (500,), generator=g)
    for salt in [0, 1, 2**31, 2**32, 2**62 - 1, *torch.randint(0, 2**62, (20,), generator=g).tolist()]:
        assert torch.equal(hash_uniform(keys, salt), on_a_tensor(keys, salt))
