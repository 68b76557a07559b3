"""The operator's decision on a quarantined WAL segment, offline:
``python -m broker.storage.wal.repair TOPIC_WAL_DIR [--truncate]``.

Run it while the broker is stopped: a running broker holds the segment open and would not see
the change. :mod:`broker.storage.wal.recovery` quarantines a segment that is corrupt in the middle
with valid batches after the corruption, and writes ``{segment file name}.quarantine`` next to
it; this command reads those markers (the broker writes the marker again at every open, so
start and stop the broker once if it was removed).

Without a flag it changes nothing: it prints each marker and the scan of its segment (the
good prefix, the bad bytes, and every run of valid batches after them: byte positions and
offsets). Exit status 1 when a segment is quarantined, 0 when none is, 2 when the command
cannot proceed (unreadable directory, segment changed since the marker, evidence file in
the way).

With ``--truncate`` the operator accepts the loss. For each quarantined segment:

0. the lost offsets are recorded as *abandoned* in the WAL directory's ``abandoned.json``
   (:mod:`broker.storage.wal.abandoned`; synced with the directory) before any file changes;
1. its good prefix (the segment header and every batch before the bad one) is written to a
   temporary file and ``fsync``-ed;
2. the whole segment is kept as evidence under ``{segment file name}.quarantined`` (a hard
   link to the same bytes, or a synced copy where links are not supported);
3. the prefix takes the segment's place (an atomic rename; a sealed file whose good prefix
   ends past the end offset in its name is renamed to its real end), then the directory is
   ``fsync``-ed;
4. the marker is removed and the directory ``fsync``-ed again.

A crash at any point leaves either the whole segment (still quarantined at the next open; a
second run records the same range again, once) or the good prefix under the segment's name,
and the evidence once step 2 is done. The next open finds a clean file and the record, and
appends continue past the abandoned range: the offsets lost are never handed out again.

Which offsets are lost: every offset after the last good one that the segment held, i.e. the
bad batch's and those of every valid batch after it, up to the highest offset a valid batch
of the file carries (for a sealed file, at least the end offset in its name). The valid
batches after the corruption were most likely acknowledged (every ack follows an
``fdatasync`` of everything before it) and may have been delivered; the bad batch's records
cannot be rebuilt. Keeping the later batches would leave a hole in the middle of a segment,
so the whole range is dropped from the WAL and recorded as abandoned: the owner publishes it
as an abandoned unavailable range (``docs/etcd-layout.md`` §5.5) when it loads the topic, so
subscriptions skip it (logged, counted in ``skipped_unavailable``) and tiering passes over
it. The dropped batches stay readable in the ``.quarantined`` file.

A segment quarantined for a damaged header (its first batch not intact) has no good prefix:
``--truncate`` replaces it by a fresh header with the start offset of its name.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from danube_pipeline.errors import CorruptRecordError
from danube_pipeline.format.records import (
    LEGACY_FORMAT_VERSION,
    SEGMENT_HEADER_SIZE,
    ScanResult,
    SegmentHeader,
    scan_records,
)
from danube_pipeline.format.segments import has_epoch_prefix, scan_batches, scan_segment

from broker.storage.wal.abandoned import ABANDONED_FILE, record_abandoned
from broker.storage.wal.quarantine import (
    QUARANTINE_SUFFIX,
    Quarantine,
    batch_format_version,
    find_valid_after,
    read_marker,
)
from broker.storage.wal.segment import ACTIVE_NAME_RE, SEALED_NAME_RE, fsync_dir, now_ms, sealed_name

EVIDENCE_SUFFIX = ".quarantined"
"""Suffix under which ``--truncate`` keeps the whole quarantined segment."""

EXIT_CLEAN = 0
EXIT_QUARANTINED = 1
EXIT_ERROR = 2


class RepairError(Exception):
    """The command cannot proceed safely; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class ValidRun:
    """Consecutive valid batches found after the corruption.

    Attributes:
        position: byte position of the first batch.
        end_position: byte position just past the last batch.
        first_offset: base offset of the first batch.
        last_offset: last offset of the last batch.
        batches: number of batches (records in version 1).
        stopped: why the run ended before the end of the file, or ``None``.
    """

    position: int
    end_position: int
    first_offset: int
    last_offset: int
    batches: int
    stopped: str | None


