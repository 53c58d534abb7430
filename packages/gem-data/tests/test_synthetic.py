import pytest
import torch

from gem_data import SyntheticConfig, SyntheticGenerator


@pytest.fixture(scope="module")
def generator():
    return SyntheticGenerator(SyntheticConfig(seed=3))


def test_batches_are_valid_for_the_declared_spec(generator):
    for index in range(3):
        generator.batch(index, 64).validate(generator.spec)


def test_batches_are_a_pure_function_of_seed_split_and_index(generator):
    a, b = generator.batch(7, 32), SyntheticGenerator(SyntheticConfig(seed=3)).batch(7, 32)
    assert torch.equal(a.labels, b.labels) and torch.equal(a.sparse.values(), b.sparse.values())
    assert torch.equal(a.sequences["post"].timestamps, b.sequences["post"].timestamps)
    assert not torch.equal(generator.batch(8, 32).dense, a.dense)
    assert not torch.equal(generator.batch(7, 32, split="eval").dense, a.dense)


def test_events_are_in_time_order_within_each_example(generator):
    batch = generator.batch(0, 128)
    for seq in batch.sequences.values():
        offsets, times = seq.offsets(), seq.timestamps
        steps = times[1:] - times[:-1]
        boundary = torch.zeros(times.numel(), dtype=torch.bool)
        boundary[offsets[1:-1][offsets[1:-1] < times.numel()]] = True  # first event of each later example
        assert bool((steps[~boundary[1:]] >= 0).all())


def test_history_lengths_are_heavy_tailed_and_bounded():
    config = SyntheticConfig(min_events=4, max_events=256)
    lengths = SyntheticGenerator(config).batch(0, 4096).sequences["purchase"].lengths().float()
    nonzero = lengths[lengths > 0]
    assert int(lengths.max()) <= 256 and int(nonzero.min()) >= 4
    assert float((lengths == 0).float().mean()) > 0.05  # some users have no purchases at all
    # power law: the mean sits well above the median and the tail reaches far
    assert float(nonzero.mean()) > 1.5 * float(nonzero.median())
    assert float(nonzero.quantile(0.99)) > 10 * config.min_events


def test_labels_follow_the_hidden_model():
    """Examples whose history matches the candidate's cluster click more often: learning is possible."""
    generator = SyntheticGenerator(SyntheticConfig(seed=0))
    batch = generator.batch(0, 8192)
    k = generator.config.num_clusters
    ad = batch.sparse.to_dict()["ad_id"].values()
    seq = batch.sequences["purchase"]
    owner = torch.repeat_interleave(torch.arange(batch.batch_size), seq.lengths())
    match = torch.zeros(batch.batch_size).index_add_(0, owner, (seq.ids.to_dict()["purchase_ad_id"].values() % k == (ad % k)[owner]).float())
    share = match / seq.lengths().clamp(min=1)
    high, low = share > 0.3, (share < 0.05) & (seq.lengths() > 5)
    clicks = batch.labels[:, 0]
    assert float(clicks[high].mean()) > float(clicks[low].mean()) + 0.1
    assert 0.05 < float(clicks.mean()) < 0.6 and float(batch.labels[:, 1].mean()) < float(clicks.mean())


def test_surfaces_differ_in_ground_truth():
    generator = SyntheticGenerator(SyntheticConfig(num_surfaces=3))
    assert len(set(generator.history_weight.tolist())) == 3
    assert torch.unique(generator.batch(0, 512).surface).tolist() == [0, 1, 2]


def test_bad_config_and_split_are_rejected():
    with pytest.raises(ValueError, match="min_events"):
        SyntheticConfig(min_events=10, max_events=5)
    with pytest.raises(ValueError, match="split"):
        SyntheticGenerator().batch(0, 4, split="test")


