"""The C Avro decoder (``decode_avro`` in danube_pipeline/lake/_framing.c, used by
danube_pipeline/lake/iceberg/avro_batch.py) against polars' decoder and the per-record path.

The property that matters: whenever a batch decoder accepts a batch, its columns equal what
the per-record path (fastavro) makes of each payload; when it cannot promise that, it refuses
the batch. tests/test_avro_batch.py runs its cases through both batch decoders; here the
values sit at every guard's edge, and random damage to valid payloads is checked both ways.
"""

from __future__ import annotations

import dataclasses
import io
import random
from collections.abc import Mapping
from typing import Any

import fastavro
import numpy as np
import pyarrow as pa
import pytest

from danube_pipeline.dev.flights import FLIGHT_AVRO_SCHEMA, encode_flight, iter_flights
from danube_pipeline.format.records import Record
from danube_pipeline.lake.iceberg import avro_batch
from danube_pipeline.lake.iceberg.avro_batch import AvroBatchDecoder, batch_decoder
from danube_pipeline.lake.iceberg.rows import BoundWriter, table_rows
from danube_pipeline.lake.iceberg.writer import WriterSchema, avro_writer

pytestmark = pytest.mark.unit

MIN_MICROS = -62_135_596_800_000_000  # 0001-01-01T00:00:00, datetime.min
MAX_MICROS = 253_402_300_799_999_999  # 9999-12-31T23:59:59.999999, datetime.max
MIN_DAYS, MAX_DAYS = -719_162, 2_932_896  # date.min, date.max


def _encode(schema: Mapping[str, Any], value: Any) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(dict(schema)), value)
    return buf.getvalue()


def _varint(value: int) -> bytes:
    z = (value << 1) ^ (value >> 63) if -(1 << 63) <= value < 1 << 63 else (value << 1) ^ (value >> 127)
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _records(payloads: list[bytes]) -> list[Record]:
    return [
        Record(offset=i, publish_time_us=1_700_000_000_000_000 + i, producer_id=7, producer_name="p", schema_id=1,
               schema_version=1, payload=p)
        for i, p in enumerate(payloads)
    ]


def _decoders(schema: Mapping[str, Any] | str) -> tuple[AvroBatchDecoder, AvroBatchDecoder]:
    native, polars = batch_decoder(schema), batch_decoder(schema, native=False)
    assert native is not None and polars is not None
    assert native.native, "the C extension was not built"
    assert not polars.native
    return native, polars


def _per_record(writer: WriterSchema, payloads: list[bytes]) -> tuple[pa.Table, list[int]]:
    """The rows and dead-lettered offsets of the per-record path."""
    slow = table_rows(
        _records(payloads), writer.iceberg_schema(), {(1, 1): BoundWriter("v1", writer=dataclasses.replace(writer, batch=None))}
    )
    return slow.rows, [d.record.offset for d in slow.dead_letters]


def _check(schema: Mapping[str, Any] | str, payloads: list[bytes]) -> tuple[bool, bool]:
    """Both batch decoders on ``payloads``: each either refuses or gives exactly the per-record
    path's columns (which then has no dead letter). Returns whether each accepted."""
    native, polars = _decoders(schema)
    writer = avro_writer(schema)
    rows, dead = _per_record(writer, payloads)
    accepted = []
    for decoder in (native, polars):
        out = decoder.decode(payloads)
        accepted.append(out is not None)
        if out is None:
            continue
        assert not dead, f"{'C' if decoder.native else 'polars'} accepted payloads the per-record path refuses"
        for column, array in out.items():
            expected = rows.column(column).combine_chunks()
            assert array.cast(expected.type).equals(expected), (column, array, expected)
    fast = table_rows(_records(payloads), writer.iceberg_schema(), {(1, 1): BoundWriter("v1", writer=writer)})
    assert fast.rows.equals(rows)
    assert [d.record.offset for d in fast.dead_letters] == dead
    return accepted[0], accepted[1]


def _one_field(avro_type: Any) -> dict[str, Any]:
    return {"type": "record", "name": "R", "fields": [{"name": "v", "type": avro_type}]}