@dataclass(frozen=True, slots=True)
class SegmentScan:
    """A quarantined segment, read again.

    Attributes:
        header: its segment header.
        size_bytes: file size.
        prefix: the scan of its good prefix (stopped at the bad batch).
        runs: the runs of valid batches after the bad one, in file order.
    """

    header: SegmentHeader
    size_bytes: int
    prefix: ScanResult
    runs: list[ValidRun]

    @property
    def last_good_offset(self) -> int:
        """The last offset of the good prefix (the segment's start - 1 if none)."""
        return self.header.start_offset + self.prefix.record_count - 1

    @property
    def highest_offset(self) -> int:
        """The highest offset any valid batch of the file carries."""
        return max([self.last_good_offset, *(run.last_offset for run in self.runs)])


def name_start(path: Path) -> int | None:
    """The start offset in a segment file's name, ``None`` for another name."""
    m = SEALED_NAME_RE.match(path.name) or ACTIVE_NAME_RE.match(path.name)
    return int(m.group(1)) if m else None


def scan_quarantined(data: bytes, *, where: str, start_offset: int | None = None) -> SegmentScan:
    """Scan a segment's good prefix and every run of valid batches after its first bad one.

    Args:
        data: the whole segment file.
        where: a name for error messages.
        start_offset: the start offset of the file's name: with it, a damaged header (or one
            whose start disagrees) gives an empty good prefix (position 0) instead of an error.

    Raises:
        CorruptRecordError: the segment header is unusable and ``start_offset`` is ``None``.
    """
    try:
        header = SegmentHeader.decode(data, where=where)
        damaged = start_offset is not None and header.start_offset != start_offset
    except CorruptRecordError:
        if start_offset is None:
            raise
        damaged = True
    if damaged:
        assert start_offset is not None
        version, _ = batch_format_version(data, start_offset)
        header = SegmentHeader(start_offset=start_offset, created_at_ms=now_ms(), format_version=version)
        prefix = ScanResult(valid_length=0, record_count=0, first_offset=None, last_offset=None,
                            error="damaged segment header")
        position = SEGMENT_HEADER_SIZE - 1  # batches are looked for from byte 32 on
    else:
        prefix = scan_segment(data, expected_first_offset=header.start_offset)
        position = prefix.valid_length
    version = header.format_version
    runs: list[ValidRun] = []
    last = header.start_offset + prefix.record_count - 1
    while position < len(data) and (found := find_valid_after(data, position, last, format_version=version)):
        if version == LEGACY_FORMAT_VERSION:
            scan = scan_records(data, start_position=found[0], keep_positions=True)
        else:
            scan = scan_batches(
                data, start_position=found[0], keep_positions=True, epoch_prefix=has_epoch_prefix(version)
            )
        assert scan.last_offset is not None  # the batch at found[0] is valid
        runs.append(ValidRun(
            position=found[0], end_position=scan.valid_length, first_offset=found[1], last_offset=scan.last_offset,
            batches=len(scan.positions), stopped=scan.error,
        ))
        position, last = scan.valid_length, scan.last_offset
    return SegmentScan(header=header, size_bytes=len(data), prefix=prefix, runs=runs)


def _check(quarantine: Quarantine, scan: SegmentScan) -> None:
    """Refuse to act when the segment no longer shows the corruption its marker describes.

    Raises:
        RepairError: the prefix ends elsewhere, or no valid batch follows any more.
    """
    sealed = SEALED_NAME_RE.match(quarantine.segment.name) is not None  # its named end was handed out
    if scan.prefix.error is None or scan.prefix.valid_length != quarantine.position or (
        not scan.runs and quarantine.position != 0 and not sealed
    ):
        raise RepairError(
            f"{quarantine.segment.name} no longer matches its marker (good prefix ends at byte "
            f"{scan.prefix.valid_length}, marker says {quarantine.position}; "
            f"{len(scan.runs)} valid runs after it): start the broker once so recovery examines it again"
        )


