"""The launch-time tuner's config choice: presets given with load_tuned, this device's shipped file, candidates;
the direct launch; planned launches; the ops launching kernels under torch.compile."""

import json
import os

import torch
from conftest import triton_on_cpu

from gem_kernels import jagged_flash_attention, layer_norm
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


# --- the direct launch of a compiled kernel ---------------------------------------------------------------------

def _triton_specialisation(arg):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    return native_specialize_impl(CUDABackend(GPUTarget("cuda", 90, 32)), arg, False, True, True)


def test_equal_specialisations_are_equal_for_triton():
    import itertools

    x = torch.zeros(256, dtype=torch.bfloat16)
    y = torch.zeros(256, dtype=torch.float32)
    args = [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, 2**31 - 16, 2**31, 2**31 + 16, 2**40 + 3, 2**62, 0.5, 1.0, True,
            False, x, x[1:], x[8:], x[16:], y, y[1:], y[4:], y[8:]]
    for a, b in itertools.product(args, repeat=2):
        if _tuning.specialisation((a,)) == _tuning.specialisation((b,)):
            assert _triton_specialisation(a) == _triton_specialisation(b), (a, b)
    assert _tuning.specialisation(("not an argument Triton takes",)) is None


class _FakeCompiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, log):
        self.log = log

    @property
    def run(self):
        return lambda *a: self.log.append(("direct",) + a)


class _FakeKernel:
    """Stands for a JITFunction with parameters (X, n, scale, A: constexpr, B: constexpr = 7)."""

    arg_names = ["X", "n", "scale", "A", "B"]

    def __init__(self):
        import inspect

        self.signature = inspect.signature(lambda X, n, scale, A, B=7: None)
        self.log = []

    def __getitem__(self, grid):
        def call(*args, **kw):
            self.log.append(("triton", grid, args, kw))
            return _FakeCompiled(self.log)
        return call


def _fast(monkeypatch):
    monkeypatch.setattr(_tuning, "interpreting", lambda: False)
    monkeypatch.setattr(_tuning, "FAST_LAUNCH", True)
    monkeypatch.setattr(_tuning, "_COMPILED", {})
    monkeypatch.setattr(_tuning.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_tuning, "_current_stream", lambda device: 1234)


def test_a_repeated_launch_calls_the_compiled_kernel_directly(monkeypatch):
    _fast(monkeypatch)
    k = _FakeKernel()
    cfg = dict(num_warps=4)
    x = torch.zeros(64)
    _tuning._launch(k, (5, 2), (x, 32, 0.5), dict(A=3), cfg, ("key",))
    _tuning._launch(k, (5, 2), (x, 48, 0.25), dict(A=3), cfg, ("key",))
    assert k.log[0] == ("triton", (5, 2), (x, 32, 0.5), dict(A=3, num_warps=4))
    # every parameter in order, the constexprs (and B's default) after the positional arguments
    assert k.log[1] == ("direct", 5, 2, 1, 1234, "function", "metadata", None, None, None, x, 48, 0.25, 3, 7)
    assert len(k.log) == 2


def test_what_changes_the_binary_goes_through_triton_again(monkeypatch):
    _fast(monkeypatch)
    k = _FakeKernel()
    cfg = dict(num_warps=4)
    x = torch.zeros(64)
    base = ((x, 32, 0.5), dict(A=3), cfg)
    _tuning._launch(k, (1,), *base, ("key",))
    for args, consts, c in [((x[1:], 32, 0.5), dict(A=3), cfg),  # alignment
                            ((x.half(), 32, 0.5), dict(A=3), cfg),  # dtype
                            ((x, 1, 0.5), dict(A=3), cfg),  # an integer equal to 1
                            ((x, 33, 0.5), dict(A=3), cfg),  # divisibility by 16
                            ((x, 2**32, 0.5), dict(A=3), cfg),  # width
                            ((x, 32, 0.5), dict(A=4), cfg),  # a constexpr
                            ((x, 32, 0.5), dict(A=3), dict(num_warps=4))]:  # another config
        before = len(k.log)
        _tuning._launch(k, (1,), args, consts, c, ("key",))
        assert k.log[before][0] == "triton", (args, consts)


