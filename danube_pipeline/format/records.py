"""The segment header, the :class:`Record` value, and format version 1 (one frame per record).

A *segment* is one file: a 32-byte header followed by its data. The broker's WAL writes
segments; a sealed segment is immutable and is uploaded byte for byte as the object
``data-{start}-{end}.dnb1`` (``docs/etcd-layout.md`` §5.1), so the same decoder reads both.
:mod:`danube_pipeline.format.segments` reads a whole segment of either version.

Segment header (little endian, 32 bytes)::

    magic b"DNB1" | format_version u16 | flags u16 | start_offset u64 | created_at_ms u64 | 8 reserved bytes

The 8 reserved bytes are ignored by readers; the broker's WAL keeps its last write's position
and size there (``broker.storage.wal.segment``, the write record), zero in older files.

Format version 3 (:data:`FORMAT_VERSION`, what the WAL writes for every new segment since
replication) holds *entries*: each entry is the leader epoch the batch was written in, then one
stored record batch exactly as in version 2::

    leader_epoch u64 | stored record batch (base offset set; its CRC32C does not cover the epoch)

Epoch 0 means unknown (a topic whose WAL was never given an epoch). Byte positions into a
version 3 segment (the WAL's sparse offset index, an object descriptor's ``offset_index``,
:attr:`ScanResult.positions`) point at the entry start, the epoch. A torn or corrupt entry (a
short epoch, a bad batch) ends the valid prefix as a bad batch does in version 2.

Format version 2 (:data:`BATCH_FORMAT_VERSION`, written since record batches) holds
producer-framed record batches (:mod:`danube_pipeline.format.batches`) with no epoch. Format
version 1 (:data:`LEGACY_FORMAT_VERSION`, written before) holds one frame per record, below.
Segments and objects of versions 1 and 2 stay readable everywhere.

Version 1 record framing (little endian)::

    body_length u32 | crc32c(body) u32 | body

Record body::

    offset u64 | publish_time_us u64 | producer_id u64 | schema_id u64 | schema_version u32
    | producer_name_length u16 | attribute_count u16 | producer_name (UTF-8)
    | attribute_count x (key_length u16 | value_length u32 | key UTF-8 | value UTF-8)
    | payload (the rest of the body)

Offsets within a segment are contiguous, starting at the header's ``start_offset``. A record
whose frame runs past the end of the data, whose CRC32C does not match, or whose offset breaks
the sequence ends the valid prefix: :func:`scan_records` reports where, so the WAL can
truncate a torn tail: nothing after it was acknowledged, since every ack follows an
``fdatasync`` of everything before it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import crc32c as _crc32c

from danube_pipeline.errors import CorruptRecordError

MAGIC = b"DNB1"
FORMAT_VERSION = 3
"""The version the WAL writes new segments in: leader epoch + record batch entries."""
BATCH_FORMAT_VERSION = 2
"""Record batches without epochs; still read (and the default of :class:`SegmentHeader`)."""
LEGACY_FORMAT_VERSION = 1
"""One frame per record; still read."""
SUPPORTED_FORMAT_VERSIONS = (LEGACY_FORMAT_VERSION, BATCH_FORMAT_VERSION, FORMAT_VERSION)
EPOCH_PREFIX_SIZE = 8
"""Bytes of the leader epoch before each batch in a version 3 segment (u64, little endian)."""
OBJECT_SUFFIX = ".dnb1"

_HEADER = struct.Struct("<4sHHQQ8x")
_FRAME = struct.Struct("<II")
_FIXED = struct.Struct("<QQQQIHH")
_ATTR = struct.Struct("<HI")

SEGMENT_HEADER_SIZE = _HEADER.size  # 32 bytes
RECORD_FRAME_SIZE = _FRAME.size  # 8 bytes
RECORD_FIXED_SIZE = _FIXED.size  # 40 bytes
MAX_RECORD_BODY_BYTES = 64 * 1024 * 1024
"""Sanity bound for decoding; larger lengths are treated as corruption."""


def crc32c(data: bytes | memoryview) -> int:
    """CRC32C (Castagnoli) of ``data`` as an unsigned 32-bit int."""
    return _crc32c.crc32c(data)


@dataclass(frozen=True, slots=True)
class Record:
    """One message as stored in the WAL and in segment objects.

    Attributes:
        offset: position in the topic, contiguous from 0.
        publish_time_us: microseconds since the Unix epoch.
        producer_id: the u64 producer id (``docs/etcd-layout.md`` §3.3).
        producer_name: the producer's name.
        schema_id: global schema id (``docs/etcd-layout.md`` §4.1); 0 = no schema.
        schema_version: version within the subject; 0 = no schema.
        attributes: user key/value pairs.
        payload: the message bytes.
        key: the routing key, or ``None`` (version 1 records have none).
    """

    offset: int
    publish_time_us: int
    producer_id: int
    producer_name: str
    schema_id: int
    schema_version: int
    payload: bytes
    attributes: Mapping[str, str] = field(default_factory=dict)
    key: str | None = None


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """The 32-byte header at the start of every segment file and object.

    ``format_version`` defaults to :data:`BATCH_FORMAT_VERSION` (bare batches follow); the WAL
    passes :data:`FORMAT_VERSION` for the segments it creates.
    """

    start_offset: int
    created_at_ms: int
    format_version: int = BATCH_FORMAT_VERSION
    flags: int = 0

    def encode(self) -> bytes:
        """The header's 32 bytes."""
        return _HEADER.pack(MAGIC, self.format_version, self.flags, self.start_offset, self.created_at_ms)

    @classmethod
    def decode(cls, data: bytes | memoryview, *, where: str = "segment") -> SegmentHeader:
        """Parse the first 32 bytes of ``data``.

        Raises:
            CorruptRecordError: if ``data`` is shorter than a header, the magic is not
                ``DNB1``, or the format version is unknown.
        """
        if len(data) < SEGMENT_HEADER_SIZE:
            raise CorruptRecordError(where, 0, f"shorter than the {SEGMENT_HEADER_SIZE}-byte header")
        magic, version, flags, start, created = _HEADER.unpack_from(data, 0)
        if magic != MAGIC:
            raise CorruptRecordError(where, 0, f"bad magic {magic!r}, expected {MAGIC!r}")
        if version not in SUPPORTED_FORMAT_VERSIONS:
            raise CorruptRecordError(where, 4, f"unknown format version {version}")
        return cls(start_offset=start, created_at_ms=created, format_version=version, flags=flags)


