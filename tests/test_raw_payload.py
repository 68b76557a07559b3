"""The table layout's ``raw_payload`` (``docs/etcd-layout.md`` §3.9): a topic table with typed
columns keeps every payload's exact bytes in ``_raw_payload``, and its dead-letter table every
message's producer id and attributes, so that the table can serve messages byte for byte.

Against a real etcd (descriptors, the layout key), real segment objects and a real SQLite
Iceberg catalog; the Spark test compacts the table, runs a ``schema_rewrite`` that changes a
column's type and a bulk load into another table, on the run's one Spark session. Payloads are
written so that re-encoding the typed columns could not give them back (JSON with its own
spacing and key order, Protobuf fields out of number order, an Avro ``double`` NaN), so only
the stored bytes pass.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq
import pytest
from google.protobuf import descriptor_pb2
from helpers import RegisterCatalog
from tiering_helpers import PUBLISH_TIME_US, Env, FakeRegistry, Protos, avro, avro_payload, put_object

from danube_pipeline.format.records import Record
from danube_pipeline.lake import iceberg
from danube_pipeline.lake import rewrite as rw
from danube_pipeline.lake.bulk import bulk_load
from danube_pipeline.lake.iceberg.schema import RESERVED_COLUMNS, payload_columns, schema_from_columns
from danube_pipeline.lake.spark.procedures import compact_table
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import TableLayout
from danube_pipeline.names import TopicName
from danube_pipeline.storage import table_columns as tc
from danube_pipeline.storage.objectstore import ObjectStore

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

F = descriptor_pb2.FieldDescriptorProto
CATALOG = "danube"
DAY_US = 86_400_000_000
V1 = avro(
    {"name": "flight", "type": "int"},
    {"name": "carrier", "type": "string"},
    {"name": "delay", "type": ["null", "double"]},
)
JSON_SCHEMA = {
    "type": "object",
    "properties": {"flight": {"type": "integer"}, "carrier": {"type": "string"}},
    "required": ["flight"],
}


def _record(offset: int, payload: bytes, schema_id: int = 0, version: int = 0) -> Record:
    """A record whose metadata varies with ``offset``: a u64 producer id with the high bit set
    for odd offsets, empty attributes for every third, three UTC days, and a routing key that
    is absent, empty or a name in turn."""
    return Record(
        offset=offset,
        publish_time_us=PUBLISH_TIME_US + (offset % 3) * DAY_US + offset,
        producer_id=(1 << 63) + offset if offset % 2 else 42,
        producer_name=f"producer-{offset % 4}",
        schema_id=schema_id,
        schema_version=version,
        payload=payload,
        attributes={} if offset % 3 == 0 else {"i": str(offset), "kind": "é"},
        key=(None, "", f"key-{offset}")[offset % 3],
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("raw-payload")


@pytest.fixture
def env(etcd_endpoints: list[str], root: Path) -> Env:
    catalog = iceberg.load_catalog(
        name=CATALOG, uri=f"sqlite:///{root / 'catalog.db'}", warehouse=(root / "warehouse").as_uri()
    )
    return Env(etcd_endpoints, catalog, ObjectStore((root / "objects").as_uri()), FakeRegistry(), Protos())


@pytest.fixture
def spark(root: Path, spark_on_catalog: RegisterCatalog) -> SparkSession:
    return spark_on_catalog(name=CATALOG, uri=f"sqlite:///{root / 'catalog.db'}", warehouse=(root / "warehouse").as_uri())


async def _set_layout(env: Env, topic: TopicName, layout: TableLayout) -> None:
    async with await MetadataStore.connect(env.endpoints) as store:
        await store.put(keys.topic_table(topic), layout)


async def _put(env: Env, topic: TopicName, *objects: list[Record]) -> list[Record]:
    async with await MetadataStore.connect(env.endpoints) as store:
        for records in objects:
            await put_object(store, env.objects, topic, records, batches=True)  # keys kept
    return [r for records in objects for r in records]


# --------------------------------------------------------------------------- the four formats


def _avro_history() -> list[list[Record]]:
    """Avro rows (one with a NaN delay), then a raw record, an unknown schema id and a corrupt
    payload (three dead letters)."""
    good = [
        _record(i, avro_payload(V1, {"flight": i, "carrier": "UA", "delay": math.nan if i == 3 else i / 2}), 1, 1)
        for i in range(8)
    ]
    bad = [_record(8, b"\x07"), _record(9, avro_payload(V1, {"flight": 9, "carrier": "AA", "delay": None}), 9, 1)]
    return [good[:5], good[5:] + bad + [_record(10, b"\xff\xff\xff", 1, 1)]]


def _json_history() -> list[list[Record]]:
    """JSON texts with their own spacing and key order; one misfit (a string ``flight``)."""
    texts = [
        b'{ "carrier" : "UA",  "flight": 1 }',
        b'{"flight":2}',
        b'{\n  "flight": 3,\n  "carrier": "D\\u004c"\n}',
        b'{"flight": "four"}',
        b'  {"carrier":"AA","flight":5}  ',
    ]
    return [[_record(i, t, 2, 1) for i, t in enumerate(texts)]]


def _protobuf_history(protos: Protos) -> list[list[Record]]:
    """Protobuf payloads with field 2 before field 1 (a serializer writes 1 first) and one
    corrupt payload."""
    flight = protos.message("raw.pb", "Flight", [("carrier", 1, F.TYPE_STRING, {}), ("delay", 2, F.TYPE_INT32, {})])
    payloads = [
        protos.encode(flight, delay=i) + protos.encode(flight, carrier=f"C{i}") for i in range(1, 4)
    ] + [b"\x0a\xff"]
    return [[_record(i, p, 3, 1) for i, p in enumerate(payloads)]]


def _raw_history() -> list[list[Record]]:
    return [[_record(i, bytes([i]) * i) for i in range(4)], [_record(4, b"")]]


def _norm_attributes(value: Any) -> dict[str, str] | None:
    return None if value is None else dict(value)


def _assert_same_message(row: dict[str, Any], r: Record, payload_column: str) -> None:
    assert row[payload_column] == r.payload, (r.offset, payload_column)
    assert row["_offset"] == r.offset
    assert round(row["_publish_time"].timestamp() * 1_000_000) == r.publish_time_us
    assert row["_producer_name"] == r.producer_name
    assert row["_producer_id"] & 0xFFFF_FFFF_FFFF_FFFF == r.producer_id
    assert _norm_attributes(row["_attributes"]) == dict(r.attributes)
    assert (row["_schema_id"], row["_schema_version"]) == (r.schema_id, r.schema_version)
    assert row[tc.KEY_COLUMN] == {tc.KEY_VALUE_FIELD: r.key}


def _rows(table: Any) -> dict[int, dict[str, Any]]:
    return {r["_offset"]: r for r in table.scan().to_arrow().to_pylist()}


def _check_table(env: Env, topic: TopicName, records: list[Record], *, dead: set[int]) -> None:
    """Every record is a row or a dead letter, each with its exact payload and metadata."""
    table = env.catalog.load_table(iceberg.table_identifier(topic))
    names = {f.name for f in table.schema().fields}
    payload_column = tc.PAYLOAD_COLUMN if tc.PAYLOAD_COLUMN in names else tc.RAW_PAYLOAD_COLUMN
    assert payload_column in names
    assert (tc.RAW_PAYLOAD_COLUMN in names) == (payload_column == tc.RAW_PAYLOAD_COLUMN)
    rows = _rows(table)
    dlq = iceberg.dead_letter_table_of(table)
    letters = _rows(dlq) if dlq is not None else {}
    assert set(letters) == dead and set(rows) == {r.offset for r in records} - dead
    for r in records:
        if r.offset in dead:
            _assert_same_message(letters[r.offset], r, tc.PAYLOAD_COLUMN)
        else:
            _assert_same_message(rows[r.offset], r, payload_column)


@pytest.mark.integration
@pytest.mark.asyncio
async def test_every_format_keeps_exact_payloads_and_metadata(env: Env) -> None:
    """Avro, JSON Schema, Protobuf and raw topics tiered with ``raw_payload`` on: every row's
    ``_raw_payload`` (``_payload`` for the raw topic) and every dead letter's ``_payload`` are the
    published bytes, with offset, publish time, producer, attributes and schema equal."""
    env.registry.add_avro(1, 1, V1, subject="avro-value")
    env.registry.add(2, 1, "JsonSchema", json.dumps(JSON_SCHEMA), "json-value")
    env.registry.add(3, 1, "Protobuf", "raw.pb.Flight", "pb-value")
    one_day = [  # an object within one day: written by the commit path's own Parquet writer
        dataclasses.replace(
            _record(i, avro_payload(V1, {"flight": i, "carrier": "B6", "delay": None}), 1, 1),
            publish_time_us=PUBLISH_TIME_US + i,
        )
        for i in range(11, 14)
    ]
    cases = [
        (TopicName("default", "raw_avro"), [*_avro_history(), one_day], {8, 9, 10}),
        (TopicName("default", "raw_json"), _json_history(), {3}),
        (TopicName("default", "raw_pb"), _protobuf_history(env.protos), {3}),
        (TopicName("default", "raw_none"), _raw_history(), set()),
    ]
    for topic, objects, dead in cases:
        await _set_layout(env, topic, TableLayout(raw_payload=True))
        records = await _put(env, topic, *objects)
        report = await env.tier(topic)
        assert report.committed_end_offset == records[-1].offset and report.dead_letter_records == len(dead)
        _check_table(env, topic, records, dead=dead)

    avro_table = env.catalog.load_table(iceberg.table_identifier(cases[0][0]))
    assert avro_table.schema().find_field(tc.RAW_PAYLOAD_COLUMN).required is False
    assert math.isnan(_rows(avro_table)[3]["delay"])  # the typed column is written as before
    dlq = iceberg.dead_letter_table_of(avro_table)
    assert dlq is not None
    assert {tc.PRODUCER_ID_COLUMN, tc.ATTRIBUTES_COLUMN, tc.KEY_COLUMN} <= {f.name for f in dlq.schema().fields}
    own_writer = 0
    for task in avro_table.scan().plan_files():
        with avro_table.io.new_input(task.file.file_path).open() as stream:
            group = pq.ParquetFile(stream).metadata.row_group(0)
            encodings = {group.column(i).path_in_schema: group.column(i).encodings for i in range(group.num_columns)}
        if "RLE_DICTIONARY" not in encodings["_offset"]:  # payload bytes, like offsets, without a dictionary
            own_writer += 1
            assert "RLE_DICTIONARY" not in encodings[tc.RAW_PAYLOAD_COLUMN]
            assert "RLE_DICTIONARY" in encodings["carrier"]
    assert own_writer == 1
    raw_table = env.catalog.load_table(iceberg.table_identifier(cases[3][0]))
    raw_names = [f.name for f in raw_table.schema().fields]
    assert tc.RAW_PAYLOAD_COLUMN not in raw_names and raw_names[-1] == tc.KEY_COLUMN


@pytest.mark.integration
@pytest.mark.asyncio
async def test_off_by_default_then_turned_on_evolves_the_table(env: Env) -> None:
    """Without the field the table and its dead-letter table are as before; turned on, the
    next tiering adds the columns in place (rows before read null) and fills them from then
    on; turned off again, new rows are written without them."""
    env.registry.add_avro(1, 1, V1, subject="avro-value")
    topic = TopicName("default", "raw_later")
    first, second = _avro_history()
    await _put(env, topic, first + [_record(5, b"\x07")])
    await env.tier(topic)
    table = env.table(topic)
    names = [f.name for f in table.schema().fields]
    assert tc.RAW_PAYLOAD_COLUMN not in names
    dlq = iceberg.dead_letter_table_of(table)
    assert dlq is not None and dlq.schema() == iceberg.dead_letter_schema()

    await _set_layout(env, topic, TableLayout(raw_payload=True))
    later = [dataclasses.replace(r, offset=r.offset + 1) for r in second]
    await _put(env, topic, later)
    report = await env.tier(topic)
    assert "add optional column _raw_payload binary" in report.schema_changes
    table = env.table(topic)
    assert [f.name for f in table.schema().fields] == [*names, tc.RAW_PAYLOAD_COLUMN, tc.KEY_COLUMN]
    rows = _rows(table)
    assert all(rows[o][tc.RAW_PAYLOAD_COLUMN] is None and rows[o][tc.KEY_COLUMN] is None for o in range(5))
    for r in later:
        if r.offset in rows:
            assert rows[r.offset][tc.RAW_PAYLOAD_COLUMN] == r.payload
    letters = _rows(iceberg.dead_letter_table_of(table))
    assert letters[5][tc.ATTRIBUTES_COLUMN] is None and letters[5][tc.PRODUCER_ID_COLUMN] is None
    assert letters[5][tc.KEY_COLUMN] is None
    for offset in (9, 10, 11):
        r = next(x for x in later if x.offset == offset)
        _assert_same_message(letters[offset], r, tc.PAYLOAD_COLUMN)

    await _set_layout(env, topic, TableLayout(raw_payload=False))
    await _put(env, topic, [_record(12, avro_payload(V1, {"flight": 12, "carrier": "B6", "delay": None}), 1, 1)])
    await env.tier(topic)
    assert _rows(env.table(topic))[12][tc.RAW_PAYLOAD_COLUMN] is None


@pytest.mark.integration
def test_admin_cli_sets_raw_payload_and_keeps_the_partitioning(etcd_endpoints: list[str]) -> None:
    """``danube-admin topics set-table-layout --raw-payload`` changes only that field of §3.9;
    ``--no-raw-payload`` turns it off; neither option is a usage error (exit 2)."""
    import asyncio
    import subprocess
    import sys

    topic = TopicName("default", "raw_cli")
    admin = str(Path(sys.executable).parent / "danube-admin")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [admin, "--etcd-endpoints", ",".join(etcd_endpoints), "--output", "json", "topics", "set-table-layout",
             topic.path, *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    async def put_root() -> None:
        async with await MetadataStore.connect(etcd_endpoints) as store:
            await store.put(keys.topic_root(topic), 0)

    async def stored() -> Any:
        async with await MetadataStore.connect(etcd_endpoints) as store:
            kv = await store.get(keys.topic_table(topic))
        return kv.value if kv is not None else None

    asyncio.run(put_root())
    hour = run("--partition-by", "hour")
    assert hour.returncode == 0, hour.stderr
    assert asyncio.run(stored()) == {"partition_transform": "hour"}
    on = run("--raw-payload")
    assert on.returncode == 0, on.stderr
    assert json.loads(on.stdout)["raw_payload"] is True
    assert asyncio.run(stored()) == {"partition_transform": "hour", "raw_payload": True}
    off = run("--no-raw-payload", "--partition-by", "day")
    assert off.returncode == 0, off.stderr
    assert asyncio.run(stored()) == {"partition_transform": "day"}
    neither = run()
    assert neither.returncode == 2 and "--raw-payload" in neither.stderr


@pytest.mark.unit
def test_layout_value_and_reserved_names() -> None:
    assert TableLayout().to_json() == {"partition_transform": "day"}  # unchanged without the field
    assert TableLayout.from_json({"partition_transform": "day"}).raw_payload is False
    on = TableLayout.from_json({"partition_transform": "hour", "raw_payload": True})
    assert on == TableLayout("hour", True) and on.to_json() == {"partition_transform": "hour", "raw_payload": True}
    with pytest.raises(ValueError, match="raw_payload must be true or false"):
        TableLayout.from_json({"raw_payload": "yes"})
    assert iceberg.RAW_PAYLOAD_COLUMN == tc.RAW_PAYLOAD_COLUMN == "_raw_payload"
    assert RESERVED_COLUMNS is tc.RESERVED_COLUMNS and {tc.RAW_PAYLOAD_COLUMN, tc.KEY_COLUMN} <= RESERVED_COLUMNS
    schema = schema_from_columns(payload_columns(V1), raw_payload=True)
    assert [f.name for f in schema.fields][-3:] == ["delay", "_raw_payload", "_key"]
    assert schema.find_field("_key").field_type == iceberg.key_type(schema.find_field("_key.value").field_id)
    assert [f.name for f in schema_from_columns(None, raw_payload=True).fields][-2:] == ["_payload", "_key"]
    assert len({f.field_id for f in schema.fields}) == len(schema.fields)
    with pytest.raises(rw.RewriteSpecError, match="columns._raw_payload"):
        rw.RewriteSpec.from_json('{"version": 2, "columns": {"_raw_payload": {"type": "string"}}}')
    with pytest.raises(rw.RewriteSpecError, match="drop"):
        rw.RewriteSpec.from_json('{"version": 2, "columns": {"a": {"type": "string"}}, "drop": ["_raw_payload"]}')


# --------------------------------------------------------------------------- Spark


@pytest.mark.spark
@pytest.mark.asyncio
async def test_exact_payloads_survive_compaction_schema_rewrite_and_bulk_load(env: Env, spark: SparkSession) -> None:
    """Compaction (Spark ``rewrite_data_files``) and a ``schema_rewrite`` that turns ``flight``
    from int into string carry ``_raw_payload`` unchanged; a bulk load writes the same rows."""
    env.registry.add_avro(1, 1, V1, subject="avro-value")
    topic = TopicName("default", "raw_maintained")
    await _set_layout(env, topic, TableLayout(partition_transform="none", raw_payload=True))
    objects = _avro_history()
    records = await _put(env, topic, *objects, *[
        [_record(i, avro_payload(V1, {"flight": i, "carrier": "DL", "delay": 1.0}), 1, 1) for i in range(j, j + 3)]
        for j in (11, 14)
    ])
    await env.tier(topic)
    dead = {8, 9, 10}
    _check_table(env, topic, records, dead=dead)
    assert iceberg.data_file_count(env.table(topic)) == 4

    compacted = compact_table(spark, topic, catalog_name=CATALOG)
    assert compacted.rewritten_data_files == 4 and iceberg.data_file_count(env.table(topic)) == 1
    _check_table(env, topic, records, dead=dead)

    table = env.table(topic)
    rw.set_rewrite_spec(table, {"version": 2, "columns": {"flight": {"type": "string"}}})
    day = dt.datetime.fromtimestamp(PUBLISH_TIME_US / 1e6, dt.UTC).date()
    report = rw.rewrite_table(spark, env.catalog, topic, catalog_name=CATALOG, day=day)
    assert report.finalized and report.units and all(u.checksum_before == u.checksum_after for u in report.units)
    table = env.table(topic)
    assert str(table.schema().find_field("flight").field_type) == "string"
    rows = _rows(table)
    assert {o: r["flight"] for o, r in rows.items()} == {r.offset: str(r.offset) for r in records if r.offset not in dead}
    _check_table(env, topic, records, dead=dead)

    bulk = await bulk_load_into(env, spark, topic, "raw_maintained_bulk")
    assert bulk.committed_end_offset == records[-1].offset
    bulk_table = env.catalog.load_table(("default", "raw_maintained_bulk"))
    assert tc.RAW_PAYLOAD_COLUMN in {f.name for f in bulk_table.schema().fields}
    bulk_rows = _rows(bulk_table)
    assert {o: r[tc.RAW_PAYLOAD_COLUMN] for o, r in bulk_rows.items()} == {
        o: r[tc.RAW_PAYLOAD_COLUMN] for o, r in rows.items()
    }
    _check_table(env, TopicName("default", "raw_maintained_bulk"), records, dead=dead)


async def bulk_load_into(env: Env, spark: SparkSession, topic: TopicName, target: str) -> Any:
    async with await MetadataStore.connect(env.endpoints) as store:
        return await bulk_load(
            spark, env.catalog, topic, store=store, objects=env.objects, registry=env.registry,
            target=target, replay=True, catalog_name=CATALOG,
        )
