"""Bad input to the readers gives one clear error naming the file and line (or row), never a quietly wrong corpus."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from gem_data import DataError, ParquetTable, read_atomic, read_sequence_text
from gem_data.sequential.corpus import vocabulary

HEADER = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"


def atomic(folder: Path, inter: str | bytes, item: str | None = None) -> Path:
    folder.mkdir()
    inter_path = folder / f"{folder.name}.inter"
    inter_path.write_bytes(inter if isinstance(inter, bytes) else inter.encode())
    if item is not None:
        (folder / f"{folder.name}.item").write_text(item)
    return folder


def sequences(corpus) -> list[list[str]]:
    bounds = zip(corpus.offsets[:-1].tolist(), corpus.offsets[1:].tolist())
    return [[corpus.item_tokens[i] for i in corpus.items[a:b].tolist()] for a, b in bounds]


# atomic files


@pytest.mark.parametrize("cell", ["nan", "-inf", "inf", "1e999"])
def test_atomic_rejects_a_time_that_is_not_finite(tmp_path, cell):
    folder = atomic(tmp_path / "toy", HEADER + f"1\t10\t3\t100\n1\t11\t4\t{cell}\n2\t10\t5\t70\n")
    with pytest.raises(DataError, match=rf"toy.inter:3: '{cell}' in float field 'timestamp' is not a finite number"):
        read_atomic(folder)
    corpus = read_atomic(folder, skip_bad_rows=True)
    assert corpus.bad_rows == 1 and corpus.timestamps.tolist() == [30.0, 0.0]


def test_atomic_rejects_a_feature_float_that_is_not_finite(tmp_path):
    folder = atomic(tmp_path / "toy", HEADER + "1\t10\t3\t100\n", item="item_id:token\tprice:float\n10\tnan\n")
    with pytest.raises(DataError, match=r"toy.item:2: 'nan' in float field 'price' is not a finite number"):
        read_atomic(folder)


def test_atomic_empty_time_names_file_and_line(tmp_path):
    folder = atomic(tmp_path / "toy", HEADER + "1\t10\t3\t100\n1\t11\t4\t\n")
    with pytest.raises(DataError, match=r"toy.inter:3: empty timestamp"):
        read_atomic(folder)
    assert read_atomic(folder, skip_bad_rows=True).bad_rows == 1


def test_atomic_time_field_must_be_float_and_a_named_one_must_exist(tmp_path):
    typed = atomic(tmp_path / "typed", "user_id:token\titem_id:token\ttimestamp:token\n1\t10\t100\n1\t11\t50\n")
    message = r"typed.inter:1: field 'timestamp' orders the events, so must be float, is token"
    with pytest.raises(DataError, match=message):
        read_atomic(typed)
    untimed = atomic(tmp_path / "untimed", "user_id:token\titem_id:token\n1\t11\n1\t10\n")
    assert sequences(read_atomic(untimed)) == [["11", "10"]]  # no time field: file order, as documented
    with pytest.raises(DataError, match=r"untimed.inter:1: header has no ts field"):
        read_atomic(untimed, time_field="ts")


def test_atomic_bytes_that_are_not_utf8_name_the_line(tmp_path):
    rows = b"caf\xc3\xa9\t10\t3\t100\ncaf\xe9\t10\t3\t100\ncaf\xe8\t11\t4\t50\n"  # UTF-8, then Latin-1 twice
    folder = atomic(tmp_path / "toy", HEADER.encode() + rows)
    with pytest.raises(DataError, match=r"toy.inter:3: byte 0xe9 at column 4 is not UTF-8 text"):
        read_atomic(folder)
    bom = atomic(tmp_path / "bom", b"\xef\xbb\xbf" + HEADER.encode() + b"caf\xc3\xa9\t10\t3\t100\n")
    assert read_atomic(bom).user_tokens == ["café"]


def test_atomic_cells_lose_surrounding_whitespace(tmp_path):
    folder = atomic(tmp_path / "toy", HEADER + "1\t10\t3\t100\n 1\t11 \t4\t50\n")
    corpus = read_atomic(folder)
    assert corpus.user_tokens == ["1"] and sequences(corpus) == [["11", "10"]]


def test_vocabulary_orders_equal_integers_the_same_every_run():
    spellings = ["1", "01", "001", "0001", "00001", "000001", "0000001", "2"]
    assert vocabulary(reversed(spellings)) == ["0000001", "000001", "00001", "0001", "001", "01", "1", "2"]
    assert vocabulary(["--1", "2"]) == ["--1", "2"]  # not integers (int() refuses "--1"): text order


# sequence text files


def test_text_ids_equal_as_integers_are_one_id(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("1 1 2 3\n2 01 02 3\n")
    attributes = tmp_path / "a.json"
    attributes.write_text(json.dumps({"01": [7], "3": [8]}))
    corpus = read_sequence_text(path, attributes)
    assert corpus.item_tokens == ["1", "2", "3"] and corpus.items.tolist() == [0, 1, 2, 0, 1, 2]
    assert corpus.item_fields["attributes"].lengths().tolist() == [1, 0, 1]
    path.write_text("1 1 2 3\n01 4 5 6\n")
    with pytest.raises(DataError, match=r"s.txt:2: user 1 appears on an earlier line too"):
        read_sequence_text(path)
    path.write_text("1 1 2 3\n")
    attributes.write_text(json.dumps({"1": [7], "01": [8]}))
    with pytest.raises(DataError, match=r"a.json:item 01: item 1 is given attributes twice"):
        read_sequence_text(path, attributes)
    # a key written twice in the JSON (a plain dict would keep its last value) and JSON's true as an id
    attributes.write_text('{"1": [7], "1": [8]}')
    with pytest.raises(DataError, match=r"a.json:item 1: item 1 is given attributes twice"):
        read_sequence_text(path, attributes)
    attributes.write_text('{"1": [true]}')
    with pytest.raises(DataError, match=r"a.json:item 1: attributes must be a list of non-negative integers, got \[True\]"):
        read_sequence_text(path, attributes)


def test_text_and_attribute_files_that_are_not_utf8_or_not_files(tmp_path):
    path = tmp_path / "s.txt"
    path.write_bytes(b"1 1 2 3\n2 2 \xe9 4\n")
    with pytest.raises(DataError, match=r"s.txt:2: byte 0xe9 at column 5 is not UTF-8 text"):
        read_sequence_text(path)
    path.write_text("1 1 2 3\n")
    attributes = tmp_path / "a.json"
    attributes.write_bytes(b'{"1": [1],\n "\xe9": [2]}')
    with pytest.raises(DataError, match=r"a.json:2: byte 0xe9 at column 3 is not UTF-8 text"):
        read_sequence_text(path, attributes)
    with pytest.raises(DataError, match=rf"{tmp_path}: is a directory, not a file"):
        read_sequence_text(tmp_path)
    with pytest.raises(DataError, match=rf"{tmp_path}: is a directory, not a file"):
        read_sequence_text(path, tmp_path)


# Parquet


def parquet(path: Path, times: list[list[float]], dense: list[list[float]] | None = None) -> Path:
    columns = {
        "event.click.item": pa.array([[1] * len(t) for t in times], pa.list_(pa.int64())),
        "event.click.timestamp": pa.array(times, pa.list_(pa.float64())),
        "label.ctr": pa.array([1.0] * len(times)),
    }
    if dense is not None:
        columns["dense"] = pa.array(dense, pa.list_(pa.float32()))
    pq.write_table(pa.table(columns), path)
    return path


def test_parquet_rejects_times_that_are_not_finite(tmp_path):
    path = parquet(tmp_path / "t.parquet", [[1.0, 2.0], [5.0, float("nan"), 1.0], [3.0, float("inf")]])
    with pytest.raises(DataError, match=r"t.parquet:row 1: event.click.timestamp is not a finite number"):
        ParquetTable(path)
    table = ParquetTable(path, skip_bad_rows=True)
    assert table.bad_rows == 2 and table.num_rows == 1


def test_parquet_times_keep_their_seconds_from_one_base_for_all_files(tmp_path):
    first = parquet(tmp_path / "a.parquet", [[1_700_000_050.0, 1_700_000_051.0]])
    second = parquet(tmp_path / "b.parquet", [[1_700_000_000.0, 1_700_000_100.0]])
    table = ParquetTable([first, second])
    assert table.take(0, torch.arange(1), 0).sequences["click"].timestamps.tolist() == [50.0, 51.0]
    assert table.take(1, torch.arange(1), 0).sequences["click"].timestamps.tolist() == [0.0, 100.0]
    assert table.time_base == 1_700_000_000.0


def test_parquet_file_that_is_not_parquet_is_named(tmp_path):
    (tmp_path / "x.parquet").write_text("hello, not parquet")
    with pytest.raises(DataError, match=r"x.parquet: not a Parquet file"):
        ParquetTable(tmp_path / "x.parquet")
    good = parquet(tmp_path / "good.parquet", [[1.0]])
    with pytest.raises(DataError, match=r"x.parquet: not a Parquet file"):
        ParquetTable([good, tmp_path / "x.parquet"])


def test_parquet_dense_width_is_not_set_by_a_bad_first_row(tmp_path):
    path = parquet(tmp_path / "d.parquet", [[1.0]] * 3, dense=[[1.0], [3.0, 4.0], [5.0, 6.0]])
    with pytest.raises(DataError, match=r"d.parquet:row 0: dense has a row width other than 2"):
        ParquetTable(path)
    path = parquet(tmp_path / "n.parquet", [[1.0]] * 3, dense=[None, [3.0, 4.0], [5.0, 6.0]])
    table = ParquetTable(path, skip_bad_rows=True)
    assert table.bad_rows == 1 and table.spec.num_dense == 2 and table.num_rows == 2


def test_parquet_rejects_dense_values_that_are_not_finite(tmp_path):
    path = parquet(tmp_path / "f.parquet", [[1.0]] * 3, dense=[[1.0, 2.0], [3.0, float("nan")], [float("inf"), 6.0]])
    with pytest.raises(DataError, match=r"f.parquet:row 1: dense is not a finite number"):
        ParquetTable(path)
    table = ParquetTable(path, skip_bad_rows=True)
    assert table.bad_rows == 2 and table.num_rows == 1


@pytest.mark.parametrize("cell", ["2_000", "\u0661\u0665", "1e3x", "0x10"])
def test_atomic_numbers_are_ascii_decimals(tmp_path, cell):
    """float() also reads "2_000" and other scripts' digits: a mangled cell became another number silently."""
    folder = atomic(tmp_path / "toy", HEADER + f"1\t10\t3\t100\n1\t11\t4\t{cell}\n")
    with pytest.raises(DataError, match=r"toy.inter:3: .* in float field 'timestamp' is not a finite number"):
        read_atomic(folder)


