"""The Iceberg mapping and the exactly-once append, on a real pyiceberg SqlCatalog (SQLite)."""

from __future__ import annotations

import datetime as dt
import io
from pathlib import Path
from typing import Any

import fastavro
import pytest
from pyiceberg.types import (
    BinaryType,
    BooleanType,
    DateType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    TimestamptzType,
)

from danube_pipeline.lake import iceberg
from danube_pipeline.errors import OffsetRangeError, SchemaMismatchError
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore, segment_object_path
from danube_pipeline.format.records import Record

pytestmark = pytest.mark.unit

TOPIC = TopicName("default", "flights")

SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Flight",
    "namespace": "danube.test",
    "fields": [
        {"name": "year", "type": "int"},
        {"name": "flight", "type": "long"},
        {"name": "carrier", "type": "string"},
        {"name": "dep_delay", "type": ["null", "double"], "default": None},
        {"name": "ratio", "type": "float"},
        {"name": "cancelled", "type": "boolean"},
        {"name": "raw", "type": ["bytes", "null"]},
        {"name": "time_hour", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "seen_us", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}]},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
        {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["A", "B"]}},
        {"name": "either", "type": ["null", "int", "string"]},
    ],
}


def _payload(schema: dict[str, Any], value: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), value)
    return buf.getvalue()


def _value(i: int) -> dict[str, Any]:
    return {
        "year": 2013,
        "flight": 1000 + i,
        "carrier": "UA" if i % 2 else "AA",
        "dep_delay": None if i % 3 == 0 else float(i),
        "ratio": 0.5,
        "cancelled": i % 5 == 0,
        "raw": None if i % 2 else b"\x00\x01",
        "time_hour": dt.datetime(2013, 1, 1, 5, tzinfo=dt.UTC) + dt.timedelta(minutes=i),
        "seen_us": None,
        "day": dt.date(2013, 1, 1),
        "tags": ["x", str(i)],
        "kind": "B",
        "either": i if i % 2 else f"s{i}",
    }


def _records(start: int, end: int, schema: dict[str, Any] | None = SCHEMA) -> list[Record]:
    out = []
    for i in range(start, end + 1):
        payload = _payload(schema, _value(i)) if schema is not None else f"raw-{i}".encode()
        out.append(
            Record(
                offset=i,
                publish_time_us=1_700_000_000_000_000 + i,
                producer_id=42,
                producer_name="loader",
                schema_id=1 if schema is not None else 0,
                schema_version=1 if schema is not None else 0,
                payload=payload,
                attributes={"source": "test", "i": str(i)},
            )
        )
    return out


@pytest.fixture
def catalog(tmp_path: Path) -> Any:
    return iceberg.load_catalog(
        name="danube",
        uri=f"sqlite:///{tmp_path / 'catalog' / 'catalog.db'}",
        warehouse=(tmp_path / "warehouse").as_uri(),
    )


def test_schema_mapping_types_and_nullability() -> None:
    schema = iceberg.iceberg_schema_for_avro(SCHEMA)
    names = [f.name for f in schema.fields]
    assert names[: len(iceberg.METADATA_COLUMNS)] == list(iceberg.METADATA_COLUMNS)
    by_name = {f.name: f for f in schema.fields}
    assert by_name["_offset"].required and by_name["_offset"].field_type == LongType()
    assert by_name["_publish_time"].field_type == TimestamptzType()
    assert by_name["_schema_version"].field_type == IntegerType()
    assert isinstance(by_name["_attributes"].field_type, MapType)
    expected = {
        "year": (IntegerType(), True),
        "flight": (LongType(), True),
        "carrier": (StringType(), True),
        "dep_delay": (DoubleType(), False),
        "ratio": (FloatType(), True),
        "cancelled": (BooleanType(), True),
        "raw": (BinaryType(), False),
        "time_hour": (TimestamptzType(), True),
        "seen_us": (TimestamptzType(), False),
        "day": (DateType(), True),
        "tags": (StringType(), True),
        "kind": (StringType(), True),
        "either": (StringType(), False),
    }
    for name, (ftype, required) in expected.items():
        assert by_name[name].field_type == ftype, name
        assert by_name[name].required is required, name


