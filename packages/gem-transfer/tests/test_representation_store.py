"""LoopFM's representation store: per-user time order, the memory bound, no leakage, exactly-once resume, bad stores,
and the student-side join."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from gem_kunlun import RepresentationFeature
from gem_kunlun.testing import SPEC, random_batch

from gem_transfer import (
    RepresentationError,
    RepresentationJoin,
    RepresentationStore,
    RepresentationTap,
    RepresentationWriter,
    example_times,
    example_users,
    random_projection,
    without_sparse_feature,
)

USER = "ad"  # random_batch gives its first sparse feature exactly one id per example
META = {"dim": 3, "teacher": {"run_dir": "t", "step": 1}, "layer": "representation", "projection_seed": 0}


def events(seed: int = 0, steps: int = 6, size: int = 16):
    """Steps of (users, times, vectors): few users, so that each has many events; some rows have no time.
    Each vector spells out its own row: (user, time, step * 1000 + row), which the tests read back."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        users = torch.randint(0, 5, (size,), generator=g)
        times = torch.randint(0, 40, (size,), generator=g).double()  # repeated times: ties happen
        times[torch.rand(size, generator=g) < 0.1] = float("nan")
        vectors = torch.stack([users.float(), times.float(), step * 1000 + torch.arange(size).float()], 1)
        out.append((step, users, times, vectors))
    return out


def write(folder, data, steps_per_part=2, meta=META):
    writer = RepresentationWriter(folder, meta, steps_per_part=steps_per_part)
    for step, users, times, vectors in data:
        if step >= writer.next_step:
            writer.append(step, users, times, vectors)
    return writer.close()


def reference_history(data, user, time, max_events):
    """Every stored row of ``user`` strictly before ``time``, by (time, step, row), the newest ``max_events``."""
    rows = [tuple(v.tolist()) for _, u, t, vs in data for uu, tt, v in zip(u.tolist(), t.tolist(), vs)
            if uu == user and not np.isnan(tt) and tt < time]
    rows.sort(key=lambda r: (r[1], r[2]))
    return rows[-max_events:] if max_events else []


def test_history_is_each_users_newest_representations_strictly_before_the_example_oldest_first(tmp_path):
    data = events()
    store = RepresentationStore(write(tmp_path / "store", data))
    assert store.rows == sum(int((~t.isnan()).sum()) for _, _, t, _ in data)
    users = torch.tensor([0, 1, 2, 3, 4, 0, 9, 2, 3])  # user 9 has no events
    times = torch.tensor([0.0, 10, 20, 39, 40, 100, 50, float("nan"), 17.5], dtype=torch.float64)
    for max_events in (1, 4, 1000):
        history = store.history(users, times, max_events)
        offsets = history.offsets().tolist()
        for i, (u, t) in enumerate(zip(users.tolist(), times.tolist())):
            got = [tuple(v) for v in history.values[offsets[i] : offsets[i + 1]].tolist()]
            wanted = reference_history(data, u, t, max_events) if not np.isnan(t) else []
            assert got == wanted, (u, t, max_events)
            assert all(row[1] < t for row in got)  # no leakage: nothing at or after the example's time
    bounded = store.history(users, times, 4)
    assert int(bounded.lengths.max()) == 4 and int(store.history(users, times, 1000).lengths.max()) > 4


def test_a_pass_cut_short_resumes_where_it_stopped_and_writes_every_row_exactly_once(tmp_path):
    data, folder = events(steps=9), tmp_path / "store"
    writer = RepresentationWriter(folder, META, steps_per_part=2)
    for step, users, times, vectors in data[:5]:
        writer.append(step, users, times, vectors)
    # cut short: step 4 was pending, and a part landed without its listing (stopped between the two renames)
    (folder / "part-00002.parquet").write_bytes(b"half a part")
    (folder / "part-00002.parquet.tmp").write_bytes(b"staged")
    with pytest.raises(RepresentationError, match=r"incomplete representation store \(the pass stopped before step 4\)"):
        RepresentationStore(folder)
    resumed = RepresentationWriter(folder, META, steps_per_part=2)
    assert resumed.resumed and resumed.next_step == 4
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "part-00000.parquet", "part-00001.parquet", "progress.json"]
    with pytest.raises(ValueError, match="expected 4"):
        resumed.append(5, *data[5][1:])
    for step, users, times, vectors in data[4:]:
        resumed.append(step, users, times, vectors)
    resumed.close()
    store = RepresentationStore(folder)
    written = sorted(store.vectors[:, 2].tolist())
    wanted = sorted(float(s * 1000 + r) for s, _, t, _ in data for r in range(t.numel()) if not np.isnan(t[r]))
    assert written == wanted  # nothing lost, nothing twice
    assert store.steps == 9


