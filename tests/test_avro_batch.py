"""The columnar Avro path (danube_pipeline/lake/iceberg/avro_batch.py) against the per-record path.

Every test decodes the same records both ways, through ``table_rows`` with the writer's batch
decoder and with it removed, and requires equal rows and equal dead letters; the tricky cases
also check that the batch decoder refuses the batch rather than guessing. Every test runs twice:
with the C decoder (``decode_avro`` in danube_pipeline/lake/_framing.c) and with the polars
decoder that replaces it when the extension is not built.
"""

from __future__ import annotations

import dataclasses
import io
import random
from collections.abc import Mapping, Sequence
from typing import Any

import fastavro
import pyarrow as pa
import pytest

from danube_pipeline.dev.flights import FLIGHT_AVRO_SCHEMA, encode_flight, iter_flights
from danube_pipeline.lake.iceberg import avro_batch
from danube_pipeline.lake.iceberg.avro_batch import batch_decoder
from danube_pipeline.lake.iceberg.rows import BoundWriter, TableRows, table_rows
from danube_pipeline.lake.iceberg.schema import schema_from_columns
from danube_pipeline.lake.iceberg.writer import WriterSchema, avro_writer
from danube_pipeline.format.records import Record

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True, params=["c", "polars"])
def decoder_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test with the C decoder, then with polars (the extension's absence simulated)."""
    if request.param == "c":
        assert avro_batch._native_decode is not None, "the C extension was not built"
    else:
        monkeypatch.setattr(avro_batch, "_native_decode", None)
    decoder = batch_decoder("long")
    assert decoder is not None and decoder.native == (request.param == "c")
    return str(request.param)

TRICKY: dict[str, Any] = {
    "type": "record",
    "name": "Tricky",
    "fields": [
        {"name": "i", "type": "int"},
        {"name": "l", "type": "long"},
        {"name": "ni", "type": ["null", "int"]},
        {"name": "in_", "type": ["int", "null"]},
        {"name": "f", "type": "float"},
        {"name": "d", "type": ["null", "double"]},
        {"name": "b", "type": "boolean"},
        {"name": "nb", "type": ["null", "boolean"]},
        {"name": "s", "type": "string"},
        {"name": "ns", "type": ["string", "null"]},
        {"name": "raw", "type": "bytes"},
        {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "tu", "type": ["null", {"type": "long", "logicalType": "timestamp-micros"}]},
        {"name": "lt", "type": {"type": "long", "logicalType": "local-timestamp-micros"}},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
    ],
}


def _encode(schema: Mapping[str, Any], value: Mapping[str, Any]) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(dict(schema)), dict(value))
    return buf.getvalue()


def _varint(value: int) -> bytes:
    z = (value << 1) ^ (value >> 63)
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _tricky_value(rng: random.Random, i: int) -> dict[str, Any]:
    edge = [-(1 << 31), (1 << 31) - 1, 0, -1, 1, 63, 64, -64, -65]
    pick = edge[i % len(edge)] if i % 3 == 0 else rng.randint(-(1 << 31), (1 << 31) - 1)
    return {
        "i": pick,
        "l": rng.choice([-(1 << 62), (1 << 62) - 1, 0, rng.randint(-(1 << 40), 1 << 40)]),
        "ni": None if i % 2 else pick,
        "in_": None if i % 3 else -pick - 1,
        "f": rng.choice([0.0, -1.5, 3.25, float("inf")]),
        "d": None if i % 5 == 0 else rng.uniform(-1e300, 1e300),
        "b": bool(i % 2),
        "nb": None if i % 4 == 0 else bool(i % 3),
        "s": rng.choice(["", "a", "ünïcödé ✈", "x" * 200]),
        "ns": None if i % 2 == 0 else "JFK" * (i % 7),
        "raw": bytes(rng.randrange(256) for _ in range(i % 9)),
        "ts": rng.randint(-62_135_596_800_000, 253_402_300_799_999),
        "tu": None if i % 3 == 1 else rng.randint(0, 2_000_000_000_000_000),
        "lt": rng.randint(-(10**15), 10**15),
        "day": rng.randint(-719_162, 2_932_896),
    }


def _records(payloads: Sequence[bytes], *, schema_id: int = 1, versions: Sequence[int] | None = None) -> list[Record]:
    return [
        Record(
            offset=100 + i,
            publish_time_us=1_700_000_000_000_000 + i,
            producer_id=(1 << 64) - 1 - i,
            producer_name="p",
            schema_id=schema_id,
            schema_version=versions[i] if versions else 1,
            payload=p,
            attributes={"n": str(i)} if i % 2 else {},
        )
        for i, p in enumerate(payloads)
    ]


