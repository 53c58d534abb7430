import pytest
import torch

from gem_parallel import PEAK_TFLOPS, mfu, peak_tflops, scaling_ratio


def test_configured_peak_wins_and_cpu_has_none():
    assert peak_tflops(torch.device("cpu")) is None
    assert peak_tflops(torch.device("cpu"), configured=12.5) == 12.5
    assert PEAK_TFLOPS["H200"] == 989.0


def test_e2e_mfu_is_local_mfu_times_scaling_ratio():
    single = 300.0  # TFLOP/s on one device
    eight = 2100.0  # TFLOP/s summed over eight devices
    local = mfu(single, 989.0)
    ratio = scaling_ratio(eight, single, 8)
    assert mfu(eight, 989.0, 8) == pytest.approx(local * ratio)
    assert ratio == pytest.approx(0.875)


def test_bad_peak_is_rejected():
    with pytest.raises(ValueError, match="peak"):
        mfu(1.0, 0.0)