def test_a_store_of_another_pass_or_a_complete_one_is_not_appended_to(tmp_path):
    folder = write(tmp_path / "store", events(steps=2)[:1])
    with pytest.raises(RepresentationError, match=r"is a complete representation store already"):
        RepresentationWriter(folder, META)
    (folder / "progress.json").write_text(json.dumps({"parts": [], "next_step": 0, "complete": False, "rows": 0}))
    with pytest.raises(RepresentationError, match=r"holds representations of another pass \(differs in dim, layer\)"):
        RepresentationWriter(folder, {**META, "dim": 4, "layer": "trunk.mlp"})
    (folder / "progress.json").write_text(json.dumps({"next_step": 0, "complete": False}))
    with pytest.raises(RepresentationError, match=r"progress.json: no 'parts' entry"):
        RepresentationWriter(folder, META)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(RepresentationError, match=r"exists and is not a representation store"):
        RepresentationWriter(tmp_path / "other", META)


def test_a_pass_stopped_before_its_first_progress_starts_over_in_its_folder(tmp_path, monkeypatch):
    """Stopped between writing meta.json and its first progress.json, the folder held this pass's meta alone: the
    rerun refused it as "not a representation store"; another pass's meta still is."""
    from gem_transfer import representation_store

    def stopped(self, complete):
        raise KeyboardInterrupt

    monkeypatch.setattr(representation_store.RepresentationWriter, "_publish", stopped)
    with pytest.raises(KeyboardInterrupt):
        RepresentationWriter(tmp_path / "store", META)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["meta.json"]
    with pytest.raises(RepresentationError, match=r"exists and is not a representation store"):
        RepresentationWriter(tmp_path / "store", {**META, "dim": 4})
    writer = RepresentationWriter(tmp_path / "store", META)
    assert writer.next_step == 0 and not writer.resumed


def _edit_progress(folder, **entries):
    progress = json.loads((folder / "progress.json").read_text())
    (folder / "progress.json").write_text(json.dumps({**progress, **entries}))


@pytest.mark.parametrize("damage, message", [
    (dict(parts=None), r"progress.json: parts is None, not a list of records"),
    (dict(parts=[{"rows": 2}]), r"progress.json: no 'file' entry"),
    (dict(next_step="x"), r"progress.json: next_step is 'x', not an integer >= 0"),
])
def test_a_damaged_progress_of_a_pass_to_resume_is_one_line(tmp_path, damage, message):
    folder = write(tmp_path / "store", events(steps=4))
    _edit_progress(folder, complete=False, **damage)
    with pytest.raises(RepresentationError, match=message) as error:
        RepresentationWriter(folder, META)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("damage, message", [
    (lambda f: None, r"no representation store there"),
    (lambda f: (f / "progress.json").unlink(), r"not a representation store \(no meta.json or progress.json\)"),
    (lambda f: (f / "meta.json").write_text("{oops"), r"meta.json: not readable as JSON"),
    (lambda f: (f / "meta.json").write_text(json.dumps({**META, "format": 99})), r"store format 99"),
    (lambda f: (f / "part-00000.parquet").write_bytes(b"PAR1 not really"), r"part-00000.parquet: unreadable representation part"),
    (lambda f: (f / "part-00001.parquet").unlink(), r"part-00001.parquet: unreadable representation part"),
    (lambda f: (f / "meta.json").write_text(json.dumps({**META, "format": 1, "dim": 5})), r"vectors of type .*, expected 5 float32"),
    (lambda f: (f / "meta.json").write_text(json.dumps({k: v for k, v in {**META, "format": 1}.items() if k != "dim"})),
     r"meta.json: no 'dim' entry"),
    (lambda f: (f / "progress.json").write_text(json.dumps({"complete": True, "next_step": 4})), r"progress.json: no 'parts' entry"),
    (lambda f: (f / "progress.json").write_text(json.dumps({"complete": True, "parts": []})), r"progress.json: no 'next_step' entry"),
    (lambda f: (f / "progress.json").write_text(json.dumps({"complete": True, "parts": [], "next_step": "x"})),
     r"progress.json: next_step is 'x', not an integer >= 0"),
    (lambda f: (f / "meta.json").write_text(json.dumps({**META, "format": 1, "dim": None})), r"meta.json: dim is None, not an integer >= 1"),
    (lambda f: _edit_progress(f, parts=None), r"progress.json: parts is None, not a list of records"),
    (lambda f: _edit_progress(f, parts=3), r"progress.json: parts is 3, not a list of records"),
    (lambda f: _edit_progress(f, parts=[{"rows": 2}]), r"progress.json: no 'file' entry"),
    (lambda f: _edit_progress(f, parts=[{"file": "part-00000.parquet", "rows": "2"}]), r"progress.json: rows is '2', not an integer"),
])
def test_a_missing_or_damaged_store_is_one_line_naming_it(tmp_path, damage, message):
    folder = write(tmp_path / "store", events(steps=4))
    if damage(folder) is None and message.startswith("no representation"):
        folder = tmp_path / "elsewhere"
    with pytest.raises(RepresentationError, match=message) as error:
        RepresentationStore(folder)
    assert "\n" not in str(error.value)


