"""WAL recovery at open: the role of Kafka's ``LogLoader``.

:class:`LogLoader` reads a topic's WAL directory and returns its sealed segments and an active
segment ready for appends. The rules, in the order they are applied:

* Sealed files (``{start}-{end}.dnb1``) are sorted by ``(start, end)``; a file whose whole
  range another sealed file holds is set aside as ``*.stale`` (left by a copy, a restore or an
  interrupted seal).
* The newest sealed file is scanned: records past the end offset in its name (a seal racing a
  write) rename it to its real end, so those offsets are never handed out again; a torn tail
  after the named end was never acknowledged and is cut off; fewer records than its name says
  is corruption and refuses the open.
* Every active file (``{start}.log``) but the newest is set aside. The newest is scanned and a
  torn or corrupt tail is truncated at the first bad record (nothing after it was acknowledged:
  every ack follows an ``fdatasync`` of everything before it). An active file whose records
  all lie in sealed files is set aside; one that overlaps sealed files with records beyond
  them refuses the open (the same offsets would exist twice).
* An active file written in format version 1 (one frame per record, before record batches)
  is sealed as it is, once its tail is checked; new batches go to a new version 2 file. Sealed
  files of either version stay readable.
* With no record at all, the WAL starts at ``initial_offset`` (the sealed state's
  ``last_committed_offset + 1`` after a topic move, ``docs/etcd-layout.md`` §5.3).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from danube_pipeline.errors import CorruptRecordError
from danube_pipeline.records import LEGACY_FORMAT_VERSION, SegmentHeader
from danube_pipeline.segments import scan_segment

from broker.wal.segment import (
    ACTIVE_NAME_RE,
    SEALED_NAME_RE,
    OffsetIndex,
    Segment,
    create_active_segment,
    fsync_dir,
    read_header,
    sealed_name,
    truncate_file,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedLog:
    """What :meth:`LogLoader.load` found.

    Attributes:
        sealed: sealed segments, ascending and non-overlapping.
        active: the active segment, open for appending.
        first_append_s: creation time (s since the epoch) of the active segment when it holds
            records (its age counts from there), else ``None``.
    """

    sealed: list[Segment]
    active: Segment
    first_append_s: float | None


class LogLoader:
    """Recovers one WAL directory (see the module docstring for the rules).

    Args:
        directory: the topic's WAL directory, created if missing.
        index_interval_bytes: spacing of the sparse offset indexes it builds.
    """

    def __init__(self, directory: Path, *, index_interval_bytes: int) -> None:
        self.directory = directory
        self.index_interval_bytes = index_interval_bytes

    def load(self, initial_offset: int) -> LoadedLog:
        """Recover the directory.

        Args:
            initial_offset: the first offset when the WAL holds no record at all.

        Returns:
            The recovered segments.

        Raises:
            CorruptRecordError: a sealed file's name disagrees with its header, the newest one
                holds fewer records than its name says, or the active file overlaps the sealed
                ones with records beyond them.
            OSError: the directory or files cannot be read or written.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        sealed: list[Segment] = []
        actives: list[tuple[int, Path]] = []
        for entry in os.scandir(self.directory):
            if m := SEALED_NAME_RE.match(entry.name):
                sealed.append(self._sealed_segment(int(m.group(1)), int(m.group(2)), Path(entry.path)))
            elif m := ACTIVE_NAME_RE.match(entry.name):
                actives.append((int(m.group(1)), Path(entry.path)))
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
            if active.format_version == LEGACY_FORMAT_VERSION:
                sealed.append(self._seal_legacy(active))
                active = self._create_active(active.end + 1)
            elif not active.is_empty:
                first_append_s = active.created_at_ms / 1000.0
        else:
            active = self._create_active(expected_start)
        fsync_dir(self.directory)
        sealed_end = sealed[-1].end if sealed else None
        if sealed_end is not None and active.end + 1 <= sealed_end:  # never reuse a sealed offset
            raise CorruptRecordError(
                str(active.path), 0,
                f"next offset {active.end + 1} is not past the sealed segments' end {sealed_end}",
            )
        return LoadedLog(sealed=sealed, active=active, first_append_s=first_append_s)

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
        if scan.error is not None:
            log.warning(
                "WAL %s: truncating %s from %d to %d bytes (%d good records): %s",
                self.directory, path.name, len(data), scan.valid_length, scan.record_count, scan.error,
            )
            truncate_file(path, scan.valid_length)
        if scan.record_count == 0 and (
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
        seg.fd = os.open(path, os.O_RDWR | os.O_APPEND)
        return seg
