"""A topic's table evolving in place with its schema versions (Iceberg spec, "Schema
Evolution"), through tiering: records of version 1, then of version 2, in segment objects
committed by ``commit_objects_to_table`` against a real etcd and a real pyiceberg catalog.
Also the JSON Schema and Protobuf mappings to Iceberg types and their payload decoding."""

from __future__ import annotations

import datetime as dt
import decimal
import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2
from pyiceberg.types import (
    BinaryType,
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    ListType,
    LongType,
    MapType,
    StringType,
    StructType,
    TimestamptzType,
)

from danube_pipeline.lake import iceberg
from danube_pipeline.errors import SchemaEvolutionError
from danube_pipeline.lake.iceberg.writer import PayloadDecodeError
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.lake.tiering import commit_objects_to_table

from tiering_helpers import Env, Protos, avro, avro_records, make_env, put_object, record

TOPIC = TopicName("default", "evolving")
F = descriptor_pb2.FieldDescriptorProto


@pytest.fixture
def env(etcd_endpoints: list[str], tmp_path: Path) -> Env:
    return make_env(etcd_endpoints, tmp_path)


def _field(env: Env, name: str) -> Any:
    return env.table().schema().find_field(name)


# --------------------------------------------------------------------------- the two bugs


@pytest.mark.integration
@pytest.mark.asyncio
async def test_removed_field_becomes_optional_and_keeps_old_values(env: Env) -> None:
    """Issue 11: v2 removes ``b``; tiering objects of v2 records only failed with "Column 'b'
    is declared non-nullable but contains nulls"."""
    v1 = avro({"name": "a", "type": "int"}, {"name": "b", "type": "string"})
    v2 = avro({"name": "a", "type": "int"})
    env.registry.add_avro(1, 1, v1)
    await env.put(avro_records(v1, 1, [(i, {"a": i, "b": f"x{i}"}) for i in range(3)]))
    await env.tier()
    b_id = _field(env, "b").field_id
    assert _field(env, "b").required

    env.registry.add_avro(1, 2, v2)
    await env.put(avro_records(v2, 2, [(i, {"a": i}) for i in range(3, 6)]))
    report = await env.tier()
    assert report.rows_appended == 3 and report.dead_letter_records == 0
    assert "make column b optional" in report.schema_changes
    b = _field(env, "b")
    assert not b.required and b.field_id == b_id
    assert env.rows("a", "b") == [
        *({"_offset": i, "a": i, "b": f"x{i}"} for i in range(3)),
        *({"_offset": i, "a": i, "b": None} for i in range(3, 6)),
    ]
    assert env.table().properties[iceberg.SCHEMA_VERSION_PROPERTY] == "2"


@pytest.mark.integration
@pytest.mark.asyncio
async def test_int_to_long_and_float_to_double_are_promoted(env: Env) -> None:
    """Issue 11: v2 promotes ``n`` int -> long; its values above 2**31 failed with "too large
    to fit", five times, and the topic never tiered again."""
    v1 = avro({"name": "n", "type": "int"}, {"name": "x", "type": "float"})
    v2 = avro({"name": "n", "type": "long"}, {"name": "x", "type": "double"})
    env.registry.add_avro(1, 1, v1)
    env.registry.add_avro(1, 2, v2)
    await env.put(avro_records(v1, 1, [(0, {"n": 1, "x": 0.5})]))
    await env.tier()
    ids = (_field(env, "n").field_id, _field(env, "x").field_id)
    assert _field(env, "n").field_type == IntegerType() and _field(env, "x").field_type == FloatType()

    big = 2**40
    # an object mixing both versions: the v1 record after the v2 ones still fits
    await env.put([
        *avro_records(v2, 2, [(1, {"n": big, "x": 1e300}), (2, {"n": -big, "x": 0.25})]),
        *avro_records(v1, 1, [(3, {"n": 7, "x": 1.5})]),
    ])
    report = await env.tier()
    assert report.rows_appended == 3 and report.dead_letter_records == 0
    assert set(report.schema_changes) == {"promote column n to long", "promote column x to double"}
    n, x = _field(env, "n"), _field(env, "x")
    assert (n.field_type, x.field_type) == (LongType(), DoubleType())
    assert (n.field_id, x.field_id) == ids
    assert env.rows("n", "x") == [
        {"_offset": 0, "n": 1, "x": 0.5},
        {"_offset": 1, "n": big, "x": 1e300},
        {"_offset": 2, "n": -big, "x": 0.25},
        {"_offset": 3, "n": 7, "x": 1.5},
    ]


