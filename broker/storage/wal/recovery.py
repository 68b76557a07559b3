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
* Every active file (``{start}.log``) but the newest is set aside. The newest one's header is
  checked first: a header that is unusable (short, bad magic, unknown version) or that names
  another start offset than the file name is *rebuilt* when the first batch at byte 32 is
  intact and carries the name's start offset (nothing is lost), and otherwise the file is
  **quarantined** as below (kept byte for byte, never deleted: its batches may have been
  acknowledged; reads serve none of it). A file with nothing after its header held no batch:
  it is set aside as ``*.stale`` and a fresh one takes its place. The file is then scanned; where
  the scan stops at a bad batch, recovery looks past it (:func:`find_valid_after`) for a later
  complete batch whose CRC32C matches and whose base offset is above the last good one:

  - nothing valid follows: a torn tail, never acknowledged (every ack follows an
    ``fdatasync`` of everything before it); the file is truncated at the bad batch and
    appends continue at the last good offset + 1.
  - a valid batch follows, but the bad batch lies in the last group commit, whose
    ``fdatasync`` never returned: a **torn group commit**. One ``pwritev`` covers several
    batches, and a power cut can persist a later page of it and lose an earlier one; nothing
    of that write was acknowledged, so the file is truncated at the bad batch (one WARNING
    line) as for a torn tail. Recovery knows the write boundary from the header's *write
    record* (:mod:`broker.storage.wal.segment`), which the group commit writes before each
    write's batches, covered by the same ``fdatasync``, and again with a *synced* bit after
    it returns (:func:`unsynced_write_start`):

    * no synced bit: the recorded write is the last one that started; it may be unsynced, so
      bytes from its start on may be torn. (A later write cannot exist on disk with its own
      record lost: that write's ``fdatasync`` would have made its record durable with it.)
    * synced bit: the recorded write was synced; only bytes from its end on (a later write
      whose record never became durable, hence whose ``fdatasync`` never returned) may be
      torn.

    The boundary must fall on a batch boundary of the good prefix, or the record is not
    trusted. What stays possible is media corruption inside the very last write after its
    ``fdatasync`` returned, whose synced bit was not yet durable (a power cut within the next
    commit): it is taken for a torn write. Files without a record (written before it) keep
    the rule below.
  - any other valid batch follows: corruption in the middle, with acknowledged batches after it. The
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
  is sealed as it is, once its tail is checked; new batches go to a new file. Every file the
  WAL creates is of version 3 (each batch preceded by its leader epoch,
  :mod:`danube_pipeline.format.segments`); an active version 2 file (batches without epochs)
  is appended to in version 2 until it rolls. Sealed files of every version stay readable, and
  the rules here apply to version 3 entries as to version 2 batches (a short epoch is a torn
  entry). A damaged header is rebuilt with the version whose first batch is intact at byte 32
  (version 2) or 40 (version 3). The tail check applies the same rule to version 1
  frames (a later frame whose CRC32C matches and whose offset is above the last good one
  means quarantine); a quarantined version 1 file is not sealed.
* What recovery reads does not grow with the log: the header of each sealed file (32 bytes),
  the newest sealed file and the active one whole (so at most two segments, of
  ``--segment-max-bytes`` each, by default 8 MiB), as Kafka's ``LogLoader`` recovers only the
  segments past its recovery point; older sealed files are indexed on their first read. The
  leader-epoch cache, when it must be rebuilt from the batches, reads one entry of each
  segment and the segments an epoch starts in (:mod:`broker.storage.wal.epochs`). One INFO
  line per open gives the time taken and the bytes scanned.
* With no record at all, the WAL starts at ``initial_offset`` (the sealed state's
  ``last_committed_offset + 1`` after a topic move, ``docs/etcd-layout.md`` §5.3).
* Offsets handed out once and lost for good are recorded as *abandoned* in the directory's
  ``abandoned.json`` (:mod:`broker.storage.wal.abandoned`, written by the repair before it cuts
  a file). The WAL never hands them out again: it continues at the highest abandoned offset
  + 1 at least; an active segment holding records below that is sealed as it is, an empty one
  replaced. Segments then leave a gap there, which reads step over.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from danube_pipeline.errors import CorruptRecordError
from danube_pipeline.format.records import (
    LEGACY_FORMAT_VERSION,
    SEGMENT_HEADER_SIZE,
    ScanResult,
    SegmentHeader,
)
from danube_pipeline.format.segments import scan_segment

from broker.storage.wal.abandoned import AbandonedRange, next_offset_floor, read_abandoned
from broker.storage.wal.quarantine import (
    QUARANTINE_SUFFIX,
    Quarantine,
    batch_format_version,
    find_valid_after,
    marker_path,
    read_marker,
    write_marker,
)
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
    WriteRecord,
    decode_write_record,
    truncate_file,
)

log = logging.getLogger(__name__)

__all__ = [
    "QUARANTINE_SUFFIX", "LoadedLog", "LogLoader", "Quarantine", "find_valid_after", "marker_path", "read_marker",
    "write_marker",
]


