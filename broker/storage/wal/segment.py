"""One WAL segment file and its sparse offset index (the role of Kafka's ``LogSegment`` and
``OffsetIndex``).

Every segment file is a :class:`danube_pipeline.format.records.SegmentHeader` followed by
entries of a leader epoch and a record batch (format version 3, written for every new segment;
:mod:`danube_pipeline.format.segments`), by bare record batches (version 2, written before
epochs; an active version 2 segment found at open is appended to in version 2 until it rolls),
or by one frame per record (version 1, written before batches). Versions 1 and 2 stay
readable. File names carry the offsets, zero-padded to 20 digits so they sort in offset order:

    {start:020d}.log                  the active segment (appended to)
    {start:020d}-{end:020d}.dnb1      a sealed, immutable segment (end inclusive)

The last 8 bytes of the header (bytes 24..32, zero in the format and ignored by readers) hold
the *write record* of a version 2 or 3 segment the WAL appends to: the byte position where its
latest group commit starts (u32) and that write's size (31 bits of a u32, little endian),
whose top bit says the write's ``fdatasync`` returned. The group commit writes the record
(not synced yet) before its batches, so the same ``fdatasync`` covers both, and writes it
again with the synced bit after the ``fdatasync`` (made durable by the next write's sync, or
by writeback): :data:`WRITE_RECORD_AT`, :func:`encode_write_record`. Recovery uses it to tell
a group commit torn by a power cut from corruption in the middle
(:mod:`broker.storage.wal.recovery`). Zero means no record (files written before it, or a
segment past 2 GiB).
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from danube_pipeline.format import batches
from danube_pipeline.errors import CorruptRecordError
from danube_pipeline.format.records import (
    EPOCH_PREFIX_SIZE,
    FORMAT_VERSION,
    LEGACY_FORMAT_VERSION,
    RECORD_FRAME_SIZE,
    SEGMENT_HEADER_SIZE,
    SegmentHeader,
    crc32c,
    decode_body,
)
from danube_pipeline.format.segments import StoredBatch, has_epoch_prefix, scan_batches, scan_segment

log = logging.getLogger(__name__)

ACTIVE_SUFFIX = ".log"
SEALED_SUFFIX = ".dnb1"
ACTIVE_NAME_RE = re.compile(r"^(\d{20})\.log$")
SEALED_NAME_RE = re.compile(r"^(\d{20})-(\d{20})\.dnb1$")

DEFAULT_INDEX_INTERVAL_BYTES = 32 * 1024
"""Distance, in bytes, between entries of a segment's sparse offset → byte-position index."""
READ_CHUNK_BYTES = 1024 * 1024
"""Bytes read from a segment file per ``pread`` when serving consumers."""

_FRAME = struct.Struct("<II")
_OFFSET = struct.Struct("<Q")
_BATCH_PREFIX = struct.Struct("<QI")  # base_offset, batch_length
_BATCH_COUNT = struct.Struct("<I")
_BATCH_PEEK_BYTES = 24  # through record_count
_EPOCH = struct.Struct("<Q")


WRITE_RECORD_AT = 24
"""Byte position of the write record in a segment header (module docstring)."""
_WRITE_RECORD = struct.Struct("<II")  # position, size | synced bit
_SYNCED_BIT = 1 << 31
_SIZE_MAX = _SYNCED_BIT - 1


@dataclass(frozen=True, slots=True)
class WriteRecord:
    """The latest group commit of a segment, as its header records it (module docstring).

    Attributes:
        position: byte position where the write starts.
        size_bytes: its size.
        synced: whether its ``fdatasync`` returned (a record without the bit may be synced too).
    """

    position: int
    size_bytes: int
    synced: bool


def encode_write_record(position: int, size_bytes: int, *, synced: bool) -> bytes:
    """The 8 bytes of a write record; zeros (no record) past the 2 GiB the fields hold."""
    if position + size_bytes > _SIZE_MAX:
        return bytes(_WRITE_RECORD.size)
    return _WRITE_RECORD.pack(position, size_bytes | (_SYNCED_BIT if synced else 0))


