"""The launch-time tuner's config choice: presets given with load_tuned, this device's shipped file, candidates."""

import json

from gem_kernels.ops.triton import _tuning

KEY = ("norm_bwd", False, False, True, 1024, "torch.bfloat16")
CANDS = [dict(ROWS=4, num_warps=8), dict(ROWS=2, num_warps=4)]


def _on_a_gpu(monkeypatch, shipped: dict, tuning: bool = False):
    monkeypatch.setattr(_tuning, "interpreting", lambda: False)
    monkeypatch.setattr(_tuning, "autotune_enabled", lambda: tuning)
    monkeypatch.setattr(_tuning, "_SHIPPED", shipped)
    monkeypatch.setattr(_tuning, "_PRESET", {})


def test_the_shipped_config_of_a_key_is_used(monkeypatch):
    _on_a_gpu(monkeypatch, {repr(KEY): dict(ROWS=2, num_warps=4)})
    assert _tuning._preset(KEY, CANDS) == dict(ROWS=2, num_warps=4)
    assert _tuning._preset(("norm_bwd", "another key"), CANDS) is None


def test_a_stale_shipped_config_is_ignored(monkeypatch):
    # a kernel that gained or lost a launch keyword since the file was written
    _on_a_gpu(monkeypatch, {repr(KEY): dict(ROWS=2, num_warps=4, PREFETCH=True)})
    assert _tuning._preset(KEY, CANDS) is None


def test_tuning_ignores_the_shipped_file_but_not_load_tuned(monkeypatch, tmp_path):
    _on_a_gpu(monkeypatch, {repr(KEY): dict(ROWS=2, num_warps=4)}, tuning=True)
    assert _tuning._preset(KEY, CANDS) is None
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({repr(KEY): dict(ROWS=1, num_warps=4)}))
    _tuning.load_tuned(str(path))
    assert _tuning._preset(KEY, CANDS) == dict(ROWS=1, num_warps=4)


def test_device_file_names():
    assert _tuning.device_file("NVIDIA H200").name == "nvidia-h200.json"
    assert _tuning.device_file("NVIDIA H100 80GB HBM3").name == "nvidia-h100-80gb-hbm3.json"


def test_host_cdiv_and_next_power_of_2_are_tritons():
    import triton

    for n in [*range(1, 3000), 2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1]:
        assert _tuning.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 128, 1000):
            assert _tuning.cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert _tuning.cdiv(0, 16) == 0
