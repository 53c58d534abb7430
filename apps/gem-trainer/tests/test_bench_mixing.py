"""The mixing benchmark's reader cost: the mixture's rate, its batch time split, and the shares it read."""

from gem_data import MixingConfig, MixSource, SyntheticConfig, SyntheticGenerator, SyntheticStream
from gem_trainer.bench_mixing import measure_mixed


def test_a_mixture_is_measured_with_the_shares_it_read():
    generators = [SyntheticGenerator(SyntheticConfig(seed=s, num_ads=2000, max_events=16)) for s in range(2)]
    makers = {"feed": lambda: SyntheticStream(generators[0], 16), "video": lambda: SyntheticStream(generators[1], 16)}
    config = MixingConfig((MixSource("feed", 3.0), MixSource("video", 1.0)), batch_size=16)
    rate, ms, shares = measure_mixed("mix", makers, config, None, seconds=0.3, batch=16)
    assert rate > 0 and ms["mixed"] >= ms["source_reads"] > 0
    assert shares.keys() == {"feed", "video"} and abs(sum(shares.values()) - 1) < 1e-9
    assert 0.6 < shares["feed"] < 0.9  # drawn 3:1