def encode_record(record: Record) -> bytes:
    """Frame one record in format version 1: length, CRC32C and body (the key is not kept).

    Returns:
        ``8 + body_length`` bytes.
    """
    name = record.producer_name.encode()
    parts = [b"", _FIXED.pack(
        record.offset,
        record.publish_time_us,
        record.producer_id,
        record.schema_id,
        record.schema_version,
        len(name),
        len(record.attributes),
    ), name]
    for key, value in record.attributes.items():
        k = key.encode()
        v = value.encode()
        parts.append(_ATTR.pack(len(k), len(v)))
        parts.append(k)
        parts.append(v)
    parts.append(record.payload)
    body = b"".join(parts)
    return _FRAME.pack(len(body), _crc32c.crc32c(body)) + body


def decode_body(body: bytes | memoryview) -> Record:
    """Decode a record body (without its frame).

    Raises:
        struct.error, UnicodeDecodeError, ValueError: if the body is malformed; callers that
            read untrusted data call this only after the CRC matched.
    """
    offset, publish, producer_id, schema_id, schema_version, name_len, attr_count = _FIXED.unpack_from(body, 0)
    pos = RECORD_FIXED_SIZE
    name = bytes(body[pos : pos + name_len]).decode()
    pos += name_len
    attributes: dict[str, str] = {}
    for _ in range(attr_count):
        klen, vlen = _ATTR.unpack_from(body, pos)
        pos += _ATTR.size
        key = bytes(body[pos : pos + klen]).decode()
        pos += klen
        attributes[key] = bytes(body[pos : pos + vlen]).decode()
        pos += vlen
    if pos > len(body):
        raise ValueError("record body shorter than its declared fields")
    return Record(
        offset=offset,
        publish_time_us=publish,
        producer_id=producer_id,
        producer_name=name,
        schema_id=schema_id,
        schema_version=schema_version,
        payload=bytes(body[pos:]),
        attributes=attributes,
    )


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What :func:`scan_records` found.

    Attributes:
        valid_length: bytes from the start of the data through the last good record.
        record_count: good records found.
        first_offset: offset of the first good record, or ``None`` if there is none.
        last_offset: offset of the last good record, or ``None``.
        error: why scanning stopped before the end of the data, or ``None`` if it did not.
        positions: ``(offset, byte_position)`` of every good record (batch, entry), when requested.
        epoch_starts: in a version 3 scan, ``(leader_epoch, base_offset)`` of every good batch
            whose epoch differs from the previous batch's (the first batch's always), epoch 0
            included: where each run of one epoch starts.
    """

    valid_length: int
    record_count: int
    first_offset: int | None
    last_offset: int | None
    error: str | None
    positions: list[tuple[int, int]] = field(default_factory=list)
    epoch_starts: list[tuple[int, int]] = field(default_factory=list)


def scan_records(
    data: bytes | memoryview,
    *,
    start_position: int = SEGMENT_HEADER_SIZE,
    expected_first_offset: int | None = None,
    keep_positions: bool = False,
) -> ScanResult:
    """Walk framed records and stop at the first one that is torn, corrupt or out of sequence.

    Never raises for bad data: the caller decides (the WAL truncates at ``valid_length``; a
    strict reader raises).

    Args:
        data: the segment bytes (header included when ``start_position`` is 32).
        start_position: byte position of the first record frame.
        expected_first_offset: the offset the first record must carry, or ``None`` to accept any.
        keep_positions: also return every record's ``(offset, byte_position)``.

    Returns:
        A :class:`ScanResult`.
    """
    view = memoryview(data)
    end = len(view)
    pos = start_position
    expected = expected_first_offset
    first: int | None = None
    last: int | None = None
    count = 0
    positions: list[tuple[int, int]] = []
    error: str | None = None
    while pos < end:
        if end - pos < RECORD_FRAME_SIZE:
            error = f"torn frame header at byte {pos}"
            break
        length, crc = _FRAME.unpack_from(view, pos)
        if length < RECORD_FIXED_SIZE or length > MAX_RECORD_BODY_BYTES:
            error = f"implausible body length {length} at byte {pos}"
            break
        body_start = pos + RECORD_FRAME_SIZE
        if body_start + length > end:
            error = f"torn record at byte {pos}: body of {length} bytes runs past the end"
            break
        body = view[body_start : body_start + length]
        if _crc32c.crc32c(body) != crc:
            error = f"CRC32C mismatch at byte {pos}"
            break
        offset = struct.unpack_from("<Q", body, 0)[0]
        if expected is not None and offset != expected:
            error = f"offset {offset} at byte {pos}, expected {expected}"
            break
        if keep_positions:
            positions.append((offset, pos))
        if first is None:
            first = offset
        last = offset
        expected = offset + 1
        count += 1
        pos = body_start + length
    return ScanResult(
        valid_length=pos if error is None else pos,
        record_count=count,
        first_offset=first,
        last_offset=last,
        error=error,
        positions=positions,
    )


def iter_records(
    data: bytes | memoryview,
    *,
    start_position: int = SEGMENT_HEADER_SIZE,
    where: str = "segment",
) -> Iterator[tuple[int, Record]]:
    """Yield ``(byte_position, record)`` for every record; strict.

    Raises:
        CorruptRecordError: at the first torn or corrupt record.
    """
    view = memoryview(data)
    end = len(view)
    pos = start_position
    while pos < end:
        if end - pos < RECORD_FRAME_SIZE:
            raise CorruptRecordError(where, pos, "torn frame header")
        length, crc = _FRAME.unpack_from(view, pos)
        body_start = pos + RECORD_FRAME_SIZE
        if length < RECORD_FIXED_SIZE or length > MAX_RECORD_BODY_BYTES or body_start + length > end:
            raise CorruptRecordError(where, pos, f"bad body length {length}")
        body = view[body_start : body_start + length]
        if _crc32c.crc32c(body) != crc:
            raise CorruptRecordError(where, pos, "CRC32C mismatch")
        try:
            record = decode_body(body)
        except (struct.error, UnicodeDecodeError, ValueError) as exc:
            raise CorruptRecordError(where, pos, f"undecodable body: {exc}") from exc
        yield pos, record
        pos = body_start + length


def object_id(start_offset: int, end_offset: int) -> str:
    """The object name of ``docs/etcd-layout.md`` §5.1: ``data-{start}-{end}.dnb1``."""
    return f"data-{start_offset}-{end_offset}{OBJECT_SUFFIX}"
