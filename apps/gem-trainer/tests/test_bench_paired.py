import json
import sys

import pytest

from gem_trainer import bench_paired
from gem_trainer.trainer import Trainer


def test_variants_alternate_in_rounds_each_under_its_own_switch_interval(tmp_path, monkeypatch):
    seen = []  # (trainer, switch interval) at each step
    original = Trainer.train_step

    def recording_step(self):
        seen.append((self.config.data.read_ahead_switch_ms, sys.getswitchinterval()))
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", recording_step)
    before = sys.getswitchinterval()
    out = tmp_path / "paired.json"
    result = bench_paired.main(["--variant", "reference", "--variant", "slow-switch: data.read_ahead_switch_ms=2",
                                "--override", "data.batch_size=8", "--override", "device=cpu",
                                "--rounds", "3", "--steps", "2", "--warmup", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    reference, other = result["variants"]["reference"], result["variants"]["slow-switch"]
    assert result["reference"] == "reference" and other["overrides"] == ["data.read_ahead_switch_ms=2"]
    assert reference["speedup_rounds"] == [1.0] * 3 and reference["speedup_over_reference"] == 1.0
    for row in (reference, other):
        assert len(row["step_ms_rounds"]) == 3 and all(t > 0 for t in row["step_ms_rounds"])
        assert row["examples_per_s"] == pytest.approx(8 / row["step_ms"] * 1e3, rel=1e-3)
    # every step ran under its own trainer's interval (the default's 0.2 ms, the variant's 2 ms): 1 warm-up and
    # 3 rounds of 2 steps each
    assert sorted(set(seen)) == [(0.2, pytest.approx(0.0002)), (2.0, pytest.approx(0.002))]
    assert len(seen) == 2 * (1 + 3 * 2)
    # Python keeps the interval in whole microseconds: a value read and set back may lose one
    assert sys.getswitchinterval() == pytest.approx(before, abs=2e-6)
    assert "gem_trainer.bench_paired" in result["meta"]["command"] and result["meta"]["device"] == "cpu"


@pytest.mark.parametrize("variant,message", [(": a.b=1", "give a name"), ("x: a.b", "is not section.field=value")])
def test_a_malformed_variant_is_refused(variant, message):
    with pytest.raises(SystemExit, match=message):
        bench_paired.parse_variant(variant)