def _both(
    records: Sequence[Record], writers: Mapping[tuple[int, int], WriterSchema], columns_of: WriterSchema | None = None
) -> tuple[TableRows, TableRows]:
    """``table_rows`` with the batch decoders (fast) and without (slow)."""
    table_schema = (columns_of or next(iter(writers.values()))).iceberg_schema()
    fast = table_rows(records, table_schema, {k: BoundWriter(f"v{k[1]}", writer=w) for k, w in writers.items()})
    slow_writers = {k: BoundWriter(f"v{k[1]}", writer=dataclasses.replace(w, batch=None)) for k, w in writers.items()}
    slow = table_rows(records, table_schema, slow_writers)
    return fast, slow


def _assert_same(fast: TableRows, slow: TableRows) -> None:
    assert fast.rows.schema == slow.rows.schema
    assert fast.rows.equals(slow.rows)
    assert [(d.record.offset, d.error) for d in fast.dead_letters] == [
        (d.record.offset, d.error) for d in slow.dead_letters
    ]


def test_flights_batch_equals_per_record() -> None:
    payloads = [encode_flight(f) for f in iter_flights(3000)]
    writer = avro_writer(FLIGHT_AVRO_SCHEMA)
    assert writer.batch is not None
    fast, slow = _both(_records(payloads), {(1, 1): writer})
    _assert_same(fast, slow)
    assert fast.rows.num_rows == 3000 and not fast.dead_letters
    assert fast.rows.column("dep_time").null_count > 0  # the flights have nulls: they were exercised
    assert fast.rows.column("_producer_id")[0].as_py() == -1  # u64 max as the int64 with the same bits


def test_tricky_values_batch_equals_per_record() -> None:
    rng = random.Random(12)
    payloads = [_encode(TRICKY, _tricky_value(rng, i)) for i in range(500)]
    writer = avro_writer(TRICKY)
    decoder = writer.batch
    assert decoder is not None
    arrays = decoder.decode(payloads)
    assert arrays is not None, "the batch path refused valid payloads"
    fast, slow = _both(_records(payloads), {(1, 1): writer})
    _assert_same(fast, slow)
    assert not fast.dead_letters and fast.rows.num_rows == 500


@pytest.mark.parametrize(
    ("name", "corrupt"),
    [
        ("leftover byte", lambda p: p + b"\x00"),
        ("leftover datum", lambda p: p + p),
        ("truncated", lambda p: p[:-1]),
        ("truncated to one byte", lambda p: p[:1]),
        ("empty", lambda p: b""),
    ],
)
def test_corrupt_payload_refuses_the_batch_and_is_dead_lettered_as_before(name: str, corrupt: Any) -> None:
    payloads = [encode_flight(f) for f in iter_flights(50)]
    payloads[20] = corrupt(payloads[20])
    writer = avro_writer(FLIGHT_AVRO_SCHEMA)
    assert writer.batch is not None
    assert writer.batch.decode(payloads) is None, name
    fast, slow = _both(_records(payloads), {(1, 1): writer})
    _assert_same(fast, slow)
    assert [d.record.offset for d in fast.dead_letters] == [120]
    assert fast.dead_letters[0].error.startswith("corrupt payload"), fast.dead_letters[0].error
    assert fast.rows.num_rows == 49


def test_leftover_bytes_that_decode_as_the_next_datum_are_caught() -> None:
    """Record 0 carries a whole extra datum and record 1 is empty: concatenated, the block holds
    exactly as many valid datums as records, which the native reader decodes without error.
    Only the framing lengths reveal it."""
    a, b, c = (_encode(TRICKY, _tricky_value(random.Random(i), i)) for i in range(3))
    payloads = [a + b, b"", c]
    writer = avro_writer(TRICKY)
    assert writer.batch is not None
    assert writer.batch.decode(payloads) is None
    fast, slow = _both(_records(payloads), {(1, 1): writer})
    _assert_same(fast, slow)
    assert [d.record.offset for d in fast.dead_letters] == [100, 101]


def test_out_of_spec_bytes_are_left_to_the_per_record_path() -> None:
    schema = {
        "type": "record",
        "name": "R",
        "fields": [{"name": "n", "type": ["null", "int"]}, {"name": "b", "type": "boolean"}],
    }
    good = _varint(1) + _varint(5) + b"\x01"
    cases = {
        "union branch 2": _varint(2) + _varint(5) + b"\x01",  # the native reader takes it as the int
        "union branch -1": _varint(-1) + _varint(5) + b"\x01",  # fastavro takes it as the last branch
        "boolean byte 2": _varint(0) + b"\x02",  # fastavro: true; the native reader: false
        "int beyond 32 bits": _varint(1) + _varint(1 << 31) + b"\x00",
        "over-long varint": _varint(1) + b"\x8a\x00" + b"\x01",
    }
    writer = avro_writer(schema)
    assert writer.batch is not None
    assert writer.batch.decode([good, good]) is not None
    for name, bad in cases.items():
        payloads = [good, bad, good]
        assert writer.batch.decode(payloads) is None, name
        fast, slow = _both(_records(payloads), {(1, 1): writer})
        _assert_same(fast, slow)