def decode_write_record(data: bytes | memoryview) -> WriteRecord | None:
    """The write record in the header at the start of ``data``, or ``None`` when there is
    none (zero, or a position inside the header)."""
    if len(data) < SEGMENT_HEADER_SIZE:
        return None
    position, field = _WRITE_RECORD.unpack_from(data, WRITE_RECORD_AT)
    size = field & _SIZE_MAX
    if position < SEGMENT_HEADER_SIZE or size == 0:
        return None
    return WriteRecord(position, size, bool(field & _SYNCED_BIT))


def active_name(start_offset: int) -> str:
    """File name of an active segment: ``{start:020d}.log``."""
    return f"{start_offset:020d}{ACTIVE_SUFFIX}"


def sealed_name(start_offset: int, end_offset: int) -> str:
    """File name of a sealed segment: ``{start:020d}-{end:020d}.dnb1`` (end inclusive)."""
    return f"{start_offset:020d}-{end_offset:020d}{SEALED_SUFFIX}"


def now_ms() -> int:
    """Wall-clock milliseconds since the Unix epoch."""
    return time.time_ns() // 1_000_000


def fsync_dir(directory: Path) -> None:
    """``fsync`` a directory so renames and creations in it are durable.

    Raises:
        OSError: the directory cannot be opened or synced.
    """
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_MAKE_DIRS_LOCK = threading.Lock()  # a directory seen as existing was made durable by its creator


def make_dirs_durable(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing parents (``mkdir -p``) so that their entries are
    durable: after the creation, the parent of each directory that was missing is synced, from
    the deepest up to the first directory that already existed. The new directory's own
    entries (files created in it later) are for the caller to sync.

    Calls are serialized within the process, so a directory another caller is creating is never
    taken for one that is already durable.

    Returns:
        The directories created, deepest first (empty when ``directory`` existed).

    Raises:
        OSError: a directory cannot be created or synced (``FileExistsError`` when a file
            stands where a directory should be).
    """
    with _MAKE_DIRS_LOCK:
        missing: list[Path] = []
        d = directory
        while not d.is_dir() and d.parent != d:
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            d.mkdir(exist_ok=True)
        for d in missing:
            fsync_dir(d.parent)
        return missing


def write_durably(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` durably: temporary file, ``fsync``, rename, ``fsync`` of
    the directory. A crash leaves the old file or the new one, never a mix.

    Raises:
        OSError: the file cannot be written, renamed or synced.
    """
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    fsync_dir(path.parent)


def cut_active_file(fd: int, position: int, header: bytes | None) -> None:
    """Cut an active segment file at byte ``position`` and ``fsync`` it (truncation, see
    :meth:`Segment.truncation_point`). The header's write record is cleared (its write is
    gone), or the whole header replaced by ``header`` when given (a segment cut to its header
    starts afresh).

    Raises:
        OSError: the truncation, write or sync failed.
    """
    os.ftruncate(fd, position)
    if header is not None:
        os.pwrite(fd, header, 0)
    else:
        os.pwrite(fd, bytes(_WRITE_RECORD.size), WRITE_RECORD_AT)
    os.fsync(fd)


def truncate_file(path: Path, length_bytes: int) -> None:
    """Cut ``path`` to ``length_bytes`` and ``fsync`` it.

    Raises:
        OSError: the file cannot be opened, truncated or synced.
    """
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, length_bytes)
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class SealedSegment:
    """One sealed, immutable segment file, as the WAL reports it.

    Attributes:
        start_offset: first offset in the file.
        end_offset: last offset in the file (inclusive).
        path: the ``.dnb1`` file.
        size_bytes: file size.
        created_at_ms: the header's creation time (ms since the epoch).
        sealed_at_ms: when it was sealed (file modification time for recovered files).
    """

    start_offset: int
    end_offset: int
    path: Path
    size_bytes: int
    created_at_ms: int
    sealed_at_ms: int

    @property
    def record_count(self) -> int:
        """Records in the segment (offsets are contiguous)."""
        return self.end_offset - self.start_offset + 1