def test_a_user_population_gives_user_ids_and_examples_ordered_in_time():
    from gem_data.synthetic import EVAL_AFTER_BATCHES, SECONDS_PER_BATCH

    plain = SyntheticGenerator(SyntheticConfig(seed=1))
    population = SyntheticGenerator(SyntheticConfig(seed=1, num_users=50))
    assert [f.name for f in population.spec.sparse] == [f.name for f in plain.spec.sparse] + ["user_id"]
    first, later, held_out = population.batch(0, 64), population.batch(3, 64), population.batch(0, 64, split="eval")
    for batch in (first, later, held_out):
        batch.validate(population.spec)
        assert int(batch.sparse["user_id"].values().max()) < 50
    # every history ends at its example's time: 1e6 + (batch + row / B) hours; held-out examples come after
    def newest(batch):
        return torch.stack([torch.zeros(64, dtype=torch.float64).index_reduce_(
            0, torch.repeat_interleave(torch.arange(64), s.lengths()), s.timestamps.double(), "amax", include_self=False)
            for s in batch.sequences.values()]).max(0).values
    expected = 1e6 + (3 + torch.arange(64, dtype=torch.float64) / 64) * SECONDS_PER_BATCH
    has_events = later.num_events() > 0
    torch.testing.assert_close(newest(later)[has_events], expected[has_events].float().double())
    assert float(newest(held_out).max()) >= 1e6 + EVAL_AFTER_BATCHES * SECONDS_PER_BATCH - 1
    # a user's interest cluster is fixed: in every batch, a user's events lean to that user's cluster
    for batch in (first, later, held_out):
        purchases = batch.sequences["purchase"]
        owner = batch.sparse["user_id"].values()[torch.repeat_interleave(torch.arange(64), purchases.lengths())]
        ads = purchases.ids["purchase_ad_id"].values()
        assert float((ads % 16 == population.user_cluster[owner]).float().mean()) > 0.5


def test_every_stream_runs_on_one_clock_before_the_held_out_split():
    # a mixture's second synthetic stream must not sit after the held-out split (its rows would read held-out
    # representations as earlier ones), nor at times float32 resolves to hours
    from gem_data import SyntheticStream
    from gem_data.synthetic import SECONDS_PER_BATCH

    population = SyntheticGenerator(SyntheticConfig(seed=1, num_users=50))
    first, second = SyntheticStream(population, 32).global_batch(5), SyntheticStream(population, 32, stream=1).global_batch(5)
    assert not torch.equal(first.dense, second.dense)  # other draws ...
    for batch in (first, second):  # ... in the same hour: batch 5's, where its histories end
        newest = max(float(s.timestamps.max()) for s in batch.sequences.values())
        assert 1e6 + 5 * SECONDS_PER_BATCH <= newest <= 1e6 + 6 * SECONDS_PER_BATCH
    held_out = population.batch(0, 32, split="eval")
    assert newest < min(float(s.timestamps.min()) for s in held_out.sequences.values())
    with pytest.raises(ValueError, match=r"stream must lie in \[0, 128\)"):
        population.batch(0, 4, stream=128)
    # stream 0's batch 2**24 would draw what stream 1's batch 0 draws
    with pytest.raises(ValueError, match=r"^a synthetic stream holds 16,777,216 batches: index 16777216 is past its end$"):
        population.batch(1 << 24, 4)


def test_user_propensity_gives_each_user_a_lasting_click_offset():
    # with the offset, a user's click rate over many examples follows it; drawn last, it moves no other draw
    with pytest.raises(ValueError, match="user_propensity needs num_users"):
        SyntheticConfig(user_propensity=0.5)
    with pytest.raises(ValueError, match="user_propensity must be >= 0"):
        SyntheticConfig(num_users=10, user_propensity=-1.0)
    plain = SyntheticGenerator(SyntheticConfig(seed=2, num_users=40))
    assert not plain.user_bias.any()
    biased = SyntheticGenerator(SyntheticConfig(seed=2, num_users=40, user_propensity=2.0))
    torch.testing.assert_close(biased.user_cluster, plain.user_cluster)
    a, b = plain.batch(5, 128), biased.batch(5, 128)
    assert torch.equal(a.dense, b.dense) and torch.equal(a.sparse.values(), b.sparse.values())
    for name in a.sequences:
        assert torch.equal(a.sequences[name].ids.values(), b.sequences[name].ids.values())
    assert float(biased.user_bias.std()) > 1.0
    clicks, shown = torch.zeros(40), torch.zeros(40)
    for index in range(40):
        batch = biased.batch(index, 256)
        users = batch.sparse["user_id"].values()
        clicks.index_add_(0, users, batch.labels[:, 0])
        shown.index_add_(0, users, torch.ones(256))
    rate = clicks / shown
    assert float(torch.corrcoef(torch.stack([rate, biased.user_bias]))[0, 1]) > 0.8
