"""WAL recovery at open: the role of Kafka's ``LogLoader``.

:class:`LogLoader` reads a topic's WAL directory and returns its sealed segments and an active
segment ready for appends. The rules, in the order they are applied:

* Sealed files (``{start}-{end}.dnb1``) are sorted by ``(start, end)``; a file whose whole
  range another sealed file holds is set aside as ``*.stale`` (left by a copy, a restore or an
  interrupted seal).
* The newest sealed file is scanned: records past the end offset in its name (a seal racing a
  write) rename it to its real end, so those offsets are never handed out again; a torn tail
  after the named end was never acknowledged and is cut off, unless a valid batch follows the
  bad one (then the file is quarantined as below, its name and bytes kept, reads stopping at
  its named end at most); fewer records than its name says is corruption and refuses the open.
* Every active file (``{start}.log``) but the newest is set aside. The newest is scanned; where
  the scan stops at a bad batch, recovery looks past it (:func:`find_valid_after`) for a later
  complete batch whose CRC32C matches and whose base offset is above the last good one:

  - nothing valid follows: a torn tail, never acknowledged (every ack follows an
    ``fdatasync`` of everything before it); the file is truncated at the bad batch and
    appends continue at the last good offset + 1.
  - a valid batch follows: corruption in the middle, with acknowledged batches after it. The
    file is **quarantined**, not truncated: its bytes stay as they are, a marker
    ``{segment file name}.quarantine`` (JSON, :class:`Quarantine`) is written next to it, one
    ERROR line is logged, reads serve offsets up to the last good one and never past it, and
    appends are refused with :class:`~danube_pipeline.errors.SegmentQuarantinedError`
    (appending after the corrupt bytes would hand out offsets that the valid batches after
    them already carry). The state is found again from the bytes at every open, so removing
    the marker by hand does not lift it; the operator decides with
    ``python -m broker.storage.wal.repair`` (:mod:`broker.storage.wal.repair`), broker stopped.

  An active file whose records all lie in sealed files is set aside; one that overlaps sealed
  files with records beyond them refuses the open (the same offsets would exist twice).
* An active file written in format version 1 (one frame per record, before record batches)
  is sealed as it is, once its tail is checked; new batches go to a new version 2 file. Sealed
  files of either version stay readable. The tail check applies the same rule to version 1
  frames (a later frame whose CRC32C matches and whose offset is above the last good one
  means quarantine); a quarantined version 1 file is not sealed.
* With no record at all, the WAL starts at ``initial_offset`` (the sealed state's
  ``last_committed_offset + 1`` after a topic move, ``docs/etcd-layout.md`` §5.3).
"""

from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import crc32c as _crc32c

from danube_pipeline.format import batches
from danube_pipeline.errors import CorruptRecordError, SegmentQuarantinedError
from danube_pipeline.format.records import (
    LEGACY_FORMAT_VERSION,
    MAX_RECORD_BODY_BYTES,
    RECORD_FIXED_SIZE,
    RECORD_FRAME_SIZE,
    ScanResult,
    SegmentHeader,
)
from danube_pipeline.format.segments import MAX_BATCH_BYTES, scan_segment

from broker.storage.wal.segment import (
    ACTIVE_NAME_RE,
    SEALED_NAME_RE,
    OffsetIndex,
    Segment,
    create_active_segment,
    fsync_dir,
    make_dirs_durable,
    now_ms,
    read_header,
    sealed_name,
    truncate_file,
)

log = logging.getLogger(__name__)

QUARANTINE_SUFFIX = ".quarantine"
"""Suffix of the marker written next to a quarantined segment: ``{segment file name}.quarantine``."""