def dropped_range(quarantine: Quarantine, scan: SegmentScan) -> tuple[int, int]:
    """The offsets ``--truncate`` drops: from the last good one + 1 to the highest offset a
    valid batch of the file carries, or a sealed file's named end if higher (the WAL handed
    out every offset up to it). Empty (last < first) when nothing was handed out past the
    good prefix."""
    last = scan.highest_offset
    if m := SEALED_NAME_RE.match(quarantine.segment.name):
        last = max(last, int(m.group(2)))
    return scan.last_good_offset + 1, last


def describe(quarantine: Quarantine, scan: SegmentScan, out: list[str]) -> None:
    """Append the human-readable report of one quarantined segment to ``out``."""
    q = quarantine
    start = scan.header.start_offset
    good = f"offsets {start}..{scan.last_good_offset}" if scan.prefix.record_count else "no offsets"
    out.append(f"quarantined segment {q.segment.name} (format version {scan.header.format_version}, "
               f"{scan.size_bytes} bytes; marker {q.marker.name}, detected {q.to_json()['detected_at']})")
    out.append(f"  bad batch at byte {q.position}: {q.error}")
    out.append(f"  good prefix: {good} in bytes 0..{q.position} (last good offset {scan.last_good_offset})")
    if scan.runs:
        out.append(f"  unreadable bytes {q.position}..{scan.runs[0].position}")
    for run in scan.runs:
        out.append(
            f"  valid again at byte {run.position}: offset {run.first_offset}..{run.last_offset} "
            f"({run.batches} batches, to byte {run.end_position}"
            + (f"; then: {run.stopped})" if run.stopped else ", end of file)")
        )
    dropped_first, dropped_last = dropped_range(quarantine, scan)
    out.append(
        f"  --truncate would keep offsets up to {scan.last_good_offset} and drop offsets "
        f"{dropped_first}..{dropped_last} ({dropped_last - dropped_first + 1} offsets), recorded as abandoned "
        "(never handed out again); the batches after the corruption were most likely acknowledged"
    )