# --------------------------------------------------------------------------- in-place evolutions


@pytest.mark.integration
@pytest.mark.asyncio
async def test_added_fields_are_optional_columns_null_for_writers_without_them(env: Env) -> None:
    """An added field becomes an optional column, even with a non-null type and a default
    (Iceberg v2 cannot add a required column). Rows of writers without it read null, not the
    Avro default, before and after the evolution."""
    v1 = avro({"name": "a", "type": "int"})
    v2 = avro(
        {"name": "a", "type": "int"},
        {"name": "route", "type": ["null", "string"], "default": None, "doc": "origin-dest"},
        {"name": "gate", "type": "int", "default": 0},
    )
    env.registry.add_avro(1, 1, v1)
    env.registry.add_avro(1, 2, v2)
    await env.put(avro_records(v1, 1, [(0, {"a": 0})]))
    await env.tier()
    await env.put([
        *avro_records(v2, 2, [(1, {"a": 1, "route": "EWR-LAX", "gate": 12})]),
        *avro_records(v1, 1, [(2, {"a": 2})]),
    ])
    report = await env.tier()
    assert report.schema_changes == ["add optional column route string", "add optional column gate int"]
    route, gate = _field(env, "route"), _field(env, "gate")
    assert not route.required and not gate.required and route.doc == "origin-dest"
    assert env.rows("a", "route", "gate") == [
        {"_offset": 0, "a": 0, "route": None, "gate": None},
        {"_offset": 1, "a": 1, "route": "EWR-LAX", "gate": 12},
        {"_offset": 2, "a": 2, "route": None, "gate": None},
    ]


@pytest.mark.integration
@pytest.mark.asyncio
async def test_decimal_precision_is_widened(env: Env) -> None:
    def price(precision: int) -> dict[str, Any]:
        return {"name": "price", "type": {"type": "bytes", "logicalType": "decimal", "precision": precision, "scale": 2}}

    v1, v2 = avro(price(5)), avro(price(12))
    env.registry.add_avro(1, 1, v1)
    env.registry.add_avro(1, 2, v2)
    await env.put(avro_records(v1, 1, [(0, {"price": decimal.Decimal("123.45")})]))
    await env.tier()
    assert _field(env, "price").field_type == DecimalType(5, 2)
    await env.put(avro_records(v2, 2, [(1, {"price": decimal.Decimal("1234567890.12")})]))
    report = await env.tier()
    assert report.schema_changes == ["promote column price to decimal(12, 2)"]
    assert _field(env, "price").field_type == DecimalType(12, 2)
    assert [r["price"] for r in env.rows("price")] == [decimal.Decimal("123.45"), decimal.Decimal("1234567890.12")]


@pytest.mark.integration
@pytest.mark.asyncio
async def test_required_field_becomes_optional(env: Env) -> None:
    v1 = avro({"name": "a", "type": "int"})
    v2 = avro({"name": "a", "type": ["null", "int"], "default": None})
    env.registry.add_avro(1, 1, v1)
    env.registry.add_avro(1, 2, v2)
    await env.put(avro_records(v1, 1, [(0, {"a": 1})]))
    await env.tier()
    assert _field(env, "a").required
    await env.put(avro_records(v2, 2, [(1, {"a": None}), (2, {"a": 3})]))
    report = await env.tier()
    assert report.schema_changes == ["make column a optional"]
    assert not _field(env, "a").required
    assert [r["a"] for r in env.rows("a")] == [1, None, 3]


@pytest.mark.integration
@pytest.mark.asyncio
async def test_rename_through_avro_aliases_keeps_the_field_id(env: Env) -> None:
    v1 = avro({"name": "a", "type": "int"}, {"name": "dest", "type": "string"})
    v2 = avro({"name": "a", "type": "int"}, {"name": "destination", "type": "string", "aliases": ["dest"]})
    env.registry.add_avro(1, 1, v1)
    env.registry.add_avro(1, 2, v2)
    await env.put(avro_records(v1, 1, [(0, {"a": 0, "dest": "LAX"})]))
    await env.tier()
    dest_id = _field(env, "dest").field_id
    # v2 records, then a late v1 record in the same object: its `dest` lands in `destination`
    await env.put([
        *avro_records(v2, 2, [(1, {"a": 1, "destination": "SFO"})]),
        *avro_records(v1, 1, [(2, {"a": 2, "dest": "ORD"})]),
    ])
    report = await env.tier()
    assert report.schema_changes == ["rename column dest to destination"]
    schema = env.table().schema()
    assert schema.find_field("destination").field_id == dest_id
    assert "dest" not in {f.name for f in schema.fields}
    assert [r["destination"] for r in env.rows("destination")] == ["LAX", "SFO", "ORD"]
    # once the table follows v2, a later object of v1 records still maps by the alias
    await env.put(avro_records(v1, 1, [(3, {"a": 3, "dest": "JFK"})]))
    await env.tier()
    assert [r["destination"] for r in env.rows("destination")] == ["LAX", "SFO", "ORD", "JFK"]


