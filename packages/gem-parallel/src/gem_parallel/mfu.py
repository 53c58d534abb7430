"""Model FLOPs utilisation: ``E2E MFU = local MFU x scaling ratio``.

Model FLOPs count dense matmuls and attention (forward x3 for training), not embedding lookups; the
denominator is the device's dense bf16 peak.
"""

from __future__ import annotations

import torch

# Dense bf16 peak TFLOP/s per device (datasheet numbers, half the sparse figures), matched by substring of the CUDA
# device name, the longest matching key first: the PCIe and NVL cards run at lower clocks than the SXM parts
# whose names ("NVIDIA H100 80GB HBM3") carry no form factor
PEAK_TFLOPS = {
    "H200 NVL": 835.0,
    "H200": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
}


def peak_of_device_name(name: str) -> float | None:
    """The table's peak for CUDA device ``name`` (None: not in the table)."""
    matches = [key for key in PEAK_TFLOPS if key in name]
    return PEAK_TFLOPS[max(matches, key=len)] if matches else None


def peak_tflops(device: torch.device, configured: float | None = None) -> float | None:
    """The configured peak, else the table entry for the CUDA device, else None (unknown, e.g. a CPU)."""
    if configured is not None:
        return configured
    if device.type == "cuda":
        return peak_of_device_name(torch.cuda.get_device_name(device))
    return None


def mfu(achieved_tflops: float, peak: float, num_devices: int = 1) -> float:
    """Achieved model TFLOP/s (summed over devices) over the combined peak of ``num_devices``."""
    if peak <= 0 or num_devices < 1:
        raise ValueError(f"peak must be > 0 and num_devices >= 1, got {peak}, {num_devices}")
    return achieved_tflops / (peak * num_devices)


def scaling_ratio(throughput_n: float, throughput_1: float, num_devices: int) -> float:
    """Throughput on ``num_devices`` over ``num_devices`` times the single-device throughput."""
    return throughput_n / (num_devices * throughput_1)
