"""Segments read into columns (danube_pipeline/lake/segment_columns.py and its C walker): the
records as a sequence, the fast path and the reference decoder agreeing on edge cases. The
random and corrupted segments are in tests/test_fuzz.py (``test_segment_columns_*``)."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pyarrow as pa
import pytest

from danube_pipeline.lake import segment_columns
from danube_pipeline.format.batches import BATCH_HEADER_SIZE, BatchBuilder, set_base_offset
from danube_pipeline.errors import CorruptRecordError, OffsetRangeError
from danube_pipeline.format.records import (
    FORMAT_VERSION,
    LEGACY_FORMAT_VERSION,
    Record,
    SegmentHeader,
    crc32c,
    encode_record,
)
from danube_pipeline.lake.segment_columns import RecordColumns, decode_segment_columns, native_framing, schema_keys
from danube_pipeline.format.segments import decode_segment, iter_stored_batches

pytestmark = pytest.mark.unit

T0 = 1_700_000_000_000_000


def _segment(start: int, batches: list[bytes]) -> bytes:
    out = bytearray(SegmentHeader(start, 0).encode())
    offset = start
    for batch in batches:
        head, rest = set_base_offset(batch, offset)
        out += head + rest
        offset += struct.unpack_from("<I", batch, 20)[0]
    return bytes(out)


def _batch(records: list[tuple[bytes, str | None, dict[str, str]]], *, schema: tuple[int, int] = (0, 0),
           producer: str = "p", first_us: int = T0) -> bytes:
    builder = BatchBuilder(first_us)
    for i, (payload, key, attributes) in enumerate(records):
        builder.append(payload, timestamp_us=first_us + i, key=key, attributes=attributes)
    return builder.build(producer_id=(1 << 64) - 7, producer_name=producer, schema_id=schema[0],
                         schema_version=schema[1])


def _mixed_segment() -> bytes:
    return _segment(40, [
        _batch([(b"a", None, {}), (b"", "k", {"x": "1", "y": "é"}), (b"ccc", "", {})], schema=(3, 1)),
        _batch([(b"\x00" * 300, "key-2", {"origin": "EWR"})], schema=(3, 2), producer="other"),
        _batch([(b"raw", None, {"only": ""})]),
    ])


def test_the_c_walker_is_built() -> None:
    # `make` installs the package with its C extension (scripts/install-system-deps.sh brings a
    # compiler); tiering's speed depends on it, so a build that silently lost it fails here.
    assert native_framing()


def test_columns_equal_the_reference_records() -> None:
    data = _mixed_segment()
    got = decode_segment_columns(data, index_interval_records=2)
    ref = decode_segment(data, index_interval_records=2)
    assert list(got.records) == ref.records
    assert got.offset_index == ref.offset_index == [[40, 32], [43, got.offset_index[1][1]]]
    assert (got.start_offset, got.end_offset, got.size_bytes) == (40, 44, len(data))
    records = got.records
    assert records.offset.tolist() == [40, 41, 42, 43, 44]
    assert records.key.to_pylist() == [None, "k", "", "key-2", None]
    assert records.attributes.to_pylist()[1] == [("x", "1"), ("y", "é")]
    assert records.payload.to_pylist()[3] == b"\x00" * 300
    assert records.producer_id.tolist() == [(1 << 64) - 7] * 5
    assert records.producer_name.to_pylist() == ["p", "p", "p", "other", "p"]
    assert records.publish_time_us.tolist() == [T0, T0 + 1, T0 + 2, T0, T0]


def test_a_sequence_of_records() -> None:
    ref = decode_segment(_mixed_segment()).records
    records = decode_segment_columns(_mixed_segment()).records
    assert len(records) == 5 and records[0] == ref[0] and records[-1] == ref[-1]
    with pytest.raises(IndexError):
        records[5]
    assert isinstance(records[1:3], RecordColumns) and list(records[1:3]) == ref[1:3]
    assert list(records[::2]) == ref[::2] and list(records[4:1]) == []
    assert list(records.take([4, 0])) == [ref[4], ref[0]]
    assert records.is_contiguous() and not records.take([0, 2]).is_contiguous()
    assert schema_keys(records) == [(0, 0), (3, 1), (3, 2)] == schema_keys(ref)
    assert RecordColumns.from_records(records) is records


def test_a_repeated_attribute_name_is_read_the_reference_way() -> None:
    # The format allows a name twice in one record; a Record keeps the later value. The C walker
    # sees the repeat and leaves the segment to the reference decoder, so the columns agree.
    builder = BatchBuilder(T0)
    builder.append(b"x", timestamp_us=T0)
    batch = bytearray(builder.build(producer_id=1, producer_name="p"))
    attrs = b"".join(struct.pack("<HI", 1, 1) + b"a" + v for v in (b"1", b"2"))
    record_at = BATCH_HEADER_SIZE + 1
    length, delta, key_len, _ = struct.unpack_from("<IIiH", batch, record_at)
    record = struct.pack("<IIiH", length + len(attrs), delta, key_len, 2) + attrs + b"x"
    batch = batch[:record_at] + bytearray(record)
    struct.pack_into("<I", batch, 8, len(batch) - 12)
    struct.pack_into("<I", batch, 12, crc32c(bytes(batch[16:])))
    data = _segment(0, [bytes(batch)])
    records = decode_segment_columns(data).records
    assert records[0].attributes == {"a": "2"} == decode_segment(data).records[0].attributes
    assert records.attributes.to_pylist() == [[("a", "2")]]


@pytest.mark.parametrize(
    ("damage", "error"),
    [
        (lambda d: d[:-1], CorruptRecordError),
        (lambda d: d[:50] + bytes([d[50] ^ 1]) + d[51:], CorruptRecordError),
        (lambda d: d[:32] + struct.pack("<Q", 41) + d[40:], OffsetRangeError),
    ],
    ids=["torn", "flipped", "offset"],
)
def test_a_bad_segment_is_refused_with_the_reference_error(damage, error) -> None:  # type: ignore[no-untyped-def]
    data = damage(_mixed_segment())
    with pytest.raises(error) as reference:
        decode_segment(data)
    with pytest.raises(error) as columns:
        decode_segment_columns(data)
    assert str(columns.value) == str(reference.value)


def test_without_the_extension_the_reference_decoder_gives_the_same_columns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fast = decode_segment_columns(_mixed_segment()).records
    monkeypatch.setattr(segment_columns, "_native", None)
    assert not native_framing()
    slow = decode_segment_columns(_mixed_segment()).records
    for name in RecordColumns.__slots__:
        a, b = getattr(fast, name), getattr(slow, name)
        assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a.equals(b), name


def test_offsets_beyond_int64_are_refused() -> None:
    data = _segment((1 << 63) - 1, [_batch([(b"a", None, {}), (b"b", None, {})])])
    assert [r.offset for r in decode_segment(data).records] == [(1 << 63) - 1, 1 << 63]
    with pytest.raises(OverflowError):
        decode_segment_columns(data)


def test_legacy_segments_are_read_by_the_reference_decoder() -> None:
    record = Record(7, T0, 5, "p", 0, 0, b"payload", {"a": "b"})
    data = SegmentHeader(7, 0, format_version=LEGACY_FORMAT_VERSION).encode() + encode_record(record)
    records = decode_segment_columns(data).records
    assert list(records) == [record]
    assert records.payload.type == pa.large_binary()


def _as_version_3(data: bytes, epochs: list[int]) -> bytes:
    """The version 2 segment ``data`` as version 3: each batch behind its epoch."""
    header = SegmentHeader.decode(data)
    out = bytearray(SegmentHeader(header.start_offset, 0, format_version=FORMAT_VERSION).encode())
    for (_, batch), epoch in zip(iter_stored_batches(data, format_version=2), epochs, strict=True):
        out += struct.pack("<Q", epoch) + batch.data
    return bytes(out)


def _as_version_1(data: bytes) -> bytes:
    decoded = decode_segment(data)
    header = SegmentHeader(decoded.start_offset, 0, format_version=LEGACY_FORMAT_VERSION).encode()
    return header + b"".join(encode_record(dataclasses.replace(r, key=None)) for r in decoded.records)


def test_version_3_segments_are_walked_by_the_fast_path_and_equal_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    v2 = _mixed_segment()
    v3 = _as_version_3(v2, [4, 4, 9])
    ref = decode_segment(v3, index_interval_records=2)
    entries = [p for p, _ in iter_stored_batches(v3, format_version=FORMAT_VERSION)]
    assert ref.offset_index == [[40, entries[0]], [43, entries[1]]] == [[40, 32], [43, entries[1]]]
    assert entries[1] == decode_segment(v2, index_interval_records=2).offset_index[1][1] + 8

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the reference decoder was used")

    with monkeypatch.context() as patched:  # the C walker reads version 3 itself
        patched.setattr(segment_columns, "decode_segment", refuse)
        fast = decode_segment_columns(v3, index_interval_records=2)
    assert (fast.header, fast.offset_index, fast.size_bytes) == (ref.header, ref.offset_index, len(v3))
    assert list(fast.records) == ref.records == decode_segment(v2).records
    monkeypatch.setattr(segment_columns, "_native", None)
    slow = decode_segment_columns(v3, index_interval_records=2)
    assert slow.offset_index == fast.offset_index
    for name in RecordColumns.__slots__:
        a, b = getattr(fast.records, name), getattr(slow.records, name)
        assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a.equals(b), name


def test_objects_of_every_version_decode_to_the_same_records() -> None:
    v2 = _segment(3, [_batch([(b"a", None, {"x": "1"}), (b"bb", None, {})]), _batch([(b"c", None, {})])])
    segments = {1: _as_version_1(v2), 2: v2, 3: _as_version_3(v2, [0, 2])}
    assert {v: SegmentHeader.decode(d).format_version for v, d in segments.items()} == {1: 1, 2: 2, 3: 3}
    decoded = {v: decode_segment_columns(d) for v, d in segments.items()}
    records = [list(d.records) for d in decoded.values()]
    assert records[0] == records[1] == records[2] and [r.offset for r in records[0]] == [3, 4, 5]


@pytest.mark.parametrize(
    ("damage", "error"),
    [
        (lambda d: d[:-1], CorruptRecordError),
        (lambda d: d[:36], CorruptRecordError),  # torn inside the first epoch
        (lambda d: d[:60] + bytes([d[60] ^ 1]) + d[61:], CorruptRecordError),
        (lambda d: d[:40] + struct.pack("<Q", 41) + d[48:], OffsetRangeError),
    ],
    ids=["torn", "torn-epoch", "flipped", "offset"],
)
def test_a_bad_version_3_segment_is_refused_with_the_reference_error(damage, error) -> None:  # type: ignore[no-untyped-def]
    data = damage(_as_version_3(_mixed_segment(), [1, 2, 3]))
    with pytest.raises(error) as reference:
        decode_segment(data)
    with pytest.raises(error) as columns:
        decode_segment_columns(data)
    assert str(columns.value) == str(reference.value)