@pytest.mark.integration
@pytest.mark.asyncio
async def test_rename_through_protobuf_field_numbers_keeps_the_field_id(env: Env) -> None:
    v1 = env.protos.message("ev.v1", "Flight", [
        ("carrier", 1, F.TYPE_STRING, {}),
        ("dep_delay", 2, F.TYPE_INT32, {}),
    ])
    v2 = env.protos.message("ev.v2", "Flight", [
        ("carrier", 1, F.TYPE_STRING, {}),
        ("departure_delay", 2, F.TYPE_INT64, {}),  # renamed and promoted
        ("route", 3, F.TYPE_STRING, {"optional": True}),
    ])
    env.registry.add(1, 1, "Protobuf", v1.full_name)
    env.registry.add(1, 2, "Protobuf", v2.full_name)
    enc = env.protos.encode
    await env.put([record(0, enc(v1, carrier="UA", dep_delay=-3), 1, 1)])
    await env.tier()
    delay_id = _field(env, "dep_delay").field_id
    await env.put([
        record(1, enc(v2, carrier="AA", departure_delay=2**40, route="JFK-LAX"), 1, 2),
        record(2, enc(v1, carrier="B6", dep_delay=5), 1, 1),
    ])
    report = await env.tier()
    assert report.dead_letter_records == 0
    assert set(report.schema_changes) == {
        "rename column dep_delay to departure_delay",
        "promote column dep_delay to long",
        "add optional column route string",
    }
    delay = _field(env, "departure_delay")
    assert delay.field_id == delay_id and delay.field_type == LongType()
    assert env.rows("carrier", "departure_delay", "route") == [
        {"_offset": 0, "carrier": "UA", "departure_delay": -3, "route": None},
        {"_offset": 1, "carrier": "AA", "departure_delay": 2**40, "route": "JFK-LAX"},
        {"_offset": 2, "carrier": "B6", "departure_delay": 5, "route": None},
    ]


@pytest.mark.integration
@pytest.mark.asyncio
async def test_older_writer_values_fit_a_column_a_rewrite_widened(env: Env) -> None:
    """After a rewrite changed ``flight`` from int to string (the ``schema_rewrite`` asset), a
    late v1 record's int is written as its decimal text, not dead-lettered."""
    v1 = avro({"name": "flight", "type": "int"})
    v2 = avro({"name": "flight", "type": "string"})
    env.registry.add_avro(1, 1, v1)
    env.registry.add_avro(1, 2, v2)
    writer = iceberg.writer.avro_writer(v2)
    iceberg.ensure_table_for_schema(
        env.catalog, TOPIC, writer.iceberg_schema(),
        properties={iceberg.SCHEMA_ID_PROPERTY: "1", iceberg.SCHEMA_VERSION_PROPERTY: "2"},
    )
    await env.put([*avro_records(v2, 2, [(0, {"flight": "UA1545"})]), *avro_records(v1, 1, [(1, {"flight": 1714})])])
    report = await env.tier()
    assert report.dead_letter_records == 0 and report.schema_changes == []
    assert [r["flight"] for r in env.rows("flight")] == ["UA1545", "1714"]