def test_schema_without_avro_has_payload_column() -> None:
    schema = iceberg.iceberg_schema_for_avro(None)
    assert [f.name for f in schema.fields][-1] == iceberg.PAYLOAD_COLUMN
    assert schema.find_field(iceberg.PAYLOAD_COLUMN).field_type == BinaryType()


def test_arrow_table_decodes_payloads() -> None:
    table = iceberg.arrow_table_for_records(_records(0, 5), SCHEMA)
    assert table.num_rows == 6
    rows = table.to_pylist()
    assert rows[1]["flight"] == 1001 and rows[1]["carrier"] == "UA"
    assert rows[0]["dep_delay"] is None and rows[1]["dep_delay"] == 1.0
    assert rows[2]["time_hour"] == dt.datetime(2013, 1, 1, 5, 2, tzinfo=dt.UTC)
    assert rows[0]["_publish_time"] == dt.datetime.fromtimestamp(1_700_000_000, tz=dt.UTC)
    assert rows[0]["tags"] == '["x","0"]'
    assert rows[0]["kind"] == "B"
    assert rows[1]["either"] == "1" and rows[2]["either"] == '"s2"'
    assert dict(rows[3]["_attributes"]) == {"source": "test", "i": "3"}
    assert not table.schema.field("_offset").nullable


def test_u64_producer_id_keeps_its_bits() -> None:
    big = 10285063371164059634  # a random u64 producer id above 2**63
    record = Record(0, 0, big, "p", 0, 0, b"x", {})
    table = iceberg.arrow_table_for_records([record], None)
    stored = table.column("_producer_id")[0].as_py()
    assert stored < 0 and stored & (2**64 - 1) == big


def test_arrow_table_rejects_undecodable_payload() -> None:
    bad = Record(0, 0, 1, "p", 1, 1, b"\xff", {})
    with pytest.raises(SchemaMismatchError):
        iceberg.arrow_table_for_records([bad], SCHEMA)


def test_append_is_exactly_once(catalog: Any) -> None:
    table = iceberg.ensure_table(catalog, TOPIC, SCHEMA)
    assert table.name()[-2:] == ("default", "flights")
    assert iceberg.committed_end_offset(table) is None

    first = iceberg.append_records(table, _records(0, 99), SCHEMA, "data-0-99.dnb1")
    assert first.rows_appended == 100 and first.snapshot_id is not None
    assert first.committed_end_offset == 99

    again = iceberg.append_records(table, _records(0, 99), SCHEMA, "data-0-99.dnb1")
    assert again.rows_appended == 0 and again.snapshot_id is None and again.skipped == 100
    assert len(table.snapshots()) == 1

    # an overlapping batch appends only what is new
    overlap = iceberg.append_records(table, _records(50, 149), SCHEMA, "data-50-149.dnb1")
    assert overlap.rows_appended == 50 and overlap.skipped == 50

    # a fresh handle from the catalog sees the same committed offset
    reloaded = catalog.load_table(("default", "flights"))
    assert iceberg.committed_end_offset(reloaded) == 149
    assert iceberg.read_offsets(reloaded) == list(range(150))

    summary = reloaded.current_snapshot().summary
    assert summary[iceberg.SUMMARY_TOPIC] == "/default/flights"
    assert summary[iceberg.SUMMARY_START_OFFSET] == "100"
    assert summary[iceberg.SUMMARY_END_OFFSET] == "149"
    assert summary[iceberg.SUMMARY_OBJECT_ID] == "data-50-149.dnb1"
    assert iceberg.data_file_count(reloaded) == 2


def test_gap_raises(catalog: Any) -> None:
    table = iceberg.ensure_table(catalog, TOPIC, SCHEMA)
    iceberg.append_records(table, _records(0, 9), SCHEMA, "data-0-9.dnb1")
    with pytest.raises(OffsetRangeError) as err:
        iceberg.append_records(table, _records(20, 29), SCHEMA, "data-20-29.dnb1")
    assert err.value.expected_offset == 10 and err.value.actual_offset == 20
    assert iceberg.row_count(table) == 10


def test_first_offset_enforced_on_empty_table(catalog: Any) -> None:
    table = iceberg.ensure_table(catalog, TOPIC, SCHEMA)
    with pytest.raises(OffsetRangeError):
        iceberg.append_records(table, _records(5, 9), SCHEMA, "data-5-9.dnb1", first_offset=0)
    records = _records(0, 9)
    with pytest.raises(OffsetRangeError):
        iceberg.append_records(table, records[:3] + records[4:], SCHEMA, "data-0-9.dnb1")


