"""The exact output of ``MixedStream``: the same examples in the same order for the same seed, whatever the
mixer does to be fast.

Two checks per mixture: a straightforward reference (each source read alone, the draws of ``(seed, step)``
counted, rows selected and concatenated with the plain batch operations) and saved fingerprints of the
batches the mixer produced before its gathering was optimised (so that a change of the draws, of the order
or of any field's layout cannot pass unnoticed).
"""

import hashlib
import itertools

import numpy as np
import pytest
import torch

import gem_data.mixing as mixing
from gem_data import (
    BatchTable,
    FeatureAlignment,
    MixedStream,
    MixingConfig,
    MixSource,
    NextItemConfig,
    NextItemDataset,
    SyntheticConfig,
    SyntheticGenerator,
    SyntheticStream,
    TableStream,
    TimeSplit,
    TimeSplitDataset,
    concat_batches,
    select_examples,
)
from gem_data.testing import small_corpus, with_event_times
from gem_kunlun import Batch

SPEC = dict(num_ads=2000, max_events=16)
STEPS = 12


@pytest.fixture(scope="module")
def mixtures(tmp_path_factory):
    """name -> (make sources, MixingConfig (per-rank batch for one rank), alignment maker or None)."""
    generators = [SyntheticGenerator(SyntheticConfig(seed=s, **SPEC)) for s in range(3)]
    table = BatchTable(generators[0].batch(0, 100), generators[0].spec)
    folder = tmp_path_factory.mktemp("mixing-exact")
    shop_corpus, film_corpus = small_corpus(folder, "shop", 20, 30, True), small_corpus(folder, "films", 12, 17, False)
    shop = NextItemDataset(shop_corpus, NextItemConfig(num_negatives=1))
    films = NextItemDataset(film_corpus, NextItemConfig(num_negatives=1))
    last = [NextItemDataset(shop_corpus, NextItemConfig(num_negatives=2, objective="retrieval", seed=s)) for s in (1, 2)]
    every = [NextItemDataset(shop_corpus, NextItemConfig(num_negatives=2, objective="retrieval", queries="every", seed=s))
             for s in (3, 4)]
    split = TimeSplit(0.5, 0.8)
    periods = {p: TimeSplitDataset(with_event_times(shop_corpus), NextItemConfig(num_negatives=1, seed=5), split, p)
               for p in ("offline", "online")}
    three = (MixSource("feed", 5.0), MixSource("video", 3.0), MixSource("live", 2.0, online=True))

    def synthetic(chunk):
        return lambda: {"feed": SyntheticStream(generators[0], chunk), "video": SyntheticStream(generators[1], 48),
                        "live": SyntheticStream(generators[2], 16)}

    ramp = dict(online_share_start=0.1, online_share_end=0.7, ramp_start=2, ramp_steps=6, seed=7)
    return {
        "synthetic ramp": (synthetic(32), MixingConfig(three, batch_size=64, **ramp), None),
        "synthetic whole batches": (synthetic(32), MixingConfig(three, batch_size=64, granularity="batch", **ramp), None),
        "synthetic uneven chunks": (synthetic(40), MixingConfig(three, batch_size=50, seed=3), None),
        "tables: finite shuffled + endless in order": (
            lambda: {"log": TableStream(table, 16, num_epochs=3, seed=4), "live": TableStream(table, 24, shuffle=False)},
            MixingConfig((MixSource("log", 2.0), MixSource("live", 1.0, online=True)), batch_size=20, online_share_start=0.5,
                         seed=5), None),
        "two domains, aligned, stamped surfaces": (
            lambda: {"shop": TableStream(shop.training_table(), 8), "films": TableStream(films.training_table(), 8, seed=2)},
            MixingConfig((MixSource("shop", 1.0), MixSource("films", 2.0)), batch_size=12, seed=11),
            lambda s: FeatureAlignment({n: x.spec for n, x in s.items()}, surfaces={"shop": 0, "films": 1})),
        "time split: offline shuffled + online in order, one corpus": (
            lambda: {"offline": TableStream(periods["offline"].training_table(), 8, seed=3),
                     "online": TableStream(periods["online"].training_table(), 8, shuffle=False)},
            MixingConfig((MixSource("offline", 1.0), MixSource("online", 1.0, online=True)), batch_size=12,
                         online_share_start=0.2, online_share_end=0.8, ramp_steps=6, seed=19), None),
        "time split, read one batch at a time": (
            lambda: {"offline": TableStream(periods["offline"].training_table(), 16, seed=3, read_rows=0),
                     "online": TableStream(periods["online"].training_table(), 16, shuffle=False, read_rows=0)},
            MixingConfig((MixSource("offline", 2.0), MixSource("online", 1.0, online=True)), batch_size=16, seed=23), None),
        "retrieval, a query per row": (
            lambda: {"a": TableStream(last[0].training_table(), 8), "b": TableStream(last[1].training_table(), 8, seed=1)},
            MixingConfig((MixSource("a", 1.0), MixSource("b", 1.0)), batch_size=10, seed=13), None),
        "retrieval, a query per event": (
            lambda: {"a": TableStream(every[0].training_table(), 4), "b": TableStream(every[1].training_table(), 4, seed=1)},
            MixingConfig((MixSource("a", 1.0), MixSource("b", 1.0)), batch_size=6, seed=17), None),
    }


