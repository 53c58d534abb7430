"""The soft-label store of offline distillation: fingerprints, writing once, lookup in any row order, bad stores."""

import dataclasses
import json

import pytest
import torch

from gem_kunlun.testing import random_batch, select_example
from gem_transfer import SoftLabelError, SoftLabelStore, SoftLabelWriter, example_fingerprints


def batches(seed: int = 0, steps: int = 5, size: int = 24):
    return [random_batch(size, seed=1000 * seed + step) for step in range(steps)]


def teacher_logits(batch) -> torch.Tensor:
    """Any deterministic function of the example stands in for a teacher."""
    return torch.stack([batch.dense.sum(1), batch.labels.sum(1) - batch.dense[:, 0]], 1)[:, : batch.labels.shape[1]]


def write_store(folder, data, steps_per_part=2):
    writer = SoftLabelWriter(folder, {"teacher": {"run_dir": "t"}}, steps_per_part=steps_per_part)
    for step, batch in enumerate(data):
        writer.append(step, example_fingerprints(batch), teacher_logits(batch))
    return writer.close()


def test_fingerprints_follow_the_example_not_its_place_and_tell_examples_apart():
    batch = batches()[0]
    prints = example_fingerprints(batch)
    assert prints.unique().numel() == batch.batch_size
    for i in (0, 7, 23):  # an example alone hashes as it does inside its batch
        assert example_fingerprints(select_example(batch, i)).tolist() == [prints[i].item()]
    labels = batch.labels.clone()
    labels[4, 0] = 1 - labels[4, 0]
    differs = example_fingerprints(dataclasses.replace(batch, labels=labels)) != prints
    assert differs.tolist() == [i == 4 for i in range(batch.batch_size)]


def test_each_step_is_written_once_and_looked_up_in_any_row_order(tmp_path):
    data = batches()
    folder = write_store(tmp_path / "labels", data)
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["steps"] == 5 and meta["rows"] == 5 * 24 and [p["first_step"] for p in meta["parts"]] == [0, 2, 4]
    assert not list(tmp_path.glob("*.partial-*"))
    store = SoftLabelStore(folder)
    for step in (3, 0, 4, 1):  # out of order: parts are swapped in as needed
        batch = data[step]
        rows = torch.randperm(batch.batch_size, generator=torch.Generator().manual_seed(step))[:10]
        assert torch.equal(store.lookup(step, example_fingerprints(batch)[rows]), teacher_logits(batch)[rows])


def test_examples_a_store_does_not_hold_are_one_line_errors(tmp_path):
    data = batches()
    store = SoftLabelStore(write_store(tmp_path / "labels", data))
    other = batches(seed=1)[2]
    with pytest.raises(SoftLabelError, match=r"24 of step 2's 24 examples have no stored labels"):
        store.lookup(2, example_fingerprints(other))
    with pytest.raises(SoftLabelError, match=r"the data, its order"):
        store.lookup(2, example_fingerprints(data[3]))  # right examples, wrong step
    with pytest.raises(SoftLabelError, match=r"holds steps 0\.\.4, asked for step 5"):
        store.lookup(5, example_fingerprints(data[0]))


def test_incomplete_missing_and_damaged_stores_are_named(tmp_path):
    with pytest.raises(SoftLabelError, match="no soft-label store there"):
        SoftLabelStore(tmp_path / "nothing")
    folder = write_store(tmp_path / "labels", batches())
    with pytest.raises(SoftLabelError, match="already exists"):
        SoftLabelWriter(folder, {})
    part = (folder / "part-00001.parquet").read_bytes()
    (folder / "part-00001.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(SoftLabelError, match=r"part-00001\.parquet: unreadable soft-label part"):  # found on opening
        SoftLabelStore(folder)
    (folder / "part-00001.parquet").write_bytes(part)
    store = SoftLabelStore(folder)
    (folder / "part-00001.parquet").write_bytes(b"not parquet at all")  # damaged after it was opened: at its steps
    with pytest.raises(SoftLabelError, match=r"part-00001\.parquet: unreadable soft-label part"):
        store.lookup(2, example_fingerprints(batches()[2]))
    (folder / "meta.json").unlink()
    with pytest.raises(SoftLabelError, match="incomplete soft-label store"):
        SoftLabelStore(folder)
    # another kind of store in its place (posttrain writes a LoopFM store beside soft labels)
    (folder / "meta.json").write_text('{"format": 1, "teacher": {"step": 60}, "dim": 8}')
    with pytest.raises(SoftLabelError, match=r"meta\.json: not a soft-label store \(no width, steps, parts\); a LoopFM "
                                             r"representation store is read through loopfm\.store$"):
        SoftLabelStore(folder)


def test_a_meta_that_is_json_but_no_store_listing_is_named(tmp_path):
    folder = write_store(tmp_path / "labels", batches())
    meta = json.loads((folder / "meta.json").read_text())
    cases = [
        ([], r"not a soft-label store's meta \(a JSON object\)"),
        ({**meta, "parts": []}, r"parts must list each part's file, first_step and rows"),
        ({**meta, "parts": [{k: v for k, v in p.items() if k != "first_step"} for p in meta["parts"]]}, r"parts must list"),
        ({**meta, "parts": meta["parts"][1:]}, r"the parts' first steps \[2, 4\] do not count up from 0 within its 5 steps"),
        ({**meta, "width": 0}, r"width 0 and steps 5 must be positive integers"),
    ]
    for written, message in cases:
        (folder / "meta.json").write_text(json.dumps(written))
        with pytest.raises(SoftLabelError, match=rf"meta\.json: {message}"):
            SoftLabelStore(folder)
    # a width the parts' rows do not hold whole queries of: named at the part, not a reshape deep in a step
    (folder / "meta.json").write_text(json.dumps({**meta, "width": meta["width"] + 1}))
    store = SoftLabelStore(folder)
    with pytest.raises(SoftLabelError, match=r"part-00000\.parquet: rows whose logits are not whole queries"):
        store.lookup(0, example_fingerprints(batches()[0]))


def test_a_pass_whose_folder_another_pass_wrote_meanwhile_is_named_and_leaves_no_staging(tmp_path):
    data = batches(steps=1)
    writer = SoftLabelWriter(tmp_path / "labels", {})
    writer.append(0, example_fingerprints(data[0]), teacher_logits(data[0]))
    (tmp_path / "labels").mkdir()  # the other pass (another process), finished first
    (tmp_path / "labels" / "meta.json").write_text('{"theirs": true}')
    with pytest.raises(SoftLabelError, match=r"labels: could not be put in place \(.*\): another pass wrote it meanwhile"):
        writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["labels"]
    assert (tmp_path / "labels" / "meta.json").read_text() == '{"theirs": true}'


def test_a_pass_cut_short_leaves_no_store(tmp_path):
    data = batches(steps=3)
    writer = SoftLabelWriter(tmp_path / "labels", {})
    writer.append(0, example_fingerprints(data[0]), teacher_logits(data[0]))
    writer.abort()
    assert not (tmp_path / "labels").exists() and not list(tmp_path.iterdir())
    writer = SoftLabelWriter(tmp_path / "labels", {})
    with pytest.raises(ValueError, match="increasing order"):
        writer.append(1, example_fingerprints(data[1]), teacher_logits(data[1]))
        writer.append(1, example_fingerprints(data[1]), teacher_logits(data[1]))