def test_atomic_feature_rows_without_a_key_or_beyond_float32_are_named(tmp_path):
    folder = atomic(tmp_path / "toy", HEADER + "1\t10\t3\t100\n1\t11\t4\t200\n",
                    item="item_id:token\tprice:float\n\t5\n11\t2\n")
    with pytest.raises(DataError, match=r"toy.item:2: empty item_id"):
        read_atomic(folder)
    (folder / "toy.item").write_text("item_id:token\tprice:float\n10\t1e39\n11\t2\n")
    with pytest.raises(DataError, match=r"toy.item:2: '1e39' in float field 'price' is out of float32 range"):
        read_atomic(folder)
    corpus = read_atomic(folder, skip_bad_rows=True)
    assert corpus.bad_rows == 1


@pytest.mark.parametrize("text, message", [
    ("[]", "expected an object mapping item ids to lists of attribute ids"),
    ('{"10": {}, "11": [1]}', r"item 10: attributes must be a list of non-negative integers"),
])
def test_attribute_files_tell_objects_from_arrays(tmp_path, text, message):
    """An array (another tool's file) read as no attributes at all, an object value as an empty list."""
    (tmp_path / "s.txt").write_text("1 10 11 12\n2 11 12 13\n")
    (tmp_path / "a.json").write_text(text)
    with pytest.raises(DataError, match=message):
        read_sequence_text(tmp_path / "s.txt", tmp_path / "a.json")