def build(mixture, rank=0, world_size=1):
    make, config, alignment = mixture
    sources = make()
    if alignment is not None:
        alignment = alignment(sources)
    return MixedStream(sources, config, rank=rank, world_size=world_size, alignment=alignment)


# -- an exact fingerprint of a batch --------------------------------------------------------------------------

def tensors(batch: Batch):
    """Every tensor of ``batch`` with a name, in a fixed order (KeyedJaggedTensors by keys, lengths, values)."""
    def kjt(name, k):
        yield f"{name}.keys={k.keys()} stride={k.stride()}", None
        yield f"{name}.lengths", k.lengths()
        yield f"{name}.values", k.values()
        yield f"{name}.length_per_key", torch.tensor(k.length_per_key())

    yield "dense", batch.dense
    yield from kjt("sparse", batch.sparse)
    for event, seq in batch.sequences.items():
        yield from kjt(event, seq.ids)
        yield f"{event}.timestamps", seq.timestamps
    yield "labels", batch.labels
    yield "surface", batch.surface
    yield "source", batch.source
    t = batch.next_items
    if t is not None:
        yield f"next_items every={t.every} loss={t.loss} catalogue={t.catalogue is not None}", None
        yield "next_items.positives", t.positives
        yield "next_items.negatives", t.negatives
    for name, r in sorted(batch.representations.items()):
        yield f"{name}.values", r.values
        yield f"{name}.lengths", r.lengths


def fingerprint(batches) -> str:
    digest = hashlib.sha256()
    for batch in batches:
        for name, tensor in tensors(batch):
            digest.update(name.encode())
            if tensor is not None:
                digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
                digest.update(np.ascontiguousarray(tensor.numpy()).tobytes())
    return digest.hexdigest()[:16]


def assert_same(got: Batch, expected: Batch) -> None:
    named = list(tensors(expected))
    assert [n for n, _ in tensors(got)] == [n for n, _ in named]
    for (name, a), (_, b) in zip(tensors(got), named):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name


# -- the reference: each source alone, the draws counted, rows selected and concatenated ------------------------

def draws(config: MixingConfig, step: int, global_batch: int) -> list[int]:
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    probabilities = config.probabilities(step)
    counts = [0] * len(config.sources)
    if config.granularity == "batch":
        counts[int(torch.multinomial(probabilities, 1, generator=generator))] = global_batch
    else:
        for i in torch.multinomial(probabilities, global_batch, replacement=True, generator=generator).tolist():
            counts[i] += 1
    return counts


def reference(mixture, steps, rank=0, world_size=1) -> list[Batch]:
    """Global batches of ``world_size`` times the config's batch size, rank ``rank``'s rows of each."""
    make, config, _ = mixture
    mixed = build(mixture)  # only for its alignment (the union spec and the re-keying of one source's batch)
    sources, names = make(), [s.name for s in config.sources]
    global_batch = config.batch_size * world_size
    counts = [draws(config, step, global_batch) for step in range(steps)]
    examples = {}
    for i, name in enumerate(names):
        needed, chunks = sum(c[i] for c in counts), []
        while sum(c.batch_size for c in chunks) < needed:
            chunks.append(sources[name].global_batch(len(chunks)))
        examples[name] = concat_batches(chunks) if chunks else None
    position, out = dict.fromkeys(names, 0), []
    for step in range(steps):
        parts = []
        for i, (name, n) in enumerate(zip(names, counts[step])):
            if n:
                part = mixed.alignment.align(name, select_examples(examples[name], torch.arange(position[name], position[name] + n)))
                part.source = torch.full((n,), i, dtype=torch.int64)
                parts.append(part)
            position[name] += n
        whole = concat_batches(parts)
        out.append(select_examples(whole, torch.arange(global_batch).tensor_split(world_size)[rank]) if world_size > 1 else whole)
    return out


