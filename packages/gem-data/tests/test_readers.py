"""The sequential text and RecBole atomic readers, on small files written here and on the shared real data."""

import json
import re
from pathlib import Path

import pytest
import torch

from gem_data import DataError, NextItemConfig, NextItemDataset, read_atomic, read_sequence_text
from gem_data.testing import find_repo_root, shared_data_dir

DATA = shared_data_dir(find_repo_root(Path(__file__)))


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_text_reader_maps_ids_and_keeps_order(tmp_path):
    seqs = write(tmp_path / "s.txt", "7 30 10 20\n\n8 10 40\n")
    attrs = write(tmp_path / "a.json", json.dumps({"10": [5, 6], "20": [6], "99": [1]}))
    corpus = read_sequence_text(seqs, attrs)
    assert corpus.item_tokens == ["10", "20", "30", "40"] and corpus.user_tokens == ["7", "8"]
    assert corpus.items.tolist() == [2, 0, 1, 0, 3] and corpus.offsets.tolist() == [0, 3, 5]
    assert corpus.timestamps.tolist() == [0, 1, 2, 0, 1]
    bags = corpus.item_fields["attributes"]
    assert bags.tokens == ["5", "6"] and bags.lengths().tolist() == [2, 1, 0, 0]
    assert bags.slots(2).tolist() == [[0, 1], [1, 2], [2, 2], [2, 2]]  # padded with vocab_size


@pytest.mark.parametrize(
    "text, line, message",
    [("1 2 3\n2 4 x\n", 2, "not a non-negative integer"), ("1 2\n3\n", 2, "no items"), ("1 2\n1 3\n", 2, "earlier line")],
)
def test_text_reader_names_file_and_line_of_a_bad_row(tmp_path, text, line, message):
    path = write(tmp_path / "bad.txt", text)
    with pytest.raises(DataError, match=rf"bad.txt:{line}: .*{message}"):
        read_sequence_text(path)
    corpus = read_sequence_text(path, skip_bad_rows=True)
    assert corpus.bad_rows == 1 and f"bad.txt:{line}" in corpus.bad_row_examples[0] and corpus.num_users == 1


def test_attribute_file_errors_name_the_file(tmp_path):
    seqs = write(tmp_path / "s.txt", "1 2 3\n")
    with pytest.raises(DataError, match=r"a.json:2: invalid JSON"):
        read_sequence_text(seqs, write(tmp_path / "a.json", '{"2": [1],\n oops}'))
    with pytest.raises(DataError, match=r"b.json:item 2: attributes must be"):
        read_sequence_text(seqs, write(tmp_path / "b.json", '{"2": "brand", "3": [1]}'))
    assert read_sequence_text(seqs, tmp_path / "b.json", skip_bad_rows=True).bad_rows == 1


def test_attribute_keys_that_name_no_item_are_not_dropped_silently(tmp_path):
    """A key that is no item id (" 1", "2.0", "item_3") named no item: its attributes were lost without a word; a file
    none of whose entries names an item (another data set's) left the attribute feature out without a word."""
    seqs = write(tmp_path / "s.txt", "1 1 2 3\n")
    for key in (" 1", "2.0", "+3", "item_3"):
        with pytest.raises(DataError, match=rf"c.json:item {re.escape(repr(key))}: is not an item id \(a non-negative integer\)$"):
            read_sequence_text(seqs, write(tmp_path / "c.json", f'{{"{key}": [1], "2": [4]}}'))
    assert read_sequence_text(seqs, tmp_path / "c.json", skip_bad_rows=True).bad_rows == 1
    with pytest.raises(DataError, match=r"d.json: no entry names an item of the sequences \(2 entries\)$"):
        read_sequence_text(seqs, write(tmp_path / "d.json", '{"7": [1], "8": [2]}'))
    with pytest.raises(DataError, match=r"e.json: no entry names an item of the sequences \(0 entries; 1 bad rows skipped\)$"):
        read_sequence_text(seqs, write(tmp_path / "e.json", '{"x": [1]}'), skip_bad_rows=True)


def test_atomic_files_joined_together_a_companion_file_of_other_ids_and_times_past_float32(tmp_path):
    """A header line repeated inside .inter (files joined) read as an interaction where no float field caught it; a
    .user / .item file naming none of the interactions' ids gave every entity zeros; times past float32's range after
    the first event reached the batches as inf."""
    folder = tmp_path / "joined"
    folder.mkdir()
    write(folder / "joined.inter", "user_id:token\titem_id:token\n1\t10\n2\t11\nuser_id:token\titem_id:token\n3\t12\n")
    with pytest.raises(DataError, match=r"joined.inter:4: the header line is repeated$"):
        read_atomic(folder)
    corpus = read_atomic(folder, skip_bad_rows=True)
    assert corpus.user_tokens == ["1", "2", "3"] and corpus.bad_rows == 1
    write(folder / "joined.item", "item_id:token\tprice:float\n010\t1.5\n011\t2.5\n")
    with pytest.raises(DataError, match=r"joined.item: no row names a item_id of the interactions"):
        read_atomic(folder, skip_bad_rows=True)
    far = tmp_path / "far"
    far.mkdir()
    write(far / "far.inter", "user_id:token\titem_id:token\ttimestamp:float\n1\t10\t0\n1\t11\t1e38\n1\t12\t4e38\n")
    with pytest.raises(DataError, match=r"far.inter:4: timestamp 4e38 lies more than float32's largest value after"):
        read_atomic(far)