EDGES: list[tuple[Any, list[int], list[int]]] = [
    # (type, values both decoders accept, values they leave to the per-record path)
    ("int", [-(1 << 31), (1 << 31) - 1, 0, -1, 63, -64, 64, -65], [1 << 31, -(1 << 31) - 1]),
    ("long", [-(1 << 62), (1 << 62) - 1, 0, 1 << 40], [1 << 62, -(1 << 62) - 1, (1 << 63) - 1, -(1 << 63)]),
    (
        {"type": "long", "logicalType": "timestamp-millis"},
        [MIN_MICROS // 1000, MAX_MICROS // 1000, 0, -1],
        [MIN_MICROS // 1000 - 1, MAX_MICROS // 1000 + 1, 1 << 60],
    ),
    (
        {"type": "long", "logicalType": "timestamp-micros"},
        [MIN_MICROS, MAX_MICROS, 0, -1],
        [MIN_MICROS - 1, MAX_MICROS + 1],
    ),
    (
        {"type": "long", "logicalType": "local-timestamp-millis"},
        [MIN_MICROS // 1000, MAX_MICROS // 1000],
        [MAX_MICROS // 1000 + 1],
    ),
    ({"type": "long", "logicalType": "local-timestamp-micros"}, [MIN_MICROS, MAX_MICROS], [MIN_MICROS - 1]),
    ({"type": "int", "logicalType": "date"}, [MIN_DAYS, MAX_DAYS, 0], [MIN_DAYS - 1, MAX_DAYS + 1]),
]


@pytest.mark.parametrize(("avro_type", "inside", "outside"), EDGES, ids=lambda v: str(v)[:40])
def test_values_at_each_guard_edge(avro_type: Any, inside: list[int], outside: list[int]) -> None:
    for nullable in (False, True):
        schema = _one_field(["null", avro_type] if nullable else avro_type)
        good = [_varint(1) + _varint(v) if nullable else _varint(v) for v in inside]
        if nullable:
            good.append(_varint(0))
        assert _check(schema, good) == (True, True), (avro_type, nullable)
        for value in outside:
            payloads = [*good, _varint(1) + _varint(value) if nullable else _varint(value)]
            assert _check(schema, payloads) == (False, False), (avro_type, nullable, value)


def test_strings_bytes_floats_and_booleans() -> None:
    schema = {
        "type": "record",
        "name": "R",
        "fields": [
            {"name": "s", "type": "string"},
            {"name": "ns", "type": ["string", "null"]},
            {"name": "b", "type": "bytes"},
            {"name": "f", "type": "float"},
            {"name": "d", "type": ["null", "double"]},
            {"name": "t", "type": "boolean"},
            {"name": "nt", "type": ["boolean", "null"]},
        ],
    }
    rng = random.Random(3)
    values = [
        {
            "s": rng.choice(["", "a", "ünïcödé ✈", "\U0001f600" * 40, "x" * 300]),
            "ns": None if i % 3 == 0 else "JFK" * (i % 5),
            "b": bytes(rng.randrange(256) for _ in range(i % 11)),
            "f": rng.choice([0.0, -0.0, 1.5, float("inf"), float("-inf"), 3.4e38]),
            "d": None if i % 4 == 0 else rng.uniform(-1e308, 1e308),
            "t": bool(i % 2),
            "nt": None if i % 5 == 0 else bool(i % 3),
        }
        for i in range(300)
    ]
    assert _check(schema, [_encode(schema, v) for v in values]) == (True, True)


@pytest.mark.parametrize(
    "bad",
    [
        b"\xed\xa0\x80",  # a UTF-16 surrogate: not UTF-8 for Python
        b"\xc0\xaf",  # an over-long '/'
        b"\xf4\x90\x80\x80",  # beyond U+10FFFF
        b"\xe2\x82",  # cut short
        b"\xff",
    ],
)
def test_strings_that_are_not_utf8_are_dead_lettered_as_before(bad: bytes) -> None:
    schema = _one_field("string")
    payloads = [_varint(1) + b"a", _varint(len(bad)) + bad, _varint(0)]
    assert _check(schema, payloads) == (False, False)
    assert _per_record(avro_writer(schema), payloads)[1] == [1]


def test_random_damage_is_refused_or_decoded_as_the_per_record_path_does() -> None:
    """Valid flights with bytes flipped, inserted, dropped or cut: every batch decoder accepts
    only what it decodes exactly as fastavro does."""
    flights = [encode_flight(f) for f in iter_flights(20)]
    rng = random.Random(20261127)
    accepted = 0
    for case in range(200):
        payloads = list(flights)
        for _ in range(1 + case % 3):
            i = rng.randrange(len(payloads))
            p = bytearray(payloads[i])
            action = rng.randrange(4)
            at = rng.randrange(len(p) + 1)
            if action == 0 and p:
                p[min(at, len(p) - 1)] = rng.randrange(256)
            elif action == 1:
                p[at:at] = bytes([rng.randrange(256)])
            elif action == 2:
                del p[at : at + rng.randrange(1, 4)]
            else:
                p = p[:at]
            payloads[i] = bytes(p)
        native, _polars = _check(FLIGHT_AVRO_SCHEMA, payloads)
        accepted += native
    assert 0 < accepted < 200  # some damage decodes to other valid values, most is refused


def test_a_slice_of_a_payload_array_decodes_like_its_payloads() -> None:
    payloads = [encode_flight(f) for f in iter_flights(100)]
    array = pa.array(payloads, type=pa.large_binary()).slice(17, 50)
    native, polars = _decoders(FLIGHT_AVRO_SCHEMA)
    from_array, from_list = native.decode_array(array), native.decode(payloads[17:67])
    reference = polars.decode_array(array)
    assert from_array is not None and from_list is not None and reference is not None
    for column, values in from_list.items():
        assert from_array[column].equals(values) and reference[column].equals(values), column


def test_offsets_outside_the_data_are_an_error() -> None:
    decode = avro_batch._native_decode
    assert decode is not None
    program = bytes([2])  # one long
    assert decode(b"\x02\x04", np.array([0, 1, 2], dtype=np.int64), program) is not None
    with pytest.raises(ValueError, match="outside"):
        decode(b"\x02\x04", np.array([0, 1, 3], dtype=np.int64), program)
    with pytest.raises(ValueError, match="outside"):
        decode(b"\x02\x04", np.array([1, 0, 2], dtype=np.int64), program)
    with pytest.raises(ValueError, match="unknown kind"):
        decode(b"\x02", np.array([0, 1], dtype=np.int64), bytes([15]))