@pytest.mark.integration
@pytest.mark.asyncio
async def test_registry_avro_versions_through_the_real_registry(env: Env) -> None:
    """The two bugs of issue 11 with schemas registered in the real registry (etcd) and parsed
    by its own parser."""
    from danube_pipeline.schemas.registry import SchemaRegistry

    v1 = avro({"name": "a", "type": "int"}, {"name": "b", "type": "string"})
    v2 = avro({"name": "a", "type": "long"})
    async with await MetadataStore.connect(env.endpoints) as store:
        registry = SchemaRegistry(store)
        first = await registry.register_avro("evolving-value", json.dumps(v1))
        second = await registry.register_avro("evolving-value", json.dumps(v2))
        sid = first.schema_id
        assert (second.schema_id, second.version) == (sid, 2)
        await put_object(store, env.objects, TOPIC, avro_records(v1, 1, [(0, {"a": 1, "b": "x"})], schema_id=sid))
        await put_object(store, env.objects, TOPIC, avro_records(v2, 2, [(1, {"a": 2**40})], schema_id=sid))
        report = await commit_objects_to_table(
            TOPIC, store=store, objects=env.objects, catalog=env.catalog, registry=registry
        )
    assert report.rows_appended == 2 and report.dead_letter_records == 0
    assert env.rows("a", "b") == [{"_offset": 0, "a": 1, "b": "x"}, {"_offset": 1, "a": 2**40, "b": None}]
    assert env.table().properties[iceberg.SCHEMA_SUBJECT_PROPERTY] == "evolving-value"


# --------------------------------------------------------------------------- incompatible changes


@pytest.mark.unit
def test_incompatible_changes_lists_what_needs_a_rewrite() -> None:
    table = iceberg.iceberg_schema_for_avro(avro(
        {"name": "flight", "type": "int"},
        {"name": "distance", "type": "long"},
        {"name": "origin", "type": "string"},
        {"name": "n", "type": "int"},
        {"name": "tail", "type": "string"},
    ))
    new = iceberg.iceberg_schema_for_avro(avro(
        {"name": "flight", "type": "string"},  # int -> string: a rewrite
        {"name": "distance", "type": {"type": "bytes", "logicalType": "decimal", "precision": 20, "scale": 0}},
        {"name": "origin", "type": "string"},
        {"name": "n", "type": "long"},  # in place
        {"name": "route", "type": ["null", "string"]},  # in place (tail removed: in place)
    ))
    changes = iceberg.incompatible_changes(table, new)
    assert len(changes) == 2
    assert changes[0].startswith("flight: int -> string is not an in-place change")
    assert changes[1].startswith("distance: long -> decimal(20, 0) is not an in-place change")
    plan = iceberg.plan_evolution(table, new)
    assert [str(c) for c in plan.changes] == [
        "make column tail optional", "promote column n to long", "add optional column route string",
    ]
    # the other way round: a column already wider than the writer's type needs nothing
    assert iceberg.incompatible_changes(new, iceberg.iceberg_schema_for_avro(avro({"name": "flight", "type": "int"}))) == []
    # renames are applied first
    renamed = iceberg.iceberg_schema_for_avro(avro({"name": "number", "type": "long"}))
    assert [str(c) for c in iceberg.plan_evolution(table, renamed, renames={"flight": "number"}).changes][:2] == [
        "rename column flight to number", "make column distance optional",
    ]


@pytest.mark.unit
def test_ensure_table_refuses_a_change_that_needs_a_rewrite(tmp_path: Path) -> None:
    catalog = iceberg.load_catalog(
        name="danube", uri=f"sqlite:///{tmp_path / 'c.db'}", warehouse=(tmp_path / "w").as_uri()
    )
    iceberg.ensure_table(catalog, TOPIC, avro({"name": "flight", "type": "int"}))
    with pytest.raises(SchemaEvolutionError) as err:
        iceberg.ensure_table(catalog, TOPIC, avro({"name": "flight", "type": "string"}))
    assert err.value.table == "default.evolving" and "flight: int -> string" in err.value.changes[0]
    table = iceberg.ensure_table(catalog, TOPIC, avro({"name": "flight", "type": "long"}))
    assert table.schema().find_field("flight").field_type == LongType()


# --------------------------------------------------------------------------- JSON Schema


JSON_V1: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["id", "carrier", "at"],
    "properties": {
        "id": {"type": "integer"},
        "carrier": {"type": "string", "description": "two-letter code"},
        "delay": {"type": ["number", "null"]},
        "cancelled": {"type": "boolean"},
        "at": {"type": "string", "format": "date-time"},
        "day": {"type": "string", "format": "date"},
        "blob": {"type": "string", "contentEncoding": "base64"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
        "plane": {
            "type": "object",
            "required": ["tail"],
            "properties": {"tail": {"type": "string"}, "seats": {"type": "integer"}},
        },
        "kind": {"enum": ["A", "B"]},
        "either": {"type": ["string", "integer"]},
        "crew": {"$ref": "#/$defs/person"},
    },
    "$defs": {"person": {"type": "object", "properties": {"name": {"type": "string"}, "boss": {"$ref": "#/$defs/person"}}}},
}


