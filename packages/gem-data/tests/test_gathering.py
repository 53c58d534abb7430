"""The gathering's fast paths give exactly what the general path (and torchrec's constructor) give, and its reused
output buffers are never written while a batch handed out still refers to them."""

import copy
import dataclasses
import gc

import pytest
import torch
from torchrec import KeyedJaggedTensor

import gem_data.gathering as gathering
from gem_data import FeatureAlignment, SyntheticConfig, SyntheticGenerator
from gem_data.gathering import BatchView, BufferPool, Piece
from gem_data.batch_ops import select_examples
from gem_data.testing import equal_batches
from gem_kunlun import EventType, FeatureSpec, SparseFeature
from gem_kunlun.testing import SPEC, random_batch


def _same_kjt(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> bool:
    """Every attribute equal (tensors by value)."""
    if vars(a).keys() != vars(b).keys():
        return False
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for x, y in zip(vars(a).values(), (vars(b)[k] for k in vars(a))))


def test_keyed_jagged_is_the_constructors_object():
    assert gathering.kjt_defaults() is not None  # the installed torchrec takes the fast path
    keys, values, lengths = ["a", "b", "c"], torch.arange(7), torch.tensor([1, 2, 0, 0, 3, 1])
    fast = gathering._keyed_jagged(keys, values, lengths, 2, [3, 0, 4])
    slow = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, stride=2, length_per_key=[3, 0, 4],
                             offset_per_key=[0, 3, 3, 7])
    assert type(fast) is KeyedJaggedTensor and _same_kjt(fast, slow)
    assert torch.equal(fast.offsets(), slow.offsets()) and torch.equal(fast["c"].values(), torch.arange(3, 7))


def _random_pieces(seed: int, rows: int = 40, whole: bool = False) -> tuple[list[Piece], FeatureAlignment]:
    """A few random row ranges of two one-spec sources' batches of ``rows`` rows (``whole``: four whole batches)."""
    generators = [SyntheticGenerator(SyntheticConfig(seed=s)) for s in (seed, seed + 10)]
    views = [BatchView(g.batch(i, rows, split="train")) for i, g in enumerate(generators)]
    alignment = FeatureAlignment({"feed": generators[0].spec, "video": generators[1].spec}, {"feed": "", "video": ""})
    draw = torch.Generator().manual_seed(seed)
    pieces = []
    for _ in range(4 if whole else 1 + seed % 4):
        source = int(torch.randint(2, (1,), generator=draw))
        lo = int(torch.randint(rows, (1,), generator=draw))
        hi = lo + 1 + int(torch.randint(rows - lo, (1,), generator=draw))
        if whole:
            lo, hi = 0, rows
        pieces.append(Piece(alignment._plans[("feed", "video")[source]], views[source], lo, hi))
    return pieces, alignment


@pytest.mark.parametrize("seed", range(8))
def test_same_keys_path_equals_the_general_path(seed):
    pieces, alignment = _random_pieces(seed)
    assert all(p.plan.identity for p in pieces)
    arrays = [p.view.arrays for p in pieces]
    for event in alignment.spec.events:
        name, keys = event.name, [f.name for f in event.features]
        fast, fast_times = gathering._join_same_keys([a.sequences[name] for a in arrays], pieces, keys, events=True)
        parts = [(a.sequences[name], p.plan.events[name], p) for a, p in zip(arrays, pieces)]
        general, general_times = gathering._gather_kjt(parts, keys, events=True)
        assert _same_kjt(fast, general) and torch.equal(fast_times, general_times)
    keys = [f.name for f in alignment.spec.sparse]
    fast, _ = gathering._join_same_keys([a.sparse for a in arrays], pieces, keys, events=False)
    parts = [(a.sparse, p.plan.sparse, p) for a, p in zip(arrays, pieces)]
    general, _ = gathering._gather_kjt(parts, keys, events=False)
    assert _same_kjt(fast, general)


def test_pooled_buffers_are_never_written_while_a_batch_holds_them(monkeypatch):
    monkeypatch.setattr(gathering, "POOLED_BYTES", 1)  # every join goes to the pool
    pool = BufferPool(3)
    claimed = []  # the buffers handed out, in order

    def claim(size, dtype):
        out = BufferPool.claim(pool, size, dtype)
        if out is not None:
            claimed.append(id(out.base))
        return out

    monkeypatch.setattr(pool, "claim", claim)
    monkeypatch.setattr(gathering, "_POOL", pool)
    largest, alignment = _random_pieces(0, whole=True)
    gathering.gather_pieces(largest, alignment.spec)  # buffers every later join fits in, free again at once
    held = []
    for seed in range(12):
        pieces, alignment = _random_pieces(seed)
        batch = gathering.gather_pieces(pieces, alignment.spec)
        held.append((batch, copy.deepcopy(batch)))
        if seed % 3 == 2:
            del held[0]  # a batch let go: its buffers are free again
            gc.collect()
    for batch, snapshot in held:
        assert equal_batches(batch, snapshot)
    assert len(pool.buffers) <= 3 and len(set(claimed)) < len(claimed)  # buffers were handed out again


