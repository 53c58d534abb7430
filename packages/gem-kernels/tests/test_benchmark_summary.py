"""The kernels benchmark's summary: a row whose compiled peer failed or was cut by the time budget says so."""

import time

from gem_kernels.ops.benchmarks.run_all import Recorder, run_compiled_peers


def test_a_peer_that_failed_or_was_cut_is_named_in_its_row(tmp_path):
    rec = Recorder(str(tmp_path / "k.json"), {})
    for case in ("long", "self", "cross"):
        rec.add("jfa", case, "gem", "fwd", 4.0)
        rec.add("jfa", case, "varlen_attn", "fwd", 5.0)

    def out_of_memory():
        raise RuntimeError("out of memory")

    def flex_self():
        rec.add("jfa", "self", "flex_attention", "fwd", 4.4)

    slow = [("long flex fwd", out_of_memory, ("jfa", "long", "flex_attention", "fwd")),
            ("self flex fwd", flex_self, ("jfa", "self", "flex_attention", "fwd"))]
    run_compiled_peers(rec, slow, deadline=time.time() + 600)
    run_compiled_peers(rec, [("cross flex fwd", flex_self, ("jfa", "cross", "flex_attention", "fwd"))], deadline=0)
    rows = {row["case"]: row for row in rec.summary()}
    assert rows["long"]["peers_missing"] == ["flex_attention"] and rows["long"]["ratio_vs_best_peer"] == 1.25
    assert rows["cross"]["peers_missing"] == ["flex_attention"]  # cut by the time budget
    assert rows["self"]["peers_missing"] == [] and rows["self"]["ratio_vs_best_peer"] == 1.1
    assert len(rec.errors) == 2