def test_parquet_corrupt_row_groups_and_directories_are_named(tmp_path):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"sparse.x": pa.array(range(1000), pa.int64()),
                             "label.click": pa.array([i % 2 for i in range(1000)], pa.int64())}),
                   path, compression="snappy", row_group_size=500)
    data = path.read_bytes()
    path.write_bytes(data[:20] + bytes(b ^ 0xFF for b in data[20:2000]) + data[2000:])  # pages; the footer whole
    with pytest.raises(DataError, match=r"c.parquet:row group 0: cannot be decoded"):
        ParquetTable(path)
    with pytest.raises(DataError, match=r"is a directory, not a file"):
        ParquetTable(tmp_path)


def test_parquet_columns_meeting_under_one_feature_name_are_named(tmp_path):
    table = pa.table({"sparse.history_item": pa.array([1], pa.int64()),
                      "event.history.item": pa.array([[1]], pa.list_(pa.int64())),
                      "event.history.timestamp": pa.array([[1.0]], pa.list_(pa.float64())),
                      "label.click": pa.array([1], pa.int64())})
    pq.write_table(table, tmp_path / "n.parquet")
    with pytest.raises(DataError, match=r"n.parquet: columns sparse.history_item and event.history.item both become "
                                        r"feature 'history_item'"):
        ParquetTable(tmp_path / "n.parquet")
