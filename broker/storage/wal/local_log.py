"""The segment files of one topic's WAL on local disk: the sealed ones and the active one,
rolling (seal the active segment, create the next), reading across them, and deleting the
oldest (Kafka's ``LocalLog``).

All file descriptors are opened, closed and renamed from the event loop or from the writer
while it holds the WAL's I/O lock, and reads are synchronous ``os.pread`` calls from the event
loop, so a reader never races a rename or a close.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import os
import threading
from pathlib import Path

from danube_pipeline.errors import CorruptRecordError, LogTruncationError, SegmentUnreadableError
from danube_pipeline.format.segments import StoredBatch, scan_segment

from broker import metrics
from broker.storage.wal.abandoned import AbandonedRange
from broker.storage.wal.epochs import LeaderEpochCache
from broker.storage.wal.quarantine import find_valid_after, write_marker
from broker.storage.wal.recovery import LogLoader, Quarantine
from broker.storage.wal.segment import (
    OffsetIndex,
    SealedSegment,
    Segment,
    create_active_segment,
    cut_active_file,
    fsync_dir,
    now_ms,
    sealed_name,
)
from broker.tasks import run_to_completion

log = logging.getLogger("broker.storage.wal.log")  # the WAL's log lines keep one logger name

MAX_OPEN_SEALED_FILES = 1024
"""Sealed segment files that reads keep open, at most, across every WAL read from one thread
(the event loop's: reads are synchronous, module docstring); beyond it the least recently read
is closed, and a later read opens it again. Counted per WAL, a consumer replaying a long history
would keep a file per segment it passed, and a few hundred such topics would reach the usual
open-files limit."""


class ReadFiles:
    """The sealed segments holding a file a read opened, least recently read first, for every
    WAL read from one thread (:func:`read_files`).

    Args:
        limit: files kept open at most (:data:`MAX_OPEN_SEALED_FILES`).
    """

    def __init__(self, limit: int = MAX_OPEN_SEALED_FILES) -> None:
        self.limit = limit
        self._open: dict[int, Segment] = {}  # id(segment): segment, in read order (held: ids stay unique)

    def __len__(self) -> int:
        return len(self._open)

    def read(self, seg: Segment) -> None:
        """``seg`` was just read through its file: now the most recently read; the least
        recently read files beyond :attr:`limit` are closed."""
        self._open.pop(id(seg), None)
        self._open[id(seg)] = seg
        while len(self._open) > self.limit:
            self._open.pop(next(iter(self._open))).close_file()

    def forget(self, seg: Segment) -> None:
        """Stop counting ``seg`` (its file is being closed: sealed, deleted, or its WAL closed)."""
        self._open.pop(id(seg), None)


_THREAD = threading.local()


def read_files() -> ReadFiles:
    """The calling thread's :class:`ReadFiles` (the event loop's, for a broker)."""
    files: ReadFiles | None = getattr(_THREAD, "files", None)
    if files is None:
        files = _THREAD.files = ReadFiles()
    return files


class LocalLog:
    """The segments of one WAL directory, sealed and active, with contiguous offsets.

    The caller (:class:`~broker.storage.wal.log.WriteAheadLog`) holds its I/O lock around
    every method that changes files (:meth:`seal`, :meth:`finish_roll`,
    :meth:`delete_oldest_sealed`, :meth:`close`).

    Args:
        directory: the topic's WAL directory.
        index_interval_bytes: spacing of the sparse read index.

    Attributes:
        active: the active segment (after :meth:`load`); while :attr:`roll_pending`, the
            segment just sealed, for reads and :attr:`durable_end`.
        roll_pending: the active segment was sealed but no new one exists yet.
        first_append: set while the active segment holds a record (the age timer waits on it).
        quarantine: the segment recovery quarantined, or ``None``.
        abandoned: the ranges recorded as abandoned (:mod:`broker.storage.wal.abandoned`):
            segments may leave a gap there, which reads step over.
        unreadable: segments found corrupt by a read (or found again at open, by their
            marker), by start offset: readers get
            :class:`~danube_pipeline.errors.SegmentUnreadableError` past the last good offset.
        sync_count: ``fdatasync`` calls made by seals.
        epochs: the leader-epoch cache (:mod:`broker.storage.wal.epochs`), loaded by :meth:`load`.
        high_watermark: the roll limit (``None``: none): while set, a segment is sealed only
            once every offset it holds is below it, so that a truncation
            (:meth:`truncate`) only ever cuts the active segment.
    """

    def __init__(self, directory: Path, *, index_interval_bytes: int) -> None:
        self.directory = directory
        self.index_interval_bytes = index_interval_bytes
        self._sealed: list[Segment] = []
        self._sealed_starts: list[int] = []
        self.active: Segment | None = None
        self.first_append = asyncio.Event()
        self._active_first_append_s: float | None = None
        self.roll_pending = False
        self.quarantine: Quarantine | None = None
        self.abandoned: list[AbandonedRange] = []
        self.unreadable: dict[int, Quarantine] = {}
        self.sync_count = 0
        self.epochs = LeaderEpochCache(directory)
        self.high_watermark: int | None = None

    @property
    def active_first_append_s(self) -> float | None:
        """When the active segment got its first record (s since the epoch), or ``None``;
        :attr:`first_append` is set exactly while it is not ``None``."""
        return self._active_first_append_s

    @active_first_append_s.setter
    def active_first_append_s(self, value: float | None) -> None:
        self._active_first_append_s = value
        if value is None:
            self.first_append.clear()
        else:
            self.first_append.set()

    def load(self, initial_offset: int) -> int:
        """Recover the directory (:mod:`broker.storage.wal.recovery`) and load the epoch
        cache, rebuilt from the batches' own epochs when the newest batch carries an epoch
        above the cache's latest (:meth:`_rebuild_epochs`); blocking.

        Returns:
            The next offset to hand out.
        """
        loaded = LogLoader(self.directory, index_interval_bytes=self.index_interval_bytes).load(initial_offset)
        self._sealed = loaded.sealed
        self._sealed_starts = [seg.start for seg in loaded.sealed]
        self.active = loaded.active
        self.active_first_append_s = loaded.first_append_s
        self.quarantine = loaded.quarantine
        self.abandoned = loaded.abandoned
        self.unreadable = {start: q for start, q in loaded.unreadable.items()}
        next_offset = loaded.active.end + 1
        self.epochs = LeaderEpochCache.load(self.directory, log_end_offset=next_offset)
        self._rebuild_epochs()
        return next_offset

    def _rebuild_epochs(self) -> None:
        """Rebuild the epoch cache from the batches' own epochs when the newest batch carries
        an epoch above the cache's latest (:meth:`LeaderEpochCache.rebuild_from_segments`).

        Raises:
            OSError: a segment cannot be read or the checkpoint written.
        """
        self.epochs.rebuild_from_segments([*self._sealed, *([self.active] if self.active is not None else [])])

    def _create_active(self, start: int) -> Segment:
        return create_active_segment(self.directory, start, self.index_interval_bytes)

    async def close(self) -> None:
        """Sync and close the active segment, and close the sealed segments' descriptors."""
        active = self.active
        if active is not None and active.fd is not None:
            fd = active.fd
            active.fd = None
            await asyncio.to_thread(self._sync_and_close, fd)
        self.close_read_files()

    def close_read_files(self) -> None:
        """Close the sealed segments' files that reads opened (a later read opens them again)."""
        for seg in self._sealed:
            if seg is not self.active:  # a sealed segment still active (roll pending) keeps its writer's file
                self._close_sealed_fd(seg)

    @staticmethod
    def _sync_and_close(fd: int) -> None:
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    @property
    def durable_end(self) -> int:
        """One past the last durable offset: every offset below it is on disk and readable."""
        assert self.active is not None
        return self.active.end + 1

    @property
    def first_offset(self) -> int:
        """The lowest offset still held locally (the first segment's start)."""
        if self._sealed:
            return self._sealed[0].start
        assert self.active is not None
        return self.active.start

    @property
    def active_path(self) -> Path:
        """Path of the active ``.log`` segment."""
        assert self.active is not None
        return self.active.path

    # ------------------------------------------------------------------ sealing

    async def seal(self) -> SealedSegment | None:
        """Seal the active segment; the caller holds the I/O lock.

        Cancellation-safe: once started, the seal (sync, rename, new active segment, state
        update) runs to its end even if the caller is cancelled, and the caller's
        cancellation is delivered only afterwards, so the I/O lock is never released while
        the files and the in-memory state disagree.

        Returns:
            The new sealed segment, or ``None`` if there was nothing to seal (no record, a
            roll to finish, or a quarantined segment).

        Raises:
            OSError: sync, rename or directory sync failed, or the next active segment could
                not be created (the segment is sealed then; the writer creates the next one
                before its next write).
        """
        if self.roll_pending:
            await run_to_completion(self.finish_roll())
            return None
        active = self.active
        if active is None or active.end < active.start or active.fd is None:
            return None
        if self.quarantine is not None:  # its bytes go past the corruption: never seal them
            return None
        if self.high_watermark is not None and active.end >= self.high_watermark:
            return None  # sealed segments stay immutable: only offsets below the watermark are sealed
        return await run_to_completion(self._seal_steps(active))

    async def _seal_steps(self, active: Segment) -> SealedSegment:
        assert active.fd is not None
        fd = active.fd
        new_path = self.directory / sealed_name(active.start, active.end)
        old_path = active.path

        def work() -> OSError | None:
            os.fdatasync(fd)
            os.rename(old_path, new_path)
            try:
                fsync_dir(self.directory)
            except OSError as exc:  # the rename happened: the state must follow it
                return exc
            return None

        dir_error = await asyncio.to_thread(work)
        # From here on the file is sealed on disk: never append to it again.
        self.sync_count += 1
        if dir_error is not None:
            log.warning(
                "WAL %s: directory sync after sealing %s failed (retried with the next segment): %s",
                self.directory, new_path.name, dir_error,
            )
        create_error: OSError | None = None
        new_active: Segment | None = None
        try:
            # Creating the new active segment syncs the directory again (covering the rename).
            new_active = await asyncio.to_thread(self._create_active, active.end + 1)
        except OSError as exc:
            create_error = exc
        # Publish the new state in one step (no await in between).
        active.path = new_path
        active.sealed_at_ms = now_ms()
        self._sealed.append(active)
        self._sealed_starts.append(active.start)
        self.active_first_append_s = None
        if new_active is not None:
            self.active = new_active
            self._close_sealed_fd(active)
        else:
            # ``active`` stays the sealed segment (for reads and durable_end) until a new
            # active segment exists; the writer creates it before its next write.
            self.roll_pending = True
        log.info("WAL %s: sealed %s (%d bytes)", self.directory, new_path.name, active.length)
        metrics.active().wal.rotated()
        if create_error is not None:
            log.error("WAL %s: cannot create the next active segment: %s", self.directory, create_error)
            raise create_error
        return active.info()

    async def finish_roll(self) -> None:
        """Create the active segment that a seal could not create; the caller holds the lock."""
        sealed = self.active
        assert sealed is not None and self.roll_pending
        new_active = await asyncio.to_thread(self._create_active, sealed.end + 1)
        self.active = new_active
        self.roll_pending = False
        self._close_sealed_fd(sealed)

    async def truncate(self, end_offset: int) -> int:
        """Remove every batch at or above ``end_offset`` (Kafka's ``LocalLog.truncateTo``; the
        rules are :meth:`~broker.storage.wal.replica_log.ReplicaLogMixin.truncate_to`'s); the
        caller holds the I/O lock and wrote everything queued. The new end is published
        before the file is cut, so no reader reaches the bytes being removed.

        Returns:
            The new next offset (``end_offset``, or the base offset of the batch holding it;
            the next offset as it was when no batch is at or above ``end_offset``).

        Raises:
            LogTruncationError, CorruptRecordError: refused; nothing changed.
            OSError: the cut or the epoch cache write failed; after a failed cut the file may
                hold more than the WAL serves, and the caller must stop appending.
        """
        active = self.active
        assert active is not None and active.fd is not None
        above = [seg for seg in self._sealed if seg.end >= end_offset]
        refusal = (
            "a segment is quarantined" if self.quarantine is not None
            else f"sealed segment {above[0].path.name} holds it; sealed segments are immutable" if above
            else f"below the active segment's start {active.start}, not held here" if end_offset < active.start
            else None
        )
        if refusal is not None:
            raise LogTruncationError(str(self.directory), end_offset, refusal)
        if end_offset > active.end:  # nothing to cut; an epoch begun at the end may still go
            await asyncio.to_thread(self.epochs.truncate_from, end_offset)
            return active.end + 1
        position, next_offset = await asyncio.to_thread(active.truncation_point, end_offset)
        old_end, removed = active.end, active.length - position
        header = active.cut_state(position, next_offset)
        if header is not None:
            self.active_first_append_s = None
        await run_to_completion(asyncio.to_thread(cut_active_file, active.fd, position, header))
        log.warning(
            "WAL %s: truncated to offset %d: offsets %d..%d removed (%d bytes of %s)",
            self.directory, next_offset, next_offset, old_end, removed, active.path.name,
        )
        await asyncio.to_thread(self.epochs.truncate_from, next_offset)
        return next_offset

    def sealed_segments(self) -> list[SealedSegment]:
        """Every sealed segment, ascending by start offset."""
        return [s.info() for s in self._sealed]

    def sealed_segment(self, start_offset: int) -> SealedSegment | None:
        """The sealed segment starting at ``start_offset``, or ``None``."""
        i = bisect.bisect_left(self._sealed_starts, start_offset)
        if i < len(self._sealed) and self._sealed[i].start == start_offset:
            return self._sealed[i].info()
        return None

    @property
    def size_bytes(self) -> int:
        """Bytes of every segment file on disk, sealed and active (headers included)."""
        total = sum(seg.length for seg in self._sealed)
        if self.active is not None and not self.roll_pending:
            total += self.active.length
        return total

    async def delete_oldest_sealed(self, start_offset: int) -> int:
        """Delete the oldest sealed segment from disk; the caller holds the I/O lock (see
        :meth:`broker.storage.wal.log.WriteAheadLog.delete_oldest_sealed`).

        Returns:
            The bytes freed.

        Raises:
            ValueError: ``start_offset`` is not the oldest sealed segment.
            OSError: the file could not be removed.
        """
        if not self._sealed or self._sealed[0].start != start_offset:
            raise ValueError(f"WAL {self.directory}: {start_offset} is not the oldest sealed segment")
        seg = self._sealed[0]
        if seg is self.active:  # sealed, but the next active segment does not exist yet
            raise ValueError(f"WAL {self.directory}: segment {start_offset} is still the newest")
        path = seg.path
        # Drop it from the state first, in one step: from here on readers go to object
        # storage for these offsets and never open the file again.
        self._sealed.pop(0)
        self._sealed_starts.pop(0)
        self._close_sealed_fd(seg)
        # A failed unlink leaves the file behind; recovery takes it back at the next open.
        await asyncio.to_thread(os.unlink, path)
        try:
            await asyncio.to_thread(fsync_dir, self.directory)
        except OSError as exc:  # the unlink happened; a crash may bring the name back
            log.warning("WAL %s: directory sync after deleting %s failed: %s", self.directory, path.name, exc)
        log.info("WAL %s: deleted %s (%d bytes, offsets %d..%d)", self.directory, path.name, seg.length, seg.start, seg.end)
        metrics.active().wal.deleted(seg.length)
        return seg.length

    # ------------------------------------------------------------------ reading

    def _close_sealed_fd(self, seg: Segment) -> None:
        """Close the file a segment was written through once it is sealed: a broker of
        10,000 topics would otherwise hold two files per topic (the open files limit is
        usually 20,000 or less); a read opens it again (:meth:`_sealed_fd`). Also used when a
        sealed segment is deleted and for :meth:`close_read_files`."""
        read_files().forget(seg)
        seg.close_file()

    def _sealed_fd(self, seg: Segment) -> int:
        if seg.fd is None:
            seg.fd = os.open(seg.path, os.O_RDONLY)
        read_files().read(seg)
        return seg.fd

    def read(self, from_offset: int, max_records: int, *, max_bytes: int) -> list[StoredBatch]:
        """Read durable batches holding ``from_offset`` and the offsets after it (see
        :meth:`broker.storage.wal.log.WriteAheadLog.read`).

        Raises:
            CorruptRecordError: a durable batch fails its CRC (disk corruption).
        """
        out: list[StoredBatch] = []
        if self.active is None or max_records <= 0:
            return out
        offset = max(from_offset, self.first_offset)
        budget = max_bytes
        records = 0
        while records < max_records and offset < self.durable_end and budget > 0:
            seg = self._segment_for(offset)
            if seg is None:
                # A gap between segments (abandoned offsets): go on at the next segment; the
                # reader sees batches start past the offset it asked for.
                seg = self._segment_after(offset)
                if seg is None:
                    break
                offset = seg.start
            if seg is self.active:
                assert seg.fd is not None
                fd = seg.fd
            else:
                fd = self._sealed_fd(seg)
            wanted = max_records - records
            flagged = self.unreadable.get(seg.start)
            if flagged is not None:
                if offset > flagged.last_good_offset:
                    if out:
                        break
                    raise SegmentUnreadableError(str(seg.path), flagged.position, flagged.last_good_offset + 1, seg.end)
                wanted = min(wanted, flagged.last_good_offset + 1 - offset)  # never reaches the bad batch
                if seg.index is None:  # recovered: index its good prefix only
                    self._index_good_prefix(seg, os.pread(fd, seg.length, 0), flagged.last_good_offset)
            try:
                seg.ensure_index(fd, self.index_interval_bytes)
                got, used = seg.read(fd, offset, wanted, budget)
            except CorruptRecordError as exc:
                if flagged is not None:
                    raise
                self._flag_unreadable(seg, fd, exc)
                continue  # serves the good part, then refuses the rest
            if not got:
                break
            out.extend(got)
            budget -= used
            records += got[-1].last_offset + 1 - offset
            offset = got[-1].last_offset + 1
        return out

    def _flag_unreadable(self, seg: Segment, fd: int, exc: CorruptRecordError) -> Quarantine:
        """A read found a bad batch in ``seg``: scan it once, write its quarantine marker
        (:mod:`broker.storage.wal.quarantine`), log ERROR and flag it in :attr:`unreadable`, so
        readers get the good prefix and then a typed error, never the bad bytes.

        Raises:
            CorruptRecordError: ``exc`` again when the scan finds no bad batch up to the
                segment's end (the read failed, not the bytes).
        """
        data = os.pread(fd, seg.length, 0)
        scan = scan_segment(data, expected_first_offset=seg.start, keep_positions=True)
        last_good = min(seg.start + scan.record_count - 1, seg.end)
        if scan.error is None or last_good >= seg.end:
            raise exc
        if seg.index is None:
            self._index_good_prefix(seg, data, last_good)
        found = find_valid_after(data, scan.valid_length, last_good, format_version=seg.format_version)
        quarantine = Quarantine(
            segment=seg.path, position=scan.valid_length, last_good_offset=last_good,
            next_valid_offset=found[1] if found else last_good + 1,
            next_valid_position=found[0] if found else scan.valid_length, error=scan.error, detected_at_ms=now_ms(),
        )
        try:
            quarantine = write_marker(quarantine)
            fsync_dir(self.directory)
        except OSError as write_exc:
            log.error("WAL %s: cannot write the quarantine marker of %s: %s", self.directory, seg.path.name, write_exc)
        self.unreadable[seg.start] = quarantine
        log.error(
            "WAL %s: QUARANTINED segment %s on read: corrupt at byte %d (%s); readers get offsets up to %d and "
            "then an error for offsets %d..%d (the bytes are kept, marker %s). Operator: stop the broker and run "
            "`python -m broker.storage.wal.repair %s`", self.directory, seg.path.name, quarantine.position,
            quarantine.error, last_good, last_good + 1, seg.end, quarantine.marker.name, self.directory,
        )
        return quarantine

    def _index_good_prefix(self, seg: Segment, data: bytes, last_good: int) -> None:
        """Give a corrupt segment an index of its batches up to ``last_good`` only."""
        scan = scan_segment(data, expected_first_offset=seg.start, keep_positions=True)
        seg.index = OffsetIndex.from_positions(scan.positions, self.index_interval_bytes, through_offset=last_good)

    def _segment_after(self, offset: int) -> Segment | None:
        """The first segment starting above ``offset`` (the active one when no sealed one does)."""
        i = bisect.bisect_right(self._sealed_starts, offset)
        if i < len(self._sealed):
            return self._sealed[i]
        active = self.active
        return active if active is not None and active.start > offset else None

    def _segment_for(self, offset: int) -> Segment | None:
        active = self.active
        assert active is not None
        if offset >= active.start:
            return active
        i = bisect.bisect_right(self._sealed_starts, offset) - 1
        if i < 0:
            return None
        seg = self._sealed[i]
        return seg if offset <= seg.end else None