_BATCH_PREFIX = struct.Struct("<QII")  # base_offset, batch_length, crc32c
_BATCH_COUNT = struct.Struct("<I")
_BATCH_MAGIC_AT = 16
_BATCH_COUNT_AT = 20
_FRAME = struct.Struct("<II")  # version 1: body_length, crc32c
_OFFSET = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class Quarantine:
    """A segment with corruption in the middle, kept byte for byte until an operator decides.

    Attributes:
        segment: the segment file.
        position: byte position of the bad batch; the good prefix is bytes ``[0, position)``.
        last_good_offset: the last offset of the good prefix (the segment's start - 1 if none).
        next_valid_offset: base offset of the first valid batch found after the bad one.
        next_valid_position: byte position of that batch.
        error: why the scan stopped at ``position``.
        detected_at_ms: when the corruption was first found (ms since the Unix epoch).
    """

    segment: Path
    position: int
    last_good_offset: int
    next_valid_offset: int
    next_valid_position: int
    error: str
    detected_at_ms: int

    @property
    def marker(self) -> Path:
        """The marker file: ``{segment file name}.quarantine`` next to the segment."""
        return marker_path(self.segment)

    def append_error(self) -> SegmentQuarantinedError:
        """The error an append to the quarantined WAL fails with."""
        return SegmentQuarantinedError(
            str(self.segment), self.position, self.last_good_offset, self.next_valid_offset
        )

    def same_facts(self, other: Quarantine) -> bool:
        """Whether ``other`` describes the same corruption (all but the detection time)."""
        return replace(other, detected_at_ms=self.detected_at_ms) == self

    def to_json(self) -> dict[str, Any]:
        """The marker's JSON object: the segment's file name, positions in bytes, offsets, the
        error text and the detection time (ISO 8601, UTC, milliseconds)."""
        detected = datetime.fromtimestamp(self.detected_at_ms / 1000, tz=UTC)
        return {
            "segment": self.segment.name,
            "position": self.position,
            "last_good_offset": self.last_good_offset,
            "next_valid_offset": self.next_valid_offset,
            "next_valid_position": self.next_valid_position,
            "error": self.error,
            "detected_at": detected.isoformat(timespec="milliseconds"),
            "operator_action": f"stop the broker, then: python -m broker.storage.wal.repair {self.segment.parent}",
        }

    @classmethod
    def from_json(cls, directory: Path, obj: Any) -> Quarantine:
        """The quarantine a marker of ``directory`` describes.

        Raises:
            ValueError: ``obj`` is not a marker object (a field is missing or mistyped).
        """
        try:
            ints = {k: obj[k] for k in ("position", "last_good_offset", "next_valid_offset", "next_valid_position")}
            if not all(isinstance(v, int) for v in ints.values()):
                raise ValueError(f"non-integer field in {ints}")
            segment, error = obj["segment"], obj["error"]
            if not isinstance(segment, str) or not isinstance(error, str) or "/" in segment:
                raise ValueError("segment and error must be strings, segment a file name")
            detected = datetime.fromisoformat(obj["detected_at"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a quarantine marker: {exc!r}") from exc
        return cls(
            segment=directory / segment, error=error, detected_at_ms=round(detected.timestamp() * 1000), **ints
        )


def marker_path(segment: Path) -> Path:
    """The quarantine marker of ``segment``: ``{segment file name}.quarantine`` next to it."""
    return segment.with_name(segment.name + QUARANTINE_SUFFIX)


def read_marker(marker: Path) -> Quarantine:
    """The quarantine a marker file describes.

    Raises:
        ValueError: the file is not JSON or not a marker.
        OSError: the file cannot be read.
    """
    try:
        obj = json.loads(marker.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{marker}: not JSON: {exc}") from exc
    return Quarantine.from_json(marker.parent, obj)


def write_marker(quarantine: Quarantine) -> Quarantine:
    """Write ``quarantine``'s marker (temporary file, ``fsync``, rename); the caller syncs the
    directory. An existing marker describing the same corruption is kept as it is.

    Returns:
        ``quarantine``, with the detection time of the existing marker when one was kept.

    Raises:
        OSError: the marker cannot be written.
    """
    marker = quarantine.marker
    try:
        old = read_marker(marker)
    except (OSError, ValueError):
        old = None
    if old is not None and quarantine.same_facts(old):
        return old
    tmp = marker.with_name(marker.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(quarantine.to_json(), f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, marker)
    return quarantine


def find_valid_after(
    data: bytes, position: int, last_good_offset: int, *, format_version: int
) -> tuple[int, int] | None:
    """Look past the bad batch at ``position`` for a valid later one.

    Walks forward from byte ``position + 1`` for the first position where a complete batch
    starts (version 2: plausible length within the data, magic, at least one record, CRC32C;
    :mod:`danube_pipeline.format.batches`) or a complete record frame (version 1: plausible length,
    CRC32C; :mod:`danube_pipeline.format.records`) whose (base) offset is above
    ``last_good_offset``. The batch at ``position`` itself never counts, whatever its offset.

    Args:
        data: the whole segment file.
        position: byte position where the scan of the good prefix stopped.
        last_good_offset: the last offset of the good prefix (the segment's start - 1 if none).
        format_version: the segment header's format version.

    Returns:
        ``(byte_position, offset)`` of the first such batch or record, or ``None`` when
        nothing valid follows (a torn tail).
    """
    end = len(data)
    if format_version == LEGACY_FORMAT_VERSION:
        for pos in range(position + 1, end - RECORD_FRAME_SIZE - RECORD_FIXED_SIZE + 1):
            length, crc = _FRAME.unpack_from(data, pos)
            body = pos + RECORD_FRAME_SIZE
            if not RECORD_FIXED_SIZE <= length <= MAX_RECORD_BODY_BYTES or body + length > end:
                continue
            offset = _OFFSET.unpack_from(data, body)[0]
            if offset > last_good_offset and _crc32c.crc32c(memoryview(data)[body : body + length]) == crc:
                return pos, offset
        return None
    magic = bytes([batches.MAGIC])
    at = position + 1 + _BATCH_MAGIC_AT
    while (at := data.find(magic, at)) >= 0:
        pos = at - _BATCH_MAGIC_AT
        at += 1
        if end - pos < batches.BATCH_HEADER_SIZE:
            return None
        base, length, _crc = _BATCH_PREFIX.unpack_from(data, pos)
        total = 12 + length
        if (
            base > last_good_offset
            and batches.BATCH_HEADER_SIZE <= total <= MAX_BATCH_BYTES
            and pos + total <= end
            and _BATCH_COUNT.unpack_from(data, pos + _BATCH_COUNT_AT)[0] >= 1
            and batches.crc_matches(data, pos, total)
        ):
            return pos, base
    return None


@dataclass(slots=True)
class LoadedLog:
    """What :meth:`LogLoader.load` found.

    Attributes:
        sealed: sealed segments, ascending and non-overlapping.
        active: the active segment, open for appending.
        first_append_s: creation time (s since the epoch) of the active segment when it holds
            records (its age counts from there), else ``None`` (also when it is quarantined, so
            it is not sealed by age).
        quarantine: the quarantined segment (the newest sealed one first, else the active
            one), or ``None``; appends must be refused while it is set.
    """

    sealed: list[Segment]
    active: Segment
    first_append_s: float | None
    quarantine: Quarantine | None = None


class LogLoader:
    """Recovers one WAL directory (see the module docstring for the rules).

    Args:
        directory: the topic's WAL directory, created if missing (with its parents, each
            made durable: :func:`~broker.storage.wal.segment.make_dirs_durable`).
        index_interval_bytes: spacing of the sparse offset indexes it builds.
    """

    def __init__(self, directory: Path, *, index_interval_bytes: int) -> None:
        self.directory = directory
        self.index_interval_bytes = index_interval_bytes
        self.quarantines: list[Quarantine] = []  # found by the last load()

    def load(self, initial_offset: int) -> LoadedLog:
        """Recover the directory.

        Args:
            initial_offset: the first offset when the WAL holds no record at all.

        Returns:
            The recovered segments, with the quarantined segment if any (its marker written).

        Raises:
            CorruptRecordError: a sealed file's name disagrees with its header, the newest one
                holds fewer records than its name says, or the active file overlaps the sealed
                ones with records beyond them.
            OSError: the directory or files cannot be read or written.
        """
        make_dirs_durable(self.directory)  # its parents synced: a power cut cannot lose the tree
        self.quarantines = []
        sealed: list[Segment] = []
        actives: list[tuple[int, Path]] = []
        markers: list[Path] = []
        for entry in os.scandir(self.directory):
            if m := SEALED_NAME_RE.match(entry.name):
                sealed.append(self._sealed_segment(int(m.group(1)), int(m.group(2)), Path(entry.path)))
            elif m := ACTIVE_NAME_RE.match(entry.name):
                actives.append((int(m.group(1)), Path(entry.path)))
            elif entry.name.endswith(QUARANTINE_SUFFIX):
                markers.append(Path(entry.path))
        sealed = self._drop_covered(sealed)
        for prev, cur in zip(sealed, sealed[1:]):
            if cur.start != prev.end + 1:
                log.warning("WAL %s: gap or overlap between %s and %s", self.directory, prev.path.name, cur.path.name)
        if sealed:
            self._verify_sealed_end(sealed[-1])
        sealed_end = sealed[-1].end if sealed else None
        expected_start = sealed_end + 1 if sealed_end is not None else initial_offset
        actives.sort()
        for _start, path in actives[:-1]:
            log.warning("WAL %s: ignoring stale active segment %s", self.directory, path.name)
            path.rename(path.with_suffix(".stale"))
        first_append_s: float | None = None
        if actives:
            start, path = actives[-1]
            active = self._recover_active(start, path, expected_start, empty_wal=not sealed)
            if any(q.segment == active.path for q in self.quarantines):
                pass  # kept as it is: neither sealed (version 1) nor aged
            elif active.format_version == LEGACY_FORMAT_VERSION:
                sealed.append(self._seal_legacy(active))
                active = self._create_active(active.end + 1)
            elif not active.is_empty:
                first_append_s = active.created_at_ms / 1000.0
        else:
            active = self._create_active(expected_start)
        current = {q.marker for q in self.quarantines}
        for marker in markers:
            if marker not in current:
                log.warning(
                    "WAL %s: stale quarantine marker %s: its segment is gone or no longer corrupt "
                    "(python -m broker.storage.wal.repair %s removes it)", self.directory, marker.name, self.directory,
                )
        fsync_dir(self.directory)
        sealed_end = sealed[-1].end if sealed else None
        if sealed_end is not None and active.end + 1 <= sealed_end:  # never reuse a sealed offset
            raise CorruptRecordError(
                str(active.path), 0,
                f"next offset {active.end + 1} is not past the sealed segments' end {sealed_end}",
            )
        quarantine = self.quarantines[0] if self.quarantines else None
        return LoadedLog(sealed=sealed, active=active, first_append_s=first_append_s, quarantine=quarantine)

    def _look_past(
        self, path: Path, data: bytes, scan: ScanResult, *, start: int, format_version: int
    ) -> Quarantine | None:
        """Decide between a torn tail and corruption in the middle for a scan that stopped at
        a bad batch (see the module docstring); quarantine the file in the second case.

        Args:
            path: the segment file; ``data`` its bytes; ``start`` its first offset.
            scan: the scan of ``data`` from ``start``, stopped with an error.
            format_version: the segment header's format version.

        Returns:
            The quarantine (marker written, ERROR logged), or ``None`` for a torn tail.

        Raises:
            OSError: the marker cannot be written.
        """
        assert scan.error is not None
        last_good = start + scan.record_count - 1
        found = find_valid_after(data, scan.valid_length, last_good, format_version=format_version)
        if found is None:
            return None
        quarantine = write_marker(Quarantine(
            segment=path, position=scan.valid_length, last_good_offset=last_good, next_valid_offset=found[1],
            next_valid_position=found[0], error=scan.error, detected_at_ms=now_ms(),
        ))
        log.error(
            "WAL %s: QUARANTINED segment %s: corrupt at byte %d (%s), yet valid batches follow from offset %d "
            "(byte %d), so this is not a torn tail; the file is kept as it is (marker %s). Reads serve %s and "
            "appends are refused. Operator: stop the broker, run `python -m broker.storage.wal.repair %s` to inspect, and "
            "add --truncate to accept the loss of offsets %d and later (or restore the file)",
            self.directory, path.name, quarantine.position, quarantine.error, quarantine.next_valid_offset,
            quarantine.next_valid_position, quarantine.marker.name,
            f"offsets up to {last_good}" if last_good >= start else "no offset of it", self.directory, last_good + 1,
        )
        self.quarantines.append(quarantine)
        return quarantine

    def _seal_legacy(self, seg: Segment) -> Segment:
        """Seal a non-empty version 1 active segment under its sealed name."""
        assert seg.fd is not None
        os.fsync(seg.fd)
        os.close(seg.fd)
        seg.fd = None
        new_path = self.directory / sealed_name(seg.start, seg.end)
        log.warning("WAL %s: sealing %s (format version 1) as %s; new batches go to a new segment",
                    self.directory, seg.path.name, new_path.name)
        os.rename(seg.path, new_path)
        seg.path = new_path
        seg.sealed_at_ms = int(new_path.stat().st_mtime * 1000)
        return seg

    def _create_active(self, start: int) -> Segment:
        return create_active_segment(self.directory, start, self.index_interval_bytes)

    def _sealed_segment(self, start: int, end: int, path: Path) -> Segment:
        header = read_header(path)
        if header.start_offset != start or end < start:
            raise CorruptRecordError(str(path), 0, "file name disagrees with its header")
        st = path.stat()
        seg = Segment(
            start, path, created_at_ms=header.created_at_ms, interval_bytes=self.index_interval_bytes,
            format_version=header.format_version,
        )
        seg.end = end
        seg.length = st.st_size
        seg.sealed_at_ms = int(st.st_mtime * 1000)
        seg.index = None  # built on first read
        return seg

    def _set_aside(self, path: Path, reason: str) -> None:
        stale = path.with_name(path.name + ".stale")
        log.warning("WAL %s: setting %s aside as %s: %s", self.directory, path.name, stale.name, reason)
        path.rename(stale)

    def _drop_covered(self, sealed: list[Segment]) -> list[Segment]:
        """Sort by ``(start, end)`` and set aside every sealed file whose whole range another
        sealed file holds."""
        sealed.sort(key=lambda s: (s.start, s.end))
        kept: list[Segment] = []
        for seg in sealed:
            if kept and kept[-1].start == seg.start:  # same start, seg.end is larger
                self._set_aside(kept.pop().path, f"its offsets are all in {seg.path.name}")
            if kept and kept[-1].end >= seg.end:
                self._set_aside(seg.path, f"its offsets are all in {kept[-1].path.name}")
                continue
            kept.append(seg)
        return kept

    def _verify_sealed_end(self, seg: Segment) -> None:
        """Check that ``seg``'s last record is the end offset in its name (see module docstring).

        Raises:
            CorruptRecordError: the file holds fewer records than its name says.
        """
        data = seg.path.read_bytes()
        scan = scan_segment(data, expected_first_offset=seg.start, keep_positions=True)
        last = seg.start + scan.record_count - 1
        if last < seg.end:
            raise CorruptRecordError(
                str(seg.path), scan.valid_length,
                scan.error or f"holds offsets only up to {last}, its name says {seg.end}",
            )
        if scan.error is not None:
            if self._look_past(seg.path, data, scan, start=seg.start, format_version=seg.format_version) is not None:
                # Quarantined: name and bytes kept; reads stop at the named end at most.
                seg.length = scan.valid_length
                seg.index = OffsetIndex.from_positions(
                    scan.positions, self.index_interval_bytes, through_offset=seg.end
                )
                return
            log.warning(
                "WAL %s: truncating sealed segment %s from %d to %d bytes (records up to %d): %s",
                self.directory, seg.path.name, len(data), scan.valid_length, last, scan.error,
            )
            truncate_file(seg.path, scan.valid_length)
        if last > seg.end:
            new_path = self.directory / sealed_name(seg.start, last)
            log.error(
                "WAL %s: sealed segment %s holds records up to offset %d, past its name's end %d; "
                "renaming it to %s so those offsets are not handed out again",
                self.directory, seg.path.name, last, seg.end, new_path.name,
            )
            os.rename(seg.path, new_path)
            seg.path = new_path
            seg.end = last
        seg.length = scan.valid_length
        seg.index = OffsetIndex.from_positions(scan.positions, self.index_interval_bytes)

    def _recover_active(self, start: int, path: Path, expected_start: int, *, empty_wal: bool) -> Segment:
        data = path.read_bytes()
        if sealed_mismatch := (not empty_wal and start != expected_start):
            log.warning(
                "WAL %s: active segment %s does not follow the sealed segments (expected start %d)",
                self.directory, path.name, expected_start,
            )
        try:
            header = SegmentHeader.decode(data, where=str(path))
        except CorruptRecordError as exc:
            log.warning("WAL %s: rewriting active segment %s with a fresh header: %s", self.directory, path.name, exc)
            path.unlink()
            return self._create_active(expected_start)
        if header.start_offset != start:
            log.warning("WAL %s: %s header start %d disagrees with its name", self.directory, path.name, header.start_offset)
            path.unlink()
            return self._create_active(expected_start)
        scan = scan_segment(data, expected_first_offset=start, keep_positions=True)
        if not empty_wal and start < expected_start and scan.record_count:
            last = start + scan.record_count - 1
            if last < expected_start:  # every record is already in a sealed segment
                self._set_aside(path, f"offsets {start}..{last} are all in sealed segments")
                return self._create_active(expected_start)
            raise CorruptRecordError(
                str(path), 0,
                f"active segment starts at {start}, inside the sealed segments (which end at "
                f"{expected_start - 1}), and holds records up to {last}: the same offsets exist twice; "
                "refusing to open the WAL (move one of the files away by hand)",
            )
        quarantine: Quarantine | None = None
        if scan.error is not None:
            quarantine = self._look_past(path, data, scan, start=start, format_version=header.format_version)
            if quarantine is None:  # a torn tail: never acknowledged
                log.warning(
                    "WAL %s: truncating %s from %d to %d bytes (%d good records): %s",
                    self.directory, path.name, len(data), scan.valid_length, scan.record_count, scan.error,
                )
                truncate_file(path, scan.valid_length)
        if quarantine is None and scan.record_count == 0 and (
            start != expected_start or sealed_mismatch or header.format_version == LEGACY_FORMAT_VERSION
        ):
            # Empty active segment at the wrong place (e.g. a sealed state moved the start), or
            # in the old format: start a fresh one.
            path.unlink()
            return self._create_active(expected_start)
        seg = Segment(
            start, path, created_at_ms=header.created_at_ms, interval_bytes=self.index_interval_bytes,
            format_version=header.format_version,
        )
        seg.index = OffsetIndex.from_positions(scan.positions, self.index_interval_bytes)
        seg.length = scan.valid_length
        seg.end = start + scan.record_count - 1
        # A quarantined file is opened read-only: nothing may ever be appended after its corrupt bytes.
        seg.fd = os.open(path, os.O_RDONLY if quarantine is not None else os.O_RDWR | os.O_APPEND)
        return seg