def test_commit_conflict_is_retried(catalog: Any) -> None:
    """Two handles on one table: the stale one loses the compare-and-swap, refreshes, and
    appends only what the other did not."""
    a = iceberg.ensure_table(catalog, TOPIC, SCHEMA)
    b = catalog.load_table(("default", "flights"))
    iceberg.append_records(a, _records(0, 9), SCHEMA, "data-0-9.dnb1")
    result = iceberg.append_records(b, _records(0, 19), SCHEMA, "data-0-19.dnb1")
    assert result.attempts == 2
    assert result.rows_appended == 10 and result.skipped == 10
    assert iceberg.read_offsets(catalog.load_table(("default", "flights"))) == list(range(20))


def test_payload_table_without_schema(catalog: Any) -> None:
    table = iceberg.ensure_table(catalog, TOPIC, None)
    iceberg.append_records(table, _records(0, 4, schema=None), None, "data-0-4.dnb1")
    rows = table.scan().to_arrow().to_pylist()
    assert [r[iceberg.PAYLOAD_COLUMN] for r in rows] == [f"raw-{i}".encode() for i in range(5)]


def test_schema_evolution_adds_columns(catalog: Any) -> None:
    v2 = {**SCHEMA, "fields": [*SCHEMA["fields"], {"name": "origin", "type": ["null", "string"], "default": None}]}
    table = iceberg.ensure_table(catalog, TOPIC, SCHEMA)
    iceberg.append_records(table, _records(0, 4), SCHEMA, "data-0-4.dnb1")
    table = iceberg.ensure_table(catalog, TOPIC, v2)
    assert "origin" in {f.name for f in table.schema().fields}
    # old (version 1) records decoded with their own writer schema under the v2 table schema
    result = iceberg.append_records(table, _records(5, 9), v2, "data-5-9.dnb1", writer_schemas={(1, 1): SCHEMA})
    assert result.rows_appended == 5
    assert iceberg.row_count(table) == 10


def test_object_store_roundtrip(tmp_path: Path) -> None:
    store = ObjectStore((tmp_path / "objects").as_uri())
    path = segment_object_path(TOPIC, "data-0-9.dnb1")
    assert path == "topics/default/flights/data-0-9.dnb1"
    assert store.info(path) is None and not store.exists(path)
    info = store.put_bytes(path, b"hello")
    assert info.size_bytes == 5 and info.etag == "5d41402abc4b2a76b9719d911017c592"
    assert store.get_bytes(path) == b"hello"
    assert store.info(path, compute_etag=True) == info
    assert store.url(path).endswith("/objects/topics/default/flights/data-0-9.dnb1")
    assert store.list("topics") == [path]
    with pytest.raises(ValueError):
        store.put_bytes("../escape", b"x")


def test_snapshot_row_count_is_the_whole_table(catalog: Any) -> None:
    table = iceberg.ensure_table(catalog, TOPIC, SCHEMA)
    assert iceberg.snapshot_row_count(table) == 0
    iceberg.append_records(table, _records(0, 9), SCHEMA, "data-0-9.dnb1")
    iceberg.append_records(table, _records(10, 14), SCHEMA, "data-10-14.dnb1")
    assert iceberg.snapshot_row_count(table) == 15 == iceberg.row_count(table)


def test_duplicate_offsets(catalog: Any) -> None:
    table = iceberg.ensure_table(catalog, TOPIC, SCHEMA)
    iceberg.append_records(table, _records(0, 9), SCHEMA, "data-0-9.dnb1")
    assert iceberg.duplicate_offsets(table) == {}
    # rows 3 and 4 again, appended behind the exactly-once append's back
    table.append(table.scan(row_filter="_offset >= 3 and _offset <= 4").to_arrow())
    table.append(table.scan(row_filter="_offset == 4").to_arrow())
    assert iceberg.duplicate_offsets(table) == {3: 2, 4: 4}
    assert iceberg.snapshot_row_count(table) == 10 + 2 + 2


