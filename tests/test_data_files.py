"""Appending to a table without pyiceberg's per-partition copy (danube_pipeline/lake/iceberg/data_files.py):
the same data files as pyiceberg's own ``Transaction.append``, on real SQL catalogs."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyiceberg.table import Table

from danube_pipeline.lake import iceberg
from danube_pipeline.lake.iceberg.data_files import (
    PLAIN_COLUMNS,
    MetadataCachingTransaction,
    append_table,
    single_partition_key,
)
from danube_pipeline.lake.iceberg.rows import table_rows
from danube_pipeline.lake.iceberg.schema import schema_from_columns
from danube_pipeline.metadata.values import TableLayout
from danube_pipeline.names import TopicName
from danube_pipeline.format.records import Record

pytestmark = pytest.mark.unit

DAY_US = 86_400_000_000
T0 = 1_700_000_000_000_000  # 2023-11-14T22:13:20Z


def _rows(table: Table, times_us: list[int]) -> pa.Table:
    records = [Record(i, t, 1, "p", 0, 0, f"payload-{i}".encode(), {"i": str(i)}) for i, t in enumerate(times_us)]
    return table_rows(records, table.schema(), {}).rows


def _tables(tmp_path: Path, layout: TableLayout = TableLayout()) -> tuple[Table, Table]:
    catalog = iceberg.load_catalog(name="t", uri=f"sqlite:///{tmp_path / 'c.db'}", warehouse=f"file://{tmp_path / 'wh'}")
    schema = schema_from_columns(None, partitioned=False)
    ours = iceberg.ensure_table_for_schema(catalog, TopicName.parse("/default/ours"), schema, layout=layout)
    theirs = iceberg.ensure_table_for_schema(catalog, TopicName.parse("/default/theirs"), schema, layout=layout)
    return ours, theirs


def _files(table: Table) -> list[dict[str, object]]:
    table.refresh()
    files = table.inspect.files().select(
        ["partition", "record_count", "value_counts", "null_value_counts", "lower_bounds", "upper_bounds"]
    ).to_pylist()
    return sorted(files, key=lambda f: str(f["partition"]))


@pytest.mark.parametrize(
    ("times", "files"),
    [
        ([T0 + i for i in range(50)], 1),  # one day: written as is
        ([T0 - DAY_US, T0, T0 + 1, T0 - DAY_US + 5], 2),  # two days, not contiguous: pyiceberg splits
    ],
    ids=["one-day", "two-days"],
)
def test_the_same_data_files_as_pyiceberg(tmp_path: Path, times: list[int], files: int) -> None:
    ours, theirs = _tables(tmp_path)
    df = _rows(ours, times)
    with MetadataCachingTransaction(ours) as transaction:
        append_table(transaction, df, ours.io, {"danube.test": "1"})
    with theirs.transaction() as transaction:
        transaction.append(df, snapshot_properties={"danube.test": "1"})
    assert len(_files(ours)) == files
    assert _files(ours) == _files(theirs)
    assert ours.scan().to_arrow().sort_by("_offset").equals(theirs.scan().to_arrow().sort_by("_offset"))
    snapshot = ours.current_snapshot()
    assert snapshot is not None and snapshot.summary is not None and snapshot.summary["danube.test"] == "1"


def test_single_partition_key(tmp_path: Path) -> None:
    ours, _ = _tables(tmp_path)
    key = single_partition_key(ours.metadata, _rows(ours, [T0, T0 + 5]))
    assert key is not None and key.partition[0] == T0 // DAY_US  # days since the epoch (Iceberg spec)
    assert single_partition_key(ours.metadata, _rows(ours, [T0, T0 + DAY_US])) is None
    hourly, _ = _tables(tmp_path / "hourly", TableLayout(partition_transform="hour"))
    key = single_partition_key(hourly.metadata, _rows(hourly, [T0, T0 + 1000]))
    assert key is not None and key.partition[0] == T0 // 3_600_000_000


def test_an_unpartitioned_table(tmp_path: Path) -> None:
    ours, theirs = _tables(tmp_path, TableLayout(partition_transform="none"))
    df = _rows(ours, [T0, T0 + DAY_US])
    with MetadataCachingTransaction(ours) as transaction:
        append_table(transaction, df, ours.io, {})
    with theirs.transaction() as transaction:
        transaction.append(df)
    assert _files(ours) == _files(theirs) and len(_files(ours)) == 1


def test_the_transaction_reads_its_metadata_once_per_state(tmp_path: Path) -> None:
    ours, _ = _tables(tmp_path)
    transaction = MetadataCachingTransaction(ours)
    first = transaction.table_metadata
    assert transaction.table_metadata is first
    transaction.set_properties({"danube.x": "1"})  # staging an update is a new state
    second = transaction.table_metadata
    assert second is not first and second.properties["danube.x"] == "1"
    assert "danube.x" not in ours.metadata.properties
    append_table(transaction, _rows(ours, [T0]), ours.io, {})
    transaction.commit_transaction()
    ours.refresh()
    assert ours.metadata.properties["danube.x"] == "1" and iceberg.snapshot_row_count(ours) == 1


def test_offsets_and_publish_times_have_no_dictionary(tmp_path: Path) -> None:
    ours, theirs = _tables(tmp_path)
    df = _rows(ours, [T0 + 1000 * i for i in range(5000)])
    with MetadataCachingTransaction(ours) as transaction:
        append_table(transaction, df, ours.io, {})
    with theirs.transaction() as transaction:
        transaction.append(df)

    def encodings(table: Table) -> tuple[dict[str, tuple[str, ...]], int]:
        [path] = [task.file.file_path for task in table.scan().plan_files()]
        with table.io.new_input(path).open() as stream:
            parquet = pq.ParquetFile(stream)
            group = parquet.metadata.row_group(0)
            columns = {group.column(i).path_in_schema: group.column(i).encodings for i in range(group.num_columns)}
        return columns, len(table.io.new_input(path))

    mine, my_size = encodings(ours)
    pyiceberg_s, their_size = encodings(theirs)
    for column in PLAIN_COLUMNS:
        assert "PLAIN" in mine[column] and "RLE_DICTIONARY" not in mine[column]
        assert "RLE_DICTIONARY" in pyiceberg_s[column]
    assert "RLE_DICTIONARY" in mine["_producer_name"]
    assert my_size < their_size