def test_invalid_utf8_is_dead_lettered_as_before() -> None:
    schema = {"type": "record", "name": "R", "fields": [{"name": "s", "type": "string"}]}
    payloads = [_varint(1) + b"a", _varint(2) + b"\xff\xfe", _varint(0)]
    writer = avro_writer(schema)
    fast, slow = _both(_records(payloads), {(1, 1): writer})
    _assert_same(fast, slow)
    assert [d.record.offset for d in fast.dead_letters] == [101]


def test_mixed_writer_versions_and_promotions() -> None:
    v1 = {"type": "record", "name": "R", "fields": [{"name": "a", "type": "int"}, {"name": "f", "type": "float"}]}
    v2 = {
        "type": "record",
        "name": "R",
        "fields": [
            {"name": "a", "type": "long"},
            {"name": "f", "type": "double"},
            {"name": "note", "type": ["null", "string"], "default": None},
        ],
    }
    versions = [1 + (i % 3 == 0) for i in range(60)]
    payloads = [
        _encode(v1, {"a": i, "f": i / 4}) if v == 1 else _encode(v2, {"a": i << 33, "f": i / 3, "note": f"n{i}"})
        for i, v in enumerate(versions)
    ]
    payloads[7] += b"\x00"  # a v1 record with a leftover byte: v1's batch is refused, v2's is not
    writers = {(1, 1): avro_writer(v1), (1, 2): avro_writer(v2)}
    fast, slow = _both(_records(payloads, versions=versions), writers, columns_of=writers[(1, 2)])
    _assert_same(fast, slow)
    assert [d.record.offset for d in fast.dead_letters] == [107]
    assert fast.rows.column("_offset").to_pylist() == [100 + i for i in range(60) if i != 7]
    assert fast.rows.schema.field("a").type == pa.int64()


def test_required_column_null_goes_to_the_per_record_path() -> None:
    """A writer whose field is nullable, into a table whose column is required."""
    required = avro_writer({"type": "record", "name": "R", "fields": [{"name": "a", "type": "int"}]})
    nullable = avro_writer({"type": "record", "name": "R", "fields": [{"name": "a", "type": ["null", "int"]}]})
    payloads = [_varint(1) + _varint(3), _varint(0), _varint(1) + _varint(4)]
    table_schema = schema_from_columns(required.columns)
    fast = table_rows(_records(payloads), table_schema, {(1, 1): BoundWriter("v1", writer=nullable)})
    slow = table_rows(
        _records(payloads), table_schema, {(1, 1): BoundWriter("v1", writer=dataclasses.replace(nullable, batch=None))}
    )
    _assert_same(fast, slow)
    assert [d.record.offset for d in fast.dead_letters] == [101]
    assert fast.dead_letters[0].error.startswith("value does not fit")


def test_out_of_range_timestamp_is_dead_lettered_as_before() -> None:
    schema = {"type": "record", "name": "R", "fields": [{"name": "t", "type": {"type": "long", "logicalType": "timestamp-millis"}}]}
    payloads = [_varint(0), _varint(1 << 60), _varint(5)]
    writer = avro_writer(schema)
    assert writer.batch is not None and writer.batch.decode(payloads) is None
    fast, slow = _both(_records(payloads), {(1, 1): writer})
    _assert_same(fast, slow)
    assert [d.record.offset for d in fast.dead_letters] == [101]


def test_schemas_outside_the_batch_types_have_no_batch_decoder() -> None:
    nested = {
        "type": "record",
        "name": "R",
        "fields": [{"name": "p", "type": {"type": "record", "name": "P", "fields": [{"name": "x", "type": "int"}]}}],
    }
    enum = {"type": "record", "name": "R", "fields": [{"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A"]}}]}
    three = {"type": "record", "name": "R", "fields": [{"name": "u", "type": ["null", "int", "string"]}]}
    decimal = {"type": "record", "name": "R", "fields": [{"name": "m", "type": {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2}}]}
    for schema in (nested, enum, three, decimal):
        assert batch_decoder(schema) is None
        assert avro_writer(schema).batch is None


def test_a_primitive_schema_is_one_value_column() -> None:
    writer = avro_writer("string")
    assert writer.batch is not None and writer.batch.columns == ("value",)
    payloads = [_varint(len(s)) + s for s in (b"", b"JFK", "✈".encode())]
    fast, slow = _both(_records(payloads), {(1, 1): writer})
    _assert_same(fast, slow)
    assert fast.rows.column("value").to_pylist() == ["", "JFK", "✈"]
