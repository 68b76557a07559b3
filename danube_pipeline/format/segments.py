"""Reading whole segments of any format version: scanning for recovery, decoding for tiering
and tests.

A segment is a :class:`~danube_pipeline.format.records.SegmentHeader` followed by

* version 3 (:data:`~danube_pipeline.format.records.FORMAT_VERSION`, what the WAL writes):
  entries of ``leader_epoch u64`` (little endian, 0 = unknown) immediately followed by one
  stored record batch as in version 2 (the batch CRC32C does not cover the epoch);
* version 2: stored record batches (:mod:`danube_pipeline.format.batches`);
* version 1: one frame per record (:mod:`danube_pipeline.format.records`).

Offsets are contiguous from the header's start offset. In version 3 every byte position
(scan positions, the sparse offset index) is the entry start, and a :class:`StoredBatch` carries
the entry's epoch in :attr:`StoredBatch.leader_epoch` while its :attr:`StoredBatch.data` is the
batch alone (what consumers and followers receive).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from danube_pipeline.format import batches
from danube_pipeline.errors import CorruptRecordError, MalformedRequestError, OffsetRangeError
from danube_pipeline.format.records import (
    EPOCH_PREFIX_SIZE,
    FORMAT_VERSION,
    LEGACY_FORMAT_VERSION,
    SEGMENT_HEADER_SIZE,
    Record,
    ScanResult,
    SegmentHeader,
    iter_records,
    scan_records,
)

__all__ = [
    "DecodedSegment", "StoredBatch", "decode_segment", "has_epoch_prefix", "iter_stored_batches", "scan_segment",
]

MAX_BATCH_BYTES = 256 * 1024 * 1024
"""Sanity bound for scanning: a longer batch_length is treated as corruption."""

_PREFIX = struct.Struct("<QII")
_COUNT = struct.Struct("<I")
_COUNT_POSITION = 20  # record_count within a batch
_EPOCH = struct.Struct("<Q")


def has_epoch_prefix(format_version: int) -> bool:
    """Whether each batch of a segment of ``format_version`` is prefixed by its leader epoch
    (version 3 and later)."""
    return format_version >= FORMAT_VERSION


@dataclass(frozen=True, slots=True)
class StoredBatch:
    """One batch as stored: its bytes start with the base offset the broker assigned.

    Attributes:
        base_offset: the first record's offset.
        record_count: records in the batch.
        data: the whole batch (in version 3 without the epoch before it).
        leader_epoch: the leader epoch the batch was written in (version 3); 0 when unknown
            (versions 1 and 2, or a WAL never given an epoch).
    """

    base_offset: int
    record_count: int
    data: bytes
    leader_epoch: int = 0

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
    epoch_prefix: bool = False,
) -> ScanResult:
    """Walk stored batches (or version 3 entries) and stop at the first one that is torn,
    corrupt or out of sequence.

    Checks each batch's length, magic and CRC32C, and that base offsets are contiguous; the
    records inside a batch whose CRC matches are not walked. Never raises for bad data.

    Args:
        epoch_prefix: each batch is preceded by its 8-byte leader epoch (version 3 entries);
            a short epoch ends the valid prefix like a torn batch.

    Returns:
        A :class:`~danube_pipeline.format.records.ScanResult`; ``positions`` (when requested) holds the
        ``(base_offset, byte_position)`` of every good batch (its entry start in version 3),
        ``record_count`` the records, and ``epoch_starts`` (version 3) where each epoch's run
        of batches starts.
    """
    view = memoryview(data)
    end = len(view)
    pos = start_position
    skip = EPOCH_PREFIX_SIZE if epoch_prefix else 0
    expected = expected_first_offset
    first: int | None = None
    last: int | None = None
    count = 0
    positions: list[tuple[int, int]] = []
    epoch_starts: list[tuple[int, int]] = []
    error: str | None = None
    while pos < end:
        at = pos + skip  # the batch
        if end - at < batches.BATCH_HEADER_SIZE:
            error = f"torn {'entry' if skip else 'batch header'} at byte {pos}"
            break
        base, length, _crc = _PREFIX.unpack_from(view, at)
        total = 12 + length
        if total < batches.BATCH_HEADER_SIZE or total > MAX_BATCH_BYTES:
            error = f"implausible batch length {length} at byte {at}"
            break
        if at + total > end:
            error = f"torn batch at byte {at}: {total} bytes run past the end"
            break
        if view[at + 16] != batches.MAGIC:
            error = f"batch magic {view[at + 16]} at byte {at}"
            break
        if not batches.crc_matches(view, at, total):
            error = f"CRC32C mismatch in the batch at byte {at}"
            break
        if expected is not None and base != expected:
            error = f"batch base offset {base} at byte {at}, expected {expected}"
            break
        records = _COUNT.unpack_from(view, at + _COUNT_POSITION)[0]
        if records < 1:
            error = f"empty batch at byte {at}"
            break
        if keep_positions:
            positions.append((base, pos))
        if skip:
            epoch = _EPOCH.unpack_from(view, pos)[0]
            if not epoch_starts or epoch_starts[-1][0] != epoch:
                epoch_starts.append((epoch, base))
        if first is None:
            first = base
        last = base + records - 1
        expected = last + 1
        count += records
        pos = at + total
    return ScanResult(
        valid_length=pos, record_count=count, first_offset=first, last_offset=last, error=error, positions=positions,
        epoch_starts=epoch_starts,
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
    if header.format_version == LEGACY_FORMAT_VERSION:
        return scan_records(data, expected_first_offset=expected_first_offset, keep_positions=keep_positions)
    return scan_batches(
        data, expected_first_offset=expected_first_offset, keep_positions=keep_positions,
        epoch_prefix=has_epoch_prefix(header.format_version),
    )


def iter_stored_batches(
    data: bytes | memoryview, *, format_version: int, start_position: int = SEGMENT_HEADER_SIZE, where: str = "segment"
) -> Iterator[tuple[int, StoredBatch]]:
    """Yield ``(byte_position, batch)`` for every batch from ``start_position``, strictly.

    Records of a version 1 segment come as one-record batches
    (:func:`~danube_pipeline.format.batches.batch_from_record`). In version 3,
    ``byte_position`` is the entry start and the batch carries the entry's epoch.

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
    skip = EPOCH_PREFIX_SIZE if has_epoch_prefix(format_version) else 0
    while pos < end:
        at = pos + skip
        if end - at < batches.BATCH_HEADER_SIZE:
            raise CorruptRecordError(where, pos, "torn entry" if skip else "torn batch header")
        base, length, _crc = _PREFIX.unpack_from(view, at)
        total = 12 + length
        if total < batches.BATCH_HEADER_SIZE or at + total > end:
            raise CorruptRecordError(where, pos, f"bad batch length {length}")
        if not batches.crc_matches(view, at, total):
            raise CorruptRecordError(where, pos, "CRC32C mismatch")
        count = _COUNT.unpack_from(view, at + _COUNT_POSITION)[0]
        epoch = _EPOCH.unpack_from(view, pos)[0] if skip else 0
        yield pos, StoredBatch(base, count, bytes(view[at : at + total]), epoch)
        pos = at + total


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
            ``offset_index``): the first record, then the first record of the batch (version 2),
            entry (version 3, the position of its epoch) or the record (version 1) that follows
            each ``index_interval_records`` records.
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
    """Decode and verify a complete segment of any version (header, every CRC, contiguous
    offsets, and in versions 2 and 3 every batch's record framing, as
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