def unsynced_write_start(record: WriteRecord | None, scan: ScanResult) -> int | None:
    """The byte position from which an active segment's bytes were never synced, by its write
    record (module docstring), or ``None`` when the record cannot say.

    Without the synced bit, the recorded write may not have been synced: from its start. With
    it, the write was synced, and only a later write (whose record never became durable, so
    whose ``fdatasync`` never returned) may be torn: from its end. The position must be a
    batch boundary of the good prefix (or the bad batch's own position), else the record is
    not trusted.
    """
    if record is None:
        return None
    boundary = record.position + record.size_bytes if record.synced else record.position
    if boundary == scan.valid_length or boundary in {pos for _, pos in scan.positions}:
        return boundary
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
        abandoned: the ranges recorded as abandoned (:mod:`broker.storage.wal.abandoned`).
        unreadable: older sealed segments whose quarantine marker a read wrote and whose bytes
            are still corrupt, by start offset: readers get an error past the last good offset.
    """

    sealed: list[Segment]
    active: Segment
    first_append_s: float | None
    quarantine: Quarantine | None = None
    abandoned: list[AbandonedRange] = field(default_factory=list)
    unreadable: dict[int, Quarantine] = field(default_factory=dict)


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
        self.scanned_bytes = 0  # read and checked by the last load(): the newest sealed file and the active one

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
            ValueError: the abandoned-ranges record is not valid.
            OSError: the directory or files cannot be read or written.
        """
        began = time.perf_counter()
        make_dirs_durable(self.directory)  # its parents synced: a power cut cannot lose the tree
        self.quarantines = []
        self.scanned_bytes = 0
        abandoned = read_abandoned(self.directory)
        floor = next_offset_floor(abandoned)  # never hand an abandoned offset out again
        for rng in abandoned:
            log.warning(
                "WAL %s: offsets %d..%d were abandoned (handed out once and lost: %s); never handed out again",
                self.directory, rng.first_offset, rng.last_offset, rng.reason,
            )
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
            abandoned_gap = any(r.first_offset <= prev.end + 1 and cur.start - 1 <= r.last_offset for r in abandoned)
            if cur.start != prev.end + 1 and not (cur.start > prev.end + 1 and abandoned_gap):
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
            elif active.format_version == LEGACY_FORMAT_VERSION or (not active.is_empty and active.end < floor - 1):
                # Version 1, or records below an abandoned range: sealed as they are, so the
                # next offset handed out lies past the abandoned offsets.
                sealed.append(self._seal_recovered(active))
                active = self._create_active(max(active.end + 1, floor))
            elif active.is_empty and active.start < floor:
                active = self._replace_active(active, floor)
            elif not active.is_empty:
                first_append_s = active.created_at_ms / 1000.0
        else:
            active = self._create_active(max(expected_start, floor))
        current = {q.marker for q in self.quarantines}
        unreadable: dict[int, Quarantine] = {}
        for marker in markers:
            if marker in current:
                continue
            if found := self._still_unreadable(marker, sealed):
                unreadable[found[0]] = found[1]
            else:
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
        log.info(
            "WAL %s recovered in %.3f s: %d sealed segments (headers read), %d bytes scanned (the newest sealed "
            "segment and the active one), next offset %d", self.directory, time.perf_counter() - began, len(sealed),
            self.scanned_bytes, active.end + 1,
        )
        return LoadedLog(
            sealed=sealed, active=active, first_append_s=first_append_s, quarantine=quarantine, abandoned=abandoned,
            unreadable=unreadable,
        )

    def _still_unreadable(self, marker: Path, sealed: list[Segment]) -> tuple[int, Quarantine] | None:
        """A marker a read wrote for a sealed segment (not the newest, which is checked whole):
        ``(start, quarantine)`` when the segment is still corrupt before its named end, else
        ``None`` (the marker is stale)."""
        try:
            quarantine = read_marker(marker)
        except (OSError, ValueError):
            return None
        seg = next((s for s in sealed if s.path == quarantine.segment), None)
        if seg is None:
            return None
        scan = scan_segment(seg.path.read_bytes(), expected_first_offset=seg.start)
        last_good = seg.start + scan.record_count - 1
        if scan.error is None or last_good >= seg.end:
            return None
        log.error(
            "WAL %s: sealed segment %s is still corrupt at byte %d (%s): readers get offsets up to %d, then an "
            "error (marker %s; python -m broker.storage.wal.repair %s)", self.directory, seg.path.name,
            scan.valid_length, scan.error, last_good, marker.name, self.directory,
        )
        return seg.start, replace(quarantine, position=scan.valid_length, last_good_offset=last_good)

    def _look_past(
        self, path: Path, data: bytes, scan: ScanResult, *, start: int, format_version: int,
        write_record: WriteRecord | None = None,
    ) -> Quarantine | None:
        """Decide between a torn tail (or torn group commit) and corruption in the middle for
        a scan that stopped at a bad batch (see the module docstring); quarantine the file in
        the last case.

        Args:
            path: the segment file; ``data`` its bytes; ``start`` its first offset.
            scan: the scan of ``data`` from ``start``, stopped with an error (with positions).
            format_version: the segment header's format version.
            write_record: the active segment's write record, ``None`` for a sealed file.

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
        unsynced_from = unsynced_write_start(write_record, scan)
        if unsynced_from is not None and scan.valid_length >= unsynced_from:
            log.warning(
                "WAL %s: torn group commit in %s: the bad batch at byte %d (%s) and the valid batches after it "
                "(from offset %d, byte %d) lie in the last write, from byte %d, whose fdatasync never returned: "
                "nothing of it was acknowledged (a power cut persisted part of it); cutting it off",
                self.directory, path.name, scan.valid_length, scan.error, found[1], found[0], unsynced_from,
            )
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

    def _replace_active(self, seg: Segment, start: int) -> Segment:
        """Remove the empty active segment ``seg`` (a header, no record) and create one at
        ``start`` (past abandoned offsets)."""
        seg.close_file()
        seg.path.unlink()
        return self._create_active(start)

    def _damaged_header(
        self, start: int, path: Path, data: bytes, why: str, expected_start: int
    ) -> Segment | tuple[bytes, SegmentHeader]:
        """An active segment whose header is unusable (module docstring): rebuild the header
        when the first batch is intact where it belongs, else quarantine the file (never
        delete it: its batches may have been acknowledged).

        Returns:
            ``(data, header)`` after a rebuild (recovery goes on with them), or the segment to
            use: a fresh one when the file held nothing past its header (set aside), else the
            quarantined file opened read-only.

        Raises:
            OSError: the file or the marker cannot be written.
        """
        if len(data) <= SEGMENT_HEADER_SIZE:  # no batch was ever in it: nothing to lose
            self._set_aside(path, f"damaged header ({why}) and nothing after it")
            return self._create_active(expected_start)
        version, intact = batch_format_version(data, start)
        if intact:
            header = SegmentHeader(
                start_offset=start, created_at_ms=int(path.stat().st_mtime * 1000), format_version=version
            )
            fd = os.open(path, os.O_WRONLY)
            try:
                os.pwrite(fd, header.encode(), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            log.warning("WAL %s: rebuilt the damaged header of %s (%s): its first batch starts at offset %d",
                        self.directory, path.name, why, start)
            return header.encode() + data[SEGMENT_HEADER_SIZE:], header
        found = find_valid_after(data, SEGMENT_HEADER_SIZE - 1, start - 1, format_version=version)
        quarantine = write_marker(Quarantine(
            segment=path, position=0, last_good_offset=start - 1,
            next_valid_offset=found[1] if found else start,
            next_valid_position=found[0] if found else SEGMENT_HEADER_SIZE,
            error=f"damaged segment header: {why}", detected_at_ms=now_ms(),
        ))
        log.error(
            "WAL %s: QUARANTINED segment %s: its header is damaged (%s) and its first batch is not intact; "
            "the file is kept as it is (marker %s) and appends are refused. Operator: stop the broker and run "
            "`python -m broker.storage.wal.repair %s`", self.directory, path.name, why, quarantine.marker.name,
            self.directory,
        )
        self.quarantines.append(quarantine)
        seg = Segment(
            start, path, created_at_ms=now_ms(), interval_bytes=self.index_interval_bytes, format_version=version
        )
        seg.fd = os.open(path, os.O_RDONLY)  # never appended to
        return seg

    def _seal_recovered(self, seg: Segment) -> Segment:
        """Seal a non-empty recovered active segment under its sealed name (version 1, or one
        followed by abandoned offsets)."""
        assert seg.fd is not None
        os.fsync(seg.fd)
        os.close(seg.fd)
        seg.fd = None
        new_path = self.directory / sealed_name(seg.start, seg.end)
        log.warning("WAL %s: sealing %s (format version %d) as %s; new batches go to a new segment",
                    self.directory, seg.path.name, seg.format_version, new_path.name)
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
        self.scanned_bytes += len(data)
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
        self.scanned_bytes += len(data)
        if sealed_mismatch := (not empty_wal and start != expected_start):
            log.warning(
                "WAL %s: active segment %s does not follow the sealed segments (expected start %d)",
                self.directory, path.name, expected_start,
            )
        try:
            header = SegmentHeader.decode(data, where=str(path))
            damaged = (
                None if header.start_offset == start else f"header start {header.start_offset} disagrees with its name"
            )
        except CorruptRecordError as exc:
            damaged = str(exc)
        if damaged is not None:
            recovered = self._damaged_header(start, path, data, damaged, expected_start)
            if isinstance(recovered, Segment):
                return recovered
            data, header = recovered
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
            record = decode_write_record(data) if header.format_version != LEGACY_FORMAT_VERSION else None
            quarantine = self._look_past(
                path, data, scan, start=start, format_version=header.format_version, write_record=record
            )
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
        seg.fd = os.open(path, os.O_RDONLY if quarantine is not None else os.O_RDWR)
        return seg
