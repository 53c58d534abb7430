"""Feature alignment: disjoint and shared id spaces, one-line errors when sources disagree, mixing aligned sources."""

import dataclasses
import itertools

import pytest
import torch

from gem_data import (
    AlignmentError,
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
)
from gem_data.testing import equal_batches, small_corpus


@pytest.fixture(scope="module")
def domains(tmp_path_factory):
    """Two next-item domains with different catalogues; only the first has item attributes."""
    folder = tmp_path_factory.mktemp("domains")
    shop = NextItemDataset(small_corpus(folder, "shop", 20, 30, True), NextItemConfig(num_negatives=1))
    films = NextItemDataset(small_corpus(folder, "films", 12, 17, False), NextItemConfig(num_negatives=1))
    return shop, films


def test_disjoint_id_spaces_lay_vocabularies_end_to_end(domains):
    shop, films = domains
    alignment = FeatureAlignment({"shop": shop.spec, "films": films.spec}, surfaces={"shop": 0, "films": 1})
    spec = alignment.spec
    vocab = {f.name: f.num_embeddings for f in spec.sparse}
    assert vocab["item_id"] == shop.corpus.num_items + films.corpus.num_items
    assert alignment.offset("films", "item_id") == shop.corpus.num_items and alignment.offset("shop", "item_id") == 0
    assert spec.num_surfaces == 2 and spec.candidate == ("item_id", "item_attributes")
    rows = torch.arange(6)
    film_batch = films.training_table().take(0, rows, 0)
    aligned = alignment.align("films", film_batch)
    aligned.validate(spec)
    assert torch.equal(aligned.sparse["item_id"].values(), film_batch.sparse["item_id"].values() + shop.corpus.num_items)
    assert aligned.sparse["item_attributes"].lengths().sum() == 0  # a feature films lack: empty bags
    history = aligned.sequences["history"]
    pad = {f.name: f.num_embeddings for f in spec.events[0].features}["history_attributes_0"] - 1
    assert set(history.ids["history_attributes_0"].values().tolist()) == {pad}  # one padding id per event
    assert torch.equal(history.timestamps, film_batch.sequences["history"].timestamps)
    assert aligned.surface.tolist() == [1] * 6
    shop_batch = alignment.align("shop", shop.training_table().take(0, rows, 0))
    shop_batch.validate(spec)
    assert int(shop_batch.sparse["item_id"].values().max()) < shop.corpus.num_items


def test_gathering_row_ranges_equals_aligning_then_concatenating(domains):
    shop, films = domains
    alignment = FeatureAlignment({"shop": shop.spec, "films": films.spec})
    a, b = shop.training_table().take(0, torch.arange(9), 0), films.training_table().take(0, torch.arange(7), 0)
    gathered = alignment.gather([("shop", a, 2, 5), ("films", b, 0, 7), ("shop", a, 5, 9)])
    from gem_data import concat_batches, select_examples

    expected = concat_batches([alignment.align("shop", select_examples(a, torch.arange(2, 5))), alignment.align("films", b),
                               alignment.align("shop", select_examples(a, torch.arange(5, 9)))])
    assert equal_batches(gathered, expected)


def test_a_shared_id_space_needs_the_same_features(domains, tmp_path):
    shop, films = domains
    with pytest.raises(AlignmentError, match="sources 'shop' and 'films' share id space 'catalogue' but their features differ"):
        FeatureAlignment({"shop": shop.spec, "films": films.spec}, id_spaces={"shop": "catalogue", "films": "catalogue"})
    same = FeatureAlignment({"a": shop.spec, "b": shop.spec}, id_spaces={"a": "x", "b": "x"})
    assert same.spec == shop.spec and same.is_identity("b")


def test_misaligned_sources_are_rejected_in_one_line(domains):
    shop, _ = domains
    synthetic = SyntheticGenerator(SyntheticConfig(num_ads=2000, max_events=16)).spec
    with pytest.raises(AlignmentError, match="different tasks") as error:
        FeatureAlignment({"shop": shop.spec, "ads": synthetic})
    assert "\n" not in str(error.value)
    moved = dataclasses.replace(synthetic, tasks=shop.spec.tasks, sparse=synthetic.sparse + (dataclasses.replace(shop.spec.events[0].features[0]),))
    with pytest.raises(AlignmentError, match="'history_item_id' is a feature of event type 'history' in id space 'shop' but a sparse feature"):
        FeatureAlignment({"shop": shop.spec, "ads": moved})