@pytest.mark.unit
def test_json_schema_maps_to_iceberg_types() -> None:
    schema = iceberg.iceberg_schema_for_json_schema(JSON_V1)
    by_name = {f.name: f for f in schema.fields}
    assert [f.name for f in schema.fields][: len(iceberg.METADATA_COLUMNS)] == list(iceberg.METADATA_COLUMNS)
    simple = {
        "id": (LongType(), True),
        "carrier": (StringType(), True),
        "delay": (DoubleType(), False),
        "cancelled": (BooleanType(), False),
        "at": (TimestamptzType(), True),
        "day": (DateType(), False),
        "blob": (BinaryType(), False),
        "kind": (StringType(), False),
        "either": (StringType(), False),
    }
    for name, (t, required) in simple.items():
        assert (by_name[name].field_type, by_name[name].required) == (t, required), name
    assert by_name["carrier"].doc == "two-letter code"
    tags = by_name["tags"].field_type
    assert isinstance(tags, ListType) and tags.element_type == StringType() and not tags.element_required
    counts = by_name["counts"].field_type
    assert isinstance(counts, MapType) and (counts.key_type, counts.value_type) == (StringType(), LongType())
    plane = by_name["plane"].field_type
    assert isinstance(plane, StructType)
    assert [(f.name, f.field_type, f.required) for f in plane.fields] == [("tail", StringType(), True), ("seats", LongType(), False)]
    crew = by_name["crew"].field_type
    assert isinstance(crew, StructType) and crew.field_by_name("boss") is not None  # recursion stops as JSON text
    assert crew.fields[1].field_type == StringType()
    ids = [f.field_id for f in schema.fields] + [f.field_id for f in plane.fields] + [tags.element_id]
    assert len(ids) == len(set(ids))


@pytest.mark.unit
def test_json_payloads_decode_to_rows_and_misfits_are_refused() -> None:
    payload = {
        "id": 7, "carrier": "UA", "delay": 2, "cancelled": False, "at": "2013-01-01T05:15:00-05:00",
        "day": "2013-01-01", "blob": "AAE=", "tags": ["x", None], "counts": {"a": 1},
        "plane": {"tail": "N14228", "seats": 180.0}, "kind": "B", "either": 3, "crew": {"name": "Ann", "boss": {"name": "Bo"}},
        "ignored": True,
    }
    row = iceberg.json_payload_to_row(JSON_V1, json.dumps(payload).encode())
    assert row["id"] == 7 and row["delay"] == 2.0 and isinstance(row["delay"], float)
    assert row["at"] == dt.datetime(2013, 1, 1, 10, 15, tzinfo=dt.UTC)
    assert row["day"] == dt.date(2013, 1, 1) and row["blob"] == b"\x00\x01"
    assert row["tags"] == ["x", None] and row["counts"] == [("a", 1)]
    assert row["plane"] == {"tail": "N14228", "seats": 180}
    assert row["either"] == "3" and row["crew"] == {"name": "Ann", "boss": '{"name":"Bo"}'}
    assert "ignored" not in row
    minimal = iceberg.json_payload_to_row(JSON_V1, b'{"id": 1, "carrier": "AA", "at": "2013-01-01T00:00:00Z"}')
    assert minimal["delay"] is None and minimal["plane"] is None

    bad = {
        b"[1": "not JSON",
        b'{"carrier": "AA", "at": "2013-01-01T00:00:00Z"}': "id: required property missing",
        b'{"id": 1.5, "carrier": "AA", "at": "2013-01-01T00:00:00Z"}': "id: expected an integer",
        b'{"id": 99999999999999999999, "carrier": "AA", "at": "2013-01-01T00:00:00Z"}': "int64 range",
        b'{"id": 1, "carrier": null, "at": "2013-01-01T00:00:00Z"}': "carrier: null where the schema allows no null",
        b'{"id": 1, "carrier": "AA", "at": "2013-01-01T00:00:00"}': "at: expected a date-time with a UTC offset",
        b'{"id": 1, "carrier": "AA", "at": "2013-01-01T00:00:00Z", "plane": {"seats": 1}}': "plane.tail: required",
        b'{"id": 1, "carrier": "AA", "at": "2013-01-01T00:00:00Z", "delay": NaN}': "not JSON",
    }
    for payload_bytes, message in bad.items():
        with pytest.raises(PayloadDecodeError, match=message.replace("(", r"\(")):
            iceberg.json_payload_to_row(JSON_V1, payload_bytes)


