import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gem_data import DataError, ParquetTable, SyntheticConfig, SyntheticGenerator, TableStream, concat_batches, write_parquet
from gem_data.testing import equal_batches


@pytest.fixture(scope="module")
def generator():
    return SyntheticGenerator(SyntheticConfig(num_ads=2000, max_events=24))


def test_round_trip_over_row_groups_and_files(generator, tmp_path):
    first, second = [generator.batch(i, 50) for i in range(3)], [generator.batch(9, 40)]
    write_parquet(first, generator.spec, tmp_path / "a.parquet", row_group_size=64)
    write_parquet(second, generator.spec, tmp_path / "b.parquet")
    table = ParquetTable([tmp_path / "a.parquet", tmp_path / "b.parquet"])
    assert table.spec == generator.spec and table.block_sizes() == [64, 64, 22, 40]
    read = concat_batches(list(TableStream(table, 64, shuffle=False, num_epochs=1)))
    read.validate(table.spec)
    expected = concat_batches(first + second)
    expected.sequences = {k: type(v)(v.ids, v.timestamps.double().float()) for k, v in expected.sequences.items()}
    assert equal_batches(read, expected)


def test_vocabularies_come_from_the_data_without_metadata(generator, tmp_path):
    write_parquet([generator.batch(0, 30)], generator.spec, tmp_path / "a.parquet")
    plain = pq.read_table(tmp_path / "a.parquet").replace_schema_metadata(None)
    pq.write_table(plain, tmp_path / "plain.parquet")
    table = ParquetTable(tmp_path / "plain.parquet")
    ads = generator.batch(0, 30).sparse["ad_id"].values()
    assert table.spec.sparse[0].num_embeddings == int(ads.max()) + 1
    assert ParquetTable(tmp_path / "plain.parquet", vocab_sizes={"ad_id": 5000}).spec.sparse[0].num_embeddings == 5000
    with pytest.raises(DataError, match=rf"plain\.parquet: ad_id: id {int(ads.max())} is past the vocabulary's 1 ids"):
        ParquetTable(tmp_path / "plain.parquet", vocab_sizes={"ad_id": 1})
    # a misspelt name left its feature sized by the file's own ids
    with pytest.raises(DataError, match=r"vocab_sizes names features the files do not hold: \['ad'\]"):
        ParquetTable(tmp_path / "plain.parquet", vocab_sizes={"ad": 5000})
    with pytest.raises(DataError, match=r"plain\.parquet: surface \d is past the 1 surfaces given"):
        ParquetTable(tmp_path / "plain.parquet", num_surfaces=1)


def handmade(path, rows, label_type=pa.float32()):
    pq.write_table(
        pa.table(
            {
                "sparse.ad": pa.array([r[0] for r in rows], pa.list_(pa.int64())),
                "event.click.item": pa.array([r[1] for r in rows], pa.list_(pa.int64())),
                "event.click.timestamp": pa.array([r[2] for r in rows], pa.list_(pa.float64())),
                "label.click": pa.array([r[3] for r in rows], label_type),
                "surface": pa.array([0] * len(rows), pa.int64()),
            }
        ),
        path,
        row_group_size=2,
    )
    return path


@pytest.mark.parametrize(
    "bad_row, message",
    [
        (([1, -2], [3], [1.0], 1.0), "negative id in sparse.ad"),
        (([1], [3, 4], [1.0], 0.0), "item and timestamp differ in length"),
        (([1], [3, 4], [2.0, 1.0], 0.0), "timestamp decreases"),
        (([1], [3], [1.0], 0.5), "label.click outside"),
        ((None, [3], [1.0], 1.0), "null in sparse.ad"),
    ],
)
def test_bad_rows_name_file_and_row_or_are_counted(tmp_path, bad_row, message):
    good = ([1, 2], [5, 6], [1.0, 2.0], 1.0)
    path = handmade(tmp_path / "user.parquet", [good, good, good, bad_row, good])
    with pytest.raises(DataError, match=rf"user.parquet:row 3: .*{message}"):
        ParquetTable(path)
    table = ParquetTable(path, skip_bad_rows=True)
    assert table.bad_rows == 1 and table.num_rows == 4 and table.block_sizes() == [2, 1, 1]
    batch = next(iter(TableStream(table, 4, shuffle=False)))
    batch.validate(table.spec)
    assert batch.sparse["ad"].values().tolist() == [1, 2] * 4
    assert table.spec.events[0].features[0].name == "click_item"


def test_boolean_labels_read_as_zero_and_one_and_their_nulls_name_the_row(tmp_path):
    good = ([1, 2], [5, 6], [1.0, 2.0], True)
    path = handmade(tmp_path / "flags.parquet", [good, ([1], [3], [1.0], False), good], pa.bool_())
    batch = next(iter(TableStream(ParquetTable(path), 3, shuffle=False)))
    assert batch.labels[:, 0].tolist() == [1.0, 0.0, 1.0]
    handmade(tmp_path / "null.parquet", [good, ([1], [3], [1.0], None), good], pa.bool_())
    with pytest.raises(DataError, match=r"null.parquet:row 1: .*null in label.click"):
        ParquetTable(tmp_path / "null.parquet")


def test_unknown_columns_are_rejected(tmp_path):
    pq.write_table(pa.table({"label.click": [1.0], "price": [2.0]}), tmp_path / "x.parquet")
    with pytest.raises(DataError, match="x.parquet: column 'price'"):
        ParquetTable(tmp_path / "x.parquet")