def write_atomic(folder: Path, inter_rows: str, item_rows: str = "", user_rows: str = "") -> Path:
    folder.mkdir()
    write(folder / "toy.inter", "user_id:token\titem_id:token\trating:float\ttimestamp:float\n" + inter_rows)
    if item_rows:
        write(folder / "toy.item", "item_id:token\tgenre:token_seq\tyear:token\tprice:float\n" + item_rows)
    if user_rows:
        write(folder / "toy.user", "user_id:token\tgender:token\tscores:float_seq\n" + user_rows)
    return folder


def test_atomic_reader_orders_by_time_and_reads_features(tmp_path):
    folder = write_atomic(
        tmp_path / "toy",
        "u1\ti2\t4\t200\nu1\ti1\t5\t100\nu2\ti1\t3\t150\nu1\ti3\t1\t200\n",
        "i1\tdrama comedy\t1995\t9.5\ni3\tdrama\t\t1.0\ni9\thorror\t2001\t2\n",
        "u2\tF\t1 2\n",
    )
    corpus = read_atomic(folder)
    assert corpus.item_tokens == ["i1", "i2", "i3"] and corpus.user_tokens == ["u1", "u2"]
    assert corpus.items.tolist() == [0, 1, 2, 0]  # u1 by time (ties in file order), then u2
    assert corpus.timestamps.tolist() == [0, 100, 100, 50]  # seconds since the first event
    genre = corpus.item_fields["genre"]
    assert genre.tokens == ["comedy", "drama"] and genre.lengths().tolist() == [2, 0, 1]
    assert corpus.item_fields["year"].lengths().tolist() == [1, 0, 0]
    assert corpus.item_dense[:, 0].tolist() == [9.5, 0.0, 1.0]
    assert corpus.user_fields["gender"].lengths().tolist() == [0, 1]
    assert corpus.ignored_fields == ["toy.inter:rating", "toy.user:scores"]


def test_an_items_float_fields_are_named_the_candidates_dense_columns(tmp_path):
    # what a two-tower model's request side must leave out (FeatureSpec.candidate_dense)
    folder = write_atomic(tmp_path / "toy", "u1\ti2\t4\t200\nu1\ti1\t5\t100\nu1\ti3\t1\t300\n",
                          "i1\tdrama\t1995\t9.5\ni2\tdrama\t\t1.0\ni3\thorror\t2001\t2\n")
    data = NextItemDataset(read_atomic(folder), NextItemConfig(num_negatives=1))
    assert data.spec.num_dense == 1 and data.spec.candidate_dense == (0,)


def test_atomic_reader_bad_rows_and_headers(tmp_path):
    folder = write_atomic(tmp_path / "toy", "u1\ti1\t4\t1\nu1\ti2\tfour\t2\nu2\ti1\t1\n")
    with pytest.raises(DataError, match=r"toy.inter:3: .*'four' in float field 'rating'"):
        read_atomic(folder)
    corpus = read_atomic(folder, skip_bad_rows=True)
    assert corpus.bad_rows == 2 and "toy.inter:4" in corpus.bad_row_examples[1] and corpus.items.numel() == 1
    broken = tmp_path / "broken"
    broken.mkdir()
    write(broken / "broken.inter", "user_id:token\titem_id:tokn\n1\t2\n")
    with pytest.raises(DataError, match=r"broken.inter:1: header cell 'item_id:tokn'"):
        read_atomic(broken)
    with pytest.raises(DataError, match="not found"):
        read_atomic(tmp_path / "nothing")


def needs(path: Path):
    if not path.exists():
        pytest.skip(f"shared real data not found at {path} (expected ../shared/data beside the repository)")


def test_beauty_matches_its_published_statistics():
    needs(DATA / "beauty")
    corpus = read_sequence_text(DATA / "beauty" / "Beauty.txt", DATA / "beauty" / "Beauty_item2attributes.json")
    assert (corpus.num_users, corpus.num_items, corpus.items.numel()) == (22363, 12101, 198502)
    assert corpus.bad_rows == 0 and int(corpus.lengths().min()) >= 5
    assert corpus.item_fields["attributes"].vocab_size == 637


def test_ml100k_matches_its_published_statistics():
    needs(DATA / "ml-100k")
    corpus = read_atomic(DATA / "ml-100k")
    assert (corpus.num_users, corpus.num_items, corpus.items.numel()) == (943, 1682, 100000)
    assert set(corpus.user_fields) == {"age", "gender", "occupation", "zip_code"}
    assert set(corpus.item_fields) == {"movie_title", "release_year", "class"}
    # each user's events are in time order
    steps = corpus.timestamps[1:] - corpus.timestamps[:-1]
    first = torch.zeros(corpus.items.numel(), dtype=torch.bool)
    first[corpus.offsets[:-1]] = True
    assert bool((steps[~first[1:]] >= 0).all())