@pytest.mark.integration
@pytest.mark.asyncio
async def test_json_schema_versions_through_tiering(env: Env) -> None:
    v2 = json.loads(json.dumps(JSON_V1))
    v2["properties"]["route"] = {"type": "string"}
    v2["properties"]["plane"]["properties"]["model"] = {"type": "string"}
    v2["required"] = ["id", "at"]  # carrier: required -> optional
    del v2["properties"]["kind"]
    env.registry.add(1, 1, "JsonSchema", json.dumps(JSON_V1))
    env.registry.add(1, 2, "JsonSchema", json.dumps(v2))
    at = "2013-01-01T05:00:00Z"
    await env.put([record(0, json.dumps({"id": 1, "carrier": "UA", "at": at, "plane": {"tail": "N1"}, "kind": "A"}).encode(), 1, 1)])
    await env.tier()
    await env.put([record(1, json.dumps({"id": 2, "at": at, "route": "EWR-LAX", "plane": {"tail": "N2", "model": "A320"}}).encode(), 1, 2)])
    report = await env.tier()
    assert report.dead_letter_records == 0
    assert set(report.schema_changes) == {
        "make column carrier optional", "add optional column route string",
        "add optional column plane.model string",
    }
    assert env.rows("id", "carrier", "route", "plane", "kind") == [
        {"_offset": 0, "id": 1, "carrier": "UA", "route": None, "plane": {"tail": "N1", "seats": None, "model": None}, "kind": "A"},
        {"_offset": 1, "id": 2, "carrier": None, "route": "EWR-LAX", "plane": {"tail": "N2", "seats": None, "model": "A320"}, "kind": None},
    ]


# --------------------------------------------------------------------------- Protobuf