def _keep_evidence(path: Path, evidence: Path) -> None:
    """Keep ``path``'s bytes under ``evidence`` (hard link, else a synced copy)."""
    try:
        os.link(path, evidence)
    except OSError:
        shutil.copyfile(path, evidence)
        fd = os.open(evidence, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def truncate(quarantine: Quarantine, scan: SegmentScan, data: bytes) -> tuple[Path, Path, int, int]:
    """Replace a quarantined segment by its good prefix (steps in the module docstring).

    The caller recorded the dropped offsets as abandoned first (step 0).

    Returns:
        ``(new_segment_path, evidence_path, first_dropped_offset, last_dropped_offset)``.

    Raises:
        RepairError: an evidence file with other bytes exists already, or a sealed file has no
            good record.
        OSError: a file operation failed (the steps done so far are safe to leave).
    """
    path = quarantine.segment
    directory = path.parent
    evidence = path.with_name(path.name + EVIDENCE_SUFFIX)
    # An evidence file holding these very bytes was left by an interrupted run: keep using it.
    kept = evidence.exists() and (os.path.samefile(path, evidence) or evidence.read_bytes() == data)
    if evidence.exists() and not kept:
        raise RepairError(f"{evidence.name} exists already: move it away first (it is earlier evidence)")
    target = path
    if m := SEALED_NAME_RE.match(path.name):
        if scan.prefix.record_count == 0:
            raise RepairError(f"sealed segment {path.name} holds no good record: move it away by hand")
        if scan.last_good_offset != int(m.group(2)):
            target = directory / sealed_name(scan.header.start_offset, scan.last_good_offset)
    tmp = path.with_name(path.name + ".repair-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        # A damaged header (position 0): the good prefix is a fresh header of the name's start.
        prefix = data[: quarantine.position] if quarantine.position else scan.header.encode()
        view = memoryview(prefix)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    if not kept:
        _keep_evidence(path, evidence)
        fsync_dir(directory)
    os.rename(tmp, target)
    fsync_dir(directory)
    if target != path:
        os.unlink(path)
        fsync_dir(directory)
    quarantine.marker.unlink()
    fsync_dir(directory)
    return target, evidence, *dropped_range(quarantine, scan)


def run(directory: Path, *, do_truncate: bool) -> tuple[int, list[str]]:
    """Report on (and with ``do_truncate`` repair) the quarantined segments of ``directory``.

    Returns:
        ``(exit_status, output_lines)``: :data:`EXIT_CLEAN`, :data:`EXIT_QUARANTINED` (report
        mode, something is quarantined) or :data:`EXIT_ERROR`.
    """
    out = [f"WAL directory {directory}"]
    if not directory.is_dir():
        return EXIT_ERROR, [*out, "error: not a directory"]
    markers = sorted(p for p in directory.iterdir() if p.name.endswith(QUARANTINE_SUFFIX))
    if not markers:
        return EXIT_CLEAN, [*out, "no quarantined segment (no *.quarantine marker)"]
    status = EXIT_CLEAN
    for marker in markers:
        try:
            quarantine = read_marker(marker)
        except (OSError, ValueError) as exc:
            out.append(f"error: unreadable marker {marker.name}: {exc}")
            status = EXIT_ERROR
            continue
        segment = quarantine.segment
        if not segment.exists():
            if do_truncate:
                marker.unlink()
                fsync_dir(directory)
                out.append(f"removed stale marker {marker.name}: segment {segment.name} no longer exists")
            else:
                out.append(f"stale marker {marker.name}: segment {segment.name} no longer exists "
                           "(--truncate removes the marker)")
            continue
        try:
            data = segment.read_bytes()
            start = name_start(segment) if quarantine.position == 0 else None
            scan = scan_quarantined(data, where=str(segment), start_offset=start)
            _check(quarantine, scan)
        except (OSError, CorruptRecordError, RepairError) as exc:
            out.append(f"error: {segment.name}: {exc}")
            status = EXIT_ERROR
            continue
        describe(quarantine, scan, out)
        if not do_truncate:
            out.append(
                f"  to accept the loss: stop the broker, then: python -m broker.storage.wal.repair {directory} --truncate"
            )
            status = max(status, EXIT_QUARANTINED)
            continue
        try:
            first, last = dropped_range(quarantine, scan)
            if last >= first:  # recorded before any file changes: never handed out again
                record_abandoned(
                    directory, first, last,
                    f"python -m broker.storage.wal.repair --truncate of quarantined segment {segment.name}",
                )
            target, evidence, first, last = truncate(quarantine, scan, data)
        except (OSError, ValueError, RepairError) as exc:
            out.append(f"error: {segment.name}: {exc}")
            status = EXIT_ERROR
            continue
        out.append(
            f"  truncated: {target.name} now holds offsets up to {scan.last_good_offset} "
            f"({quarantine.position} bytes); the whole segment is kept as {evidence.name}; marker removed"
        )
        out.append(
            f"  dropped offsets {first}..{last} ({last - first + 1} offsets), recorded as abandoned in "
            f"{ABANDONED_FILE}: never handed out again; appends continue past them at "
            f"{max(first, last + 1)}, and subscriptions and tiering pass over them once the broker loads the topic"
        )
    return status, out


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m broker.storage.wal.repair",
        description="Inspect or repair a topic's quarantined WAL segment. Run it with the broker stopped.",
    )
    parser.add_argument("directory", type=Path, help="the topic's WAL directory ({wal_dir}/{namespace}/{topic})")
    parser.add_argument(
        "--truncate", action="store_true",
        help="accept the loss: record the dropped offsets as abandoned (never handed out again), keep the "
        "segment as {name}.quarantined, replace it by its good prefix, remove the marker",
    )
    args = parser.parse_args(argv)
    status, lines = run(args.directory, do_truncate=args.truncate)
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