def test_declarations_naming_no_source_and_an_alignment_of_other_specs_are_rejected_in_one_line(domains, tmp_path):
    shop, films = domains
    specs = {"shop": shop.spec, "films": films.spec}
    with pytest.raises(AlignmentError, match=r"surfaces names \['film'\], which are not among the sources"):
        FeatureAlignment(specs, surfaces={"shop": 0, "film": 1})
    with pytest.raises(AlignmentError, match=r"id_spaces names \['film'\]"):
        FeatureAlignment(specs, id_spaces={"film": "x"})
    with pytest.raises(AlignmentError, match="surfaces must be >= 0"):
        FeatureAlignment(specs, surfaces={"shop": -1})
    # 'shop', left out of id_spaces, is its own space named 'shop': films declaring a space of that name would join it
    with pytest.raises(AlignmentError, match=r"id_spaces declares space\(s\) \['shop'\], the name of sources left out"):
        FeatureAlignment({"shop": shop.spec, "films": shop.spec}, id_spaces={"films": "shop"})
    # the same features with a larger catalogue: its ids would run into the next source's shifted range
    bigger = NextItemDataset(small_corpus(tmp_path, "shop", 20, 60, True), NextItemConfig(num_negatives=1))
    streams = {"shop": TableStream(bigger.training_table(), 8), "films": TableStream(films.training_table(), 8)}
    config = MixingConfig((MixSource("shop"), MixSource("films")), batch_size=12)
    with pytest.raises(AlignmentError, match="source 'shop': its stream has another FeatureSpec than the alignment was built for"):
        MixedStream(streams, config, alignment=FeatureAlignment(specs, surfaces={"shop": 0, "films": 1}))
    # a source keeping its reader's surfaces (none stamped) whose stream has more than the alignment counted
    generator = SyntheticGenerator(SyntheticConfig(num_ads=500, max_events=8))
    assert generator.spec.num_surfaces > 1
    one_surface = dataclasses.replace(generator.spec, num_surfaces=1)
    synthetic = {"a": SyntheticStream(generator, 8), "b": SyntheticStream(generator, 8)}
    with pytest.raises(AlignmentError, match=r"source 'a': its stream has \d+ surfaces, the alignment was built for 1"):
        MixedStream(synthetic, MixingConfig((MixSource("a"), MixSource("b")), batch_size=8),
                    alignment=FeatureAlignment({"a": one_surface, "b": one_surface}, {"a": "", "b": ""}))
    # stamped, the reader's surfaces are replaced: the stream may carry any number
    MixedStream(synthetic, MixingConfig((MixSource("a"), MixSource("b")), batch_size=8),
                alignment=FeatureAlignment({"a": one_surface, "b": one_surface}, {"a": "", "b": ""}, {"a": 0, "b": 1}))


def test_retrieval_batches_need_one_id_space(tmp_path):
    folder = tmp_path
    retrieval = NextItemConfig(num_negatives=2, objective="retrieval")
    a = NextItemDataset(small_corpus(folder, "a", 10, 20, False), retrieval)
    b = NextItemDataset(small_corpus(folder, "b", 10, 25, False), retrieval)
    alignment = FeatureAlignment({"a": a.spec, "b": b.spec})
    with pytest.raises(AlignmentError, match="retrieval needs every source in one id space"):
        alignment.align("b", b.training_table().take(0, torch.arange(3), 0))


def test_mixed_aligned_sources_are_read_in_place_and_resume_exactly(domains):
    shop, films = domains
    alignment = FeatureAlignment({"shop": shop.spec, "films": films.spec}, surfaces={"shop": 0, "films": 1})

    def stream(rank=0, world=1):
        sources = {"shop": TableStream(shop.training_table(), 8), "films": TableStream(films.training_table(), 8)}
        return MixedStream(sources, MixingConfig((MixSource("shop", 2.0), MixSource("films", 1.0)), batch_size=12 // world, seed=4),
                           rank, world, alignment)

    one = stream()
    batches = list(itertools.islice(one, 6))
    for batch in batches:
        batch.validate(alignment.spec)
        assert torch.equal(batch.surface, batch.source)  # the domain stamped per source
    # films' examples are films' own stream, in its order
    film_rows = sum(int((b.source == 1).sum()) for b in batches)
    direct = alignment.align("films", next(iter(TableStream(films.training_table(), film_rows))))
    from gem_data import concat_batches, select_examples

    mixed_films = concat_batches([select_examples(b, (b.source == 1).nonzero().squeeze(1)) for b in batches])
    assert torch.equal(mixed_films.sparse["item_id"].values(), direct.sparse["item_id"].values())
    two = [stream(r, 2) for r in range(2)]
    for expected, *parts in itertools.islice(zip(stream(), *two), 5):
        assert equal_batches(concat_batches(parts), expected)
    state = one.state_dict()
    resumed = stream()
    resumed.load_state_dict(state)
    assert all(equal_batches(a, b) for a, b in zip(itertools.islice(one, 3), itertools.islice(resumed, 3)))


def test_batch_table_sources_of_one_spec_need_no_alignment():
    generator = SyntheticGenerator(SyntheticConfig(num_ads=2000, max_events=16))
    table = BatchTable(generator.batch(0, 64), generator.spec)
    mixed = MixedStream({"a": TableStream(table, 16), "b": TableStream(table, 16, seed=1)},
                        MixingConfig((MixSource("a"), MixSource("b")), batch_size=16))
    assert mixed.spec == generator.spec and mixed.alignment.is_identity("a")
    next(iter(mixed)).validate(generator.spec)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gathering_random_row_ranges_of_one_spec_equals_selecting_then_concatenating(seed):
    from gem_data import concat_batches, select_examples

    generators = [SyntheticGenerator(SyntheticConfig(seed=s)) for s in (seed, seed + 10)]
    batches = {"feed": generators[0].batch(0, 40, split="train"), "video": generators[1].batch(3, 40, split="train")}
    alignment = FeatureAlignment({"feed": generators[0].spec, "video": generators[1].spec}, dict.fromkeys(batches, ""))
    draw = torch.Generator().manual_seed(seed)
    segments = []
    for _ in range(5):
        name = ("feed", "video")[int(torch.randint(2, (1,), generator=draw))]
        lo = int(torch.randint(40, (1,), generator=draw))
        hi = lo + 1 + int(torch.randint(40 - lo, (1,), generator=draw))
        segments.append((name, batches[name], lo, hi))
    expected = concat_batches([select_examples(b, torch.arange(lo, hi)) for _, b, lo, hi in segments])
    gathered = alignment.gather(segments)
    gathered.validate(alignment.spec)
    assert equal_batches(gathered, expected)
