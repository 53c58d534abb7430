import pytest
import torch

from gem_parallel import PEAK_TFLOPS, mfu, peak_tflops, scaling_ratio


def test_configured_peak_wins_and_cpu_has_none():
    assert peak_tflops(torch.device("cpu")) is None
    assert peak_tflops(torch.device("cpu"), configured=12.5) == 12.5
    assert PEAK_TFLOPS["H200"] == 989.0


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H200", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200 NVL", 835.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("Tesla T4", None),
])
def test_a_device_gets_the_peak_of_its_own_model(name, peak):
    """The PCIe and NVL cards are not the SXM parts their names contain."""
    from gem_parallel.mfu import peak_of_device_name

    assert peak_of_device_name(name) == peak


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