# fingerprints of the first STEPS batches as the mixer gave them before its gathering was optimised (at 2a4d998); the
# time-split ones since the split corpus has event times of its own (with_event_times: a time split refuses a sequence
# file's positions), taken where they equal the plain batch operations' reference, as every row here does
SAVED = {
    ("synthetic ramp", 0, 1): "380140dbcf995cac",
    ("synthetic ramp", 1, 3): "579b9d1636d717e5",
    ("synthetic whole batches", 0, 1): "6337c49a79b5abeb",
    ("synthetic whole batches", 0, 2): "fcc7152587fa5619",
    ("synthetic uneven chunks", 0, 1): "d575302f0a37aae7",
    ("tables: finite shuffled + endless in order", 0, 1): "df355d76e68519de",
    ("tables: finite shuffled + endless in order", 1, 2): "11477cbb4654eee8",
    ("two domains, aligned, stamped surfaces", 0, 1): "c31daf313441c61f",
    ("two domains, aligned, stamped surfaces", 1, 2): "933b2eacf8befa16",
    # ... and, for the time-split mixtures (two periods of one corpus), as it gave them at f469217
    ("time split: offline shuffled + online in order, one corpus", 0, 1): "2d84ae7aa4ca21a4",
    ("time split: offline shuffled + online in order, one corpus", 1, 2): "adb1b2450cb2d6fc",
    ("time split, read one batch at a time", 0, 1): "f7471e7120a5adc0",
    ("time split, read one batch at a time", 1, 2): "3efc3d3ca7cde6ad",
    ("retrieval, a query per row", 0, 1): "a7a06bc45abfd47f",
    ("retrieval, a query per event", 0, 1): "8715f4e061e03e4c",
    ("retrieval, a query per event", 1, 2): "062fabc0f48b0237",
}


@pytest.mark.parametrize("name, rank, world_size", list(SAVED))
def test_the_mixture_is_exactly_the_reference_and_the_saved_one(mixtures, name, rank, world_size):
    make, config, alignment = mixtures[name]
    mixture = (make, MixingConfig(**{**config.__dict__, "batch_size": config.batch_size // world_size}), alignment)
    got = list(itertools.islice(build(mixture, rank, world_size), STEPS))
    expected = reference(mixture, STEPS, rank, world_size)
    assert len(got) == STEPS
    for step, (g, e) in enumerate(zip(got, expected)):
        try:
            assert_same(g, e)
        except AssertionError as error:
            raise AssertionError(f"step {step}: {error}") from None
    assert fingerprint(got) == SAVED[(name, rank, world_size)]


@pytest.mark.parametrize("name", ["synthetic ramp", "tables: finite shuffled + endless in order", "two domains, aligned, stamped surfaces",
                                  "time split: offline shuffled + online in order, one corpus"])
def test_a_resumed_mixture_continues_with_exactly_the_same_batches(mixtures, name):
    mixture = mixtures[name]
    whole = list(itertools.islice(build(mixture), STEPS))
    first = build(mixture)
    for _ in itertools.islice(first, 5):
        pass
    resumed = build(mixture)
    resumed.load_state_dict(first.state_dict())
    for g, e in zip(itertools.islice(resumed, STEPS - 5), whole[5:], strict=True):
        assert_same(g, e)


@pytest.mark.parametrize("gathered", [True, False], ids=["steps gathered", "step by step"])
@pytest.mark.parametrize("name", ["tables: finite shuffled + endless in order", "two domains, aligned, stamped surfaces",
                                  "time split: offline shuffled + online in order, one corpus"])
def test_a_data_worker_gives_one_process_batches_reading_only_its_own_rows(mixtures, name, gathered, monkeypatch):
    # a DataLoader worker delivers every num_workers-th batch: it gives one process's batches, and of the table rows it
    # reads, those before its next batch's are rows of its own batches (a read ahead of the next rows would read the
    # other workers'). Step by step: tables of one assembler are planned (PlanReader), others gathered per step
    if not gathered:
        monkeypatch.setattr(mixing, "GATHER_MAX_ROWS", 0)
    mixture, workers = mixtures[name], 3
    one = build(mixture)
    whole = list(itertools.islice(build(mixture), 18))
    for worker in range(workers):
        stream = build(mixture)
        stream._stride = workers  # as iterating it in a DataLoader worker of `workers` sets it
        read = {source_name: [] for source_name in stream.names}
        for source_name, source in zip(stream.names, stream.sources):
            for method in ("_rows", "_plans"):
                def recorded(positions, read_rows=getattr(source, method), into=read[source_name]):
                    into.append(positions)
                    return read_rows(positions)
                setattr(source, method, recorded)
        steps = range(worker, len(whole), workers)
        for step in steps:
            assert_same(stream.rank_batch(step), whole[step])
        own = {source_name: set() for source_name in stream.names}
        for step in steps:
            for source_name, first, n in zip(stream.names, one.positions(step), one.composition(step)):
                own[source_name].update(range(first, first + n))
        after = dict(zip(stream.names, one.positions(steps[-1] + 1)))
        assert any(read.values())
        for source_name, positions in read.items():
            positions = torch.cat(positions).tolist() if positions else []
            assert {p for p in positions if p < after[source_name]} <= own[source_name], source_name
