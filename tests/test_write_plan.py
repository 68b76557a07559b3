"""The per-schema write plan of danube_pipeline/lake/iceberg/data_files.py: what pyiceberg derives
for every data file, derived once per table schema, and the same files and statistics as
pyiceberg's own derivations give."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from pyiceberg.io.fileformat import FileFormatFactory
from pyiceberg.io.pyarrow import (
    _to_requested_schema,
    compute_statistics_plan,
    parquet_path_to_id_mapping,
    pyarrow_to_schema,
    schema_to_pyarrow,
)
from pyiceberg.manifest import FileFormat
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.table.metadata import TableMetadata
from pyiceberg.types import StringType

from danube_pipeline.dev.flights import FLIGHT_AVRO_SCHEMA, encode_flight, iter_flights
from danube_pipeline.format.records import Record
from danube_pipeline.lake.iceberg import data_files
from danube_pipeline.lake.iceberg.layout import partition_spec
from danube_pipeline.lake.iceberg.rows import BoundWriter, table_rows
from danube_pipeline.lake.iceberg.writer import WriterSchema, avro_writer
from danube_pipeline.storage.catalog import load_catalog

pytestmark = pytest.mark.unit


def _table(tmp_path: Path, name: str = "t") -> tuple[Table, WriterSchema]:
    catalog = load_catalog(name="plan", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/wh")
    catalog.create_namespace_if_not_exists("ns")
    writer = avro_writer(FLIGHT_AVRO_SCHEMA)
    return catalog.create_table(f"ns.{name}", schema=writer.iceberg_schema()), writer


def _rows(writer: WriterSchema, schema: Schema, n: int = 300) -> pa.Table:
    records = [
        Record(offset=i, publish_time_us=1_700_000_000_000_000 + i, producer_id=1, producer_name="p", schema_id=1,
               schema_version=1, payload=encode_flight(f), attributes={"origin": f["origin"]})
        for i, f in enumerate(iter_flights(n))
    ]
    return table_rows(records, schema, {(1, 1): BoundWriter("v1", writer=writer)}).rows


def test_the_plan_holds_what_pyiceberg_derives(tmp_path: Path) -> None:
    table, _writer = _table(tmp_path)
    metadata: TableMetadata = table.metadata
    plan = data_files.write_plan(metadata)
    schema = metadata.schema()
    assert plan.file_schema == schema
    assert plan.arrow_schema.equals(schema_to_pyarrow(schema, include_field_ids=False))
    assert plan.path_ids == parquet_path_to_id_mapping(schema)
    assert plan.statistics_plan == compute_statistics_plan(schema, metadata.properties)
    assert plan.use_dictionary is not None and not set(data_files.PLAIN_COLUMNS) & set(plan.use_dictionary)
    assert data_files.write_plan(metadata) is plan


def test_a_new_schema_or_metrics_property_gets_a_new_plan_other_properties_do_not(tmp_path: Path) -> None:
    table, _writer = _table(tmp_path)
    plan = data_files.write_plan(table.metadata)
    with table.transaction() as tx:
        tx.set_properties({"danube.committed-end-offset": "41"})
    table = table.refresh()
    assert data_files.write_plan(table.metadata) is plan  # the plan reads no such property
    with table.transaction() as tx:
        tx.set_properties({"write.metadata.metrics.column.carrier": "none"})
    table = table.refresh()
    metrics = data_files.write_plan(table.metadata)
    assert metrics is not plan
    carrier = table.schema().find_field("carrier").field_id
    assert metrics.statistics_plan[carrier].mode != plan.statistics_plan[carrier].mode
    with table.update_schema() as update:
        update.add_column("note", StringType())
    table = table.refresh()
    evolved = data_files.write_plan(table.metadata)
    assert evolved is not metrics and "note" in evolved.path_ids


def test_projection_equals_pyiceberg_and_is_reused(tmp_path: Path) -> None:
    table, writer = _table(tmp_path)
    rows = _rows(writer, table.schema())
    plan = data_files.write_plan(table.metadata)
    task_schema = plan.task_schema(rows.schema, False)
    assert task_schema == pyarrow_to_schema(
        rows.schema, name_mapping=table.schema().name_mapping, format_version=table.metadata.format_version
    )
    batch = rows.to_batches()[0]
    expected = _to_requested_schema(
        requested_schema=plan.file_schema, file_schema=task_schema, batch=batch, include_field_ids=True,
        format_model=FileFormatFactory.get(FileFormat.PARQUET),
    )
    first = plan.project(batch, task_schema, False)  # pyiceberg's projection, remembered
    again = plan.project(batch, task_schema, False)  # the remembered schema, columns as they are
    assert isinstance(plan._projected[batch.schema], pa.Schema)
    for out in (first, again):
        assert out.schema.equals(expected.schema, check_metadata=True)
        assert str(out.schema) == str(expected.schema)  # nested field ids (the map's key and value)
        assert out.equals(expected)


def test_a_projection_that_casts_is_never_reused(tmp_path: Path) -> None:
    table, writer = _table(tmp_path)
    rows = _rows(writer, table.schema())
    offsets = pa.field("_offset", pa.int32(), nullable=False)
    narrow = rows.set_column(0, offsets, rows.column("_offset").cast(pa.int32()))  # an int for a long column
    plan = data_files.write_plan(table.metadata)
    batch = narrow.to_batches()[0]
    task_schema = plan.task_schema(narrow.schema, False)
    out = plan.project(batch, task_schema, False)
    assert out.schema.field("_offset").type == pa.int64()  # pyiceberg promoted it
    assert plan._projected[batch.schema] is None
    again = plan.project(batch, task_schema, False)
    assert again.equals(out) and again.schema.field("_offset").type == pa.int64()


def test_appended_files_carry_pyiceberg_statistics(tmp_path: Path) -> None:
    table, writer = _table(tmp_path)
    rows = _rows(writer, table.schema())
    with table.transaction() as tx:
        data_files.append_table(tx, rows, table.io, {})
    table = table.refresh()
    (task,) = table.scan().plan_files()
    with table.transaction() as tx:  # pyiceberg's own write of the same rows, for comparison
        tx.append(rows)
    table = table.refresh()
    theirs = [t.file for t in table.scan().plan_files() if t.file.file_path != task.file.file_path]
    (reference,) = theirs
    ours = task.file
    assert ours.record_count == reference.record_count == 300
    assert ours.lower_bounds == reference.lower_bounds and ours.upper_bounds == reference.upper_bounds
    assert ours.null_value_counts == reference.null_value_counts and ours.value_counts == reference.value_counts
    assert table.scan().to_arrow().num_rows == 600


def test_single_partition_key_from_the_least_and_greatest_publish_times(tmp_path: Path) -> None:
    catalog = load_catalog(name="plan", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/wh")
    catalog.create_namespace_if_not_exists("ns")
    writer = avro_writer(FLIGHT_AVRO_SCHEMA)
    table = catalog.create_table(
        "ns.daily", schema=writer.iceberg_schema(), partition_spec=partition_spec(writer.iceberg_schema())
    )
    assert not table.spec().is_unpartitioned()
    rows = _rows(writer, table.schema(), n=5)
    day = 86_400_000_000
    t0 = 1_700_000_000_000_000 - 1_700_000_000_000_000 % day

    def at(times: list[int | None]) -> pa.Table:
        column = pa.array(times, type=pa.timestamp("us", tz="UTC"))
        return rows.set_column(rows.schema.get_field_index("_publish_time"), rows.schema.field("_publish_time"), column)

    key = data_files.single_partition_key(table.metadata, at([t0 + 5, t0, t0 + day - 1, t0 + 3, t0 + 7]))
    assert key is not None and key.partition[0] == t0 // day
    assert data_files.single_partition_key(table.metadata, at([t0 + 5, t0 + day, t0, t0 + 3, t0 + 7])) is None
    assert data_files.single_partition_key(table.metadata, at([t0 + 5, t0 - 1, t0, t0 + 3, t0 + 7])) is None
    assert data_files.single_partition_key(table.metadata, at([t0 + 5, None, t0, t0 + 3, t0 + 7])) is None
