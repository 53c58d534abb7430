import dataclasses
import itertools
import math

import pytest
import torch

from gem_data import (
    BatchTable,
    MixedStream,
    MixingConfig,
    MixSource,
    ShardedStream,
    SyntheticConfig,
    SyntheticGenerator,
    SyntheticStream,
    TableStream,
    WorkerLoader,
    concat_batches,
    select_examples,
)
from gem_data import mixing
from gem_data.testing import equal_batches

SPEC = dict(num_ads=2000, max_events=16)


def sources(chunk=32):
    return {
        "feed": SyntheticStream(SyntheticGenerator(SyntheticConfig(seed=0, **SPEC)), chunk),
        "video": SyntheticStream(SyntheticGenerator(SyntheticConfig(seed=1, **SPEC)), 48),
        "live": SyntheticStream(SyntheticGenerator(SyntheticConfig(seed=2, **SPEC)), 16),
    }


CONFIG = MixingConfig((MixSource("feed", 5.0), MixSource("video", 3.0), MixSource("live", 2.0, online=True)), batch_size=64, seed=7)


def test_realised_mixture_matches_the_weights_within_binomial_bounds():
    stream = MixedStream(sources(), CONFIG)
    batches = list(itertools.islice(stream, 60))
    n = 60 * 64
    counts = stream.counts()
    assert sum(counts.values()) == n
    for source, p in zip(CONFIG.sources, CONFIG.probabilities(0).tolist()):
        assert abs(counts[source.name] - n * p) <= 4 * math.sqrt(n * p * (1 - p)), (source.name, counts)
    realised = torch.bincount(torch.cat([b.source for b in batches]), minlength=3).tolist()
    assert realised == list(counts.values())
    batches[0].validate(stream.spec)


def test_sources_are_read_in_place_in_their_own_order():
    stream = MixedStream(sources(), CONFIG)
    mixed = list(itertools.islice(stream, 10))
    feed = concat_batches([select_examples(b, (b.source == 0).nonzero().squeeze(1)) for b in mixed])
    direct = concat_batches(list(itertools.islice(iter(sources()["feed"]), math.ceil(feed.batch_size / 32))))
    assert torch.equal(feed.dense, direct.dense[: feed.batch_size])


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("granularity", ["example", "batch"])
def test_ranks_together_see_exactly_what_one_process_sees(world_size, granularity):
    config = MixingConfig(CONFIG.sources, batch_size=48, granularity=granularity, online_share_start=0.1,
                          online_share_end=0.6, ramp_steps=6, seed=3)
    whole = MixedStream(sources(), MixingConfig(**{**config.__dict__, "batch_size": 48 * world_size}))
    ranks = [MixedStream(sources(), config, rank=r, world_size=world_size) for r in range(world_size)]
    for expected, *parts in itertools.islice(zip(whole, *ranks), 8):
        assert all(p.batch_size == 48 for p in parts)
        assert equal_batches(concat_batches(parts), expected)
    assert all(r.counts() == whole.counts() for r in ranks)


def test_data_workers_give_the_same_mixture():
    # (past each worker's first gather of its next steps: a worker walks over the other's steps between its own)
    steps = 2 * mixing.GATHER_STEPS + 6
    plain = list(itertools.islice(MixedStream(sources(), CONFIG), steps))
    loader = WorkerLoader(MixedStream(sources(), CONFIG), num_workers=2)
    assert all(equal_batches(a, b) for a, b in zip(plain, itertools.islice(loader, steps), strict=True))
    reference = MixedStream(sources(), CONFIG)
    reference.position = steps
    assert loader.stream.counts() == reference.counts()