class OffsetIndex:
    """Sparse ``offset → byte position`` pairs of one segment, in ascending order.

    An entry is added when at least ``interval_bytes`` were written since the previous one, so
    a read starting at any offset scans at most one interval of records it does not return.
    """

    __slots__ = ("offsets", "positions", "interval_bytes", "_last_position")

    def __init__(self, interval_bytes: int) -> None:
        self.offsets: list[int] = []
        self.positions: list[int] = []
        self.interval_bytes = interval_bytes
        self._last_position = -interval_bytes

    def add(self, offset: int, position: int) -> None:
        """Record that ``offset``'s frame starts at byte ``position`` (kept if far enough)."""
        if position - self._last_position >= self.interval_bytes or not self.offsets:
            self.offsets.append(offset)
            self.positions.append(position)
            self._last_position = position

    def truncate(self, offset: int) -> None:
        """Drop the entries at or above ``offset`` (the segment was cut there)."""
        i = bisect.bisect_left(self.offsets, offset)
        del self.offsets[i:], self.positions[i:]
        self._last_position = self.positions[-1] if self.positions else -self.interval_bytes

    def floor(self, offset: int) -> tuple[int, int]:
        """The last indexed ``(offset, position)`` at or before ``offset``; the header's end if none."""
        i = bisect.bisect_right(self.offsets, offset) - 1
        if i < 0:
            return (-1, SEGMENT_HEADER_SIZE)
        return self.offsets[i], self.positions[i]

    @classmethod
    def from_positions(
        cls, positions: list[tuple[int, int]], interval_bytes: int, *, through_offset: int | None = None
    ) -> OffsetIndex:
        """An index built from every record's ``(offset, position)``, stopping after ``through_offset``."""
        index = cls(interval_bytes)
        for offset, pos in positions:
            if through_offset is not None and offset > through_offset:
                break
            index.add(offset, pos)
        return index


