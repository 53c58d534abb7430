"""The stores list a file only once its bytes and its name are on disk: the order of syncs and renames, recorded."""

import os

import torch

from gem_kunlun.testing import random_batch
from gem_transfer import RepresentationWriter, SoftLabelWriter, durable, example_fingerprints


def recorded(monkeypatch) -> list[tuple[str, str]]:
    """Every fsync (the synced path) and rename (the new name) that gem_transfer's stores make, in order."""
    events = []
    fsync, replace, rename = os.fsync, os.replace, os.rename

    def synced(descriptor):
        events.append(("sync", os.readlink(f"/proc/self/fd/{descriptor}")))
        fsync(descriptor)

    def replaced(source, target):
        events.append(("name", str(target)))
        replace(source, target)

    def renamed(source, target):
        events.append(("name", str(target)))
        rename(source, target)

    monkeypatch.setattr(durable.os, "fsync", synced)
    monkeypatch.setattr(durable.os, "replace", replaced)
    monkeypatch.setattr(os, "rename", renamed)
    return events


def test_a_representation_part_is_on_disk_before_the_progress_that_lists_it(tmp_path, monkeypatch):
    events = recorded(monkeypatch)
    writer = RepresentationWriter(tmp_path / "store", {"dim": 3}, steps_per_part=1)
    for step in range(2):
        writer.append(step, torch.arange(4), torch.arange(4).double() + step, torch.zeros(4, 3))
    writer.close()
    folder = str((tmp_path / "store").resolve())
    for part in ("part-00000.parquet", "part-00001.parquet"):
        named = events.index(("name", str(tmp_path / "store" / part)))
        assert events[named - 1] == ("sync", f"{folder}/{part}.tmp")  # its bytes, then its name
        assert events[named + 1] == ("sync", folder)  # ... on disk
        listed = next(i for i, e in enumerate(events) if i > named and e == ("name", str(tmp_path / "store" / "progress.json")))
        assert listed > named + 1


def test_a_soft_label_stores_parts_and_meta_are_on_disk_before_its_name(tmp_path, monkeypatch):
    events = recorded(monkeypatch)
    writer = SoftLabelWriter(tmp_path / "labels", {}, steps_per_part=1)
    for step in range(2):
        batch = random_batch(8, seed=step)
        writer.append(step, example_fingerprints(batch), batch.labels.float())
    writer.close()
    named = events.index(("name", str(tmp_path / "labels")))
    before = {path.rsplit("/", 1)[-1] for kind, path in events[:named] if kind == "sync"}
    assert {"part-00000.parquet", "part-00001.parquet", "meta.json.tmp"} <= before
    assert events[named - 1] == ("sync", str((tmp_path / f"labels.partial-{os.getpid()}").resolve()))  # the folder's entries
    assert events[named + 1] == ("sync", str(tmp_path.resolve()))
