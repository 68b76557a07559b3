"""Reading whole segments of either format version: scanning for recovery, decoding for
tiering and tests.

A segment is a :class:`~danube_pipeline.format.records.SegmentHeader` followed by record batches
(version 2, :mod:`danube_pipeline.format.batches`) or by one frame per record (version 1,
:mod:`danube_pipeline.format.records`). Offsets are contiguous from the header's start offset.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from danube_pipeline.format import batches
from danube_pipeline.errors import CorruptRecordError, MalformedRequestError, OffsetRangeError
from danube_pipeline.format.records import (
    LEGACY_FORMAT_VERSION,
    SEGMENT_HEADER_SIZE,
    Record,
    ScanResult,
    SegmentHeader,
    iter_records,
    scan_records,
)

__all__ = ["DecodedSegment", "StoredBatch", "decode_segment", "iter_stored_batches", "scan_segment"]

MAX_BATCH_BYTES = 256 * 1024 * 1024
"""Sanity bound for scanning: a longer batch_length is treated as corruption."""

_PREFIX = struct.Struct("<QII")
_COUNT = struct.Struct("<I")
_COUNT_POSITION = 20  # record_count within a batch


@dataclass(frozen=True, slots=True)
class StoredBatch:
    """One batch as stored: its bytes start with the base offset the broker assigned.

    Attributes:
        base_offset: the first record's offset.
        record_count: records in the batch.
        data: the whole batch.
    """

    base_offset: int
    record_count: int
    data: bytes

    @property
    def last_offset(self) -> int:
        """The last record's offset."""
        return self.base_offset + self.record_count - 1


