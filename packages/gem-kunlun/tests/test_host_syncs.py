"""The Kunlun training step's host synchronisations, counted: every read of a device value on the host
(``.item()``, ``int(t)``, ``bool(t)``) and every op whose output size depends on values (boolean indexing,
``nonzero``, ``bincount``, ``repeat_interleave`` without ``output_size``) stalls the host until the GPU catches
up. The forward and backward below may make only the ones listed in ``KNOWN``; a new one fails this test.
Runs on the CPU: the ops are the same, only their cost differs."""

import collections
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gem_kunlun import KunlunConfig, KunlunModel, multitask_loss
from gem_kunlun.testing import SPEC, random_batch

SCALAR_READS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default"}
DYNAMIC_SHAPES = {"aten.nonzero.default", "aten.masked_select.default", "aten.bincount.default", "aten.where.default",
                  "aten._unique2.default", "aten.unique_dim.default", "aten.unique_consecutive.default"}
# None is left: truncation to max_seq_len sizes its output from the host's copy of the lengths (a batch made
# on the device has none: it then reads the size back, see the last test), and experts run on slots of a
# host-known size in training with a capacity (evaluation, unbounded capacity and a capacity counted over
# several ranks without a bound on the global batch still gather each expert's examples by mask).
KNOWN: set = set()
TRUNCATION_READ = ("aten._local_scalar_dense.default", "gem_kunlun/sequence.py", "jagged_slices")


class HostSyncs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        syncs = name in SCALAR_READS or name in DYNAMIC_SHAPES
        if name == "aten.repeat_interleave.Tensor":
            syncs = kwargs.get("output_size") is None
        if name in ("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default"):
            syncs = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if syncs:
            frames = [f for f in traceback.extract_stack() if "/src/gem_" in f.filename]
            where = frames[-1] if frames else None
            self.sites[(name, where.filename.split("/src/")[-1] if where else "?", where.name if where else "?")] += 1
        return func(*args, **kwargs)


CONFIG = KunlunConfig(d_model=16, num_heads=2, num_summary_tokens=3, num_seeds=2, num_experts=3, top_k=2,
                      max_seq_len=6)  # shorter than some histories: truncation runs


def test_a_kunlun_training_step_makes_no_host_sync_beyond_the_known_ones():
    model = KunlunModel(SPEC, CONFIG)
    batch = random_batch(32, seed=1, max_events=9)
    spy = HostSyncs()
    with spy:
        out = model(batch)
        (multitask_loss(out.logits, batch.labels, torch.ones(len(SPEC.tasks))) + out.aux_loss).backward()
    sites = set(spy.sites)
    unknown = sites - KNOWN
    assert not unknown, f"new host synchronisations in the training step: {sorted(unknown)}"
    model.eval()  # evaluation keeps every assignment: experts gather theirs by mask, which the spy sees
    with HostSyncs() as spy, torch.no_grad():
        model(batch)
    assert ("aten.index.Tensor", "gem_kunlun/moe.py", "local_dispatch") in spy.sites


@pytest.mark.parametrize("max_events", [9, 3])
def test_truncation_without_host_lengths_reads_the_size_back_and_computes_the_same(monkeypatch, max_events):
    """A batch made on the device has no host copy of its lengths: truncation then reads its size from the
    device (the spy sees it), and the model computes exactly what it does from the host's copy (which, where no
    history is cut (max_events 3: at most 6 merged events), skips the truncation's gathers)."""
    from gem_kunlun.batch import EventSequence

    torch.manual_seed(0)
    model = KunlunModel(SPEC, CONFIG).eval()  # eval: no routing differences between the two passes
    assert CONFIG.max_seq_len >= 2 * 3
    batch = random_batch(32, seed=1, max_events=max_events)
    with torch.no_grad():
        from_host = model(batch).logits
        monkeypatch.setattr(EventSequence, "host_lengths", lambda self: None)
        with HostSyncs() as spy:
            from_device = model(batch).logits
    assert TRUNCATION_READ in spy.sites
    torch.testing.assert_close(from_host, from_device, rtol=0, atol=0)