def test_the_direct_launch_can_be_turned_off_and_yields_to_launch_hooks(monkeypatch):
    _fast(monkeypatch)
    k = _FakeKernel()
    cfg = dict(num_warps=4)
    x = torch.zeros(64)
    monkeypatch.setattr(_tuning, "FAST_LAUNCH", False)
    for _ in range(2):
        _tuning._launch(k, (1,), (x, 32, 0.5), dict(A=3), cfg, ("key",))
    monkeypatch.setattr(_tuning, "FAST_LAUNCH", True)
    monkeypatch.setattr(_tuning.triton.knobs.runtime.launch_enter_hook, "calls", [lambda meta: None])
    for _ in range(2):
        _tuning._launch(k, (1,), (x, 32, 0.5), dict(A=3), cfg, ("key",))
    assert [e[0] for e in k.log] == ["triton"] * 4


def test_a_planned_launch_fills_its_slots_and_then_calls_the_launcher_directly(monkeypatch):
    _fast(monkeypatch)
    monkeypatch.setattr(_tuning, "_TUNED", {})
    k = _FakeKernel()
    cfg = dict(ROWS=16, num_warps=4)
    planned = _tuning.PlannedLaunch(k, lambda c: (40 // c["ROWS"], 3), (_tuning.RowTiles(1, "ROWS"), 32, _tuning.Slot(0)),
                                    dict(A=3), ("key",), [cfg])
    x, y = torch.zeros(64, 2, 16, dtype=torch.float16), torch.zeros(40, 2, 16, dtype=torch.float16)
    planned((torch.ones(3), x))
    planned((torch.ones(5), y))
    (tag, grid, (first, n, slot), named), (tag2, *direct) = k.log
    assert (tag, grid, n, named, tag2) == ("triton", (2, 3), 32, dict(A=3, **cfg), "direct")
    assert torch.equal(slot, torch.ones(3)) and first.base is x
    assert (first.shape, first.strides, first.block_shape, first.padding) == ([64, 32], [32, 1], [16, 16], "zero")
    # the launcher: grid, stream, function, metadata, hooks, the arguments with this call's tensors, the constexprs
    desc = direct[9]
    assert direct[:9] == [2, 3, 1, 1234, "function", "metadata", None, None, None] and direct[10] == 32
    assert torch.equal(direct[11], torch.ones(5)) and direct[12:] == [3, 7]
    assert desc.base is y and (desc.shape, desc.strides, desc.block_shape, desc.padding) == (
        [40, 32], [32, 1], [16, 16], "zero")


def test_plans_are_made_once_per_key_and_dropped_with_the_picked_configs(monkeypatch):
    monkeypatch.setattr(_tuning, "_PLANS", {})
    made = []
    for key in ("a", "a", "b"):
        _tuning.plan((key,), lambda: made.append(key) or [key])
    assert made == ["a", "b"] and _tuning.plan(("a",), lambda: ["other"]) == ["a"]
    with _tuning.untuned():
        pass
    assert _tuning._PLANS == {}


@triton_on_cpu
def test_attention_plans_are_shared_by_lengths_and_split_by_alignment(monkeypatch):
    # one plan for a jagged batch's every total length (that fills little of the declared lengths: the grid over
    # the real tiles); a tensor starting off Triton's 16-byte alignment is another binary (and no tensor descriptor):
    # a plan of its own
    monkeypatch.setattr(_tuning, "_PLANS", {})
    torch.manual_seed(0)
    for lengths in ([5, 7], [3, 9], [4, 6]):
        offsets = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int64)
        q, k, v = (torch.randn(sum(lengths), 2, 16) for _ in range(3))
        jagged_flash_attention(q, k, v, offsets, max_seq_len=9, kernel="triton", validate=False)
    assert len(_tuning._PLANS) == 1
    offsets = torch.tensor([0, 5, 12], dtype=torch.int64)
    q, k, v = (torch.randn(12 * 32 + 1)[1:].view(12, 2, 16) for _ in range(3))
    got = jagged_flash_attention(q, k, v, offsets, max_seq_len=9, kernel="triton", validate=False)
    want = jagged_flash_attention(q, k, v, offsets, max_seq_len=9, kernel="pytorch")
    assert len(_tuning._PLANS) == 2
    torch.testing.assert_close(got, want)