class Segment:
    """Runtime state of one segment file (sealed or active).

    Attributes:
        start: first offset of the file.
        end: last durable offset; ``start - 1`` while empty.
        path: the file.
        length: durable bytes (header included).
        created_at_ms: the header's creation time.
        sealed_at_ms: when it was sealed; 0 while active.
        index: its sparse offset index; ``None`` until first read for a recovered sealed file.
        fd: an open descriptor (the active segment always has one; sealed ones on demand).
        format_version: 3 (epoch + batch entries), 2 (record batches, written before epochs) or
            1 (one frame per record, written before batches).
    """

    __slots__ = ("start", "end", "path", "length", "created_at_ms", "sealed_at_ms", "index", "fd", "format_version")

    def __init__(
        self, start: int, path: Path, *, created_at_ms: int, interval_bytes: int, format_version: int = FORMAT_VERSION
    ) -> None:
        self.start = start
        self.format_version = format_version
        self.end = start - 1
        self.path = path
        self.length = SEGMENT_HEADER_SIZE
        self.created_at_ms = created_at_ms
        self.sealed_at_ms = 0
        self.index: OffsetIndex | None = OffsetIndex(interval_bytes)
        self.fd: int | None = None

    @property
    def is_empty(self) -> bool:
        """Whether the segment holds no durable record."""
        return self.end < self.start

    def close_file(self) -> None:
        """Close :attr:`fd` if it is open (a later read of a sealed segment opens it again)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def info(self) -> SealedSegment:
        """The public description of this segment."""
        return SealedSegment(
            start_offset=self.start,
            end_offset=self.end,
            path=self.path,
            size_bytes=self.length,
            created_at_ms=self.created_at_ms,
            sealed_at_ms=self.sealed_at_ms,
        )

    def ensure_index(self, fd: int, interval_bytes: int) -> OffsetIndex:
        """The segment's index, built on first use by scanning the file (recovered sealed files).

        A file holding records past :attr:`end` keeps serving only through :attr:`end` (logged).

        Raises:
            CorruptRecordError: the file holds fewer records than :attr:`end` says.
        """
        if self.index is not None:
            return self.index
        data = os.pread(fd, self.length, 0)
        scan = scan_segment(data, expected_first_offset=self.start, keep_positions=True)
        last = self.start + scan.record_count - 1
        if last < self.end:
            raise CorruptRecordError(
                str(self.path), scan.valid_length,
                scan.error or f"holds offsets up to {last}, its name says {self.end}",
            )
        if last > self.end or scan.error is not None:
            log.error(
                "segment %s holds data past its end offset %d (records up to %d%s); reads stop at %d",
                self.path, self.end, last, f", then: {scan.error}" if scan.error else "", self.end,
            )
        self.index = OffsetIndex.from_positions(scan.positions, interval_bytes, through_offset=self.end)
        return self.index

    def truncation_point(self, offset: int) -> tuple[int, int]:
        """Where to cut this (active, version 2 or 3) segment so that no offset at or above
        ``offset`` remains (Kafka's ``LogSegment.truncateTo``); blocking, reads only.

        The cut falls on the batch that holds ``offset``: a batch is removed whole, so when
        ``offset`` lies inside a batch, that batch goes too and the new next offset is its
        base offset.

        Returns:
            ``(byte_position, next_offset)``: ``(length, end + 1)`` when nothing is at or above
            ``offset``.

        Raises:
            CorruptRecordError: the durable batches from the index entry on do not scan.
        """
        assert self.fd is not None and self.index is not None and self.format_version != LEGACY_FORMAT_VERSION
        _, start = self.index.floor(offset)
        data = os.pread(self.fd, self.length - start, start)
        prefix = has_epoch_prefix(self.format_version)
        scan = scan_batches(data, start_position=0, keep_positions=True, epoch_prefix=prefix)
        if scan.error is not None or scan.valid_length != self.length - start:
            raise CorruptRecordError(str(self.path), start + scan.valid_length, scan.error or "short read")
        bases = [base for base, _ in scan.positions]
        for i, (base, rel) in enumerate(scan.positions):
            last = bases[i + 1] - 1 if i + 1 < len(bases) else self.end
            if last >= offset:
                return start + rel, base
        return self.length, self.end + 1

    def cut_state(self, position: int, next_offset: int) -> bytes | None:
        """Make the state say the segment ends at byte ``position`` and offset
        ``next_offset - 1`` (a :meth:`truncation_point`), before the file is cut
        (:func:`cut_active_file`), so readers never reach the bytes being removed.

        Returns:
            The fresh header to write when the segment is cut back to its header (its age
            starts again), else ``None``.
        """
        assert self.index is not None
        self.end, self.length = next_offset - 1, position
        self.index.truncate(next_offset)
        if next_offset > self.start:
            return None
        self.created_at_ms = now_ms()
        return SegmentHeader(
            start_offset=self.start, created_at_ms=self.created_at_ms, format_version=self.format_version
        ).encode()

    def read(self, fd: int, offset: int, max_records: int, max_bytes: int) -> tuple[list[StoredBatch], int]:
        """Durable batches of this segment holding ``offset`` and the offsets after it.

        Seeks with the index, then reads ``pread`` chunks of :data:`READ_CHUNK_BYTES`; never
        returns a batch past :attr:`end`, and checks each batch's CRC32C. The first batch may
        start before ``offset``. Records of a version 1 segment come as one-record batches;
        batches of a version 3 segment carry their entry's leader epoch.

        Args:
            fd: an open descriptor of the file.
            offset: first offset wanted.
            max_records: stop once the batches hold this many records from ``offset`` on.
            max_bytes: stop once this many bytes were read (at least one batch).

        Returns:
            ``(batches, bytes_used)``.

        Raises:
            CorruptRecordError: a durable batch or record is short or fails its CRC32C.
        """
        if self.format_version == LEGACY_FORMAT_VERSION:
            return self._read_records(fd, offset, max_records, max_bytes)
        assert self.index is not None
        _, pos = self.index.floor(offset)
        end_pos = self.length
        skip = EPOCH_PREFIX_SIZE if has_epoch_prefix(self.format_version) else 0
        peek = skip + _BATCH_PEEK_BYTES
        out: list[StoredBatch] = []
        records = used = 0
        buf = b""
        buf_start = pos
        while pos < end_pos and records < max_records and used < max_bytes:
            rel = pos - buf_start
            if len(buf) - rel < peek:
                buf = os.pread(fd, min(READ_CHUNK_BYTES, end_pos - pos), pos)
                buf_start, rel = pos, 0
                if len(buf) < peek:
                    raise CorruptRecordError(str(self.path), pos, "short read of a durable batch header")
            base, length = _BATCH_PREFIX.unpack_from(buf, rel + skip)
            count = _BATCH_COUNT.unpack_from(buf, rel + skip + 20)[0]
            total = skip + 12 + length  # the entry: epoch (version 3) and batch
            if base > self.end:  # never read past the segment's known end
                break
            if base + count - 1 >= offset:
                if len(buf) - rel < total:
                    buf = os.pread(fd, max(total, min(READ_CHUNK_BYTES, end_pos - pos)), pos)
                    buf_start, rel = pos, 0
                    if len(buf) < total:
                        raise CorruptRecordError(str(self.path), pos, "short read of a durable batch")
                if not batches.crc_matches(buf, rel + skip, total - skip):
                    raise CorruptRecordError(str(self.path), pos, "CRC32C mismatch")
                epoch = _EPOCH.unpack_from(buf, rel)[0] if skip else 0
                out.append(StoredBatch(base, count, buf[rel + skip : rel + total], epoch))
                records += base + count - max(base, offset)
                used += total - skip
            pos += total
        return out, used

    def _read_records(self, fd: int, offset: int, max_records: int, max_bytes: int) -> tuple[list[StoredBatch], int]:
        """:meth:`read` for a version 1 segment: each record as a one-record batch."""
        assert self.index is not None
        _, pos = self.index.floor(offset)
        end_pos = self.length
        out: list[StoredBatch] = []
        used = 0
        buf = b""
        buf_start = pos
        while pos < end_pos and len(out) < max_records and used < max_bytes:
            rel = pos - buf_start
            if len(buf) - rel < RECORD_FRAME_SIZE:
                buf = os.pread(fd, min(READ_CHUNK_BYTES, end_pos - pos), pos)
                buf_start, rel = pos, 0
                if len(buf) < RECORD_FRAME_SIZE:
                    raise CorruptRecordError(str(self.path), pos, "short read of a durable frame")
            length, crc = _FRAME.unpack_from(buf, rel)
            total = RECORD_FRAME_SIZE + length
            if len(buf) - rel < total:
                buf = os.pread(fd, max(total, min(READ_CHUNK_BYTES, end_pos - pos)), pos)
                buf_start, rel = pos, 0
                if len(buf) < total:
                    raise CorruptRecordError(str(self.path), pos, "short read of a durable record")
            rec_offset = _OFFSET.unpack_from(buf, rel + RECORD_FRAME_SIZE)[0]
            if rec_offset > self.end:
                break
            if rec_offset >= offset:
                body = memoryview(buf)[rel + RECORD_FRAME_SIZE : rel + total]
                if crc32c(body) != crc:
                    raise CorruptRecordError(str(self.path), pos, "CRC32C mismatch")
                out.append(StoredBatch(rec_offset, 1, batches.batch_from_record(decode_body(body))))
                used += total
            pos += total
        return out, used


def create_active_segment(directory: Path, start: int, interval_bytes: int) -> Segment:
    """Create ``{start:020d}.log`` with a synced header of format version 3
    (:data:`~danube_pipeline.format.records.FORMAT_VERSION`; temporary file, rename, directory
    sync) and open it for appending.

    Raises:
        OSError: the file cannot be created or synced.
    """
    created = now_ms()
    path = directory / active_name(start)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, SegmentHeader(start_offset=start, created_at_ms=created, format_version=FORMAT_VERSION).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    fsync_dir(directory)
    seg = Segment(start, path, created_at_ms=created, interval_bytes=interval_bytes, format_version=FORMAT_VERSION)
    seg.fd = os.open(path, os.O_RDWR)  # written at explicit positions (pwritev), never O_APPEND
    return seg


def read_header(path: Path) -> SegmentHeader:
    """The header of the segment file at ``path``.

    Raises:
        CorruptRecordError: the header is short, has a bad magic or an unknown version.
        OSError: the file cannot be read.
    """
    fd = os.open(path, os.O_RDONLY)
    try:  # unbuffered: the header's bytes only (recovery reads the header of every sealed file)
        return SegmentHeader.decode(os.pread(fd, SEGMENT_HEADER_SIZE, 0), where=str(path))
    finally:
        os.close(fd)