@pytest.mark.parametrize("granularity", ["example", "batch"])
def test_resume_mid_ramp_continues_the_exact_sequence(granularity):
    config = MixingConfig(CONFIG.sources, batch_size=40, granularity=granularity, online_share_start=0.0,
                          online_share_end=0.9, ramp_start=3, ramp_steps=10, seed=3)
    stream = MixedStream(sources(), config)
    batches = iter(stream)
    for _ in range(7):  # inside the ramp
        next(batches)
    state, saved = stream.state_dict(), stream.counts()
    expected = list(itertools.islice(batches, 5))
    for rank, world in ((0, 1), (1, 2)):  # the same global batches resume on another number of ranks
        resumed = MixedStream(sources(), MixingConfig(**{**config.__dict__, "batch_size": 40 // world}), rank=rank, world_size=world)
        resumed.load_state_dict(state)
        assert resumed.counts() == saved
        got = list(itertools.islice(resumed, 5))
        rows = [torch.arange(40).tensor_split(world)[rank] for _ in got]
        assert all(equal_batches(g, select_examples(e, r)) for g, e, r in zip(got, expected, rows))


def test_online_share_follows_the_schedule():
    ramp = MixingConfig(CONFIG.sources, batch_size=200, online_share_start=0.0, online_share_end=0.8, ramp_start=4, ramp_steps=10)
    assert [ramp.online_share(t) for t in (0, 4, 9, 14, 50)] == pytest.approx([0.0, 0.0, 0.4, 0.8, 0.8])
    assert ramp.probabilities(9).tolist() == pytest.approx([0.6 * 5 / 8, 0.6 * 3 / 8, 0.4])
    switch = MixingConfig(CONFIG.sources, online_share_start=0.0, online_share_end=1.0, ramp_start=5)
    assert [switch.online_share(t) for t in (4, 5)] == [0.0, 1.0]
    constant = MixingConfig(CONFIG.sources, online_share_start=0.3)
    assert {constant.online_share(t) for t in (0, 100, 10_000)} == {0.3}
    stream = MixedStream(sources(), ramp)
    online = [float((b.source == 2).float().mean()) for b in itertools.islice(stream, 30)]
    assert max(online[:5]) == 0.0 and abs(sum(online[20:]) / 10 - 0.8) < 0.05
    assert stream.shares()["live"] == pytest.approx(0.8)


def test_a_finite_source_ends_the_mixture_on_every_rank_at_the_same_step():
    generator = SyntheticGenerator(SyntheticConfig(**SPEC))
    table = BatchTable(generator.batch(0, 100), generator.spec)
    config = MixingConfig((MixSource("log", 1.0), MixSource("live", 1.0)), batch_size=20, seed=1)
    steps = []
    for rank in range(2):
        finite = {"log": TableStream(table, 16, shuffle=False, num_epochs=1), "live": SyntheticStream(generator, 16)}
        steps.append(sum(1 for _ in MixedStream(finite, config, rank=rank, world_size=2)))
    assert steps[0] == steps[1] and 0 < steps[0] < 10


def test_the_sources_a_number_of_steps_would_read_past_their_end_are_known_before_reading():
    generator = SyntheticGenerator(SyntheticConfig(**SPEC))
    table = BatchTable(generator.batch(0, 100), generator.spec)
    config = MixingConfig((MixSource("log", 1.0), MixSource("live", 1.0)), batch_size=20, seed=1)

    def mixture():
        return MixedStream({"log": TableStream(table, 16, shuffle=False, num_epochs=1), "live": SyntheticStream(generator, 16)},
                           config)
    read = sum(1 for _ in mixture())  # the steps it gives before the finite source runs out
    assert mixture().short_sources(read) == []
    [(name, needed, held, step)] = mixture().short_sources(read + 5)
    assert (name, held, step) == ("log", 100, read) and needed > 100
    assert mixture().positions(read + 5)[0] == needed


def test_a_resumed_mixture_reads_on_from_the_saved_positions_under_a_changed_share():
    """A resume may change the online share: the steps from the saved one on are drawn under the new share from the
    examples the saved run read, and the check of a source's end counts from there. It once replayed every step from 0
    under the new share (the check passed a schedule that ran the online source dry mid-run), and a query past the
    saved step dropped its positions (the next batch read online rows again)."""
    generator = SyntheticGenerator(SyntheticConfig(**SPEC))
    table = BatchTable(generator.batch(0, 150), generator.spec)

    def mixture(share):
        config = MixingConfig((MixSource("offline", 1.0), MixSource("online", 1.0, online=True)), batch_size=16,
                              online_share_start=share, seed=0)
        return MixedStream({"offline": SyntheticStream(generator, 16),
                            "online": TableStream(table, 16, shuffle=False, num_epochs=1)}, config)

    first = mixture(0.9)
    for _ in itertools.islice(first, 8):
        pass
    state = first.state_dict()
    online_read = state["examples"]["online"]
    assert online_read > 100
    resumed = mixture(0.5)
    resumed.load_state_dict(state)
    [(name, needed, held, step)] = resumed.short_sources(16)
    assert (name, held) == ("online", 150) and needed > 150 and 8 <= step < 16
    assert resumed.counts() == state["examples"]  # the query kept the saved positions
    given = list(itertools.islice(resumed, 8))
    assert len(given) == step - 8  # the stream ends where the check said it would
    assert resumed.positions(8) == tuple(state["examples"].values())
    with pytest.raises(ValueError, match=r"resumed at global batch 8; the positions of batch 3 before it are the saved run's"):
        resumed.positions(3)
    # the rows after the saved ones: the first resumed batch's online rows continue the table
    again = mixture(0.5)
    again.load_state_dict(state)
    again.short_sources(16)
    batch = next(iter(again))
    online_rows = batch.labels[batch.source == 1]
    alone = TableStream(table, 16, shuffle=False, num_epochs=1)._rows(torch.arange(online_read, online_read + len(online_rows)))
    assert len(online_rows) and torch.equal(online_rows, alone.labels)


@pytest.mark.parametrize("granularity", ["example", "batch"])
def test_data_workers_end_a_mixture_with_a_finite_source_where_one_process_ends_it(granularity):
    # each worker checks only its own steps: a later step that draws nothing from the spent source must end it too
    generator = SyntheticGenerator(SyntheticConfig(**SPEC))
    rows = 40 if granularity == "example" else 100
    table = BatchTable(generator.batch(0, rows), generator.spec)
    batch_size = 4 if granularity == "example" else 20  # small batches: some steps draw nothing from one source
    config = MixingConfig((MixSource("log", 1.0), MixSource("live", 3.0 if granularity == "example" else 1.0)),
                          batch_size=batch_size, granularity=granularity, seed=0 if granularity == "example" else 3)

    def mixture():
        return MixedStream({"log": TableStream(table, 16, shuffle=False, num_epochs=1), "live": SyntheticStream(generator, 16)},
                           config)

    plain = list(mixture())
    loader = WorkerLoader(mixture(), num_workers=2)
    got = list(itertools.islice(loader, len(plain) + 10))
    assert len(got) == len(plain) and all(equal_batches(a, b) for a, b in zip(got, plain))
    assert loader.stream.counts()["log"] <= rows  # the state saved counts no example the source does not hold


def test_sources_must_share_a_spec_and_configs_are_checked():
    other = dict(sources())
    other["live"] = SyntheticStream(SyntheticGenerator(SyntheticConfig(num_ads=3000, max_events=16)), 16)
    with pytest.raises(ValueError, match="source 'live' has another FeatureSpec"):
        MixedStream(other, CONFIG)
    with pytest.raises(ValueError, match="no stream given"):
        MixedStream({"feed": sources()["feed"]}, CONFIG)
    sharded = dict(sources())
    sharded["feed"] = SyntheticStream(SyntheticGenerator(SyntheticConfig(**SPEC)), 16, rank=0, world_size=2)
    with pytest.raises(ValueError, match="whole ShardedStream"):
        MixedStream(sharded, CONFIG)
    with pytest.raises(ValueError, match="online sources"):
        MixingConfig((MixSource("a"),), online_share_start=0.1, online_share_end=0.2)
    with pytest.raises(ValueError, match="needs online_share_start"):
        MixingConfig((MixSource("a"), MixSource("b", online=True)), online_share_end=0.2)
    with pytest.raises(ValueError, match="repeated"):
        MixingConfig((MixSource("a"), MixSource("a")))
    with pytest.raises(ValueError, match=r"weights must be finite and >= 0 with a positive sum, got \[nan, 1.0\]"):
        MixingConfig((MixSource("a", math.nan), MixSource("b")))
    with pytest.raises(ValueError, match=r"streams \['extra'\] are not among the mixture's sources"):
        MixedStream({**sources(), "extra": sources()["feed"]}, CONFIG)
    with pytest.raises(ValueError, match="not a mixture's"):
        MixedStream(sources(), CONFIG).load_state_dict({"position": 3, "global_batch_size": 64})
    two = (MixSource("a"), MixSource("b", online=True))
    for field, value in (("ramp_start", math.nan), ("ramp_steps", -1), ("batch_size", 2.5), ("batch_size", 0)):
        with pytest.raises(ValueError, match=rf"MixingConfig.{field} must be an integer >= [01], got {value}"):
            MixingConfig(two, online_share_start=0.1, online_share_end=0.5, **{field: value})
    with pytest.raises(ValueError, match=r"ramp_start \(5\) and ramp_steps \(10\) schedule a move to online_share_end, which is not set"):
        MixingConfig(two, online_share_start=0.1, ramp_start=5, ramp_steps=10)


def test_large_seeds_seed_the_draws_and_the_tables_order():
    """A run seed such as a date makes the derived generator seeds pass 64 bits: they are taken modulo 2**64 (what a
    generator holds), and every seed that fitted draws what it drew before."""
    config = dataclasses.replace(CONFIG, seed=20240101 * 10**6)
    batch = next(iter(MixedStream(sources(), config)))
    assert batch.batch_size == CONFIG.batch_size
    small = MixedStream(sources(), dataclasses.replace(CONFIG, seed=3))
    generator = torch.Generator().manual_seed(3 * 1_000_003 + 5)
    probabilities = CONFIG.probabilities(5)
    drawn = torch.multinomial(probabilities, small.global_batch_size, replacement=True, generator=generator)
    assert small.composition(5) == tuple(torch.bincount(drawn, minlength=len(CONFIG.sources)).tolist())
    generator = SyntheticGenerator(SyntheticConfig(**SPEC))
    table = BatchTable(generator.batch(0, 40), generator.spec)
    assert TableStream(table, 8, seed=20240101).global_batch(0).batch_size == 8


class ShortStream(ShardedStream):
    """A stream the mixer cannot size without reading: three global batches of a synthetic generator."""

    def __init__(self, generator, batch_size):
        super().__init__(batch_size)
        self.generator = generator

    @property
    def spec(self):
        return self.generator.spec

    def global_batch(self, index):
        return self.generator.batch(index, self.global_batch_size) if index < 3 else None


def test_a_source_of_unknown_length_is_probed_and_ends_the_mixture_on_every_rank():
    generator = SyntheticGenerator(SyntheticConfig(**SPEC))
    config = MixingConfig((MixSource("short", 1.0), MixSource("live", 1.0)), batch_size=10, seed=2)
    steps = [sum(1 for _ in MixedStream({"short": ShortStream(generator, 16), "live": SyntheticStream(generator, 16)},
                                        config, rank=rank, world_size=2)) for rank in range(2)]
    whole = MixedStream({"short": ShortStream(generator, 16), "live": SyntheticStream(generator, 16)},
                        MixingConfig(config.sources, batch_size=20, seed=2))
    assert steps[0] == steps[1] == sum(1 for _ in whole) > 0
    assert whole.counts()["short"] <= 48


@pytest.mark.parametrize("batch_size", [7, 32, 64, 200, 300])
@pytest.mark.parametrize("granularity", ["example", "batch"])
def test_batches_gathered_several_at_once_are_the_batches_gathered_one_by_one(monkeypatch, batch_size, granularity):
    """(At 32 whole batches, the feed's steps are its batches taken whole, handed out without a copy, between
    steps of the other sources' rows joined together.)"""
    config = MixingConfig(CONFIG.sources, batch_size=batch_size, granularity=granularity, online_share_start=0.1,
                          online_share_end=0.6, ramp_steps=6, seed=5)
    together = MixedStream(sources(), config)
    assert together._steps_per_gather == (mixing.GATHER_STEPS if batch_size <= mixing.GATHER_MAX_ROWS else 1)
    monkeypatch.setattr(mixing, "GATHER_MAX_ROWS", 0)  # one step at a time: the reference
    one_by_one = MixedStream(sources(), config)
    assert one_by_one._steps_per_gather == 1
    for a, b in itertools.islice(zip(together, one_by_one), 40):
        assert equal_batches(a, b)
    assert together.counts() == one_by_one.counts()
    # random access and asking twice for a batch give it again
    for index in (3, 3, 1, 39, 2):
        assert equal_batches(together.global_batch(index), one_by_one.global_batch(index))


def test_a_finite_source_ends_batches_gathered_several_at_once_where_it_ends_them_one_by_one(monkeypatch):
    generator = SyntheticGenerator(SyntheticConfig(**SPEC))
    table = BatchTable(generator.batch(0, 100), generator.spec)
    config = MixingConfig((MixSource("log", 1.0), MixSource("live", 1.0)), batch_size=20, seed=1)

    def mixture():
        return MixedStream({"log": TableStream(table, 16, shuffle=False, num_epochs=1), "live": SyntheticStream(generator, 16)}, config)

    together = list(mixture())
    monkeypatch.setattr(mixing, "GATHER_MAX_ROWS", 0)
    one_by_one = list(mixture())
    assert 0 < len(together) == len(one_by_one) < 20
    assert all(equal_batches(a, b) for a, b in zip(together, one_by_one))


def test_reading_through_data_workers_leaves_the_global_random_state_alone():
    # a DataLoader iterator draws its workers' seed from the global generator unless given its own: a resumed run
    # would then draw other dropout masks than the run it continues
    loader = WorkerLoader(MixedStream(sources(), CONFIG), num_workers=2)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    next(iter(loader))
    assert torch.equal(torch.get_rng_state(), before)