def scan_batches(
    data: bytes | memoryview,
    *,
    start_position: int = SEGMENT_HEADER_SIZE,
    expected_first_offset: int | None = None,
    keep_positions: bool = False,
) -> ScanResult:
    """Walk stored batches and stop at the first one that is torn, corrupt or out of sequence.

    Checks each batch's length, magic and CRC32C, and that base offsets are contiguous; the
    records inside a batch whose CRC matches are not walked. Never raises for bad data.

    Returns:
        A :class:`~danube_pipeline.format.records.ScanResult`; ``positions`` (when requested) holds the
        ``(base_offset, byte_position)`` of every good batch and ``record_count`` the records.
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
        if end - pos < batches.BATCH_HEADER_SIZE:
            error = f"torn batch header at byte {pos}"
            break
        base, length, _crc = _PREFIX.unpack_from(view, pos)
        total = 12 + length
        if total < batches.BATCH_HEADER_SIZE or total > MAX_BATCH_BYTES:
            error = f"implausible batch length {length} at byte {pos}"
            break
        if pos + total > end:
            error = f"torn batch at byte {pos}: {total} bytes run past the end"
            break
        if view[pos + 16] != batches.MAGIC:
            error = f"batch magic {view[pos + 16]} at byte {pos}"
            break
        if not batches.crc_matches(view, pos, total):
            error = f"CRC32C mismatch in the batch at byte {pos}"
            break
        if expected is not None and base != expected:
            error = f"batch base offset {base} at byte {pos}, expected {expected}"
            break
        records = _COUNT.unpack_from(view, pos + _COUNT_POSITION)[0]
        if records < 1:
            error = f"empty batch at byte {pos}"
            break
        if keep_positions:
            positions.append((base, pos))
        if first is None:
            first = base
        last = base + records - 1
        expected = last + 1
        count += records
        pos += total
    return ScanResult(
        valid_length=pos, record_count=count, first_offset=first, last_offset=last, error=error, positions=positions
    )


def scan_segment(
    data: bytes | memoryview, *, expected_first_offset: int | None = None, keep_positions: bool = False
) -> ScanResult:
    """:func:`scan_batches` or :func:`~danube_pipeline.format.records.scan_records`, by the header's
    format version (``data`` starts with the segment header).

    Raises:
        CorruptRecordError: the header is unusable.
    """
    header = SegmentHeader.decode(data)
    scan = scan_records if header.format_version == LEGACY_FORMAT_VERSION else scan_batches
    return scan(data, expected_first_offset=expected_first_offset, keep_positions=keep_positions)


def iter_stored_batches(
    data: bytes | memoryview, *, format_version: int, start_position: int = SEGMENT_HEADER_SIZE, where: str = "segment"
) -> Iterator[tuple[int, StoredBatch]]:
    """Yield ``(byte_position, batch)`` for every batch from ``start_position``, strictly.

    Records of a version 1 segment come as one-record batches
    (:func:`~danube_pipeline.format.batches.batch_from_record`).

    Raises:
        CorruptRecordError: a torn or corrupt batch or record.
    """
    if format_version == LEGACY_FORMAT_VERSION:
        for pos, record in iter_records(data, start_position=start_position, where=where):
            yield pos, StoredBatch(record.offset, 1, batches.batch_from_record(record))
        return
    view = memoryview(data)
    end = len(view)
    pos = start_position
    while pos < end:
        if end - pos < batches.BATCH_HEADER_SIZE:
            raise CorruptRecordError(where, pos, "torn batch header")
        base, length, _crc = _PREFIX.unpack_from(view, pos)
        total = 12 + length
        if total < batches.BATCH_HEADER_SIZE or pos + total > end:
            raise CorruptRecordError(where, pos, f"bad batch length {length}")
        if not batches.crc_matches(view, pos, total):
            raise CorruptRecordError(where, pos, "CRC32C mismatch")
        count = _COUNT.unpack_from(view, pos + _COUNT_POSITION)[0]
        yield pos, StoredBatch(base, count, bytes(view[pos : pos + total]))
        pos += total


RecordsT = TypeVar("RecordsT", bound=Sequence[Record])


@dataclass(frozen=True, slots=True)
class DecodedSegment(Generic[RecordsT]):
    """A whole segment, checked.

    Attributes:
        header: the segment header.
        records: every record, offsets contiguous from ``header.start_offset``: a list of
            :class:`~danube_pipeline.format.records.Record` (:func:`decode_segment`), or columns
            (:func:`~danube_pipeline.lake.segment_columns.decode_segment_columns`).
        offset_index: sparse ``[offset, byte_position]`` pairs (``docs/etcd-layout.md`` §5.1
            ``offset_index``): the first record, then the first record of the batch (version 2)
            or the record (version 1) that follows each ``index_interval_records`` records.
        size_bytes: total bytes.
    """

    header: SegmentHeader
    records: RecordsT
    offset_index: list[list[int]]
    size_bytes: int

    @property
    def start_offset(self) -> int:
        return self.header.start_offset

    @property
    def end_offset(self) -> int:
        """Inclusive end offset. Raises ValueError on an empty segment."""
        if not len(self.records):
            raise ValueError("empty segment has no end offset")
        return self.records[-1].offset


def decode_segment(
    data: bytes | memoryview, *, where: str = "segment", index_interval_records: int = 1000
) -> DecodedSegment[list[Record]]:
    """Decode and verify a complete segment of either version (header, every CRC, contiguous
    offsets, and in version 2 every batch's record framing, as
    :func:`~danube_pipeline.format.batches.validate_batch` checks it).

    Args:
        data: the segment or ``.dnb1`` object bytes.
        where: a name for error messages (file path or object id).
        index_interval_records: records between entries of the sparse offset index.

    Raises:
        CorruptRecordError: bad header, torn or corrupt batch or record, or a batch whose CRC
            matches but whose records break the framing.
        OffsetRangeError: offsets not contiguous from the header's start offset.
    """
    header = SegmentHeader.decode(data, where=where)
    records: list[Record] = []
    index: list[list[int]] = []
    expected = header.start_offset
    next_index_at = expected
    if header.format_version == LEGACY_FORMAT_VERSION:
        for pos, record in iter_records(data, where=where):
            if record.offset != expected:
                raise OffsetRangeError(expected, record.offset, where)
            if record.offset >= next_index_at:
                index.append([record.offset, pos])
                next_index_at = record.offset + index_interval_records
            records.append(record)
            expected += 1
    else:
        for pos, batch in iter_stored_batches(data, format_version=header.format_version, where=where):
            if batch.base_offset != expected:
                raise OffsetRangeError(expected, batch.base_offset, where)
            if batch.base_offset >= next_index_at:
                index.append([batch.base_offset, pos])
                next_index_at = batch.base_offset + index_interval_records
            try:
                # The CRC only proves the bytes are the ones written: check the record framing
                # too, as the broker did before appending, so a batch whose records break it
                # (trailing bytes, a key or payload running past its record) is never decoded
                # into truncated records.
                batches.validate_batch(batch.data)
                records.extend(batches.batch_records(batch.data))
            except (MalformedRequestError, struct.error, UnicodeDecodeError) as exc:
                raise CorruptRecordError(where, pos, f"undecodable batch: {exc}") from exc
            expected = batch.last_offset + 1
    return DecodedSegment(header=header, records=records, offset_index=index, size_bytes=len(data))
