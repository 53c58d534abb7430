import itertools
import math

import pytest
import torch

from gem_data import MixedStream, MixingConfig, MixSource, SyntheticConfig, SyntheticGenerator, SyntheticStream
from gem_data.testing import equal_batches


def sources(batch_size=32):
    spec = dict(num_ads=2000, max_events=16)
    return {
        "feed": SyntheticStream(SyntheticGenerator(SyntheticConfig(seed=0, **spec)), batch_size),
        "video": SyntheticStream(SyntheticGenerator(SyntheticConfig(seed=1, **spec)), 48),
        "live": SyntheticStream(SyntheticGenerator(SyntheticConfig(seed=2, **spec)), 16),
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
    from gem_data import concat_batches, select_examples

    feed = concat_batches([select_examples(b, (b.source == 0).nonzero().squeeze(1)) for b in mixed])
    direct = concat_batches(list(itertools.islice(iter(sources()["feed"]), math.ceil(feed.batch_size / 32))))
    assert torch.equal(feed.dense, direct.dense[: feed.batch_size])


@pytest.mark.parametrize("granularity", ["example", "batch"])
def test_resume_continues_the_exact_sequence(granularity):
    config = MixingConfig(CONFIG.sources, batch_size=40, granularity=granularity, seed=3)
    stream = MixedStream(sources(), config)
    batches = iter(stream)
    for _ in range(7):
        next(batches)
    state = stream.state_dict()
    expected = list(itertools.islice(batches, 5))
    resumed = MixedStream(sources(), config)
    resumed.load_state_dict(state)
    got = list(itertools.islice(resumed, 5))
    assert all(equal_batches(a, b) for a, b in zip(got, expected))
    assert resumed.counts() == stream.counts()


def test_online_share_ramps_linearly():
    config = MixingConfig(CONFIG.sources, batch_size=200, online_share_start=0.0, online_share_end=0.8, ramp_steps=10)
    assert config.online_share(5) == pytest.approx(0.4) and config.online_share(50) == pytest.approx(0.8)
    p = config.probabilities(5)
    assert p.tolist() == pytest.approx([0.6 * 5 / 8, 0.6 * 3 / 8, 0.4])
    stream = MixedStream(sources(), config)
    online = [float((b.source == 2).float().mean()) for b in itertools.islice(stream, 30)]
    assert online[0] == 0.0 and abs(sum(online[20:]) / 10 - 0.8) < 0.05


def test_sources_must_share_a_spec_and_configs_are_checked():
    other = dict(sources())
    other["live"] = SyntheticStream(SyntheticGenerator(SyntheticConfig(num_ads=3000, max_events=16)), 16)
    with pytest.raises(ValueError, match="source 'live' has another FeatureSpec"):
        MixedStream(other, CONFIG)
    with pytest.raises(ValueError, match="no stream given"):
        MixedStream({"feed": sources()["feed"]}, CONFIG)
    with pytest.raises(ValueError, match="online sources"):
        MixingConfig((MixSource("a"),), online_share_start=0.1, online_share_end=0.2)
    with pytest.raises(ValueError, match="repeated"):
        MixingConfig((MixSource("a"), MixSource("a")))