def _random_steps(seed: int, rows: int = 24) -> tuple[list[list[Piece]], FeatureAlignment]:
    """A few steps of ``rows`` rows each, every step cut from consecutive row ranges of a few source batches (two
    generators, batches of other sizes than a step, so that pieces straddle them), as the mixer cuts them; one
    source's surface stamped in some."""
    draw = torch.Generator().manual_seed(seed)
    generators = [SyntheticGenerator(SyntheticConfig(seed=s, max_events=32)) for s in (seed, seed + 10)]
    surfaces = {"feed": None, "video": 2} if seed % 2 else None
    alignment = FeatureAlignment({"feed": generators[0].spec, "video": generators[1].spec}, {"feed": "", "video": ""}, surfaces)
    chunks = [int(torch.randint(5, 40, (1,), generator=draw)) for _ in range(2)]
    held = [[], []]  # per source, its batches read so far
    position = [0, 0]
    steps = []
    for _ in range(2 + seed % 5):
        share = int(torch.randint(rows + 1, (1,), generator=draw))
        step = []
        for source, n in enumerate((share, rows - share)):
            while n:
                index, row = divmod(position[source], chunks[source])
                while len(held[source]) <= index:
                    held[source].append(BatchView(generators[source].batch(len(held[source]), chunks[source], split="train")))
                take = min(n, chunks[source] - row)
                step.append(Piece(alignment._plans[("feed", "video")[source]], held[source][index], row, row + take))
                position[source] += take
                n -= take
        steps.append(step)
    return steps, alignment


def _same_batch(a, b) -> bool:
    """Every field equal, the key sets attribute by attribute."""
    return (equal_batches(a, b) and _same_kjt(a.sparse, b.sparse) and a.sequences.keys() == b.sequences.keys()
            and all(_same_kjt(a.sequences[k].ids, b.sequences[k].ids) for k in a.sequences)
            and a.next_items is None and b.next_items is None)


@pytest.mark.parametrize("seed", range(12))
def test_steps_gathered_together_equal_the_steps_gathered_one_by_one(seed):
    steps, alignment = _random_steps(seed)
    together = gathering.gather_steps(steps, alignment.spec)
    one_by_one = [gathering.gather_pieces(step, alignment.spec) for step in steps]
    assert len(together) == len(steps)
    # joined at once: the steps' tensors are ranges of the same arrays
    assert together[0].dense.untyped_storage().data_ptr() == together[-1].dense.untyped_storage().data_ptr()
    for fast, reference in zip(together, one_by_one):
        assert _same_batch(fast, reference)
        assert all(t.is_contiguous() for t in (fast.dense, fast.labels, fast.surface, fast.sparse.values(), fast.sparse.lengths()))


def test_source_batches_whose_fields_cannot_be_joined_as_they_are_are_gathered_step_by_step():
    steps, alignment = _random_steps(4)
    views = list({id(p.view): p.view for step in steps for p in step}.values())
    events = [e.name for e in alignment.spec.events]
    assert gathering.JoinedBatches.join([v.batch for v in views], events) is not None
    first = views[0].batch
    # a key set holding more ids than its lengths count: positions in the joined ids would not follow the lengths
    kjt = first.sparse
    longer = KeyedJaggedTensor(keys=kjt.keys(), values=torch.cat([kjt.values(), kjt.values()[:1]]), lengths=kjt.lengths())
    views[0].batch = dataclasses.replace(first, sparse=longer)
    assert gathering.JoinedBatches.join([v.batch for v in views], events) is None
    # an event type with a timestamp missing
    name = events[0]
    sequence = first.sequences[name]
    views[0].batch = dataclasses.replace(first, sequences={**first.sequences, name: dataclasses.replace(sequence, timestamps=sequence.timestamps[:-1])})
    assert gathering.JoinedBatches.join([v.batch for v in views], events) is None
    # dense features of another type in one batch: a join would convert them; the steps are gathered one by one
    views[0].batch = dataclasses.replace(first, dense=first.dense.double())
    assert gathering.JoinedBatches.join([v.batch for v in views], events) is None
    gathered = gathering.gather_steps(steps, alignment.spec)
    assert gathered[0].dense.untyped_storage().data_ptr() != gathered[-1].dense.untyped_storage().data_ptr()
    for fast, reference in zip(gathered, [gathering.gather_pieces(step, alignment.spec) for step in steps]):
        assert _same_batch(fast, reference)