def _everything(protos: Protos) -> Any:
    inner = protos.message("ev.all", "Plane", [("tail", 1, F.TYPE_STRING, {}), ("seats", 2, F.TYPE_UINT32, {})])
    node = protos.message("ev.rec", "Node", [("name", 1, F.TYPE_STRING, {}), ("next", 2, F.TYPE_MESSAGE, {"type_name": ".ev.rec.Node"})])
    proto = descriptor_pb2.FileDescriptorProto(
        name="everything.proto", package="ev.all2", syntax="proto3",
        dependency=["google/protobuf/timestamp.proto", "google/protobuf/wrappers.proto", inner.file.name, node.file.name],
    )
    from google.protobuf import wrappers_pb2

    protos.pool.AddSerializedFile(wrappers_pb2.DESCRIPTOR.serialized_pb)
    kind = proto.enum_type.add(name="Kind")
    kind.value.add(name="KIND_UNSET", number=0)
    kind.value.add(name="KIND_B", number=2)
    m = proto.message_type.add(name="Everything")
    scalars = [
        ("i32", F.TYPE_INT32), ("s32", F.TYPE_SINT32), ("sf32", F.TYPE_SFIXED32),
        ("i64", F.TYPE_INT64), ("s64", F.TYPE_SINT64), ("sf64", F.TYPE_SFIXED64),
        ("u32", F.TYPE_UINT32), ("f32", F.TYPE_FIXED32), ("u64", F.TYPE_UINT64), ("f64", F.TYPE_FIXED64),
        ("fl", F.TYPE_FLOAT), ("db", F.TYPE_DOUBLE), ("ok", F.TYPE_BOOL), ("s", F.TYPE_STRING), ("b", F.TYPE_BYTES),
    ]
    for number, (name, t) in enumerate(scalars, start=1):
        m.field.add(name=name, number=number, type=t, label=F.LABEL_OPTIONAL)
    n = len(scalars)
    m.field.add(name="kind", number=n + 1, type=F.TYPE_ENUM, type_name=".ev.all2.Kind", label=F.LABEL_OPTIONAL)
    m.field.add(name="plane", number=n + 2, type=F.TYPE_MESSAGE, type_name=".ev.all.Plane", label=F.LABEL_OPTIONAL)
    m.field.add(name="tags", number=n + 3, type=F.TYPE_STRING, label=F.LABEL_REPEATED)
    m.field.add(name="planes", number=n + 4, type=F.TYPE_MESSAGE, type_name=".ev.all.Plane", label=F.LABEL_REPEATED)
    entry = m.nested_type.add(name="CountsEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    m.field.add(name="counts", number=n + 5, type=F.TYPE_MESSAGE, type_name=".ev.all2.Everything.CountsEntry", label=F.LABEL_REPEATED)
    m.field.add(name="at", number=n + 6, type=F.TYPE_MESSAGE, type_name=".google.protobuf.Timestamp", label=F.LABEL_OPTIONAL)
    m.field.add(name="maybe", number=n + 7, type=F.TYPE_MESSAGE, type_name=".google.protobuf.Int64Value", label=F.LABEL_OPTIONAL)
    m.oneof_decl.add(name="_opt")
    m.field.add(name="opt", number=n + 8, type=F.TYPE_INT32, label=F.LABEL_OPTIONAL, proto3_optional=True, oneof_index=0)
    m.field.add(name="node", number=n + 9, type=F.TYPE_MESSAGE, type_name=".ev.rec.Node", label=F.LABEL_OPTIONAL)
    protos.pool.Add(proto)
    return protos.pool.FindMessageTypeByName("ev.all2.Everything")


@pytest.mark.unit
def test_protobuf_maps_to_iceberg_types(env: Env) -> None:
    descriptor = _everything(env.protos)
    schema = iceberg.iceberg_schema_for_protobuf(descriptor)
    by_name = {f.name: f for f in schema.fields}
    expected = {
        "i32": IntegerType(), "s32": IntegerType(), "sf32": IntegerType(),
        "i64": LongType(), "s64": LongType(), "sf64": LongType(),
        "u32": LongType(), "f32": LongType(), "u64": DecimalType(20, 0), "f64": DecimalType(20, 0),
        "fl": FloatType(), "db": DoubleType(), "ok": BooleanType(), "s": StringType(), "b": BinaryType(),
        "kind": StringType(), "at": TimestamptzType(), "maybe": LongType(), "opt": IntegerType(),
    }
    for name, t in expected.items():
        assert by_name[name].field_type == t, name
    assert all(by_name[name].required for name in expected if name not in ("at", "maybe", "opt"))
    assert not by_name["at"].required and not by_name["maybe"].required and not by_name["opt"].required
    plane = by_name["plane"].field_type
    assert isinstance(plane, StructType) and not by_name["plane"].required
    assert [(f.name, f.field_type) for f in plane.fields] == [("tail", StringType()), ("seats", LongType())]
    tags, planes, counts = by_name["tags"].field_type, by_name["planes"].field_type, by_name["counts"].field_type
    assert isinstance(tags, ListType) and tags.element_type == StringType() and tags.element_required
    assert isinstance(planes, ListType) and isinstance(planes.element_type, StructType)
    assert isinstance(counts, MapType) and (counts.key_type, counts.value_type) == (StringType(), LongType())
    node = by_name["node"].field_type
    assert isinstance(node, StructType) and node.field_by_name("next") is not None
    assert node.fields[1].field_type == StringType()  # the recursion: JSON text


@pytest.mark.unit
def test_protobuf_payloads_decode_to_rows(env: Env) -> None:
    descriptor = _everything(env.protos)
    node_cls = env.protos.pool.FindMessageTypeByName("ev.rec.Node")
    payload = env.protos.encode(
        descriptor, i32=-1, s32=-2, sf32=-3, i64=-(2**40), s64=5, sf64=6, u32=2**32 - 1, f32=8, u64=2**64 - 1, f64=9,
        fl=0.5, db=1e300, ok=True, s="héllo", b=b"\x00", kind=2, tags=["x", "y"], counts={"a": 1},
        at=dt.datetime(2013, 1, 1, 5, 0, 0, 123456, tzinfo=dt.UTC), opt=0,
    )
    from google.protobuf import message_factory

    cls = message_factory.GetMessageClass(descriptor)
    message = cls.FromString(payload)
    message.plane.tail = "N1"
    message.planes.add(tail="N2", seats=3)
    message.maybe.value = 42
    message.node.CopyFrom(message_factory.GetMessageClass(node_cls)(name="a", next={"name": "b"}))
    row = iceberg.protobuf_payload_to_row(descriptor, message.SerializeToString())
    assert row["i64"] == -(2**40) and row["u32"] == 2**32 - 1
    assert row["u64"] == decimal.Decimal(2**64 - 1) and row["f64"] == decimal.Decimal(9)
    assert row["kind"] == "KIND_B" and row["s"] == "héllo" and row["b"] == b"\x00"
    assert row["plane"] == {"tail": "N1", "seats": 0}
    assert row["planes"] == [{"tail": "N2", "seats": 3}] and row["tags"] == ["x", "y"]
    assert row["counts"] == [("a", 1)]
    assert row["at"] == dt.datetime(2013, 1, 1, 5, 0, 0, 123456, tzinfo=dt.UTC)
    assert row["maybe"] == 42 and row["opt"] == 0
    assert json.loads(row["node"]["next"]) == {"name": "b"}
    empty = iceberg.protobuf_payload_to_row(descriptor, b"")
    assert empty["i32"] == 0 and empty["plane"] is None and empty["at"] is None and empty["maybe"] is None
    assert empty["opt"] is None and empty["tags"] == [] and empty["kind"] == "KIND_UNSET"
    with pytest.raises(PayloadDecodeError):
        iceberg.protobuf_payload_to_row(descriptor, b"\xff\xff\xff")


@pytest.mark.integration
@pytest.mark.asyncio
async def test_protobuf_through_tiering_with_the_registry_parser(env: Env) -> None:
    """Protobuf ``.proto`` texts parsed by the registry's own parser (``protoc``), a nested
    message, a repeated field, a map and a Timestamp written and read back."""
    pytest.importorskip("grpc_tools")
    pytest.importorskip("danube_pipeline.schemas.formats")
    v1 = """syntax = "proto3";
package flights;
import "google/protobuf/timestamp.proto";
message Flight {
  string carrier = 1;
  int32 delay = 2;
  message Plane { string tail = 1; }
  Plane plane = 3;
  repeated string tags = 4;
  map<string, int64> counts = 5;
  google.protobuf.Timestamp at = 6;
}
"""
    v2 = v1.replace("int32 delay = 2;", "int64 delay_minutes = 2;").replace(
        "google.protobuf.Timestamp at = 6;", "google.protobuf.Timestamp at = 6;\n  optional string route = 7;"
    )
    env.registry.add(4, 1, "Protobuf", v1, "flights-value")
    env.registry.add(4, 2, "Protobuf", v2, "flights-value")
    from danube_pipeline.schemas.formats import parse_schema

    d1 = parse_schema("Protobuf", v1, subject="flights-value").message_descriptor
    d2 = parse_schema("Protobuf", v2, subject="flights-value").message_descriptor
    from google.protobuf import message_factory

    m1 = message_factory.GetMessageClass(d1)(carrier="UA", delay=-4, tags=["a"], counts={"x": 1})
    m1.plane.tail = "N1"
    m1.at.FromSeconds(1_357_016_400)
    m2 = message_factory.GetMessageClass(d2)(carrier="AA", delay_minutes=2**33, route="EWR-LAX")
    await env.put([record(0, m1.SerializeToString(), 4, 1)])
    await env.tier(parse_schema=None)
    await env.put([record(1, m2.SerializeToString(), 4, 2)])
    report = await env.tier(parse_schema=None)
    assert report.dead_letter_records == 0
    assert "rename column delay to delay_minutes" in report.schema_changes
    assert env.rows("carrier", "delay_minutes", "plane", "tags", "counts", "at", "route") == [
        {"_offset": 0, "carrier": "UA", "delay_minutes": -4, "plane": {"tail": "N1"}, "tags": ["a"],
         "counts": [("x", 1)], "at": dt.datetime(2013, 1, 1, 5, 0, tzinfo=dt.UTC), "route": None},
        {"_offset": 1, "carrier": "AA", "delay_minutes": 2**33, "plane": None, "tags": [],
         "counts": [], "at": None, "route": "EWR-LAX"},
    ]


@pytest.mark.unit
def test_without_the_registry_parser_avro_and_json_schema_still_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``danube_pipeline.schemas.formats`` is missing, tiering parses Avro and JSON Schema
    texts itself; a Protobuf schema cannot be read (its records would be dead-lettered)."""
    import importlib

    from danube_pipeline.lake import schema_lookup
    from danube_pipeline.errors import InvalidSchemaError

    def missing(name: str) -> Any:
        raise ImportError(name)

    monkeypatch.setattr(importlib, "import_module", missing)  # what schema_lookup calls
    parse = schema_lookup.default_schema_parser()
    writer = iceberg.writer_for_parsed(parse("Avro", json.dumps(avro({"name": "a", "type": "int"})), subject="s"))
    assert [c.name for c in writer.columns] == ["a"]
    writer = iceberg.writer_for_parsed(parse("JsonSchema", json.dumps(JSON_V1), subject="s"))
    assert writer.columns[0].name == "id"
    assert iceberg.writer_for_parsed(parse("Avro", '"string"', subject="s")).columns[0].name == iceberg.VALUE_COLUMN
    with pytest.raises(InvalidSchemaError):
        parse("Protobuf", 'syntax = "proto3"; message M {}', subject="s")