def test_example_times_are_each_examples_newest_event_and_nan_without_events():
    batch = random_batch(12, seed=3, max_events=3)
    times = example_times(batch)
    for i in range(12):
        newest = []
        for seq in batch.sequences.values():
            o = seq.offsets()
            newest += seq.timestamps[o[i] : o[i + 1]].tolist()
        assert (np.isnan(times[i]) and not newest) or times[i] == max(newest)
    assert bool(times.isnan().any())  # max_events=3 leaves some example without events


def test_user_ids_must_be_one_per_example():
    batch = random_batch(6)
    assert example_users(batch, USER).tolist() == batch.sparse[USER].values().tolist()
    with pytest.raises(RepresentationError, match=r"user feature 'tags' must hold one id per example; example \d+ has"):
        example_users(batch, "tags")
    with pytest.raises(RepresentationError, match=r"user feature 'user' is not among"):
        example_users(batch, "user")


class Listed:
    """The smallest batch stream: a list of batches and a position."""

    def __init__(self, batches):
        self.batches, self.position, self.spec = batches, 0, SPEC

    def __iter__(self):
        while self.position < len(self.batches):
            self.position += 1
            yield self.batches[self.position - 1]

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_the_join_gives_each_example_its_users_earlier_representations_and_resumes_exactly(tmp_path):
    batches = [random_batch(16, seed=s) for s in range(4)]
    for b in batches:  # few users, so that histories are shared
        b.sparse = type(b.sparse).from_lengths_sync(keys=b.sparse.keys(), values=torch.cat(
            [b.sparse[USER].values() % 3, b.sparse["tags"].values()]), lengths=b.sparse.lengths())
    data = [(s, example_users(b, USER), example_times(b), torch.randn(16, 3)) for s, b in enumerate(batches)]
    store = RepresentationStore(write(tmp_path / "store", data))
    join = RepresentationJoin(Listed(batches), store, USER, max_events=5)
    assert join.spec.representations[-1].name == "loopfm" and join.spec.representations[-1].dim == 3
    joined = list(join)
    for batch in joined:
        batch.validate(join.spec)
        history = batch.representations["loopfm"]
        expected = store.history(example_users(batch, USER), example_times(batch), 5)
        assert torch.equal(history.values, expected.values) and torch.equal(history.lengths, expected.lengths)
    assert sum(int(b.representations["loopfm"].lengths.sum()) for b in joined) > 0
    again = RepresentationJoin(Listed(batches), store, USER, max_events=5)
    again.load_state_dict({"position": 2})
    assert torch.equal(next(iter(again)).representations["loopfm"].values, joined[2].representations["loopfm"].values)
    with pytest.raises(RepresentationError, match=r"user feature 'user_id' is not among the data's sparse features"):
        RepresentationJoin(Listed(batches), store, "user_id", max_events=5)



def test_a_key_only_join_keeps_every_other_feature_and_drops_the_user_from_spec_and_batches(tmp_path):
    batches = [random_batch(8, seed=s) for s in range(2)]
    data = [(s, example_users(b, USER), example_times(b), torch.randn(8, 3)) for s, b in enumerate(batches)]
    store = RepresentationStore(write(tmp_path / "store", data))
    keyed = list(RepresentationJoin(Listed(batches), store, USER, max_events=5))
    join = RepresentationJoin(Listed(batches), store, USER, max_events=5, key_only=True)
    assert [f.name for f in join.spec.sparse] == [f.name for f in SPEC.sparse if f.name != USER]
    for batch, full in zip(join, keyed):
        batch.validate(join.spec)
        assert batch.sparse.keys() == [k for k in full.sparse.keys() if k != USER]
        for key in batch.sparse.keys():  # the other features' ids untouched
            assert torch.equal(batch.sparse[key].values(), full.sparse[key].values())
            assert torch.equal(batch.sparse[key].lengths(), full.sparse[key].lengths())
        assert torch.equal(batch.representations["loopfm"].values, full.representations["loopfm"].values)
    assert join.spec == dataclasses.replace(without_sparse_feature(SPEC, USER), representations=(RepresentationFeature("loopfm", 3),))
    with pytest.raises(RepresentationError, match=r"'nowhere' is not among the data's sparse features"):
        without_sparse_feature(SPEC, "nowhere")


def test_the_tap_projects_the_chosen_layer_with_a_fixed_seeded_matrix():
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    x = torch.randn(5, 4)

    class Output:
        representation = None

    tap = RepresentationTap(teacher, "0", dim=3, seed=7)
    teacher(x)
    torch.testing.assert_close(tap.vectors(Output(), 5), teacher[0](x) @ random_projection(6, 3, 7))
    assert torch.equal(random_projection(6, 3, 7), random_projection(6, 3, 7))
    assert not torch.equal(random_projection(6, 3, 7), random_projection(6, 3, 8))
    tap.close()
    with pytest.raises(ValueError, match=r"the teacher has no layer 'trunk.mlp'"):
        RepresentationTap(teacher, "trunk.mlp", dim=3, seed=7)
    plain = RepresentationTap(teacher, "representation", dim=3, seed=7)
    with pytest.raises(ValueError, match=r"teacher layer 'representation' gave NoneType, expected one row per example"):
        plain.vectors(Output(), 5)