@pytest.mark.parametrize("seed", range(4))
def test_a_steps_sources_are_kept_where_only_some_source_batches_carry_them(seed):
    steps, alignment = _random_steps(seed)
    views = list({id(p.view): p.view for step in steps for p in step}.values())
    for i, view in enumerate(views[:-1]):  # the last source batch carries none
        view.batch = dataclasses.replace(view.batch, source=torch.full((view.rows,), i % 3, dtype=torch.int64))
    one_by_one = [gathering.gather_pieces(step, alignment.spec) for step in steps]
    assert any(batch.source is not None for batch in one_by_one)
    for fast, reference in zip(gathering.gather_steps(steps, alignment.spec), one_by_one):
        assert _same_batch(fast, reference)


def test_steps_of_different_sizes_are_gathered_one_by_one():
    steps, alignment = _random_steps(3)
    steps[-1] = steps[-1][:1]  # a shorter last step
    for fast, reference in zip(gathering.gather_steps(steps, alignment.spec),
                               [gathering.gather_pieces(step, alignment.spec) for step in steps]):
        assert _same_batch(fast, reference)


def test_pooled_buffers_of_steps_gathered_together_are_never_written_while_a_batch_holds_them(monkeypatch):
    monkeypatch.setattr(gathering, "POOLED_BYTES", 1)  # every join goes to the pool
    monkeypatch.setattr(gathering, "_POOL", BufferPool(3))
    held = []
    for seed in range(10):
        steps, alignment = _random_steps(seed)
        batches = gathering.gather_steps(steps, alignment.spec)
        held.append((batches[-1], copy.deepcopy(batches[-1])))  # one batch of the steps kept, the others let go
        del batches
        if seed % 3 == 2:
            del held[0]
            gc.collect()
    for batch, snapshot in held:
        assert equal_batches(batch, snapshot)


def test_an_empty_range_at_a_batchs_end_keeps_every_key_of_the_other_pieces():
    """Rows [2, 2) of a 2-row batch add nothing: the gathered batch is the other piece's rows, every key kept (the
    last key's ids were lost on the same-spec path, and the re-keying path raised)."""
    spec = dataclasses.replace(SPEC, events=SPEC.events[:1])
    first, second = random_batch(2, seed=1, spec=spec), random_batch(3, seed=2, spec=spec)
    same = FeatureAlignment({"a": spec, "b": spec}, {"a": "", "b": ""})
    assert equal_batches(same.gather([("a", first, 2, 2), ("b", second, 0, 3)]),
                         same.gather([("b", second, 0, 2), ("b", second, 2, 3)]))
    apart = FeatureAlignment({"a": spec, "b": dataclasses.replace(spec, num_dense=1)})  # two id spaces: re-keyed
    got = apart.gather([("a", first, 2, 2), ("a", first, 0, 1)])
    assert equal_batches(got, apart.gather([("a", first, 0, 1)]))


def test_a_re_keyed_sources_empty_batch_aligns_to_an_empty_union_batch():
    """A rank's empty share of a short last held-out batch, from a source in an id space of its own."""
    other = dataclasses.replace(SPEC, num_dense=1)
    alignment = FeatureAlignment({"a": SPEC, "b": other})
    empty = select_examples(random_batch(4, seed=1, spec=other), torch.arange(0))
    aligned = alignment.align("b", empty)
    assert aligned.batch_size == 0 and aligned.sparse.keys() == [f.name for f in alignment.spec.sparse]
    aligned.validate(alignment.spec)


def test_large_joins_of_ids_of_two_types_keep_the_wider_type(monkeypatch):
    """A join large enough for the pooled buffers, of int32 ids then int64 ids above 2^31: int64 ids, as a small
    join gives (a buffer of the first piece's type wrapped them)."""
    spec = FeatureSpec(num_dense=1, sparse=(SparseFeature("user", 2**33),), events=(EventType("e", (SparseFeature("item", 9),)),),
                       tasks=("click",))
    narrow, wide = random_batch(2, seed=1, spec=spec), random_batch(2, seed=2, spec=spec)
    k = narrow.sparse
    narrow.sparse = KeyedJaggedTensor(keys=k.keys(), values=(k.values() % 1000).int(), lengths=k.lengths())
    k = wide.sparse
    wide.sparse = KeyedJaggedTensor(keys=k.keys(), values=k.values() % 1000 + 2**31, lengths=k.lengths())
    alignment = FeatureAlignment({"a": spec, "b": spec}, {"a": "", "b": ""})
    pieces = [("a", narrow, 0, 1), ("b", wide, 0, 2)]
    small = alignment.gather(pieces).sparse.values()
    monkeypatch.setattr(gathering, "POOLED_BYTES", 1)
    pooled = alignment.gather(pieces).sparse.values()
    assert small.dtype == pooled.dtype == torch.int64 and torch.equal(small, pooled) and int(pooled.max()) >= 2**31