def test_committed_end_offset_is_a_property_set_in_the_append_commit(catalog: Any) -> None:
    """Each append is one commit (one new metadata file) holding both the snapshot and the
    ``danube.committed-end-offset`` property; pyiceberg's disabled retry setting stays off the
    stored table."""
    table = iceberg.ensure_table(catalog, TOPIC, SCHEMA)
    assert iceberg.COMMITTED_END_OFFSET_PROPERTY not in table.properties
    for start in (0, 10):
        before = len(table.metadata.metadata_log)
        result = iceberg.append_records(table, _records(start, start + 9), SCHEMA, f"data-{start}-{start + 9}.dnb1")
        stored = catalog.load_table(("default", "flights"))
        assert len(stored.metadata.metadata_log) == before + 1  # one commit, not two
        assert stored.current_snapshot().snapshot_id == result.snapshot_id
        assert stored.properties[iceberg.COMMITTED_END_OFFSET_PROPERTY] == str(start + 9)
        assert "commit.retry.num-retries" not in stored.properties


def test_committed_end_offset_survives_deletes_and_snapshot_expiry(catalog: Any) -> None:
    """Once no snapshot carrying ``danube.end-offset`` is left (a row delete on top, the
    appends' snapshots expired), the committed end offset still holds, so a replay appends
    nothing and the next object follows on."""
    table = iceberg.ensure_table(catalog, TOPIC, SCHEMA)
    iceberg.append_records(table, _records(0, 9), SCHEMA, "data-0-9.dnb1")
    iceberg.append_records(table, _records(10, 19), SCHEMA, "data-10-19.dnb1")
    table.delete("_offset < 5")
    table.maintenance.expire_snapshots().older_than(dt.datetime.now(dt.UTC) + dt.timedelta(minutes=1)).commit()
    table = catalog.load_table(("default", "flights"))
    assert len(table.snapshots()) == 1
    assert table.current_snapshot().summary[iceberg.SUMMARY_END_OFFSET] is None
    assert iceberg.committed_end_offset(table) == 19

    replay = iceberg.append_records(table, _records(10, 19), SCHEMA, "data-10-19.dnb1", first_offset=0)
    assert replay.rows_appended == 0 and replay.skipped == 10
    more = iceberg.append_records(table, _records(20, 24), SCHEMA, "data-20-24.dnb1", first_offset=0)
    assert more.rows_appended == 5
    assert iceberg.read_offsets(table) == list(range(5, 25))


def test_committed_end_offset_falls_back_to_snapshot_summaries(catalog: Any) -> None:
    """A table written before the property existed: the newest ancestor summary answers, and
    the next append writes the property."""
    table = iceberg.ensure_table(catalog, TOPIC, SCHEMA)
    iceberg.append_records(table, _records(0, 9), SCHEMA, "data-0-9.dnb1")
    with table.transaction() as transaction:
        transaction.remove_properties(iceberg.COMMITTED_END_OFFSET_PROPERTY)
    table.delete("_offset < 2")  # a snapshot without the summary on top
    assert iceberg.COMMITTED_END_OFFSET_PROPERTY not in table.properties
    assert iceberg.committed_end_offset(table) == 9
    iceberg.append_records(table, _records(5, 14), SCHEMA, "data-5-14.dnb1")
    assert table.properties[iceberg.COMMITTED_END_OFFSET_PROPERTY] == "14"
    assert iceberg.read_offsets(table) == list(range(2, 15))


def test_append_resumes_at_first_offset_after_expired_objects(catalog: Any) -> None:
    """Objects 10-19 expired and were deleted before reaching the table: with the topic's first
    remaining offset given, the append resumes there; without it, it is a gap."""
    table = iceberg.ensure_table(catalog, TOPIC, SCHEMA)
    iceberg.append_records(table, _records(0, 9), SCHEMA, "data-0-9.dnb1", first_offset=0)
    with pytest.raises(OffsetRangeError):
        iceberg.append_records(table, _records(20, 29), SCHEMA, "data-20-29.dnb1")
    with pytest.raises(OffsetRangeError) as err:  # a gap above the first offset is still one
        iceberg.append_records(table, _records(25, 29), SCHEMA, "data-25-29.dnb1", first_offset=20)
    assert err.value.expected_offset == 20
    result = iceberg.append_records(table, _records(20, 29), SCHEMA, "data-20-29.dnb1", first_offset=20)
    assert result.rows_appended == 10 and result.committed_end_offset == 29
    assert iceberg.read_offsets(table) == [*range(10), *range(20, 30)]