@triton_on_cpu
def test_a_plan_holds_none_of_its_first_calls_tensors(monkeypatch):
    # a plan outlives the call that made it: holding that call's inputs would keep a batch's activations alive
    import gc
    import weakref

    from gem_kernels import gdpa

    monkeypatch.setattr(_tuning, "_PLANS", {})
    offsets, kv_offsets = torch.tensor([0, 5, 12], dtype=torch.int64), torch.tensor([0, 3, 7], dtype=torch.int64)
    q = torch.randn(12, 2, 16, dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(7, 2, 16, dtype=torch.float16, requires_grad=True) for _ in range(2))
    out = gdpa(q, k, v, offsets, kv_offsets, max_seq_len_q=8, max_seq_len_kv=4, kernel="triton", validate=False)
    out.sum().backward()
    assert len(_tuning._PLANS) == 2  # forward and backward
    refs = [weakref.ref(t) for t in (q, k, v, out)]
    del q, k, v, out
    gc.collect()
    assert all(r() is None for r in refs)


def test_tuning_launches_the_fastest_candidate_timed_from_a_graph_and_skips_failing_ones(monkeypatch):
    _on_a_gpu(monkeypatch, {}, tuning=True)
    monkeypatch.setattr(_tuning, "_TUNED", {})
    monkeypatch.setattr(_tuning, "FAST_LAUNCH", False)
    monkeypatch.setattr(_tuning.torch.cuda, "synchronize", lambda: None)
    times = {2: 0.5, 4: None, 8: 0.3, 16: 0.9}  # ms per num_warps; None: out of shared memory
    timed = []

    def graph_timed(run):
        k.log.clear()
        run()  # one launch of the candidate under test
        warps = k.log[0][3]["num_warps"]
        timed.append(warps)
        if times[warps] is None:
            raise RuntimeError("out of resources")
        return times[warps]

    monkeypatch.setattr(_tuning, "candidate_ms", graph_timed)
    k = _FakeKernel()
    x = torch.zeros(64)
    cands = [dict(num_warps=w) for w in times]
    _tuning.launch(k, lambda c: (c["num_warps"],), (x, 32, 0.5), dict(A=3), ("tuned key",), cands)
    assert timed == [2, 4, 8, 16]
    assert _tuning.tuned_configs()[("tuned key",)] == dict(num_warps=8)
    assert k.log[-1] == ("triton", (8,), (x, 32, 0.5), dict(A=3, num_warps=8))  # the launch that counts
    # the key keeps its config: no timing again
    _tuning.launch(k, lambda c: (c["num_warps"],), (x, 32, 0.5), dict(A=3), ("tuned key",), cands)
    assert timed == [2, 4, 8, 16]


def test_launches_inside_untuned_do_not_tune_and_their_picks_are_dropped_after(monkeypatch):
    monkeypatch.setenv("GEM_KERNELS_AUTOTUNE", "1")
    monkeypatch.setattr(_tuning, "_TUNED", {("before",): {"BLOCK": 1}})
    with _tuning.untuned():
        assert "GEM_KERNELS_AUTOTUNE" not in os.environ
        _tuning._TUNED[("check",)] = {"BLOCK": 2}
    assert os.environ["GEM_KERNELS_AUTOTUNE"] == "1" and _tuning._TUNED == {}


@triton_on_cpu
def test_a_compiled_caller_runs_the_triton_ops_between_its_graphs():
    # Dynamo cannot trace the launch path: each op launching Triton kernels breaks the caller's graph and runs as it
    # is; the caller's result and gradients are the eager ones
    torch.manual_seed(0)
    offsets = torch.tensor([0, 5, 12], dtype=torch.int64)
    q, k, v = (torch.randn(12, 2, 16, requires_grad=True) for _ in range(3))
    weight, bias = torch.ones(32, requires_grad=True), torch.zeros(32, requires_grad=True)

    def caller(q, k, v):
        o = jagged_flash_attention(q * 2, k, v, offsets, max_seq_len=8, kernel="triton", validate=False)
        return layer_norm(o.reshape(12, 32) + 1, weight, bias, kernel="triton").square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(caller, backend="eager", fullgraph=False)
    got, expected = compiled(q, k, v), caller(q, k, v)
    grads, wanted = (torch.autograd.grad(x, (q, k, v, weight)) for x in (got, expected))
    torch.testing.assert_close(got, expected)
    for g, w in zip(grads, wanted):
        torch.testing.assert_close(g, w)
