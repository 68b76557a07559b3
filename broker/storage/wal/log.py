"""The per-topic write-ahead log: append with group commit, seal, read.

A topic's WAL is a directory of segment files (:mod:`broker.storage.wal.segment`): sealed, immutable
``{start:020d}-{end:020d}.dnb1`` files and one active ``{start:020d}.log``; offsets are
contiguous across them. :mod:`broker.storage.wal.recovery` brings the directory back at open.

Group commit: :meth:`WriteAheadLog.enqueue` takes one producer-framed record batch, assigns
its offsets at once and queues it; one writer task takes everything queued since its previous
write and does ONE ``os.writev`` (each batch's bytes as received, behind the base offset it was
given) and ONE ``os.fdatasync`` in a worker thread (so the event loop keeps accepting appends
meanwhile), then resolves every waiting future. A producer is acknowledged only after the
``fdatasync`` that covers its batch. No Python object is made per message.

All file descriptors are opened, closed and renamed from the event loop or from the writer
while it holds the I/O lock, and reads are synchronous ``os.pread`` calls from the event loop,
so a reader never races a rename or a close.

A full disk (``ENOSPC``, ``EDQUOT``) fails the appends of that write with
:class:`~danube_pipeline.errors.StorageFullError`; the file is cut back to its last good byte,
reads go on, and the next write that fits succeeds. The WAL tells its
:class:`StorageMonitor` when it becomes full and when a write succeeds again, and logs once per
episode.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from danube_pipeline.errors import StorageFullError
from danube_pipeline.outages import OutageLog
from danube_pipeline.format.segments import StoredBatch

from broker.tasks import run_to_completion
from broker.storage.wal.pending import PendingAppend, plan_write, write_all
from broker.storage.wal.recovery import LogLoader, Quarantine
from broker.storage.wal.segment import (
    DEFAULT_INDEX_INTERVAL_BYTES,
    SealedSegment,
    Segment,
    create_active_segment,
    fsync_dir,
    now_ms,
    sealed_name,
)

log = logging.getLogger(__name__)

_MAX_OPEN_SEALED_FDS = 64
DEFAULT_INLINE_WRITE_MAX_BYTES = 64 * 1024
"""Group commits up to this size are written and synced on the event loop; larger ones in a
worker thread, so the loop keeps serving while the disk works."""


_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def storage_error(exc: BaseException, path: Path) -> BaseException:
    """``exc`` as the error an append reports: a full disk becomes
    :class:`~danube_pipeline.errors.StorageFullError`, anything else stays as it is."""
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
        return StorageFullError(str(path), os.strerror(exc.errno))
    return exc


class StorageMonitor(Protocol):
    """Who learns that a WAL's disk is full, and that it takes writes again."""

    def storage_full(self, directory: Path, error: StorageFullError) -> None: ...

    def storage_available(self, directory: Path) -> None: ...


class OffsetGuard(Protocol):
    """Reserves offsets before the WAL writes them (:class:`broker.cluster.ownership.Ownership`)."""

    reserved_end: int

    async def reserve_through(self, offset: int) -> None: ...


class WriteAheadLog:
    """Durable, append-only log of one topic, made of ``dnb1`` segment files.

    Open it with :meth:`open` and close it with :meth:`close`. ``sync_count``,
    ``record_count`` and ``byte_count`` count the ``fdatasync`` calls, the records and the
    record-batch bytes written since it was opened.
    """

    def __init__(
        self,
        directory: Path,
        *,
        segment_max_bytes: int,
        segment_max_age_s: float,
        index_interval_bytes: int = DEFAULT_INDEX_INTERVAL_BYTES,
    ) -> None:
        self.directory = directory
        self.segment_max_bytes = segment_max_bytes
        self.segment_max_age_s = segment_max_age_s
        self.index_interval_bytes = index_interval_bytes
        self.inline_write_max_bytes = DEFAULT_INLINE_WRITE_MAX_BYTES
        self.sync_count = 0
        self.record_count = 0
        self.byte_count = 0
        self._sealed: list[Segment] = []
        self._sealed_starts: list[int] = []
        self._active: Segment | None = None
        self._active_first_append_s: float | None = None
        self._next_offset = 0  # next offset enqueue hands out
        self._queue: list[PendingAppend] = []
        self._wakeup = asyncio.Event()
        self._advanced = asyncio.Event()
        self._io_lock = asyncio.Lock()
        self._writer_task: asyncio.Task[None] | None = None
        self._timer_task: asyncio.Task[None] | None = None
        self._closed = False
        self._failed: BaseException | None = None
        self._roll_pending = False  # the active segment was sealed but no new one exists yet
        self._listeners: list[Callable[[int], None]] = []
        self._open_sealed_fds: list[Segment] = []  # LRU of sealed segments holding an fd
        self.storage_monitor: StorageMonitor | None = None
        self.offset_guard: OffsetGuard | None = None
        self._storage_full = False
        self._seal_outage = OutageLog(log, f"sealing WAL segments in {directory}")

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        segment_max_bytes: int = 8 * 1024 * 1024,
        segment_max_age_s: float = 60.0,
        initial_offset: int = 0,
        index_interval_bytes: int = DEFAULT_INDEX_INTERVAL_BYTES,
    ) -> WriteAheadLog:
        """Open (or create) the WAL in ``directory``, recovering its files.

        Recovery follows :mod:`broker.storage.wal.recovery`: a torn tail of the active segment (nothing
        valid after the first bad batch) is truncated (and logged), and appends continue at the
        last good offset + 1; corruption followed by valid batches quarantines the segment
        (:attr:`quarantine`): reads stop before it and appends are refused until an operator
        runs ``python -m broker.storage.wal.repair``.

        Args:
            directory: the topic's WAL directory, created if missing.
            segment_max_bytes: the active segment is sealed once it reaches this size.
            segment_max_age_s: a non-empty active segment is sealed once its first record is
                this old.
            initial_offset: the first offset when the WAL holds no record at all
                (``docs/etcd-layout.md`` §5.3: ``last_committed_offset + 1`` after a topic move).
            index_interval_bytes: spacing of the sparse read index.

        Raises:
            CorruptRecordError: a sealed segment's name or header is unusable, the newest one
                holds fewer records than its name says, or the active segment overlaps the
                sealed ones with records beyond them (the same offsets would exist twice).
            OSError: the directory or files cannot be read or written.
        """
        wal = cls(
            Path(directory),
            segment_max_bytes=segment_max_bytes,
            segment_max_age_s=segment_max_age_s,
            index_interval_bytes=index_interval_bytes,
        )
        await asyncio.to_thread(wal._load, initial_offset)
        wal._writer_task = asyncio.create_task(wal._writer(), name=f"wal-writer:{directory}")
        wal._timer_task = asyncio.create_task(wal._age_timer(), name=f"wal-timer:{directory}")
        return wal

    async def close(self) -> None:
        """Write everything queued, sync, and close the files. Appends fail afterwards."""
        if self._closed:
            return
        self._closed = True
        if self._timer_task is not None:
            # Never cancel the age timer in the middle of a seal: wait for the I/O lock (held
            # for the whole seal) and cancel it while it sleeps or waits for the lock.
            async with self._io_lock:
                self._timer_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer_task
        self._wakeup.set()
        if self._writer_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer_task
        async with self._io_lock:
            active = self._active
            if active is not None and active.fd is not None:
                fd = active.fd
                active.fd = None
                await asyncio.to_thread(self._sync_and_close, fd)
            for seg in self._open_sealed_fds:
                if seg.fd is not None:
                    os.close(seg.fd)
                    seg.fd = None
            self._open_sealed_fds.clear()
        self._advanced.set()

    @staticmethod
    def _sync_and_close(fd: int) -> None:
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def _load(self, initial_offset: int) -> None:
        loaded = LogLoader(self.directory, index_interval_bytes=self.index_interval_bytes).load(initial_offset)
        self._sealed = loaded.sealed
        self._sealed_starts = [seg.start for seg in loaded.sealed]
        self._active = loaded.active
        self._active_first_append_s = loaded.first_append_s
        self._next_offset = loaded.active.end + 1
        self._quarantine = loaded.quarantine

    def _create_active(self, start: int) -> Segment:
        return create_active_segment(self.directory, start, self.index_interval_bytes)

    # ------------------------------------------------------------------ appending

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (appends fail from then on)."""
        return self._closed

    @property
    def next_offset(self) -> int:
        """The offset the next enqueued message will get."""
        return self._next_offset

    @property
    def durable_end(self) -> int:
        """One past the last durable offset: every offset below it is on disk and readable."""
        assert self._active is not None
        return self._active.end + 1

    @property
    def first_offset(self) -> int:
        """The lowest offset still held locally (the first segment's start)."""
        if self._sealed:
            return self._sealed[0].start
        assert self._active is not None
        return self._active.start

    _quarantine: Quarantine | None = None  # set by _load

    @property
    def quarantine(self) -> Quarantine | None:
        """The segment recovery quarantined (corruption in the middle, valid batches after it;
        :mod:`broker.storage.wal.recovery`), or ``None``. While set, reads serve offsets up to its last
        good offset and appends are refused; ``python -m broker.storage.wal.repair`` lifts it offline."""
        return self._quarantine

    def enqueue(self, batch: bytes, record_count: int) -> asyncio.Future[tuple[int, int]]:
        """Give a record batch its offsets now and queue it for the next group commit.

        Calling this in order from one task keeps that order on disk. The caller checked the
        batch (:func:`danube_pipeline.format.batches.validate_batch`).

        Args:
            batch: one batch as the producer framed it.
            record_count: the records it holds.

        Returns:
            A future resolving to ``(first_offset, last_offset)`` after the ``fdatasync`` that
            makes them durable, or failing with :class:`~danube_pipeline.errors.StorageFullError`
            (disk full) or the ``OSError`` of the write.

        Raises:
            ValueError: if ``record_count`` is not positive.
            RuntimeError: if the WAL is closed or a previous write failed unrecoverably.
            SegmentQuarantinedError: a segment is quarantined (:attr:`quarantine`); appending
                would hand out offsets that valid batches after its corruption already carry.
        """
        if record_count < 1:
            raise ValueError("nothing to append")
        if self._closed:
            raise RuntimeError(f"WAL {self.directory} is closed")
        if self._quarantine is not None:
            raise self._quarantine.append_error()
        if self._failed is not None:
            raise RuntimeError(f"WAL {self.directory} failed: {self._failed}")
        fut: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        self._queue.append(PendingAppend(self._next_offset, batch, record_count, fut))
        self._next_offset += record_count
        self._wakeup.set()
        return fut

    async def append(self, batch: bytes, record_count: int) -> tuple[int, int]:
        """Append a record batch and return ``(first_offset, last_offset)`` once durable.

        Cancelling the caller does not cancel the write.

        Raises:
            ValueError, RuntimeError: see :meth:`enqueue`.
            StorageFullError: the disk is full (nothing of the batch is kept).
            OSError: the write or ``fdatasync`` failed (nothing of the batch is kept).
        """
        return await asyncio.shield(self.enqueue(batch, record_count))

    def add_listener(self, callback: Callable[[int], None]) -> Callable[[], None]:
        """Call ``callback(durable_end)`` whenever the durable end advances; returns a remover."""
        self._listeners.append(callback)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(callback)

        return remove

    async def wait_for_offset(self, offset: int, *, timeout_s: float | None = None) -> bool:
        """Wait until ``offset`` is durable (``durable_end > offset``).

        Returns:
            True if it is, False on timeout or once the WAL is closed.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while self.durable_end <= offset and not self._closed:
            event = self._advanced
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except TimeoutError:
                return False
        return self.durable_end > offset

    def _wake_waiters(self) -> None:
        """Wake every ``await self._advanced.wait()``: a write round ended (written or failed)."""
        event, self._advanced = self._advanced, asyncio.Event()
        event.set()

    def _signal_advanced(self) -> None:
        self._wake_waiters()
        end = self.durable_end
        for cb in list(self._listeners):
            try:
                cb(end)
            except Exception:  # a listener must not break the writer
                log.exception("WAL listener failed")

    async def _writer(self) -> None:
        while True:
            if not self._queue:
                if self._closed:
                    return
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            async with self._io_lock:
                if self._roll_pending:
                    try:
                        await run_to_completion(self._finish_roll())
                    except OSError as exc:
                        self._fail_queued(exc)
                        continue
                batch = self._take_batch()
                guard = self.offset_guard
                if guard is not None and batch[-1].last_offset > guard.reserved_end:
                    try:
                        await guard.reserve_through(batch[-1].last_offset)
                    except Exception as exc:  # noqa: BLE001 - fenced or etcd down: nothing is written
                        self._refuse_queued(batch, exc)
                        continue
                await self._write_batch(batch)
                active = self._active
                if (
                    self._failed is None
                    and active is not None
                    and active.length >= self.segment_max_bytes
                    and active.end >= active.start
                ):
                    try:
                        await self._seal_locked()
                        self._seal_outage.succeeded()
                    except OSError as exc:  # keep appending to the active segment; retried next write
                        self._seal_outage.failed(exc)

    def _take_batch(self) -> list[PendingAppend]:
        """Everything queued, but no more than fits the active segment (at least one append),
        so segments stay close to ``segment_max_bytes``; the rest goes after the roll."""
        assert self._active is not None
        room = self.segment_max_bytes - self._active.length
        taken = 0
        size = 0
        for item in self._queue:
            if taken and size + len(item.data) > room:
                break
            size += len(item.data)
            taken += 1
        batch, self._queue = self._queue[:taken], self._queue[taken:]
        return batch

    async def _write_batch(self, batch: list[PendingAppend]) -> None:
        active = self._active
        assert active is not None and active.fd is not None
        fd = active.fd
        start_length = active.length

        buffers, positions, size = plan_write(batch, start_length)

        def work() -> None:
            write_all(fd, buffers)
            os.fdatasync(fd)

        try:
            if size <= self.inline_write_max_bytes:
                # A small commit is cheaper on the event loop than handed to a thread and back
                # (about 0.1 ms each way); appends arriving meanwhile join the next commit.
                work()
            else:
                await asyncio.to_thread(work)
        except BaseException as exc:
            self._fail_batch(batch, exc, fd, start_length)
            if not isinstance(exc, Exception):
                raise
            return
        self.sync_count += 1
        self.record_count += sum(item.record_count for item in batch)
        self.byte_count += size
        assert active.index is not None
        for offset, pos in positions:
            active.index.add(offset, pos)
        active.length = start_length + size
        active.end = batch[-1].last_offset
        if self._active_first_append_s is None:
            self._active_first_append_s = time.time()
        if self._storage_full:
            self._storage_full = False
            log.info("WAL %s: writes succeed again", self.directory)
            if self.storage_monitor is not None:
                self.storage_monitor.storage_available(self.directory)
        self._signal_advanced()
        for item in batch:
            if not item.future.done():
                item.future.set_result((item.first_offset, item.last_offset))

    def _fail_batch(self, batch: list[PendingAppend], exc: BaseException, fd: int, good_length: int) -> None:
        """A write failed: drop the batch and everything queued after it (their offsets were
        never acknowledged), cut the file back, and hand the offsets out again."""
        failed = batch + self._queue
        self._queue = []
        error = self._report_failure(exc, len(failed))
        assert self._active is not None
        self._next_offset = self._active.end + 1
        try:
            os.ftruncate(fd, good_length)
            os.fsync(fd)
        except OSError as trunc_exc:
            self._failed = trunc_exc
            log.error("WAL %s: cannot truncate after a failed write; WAL disabled: %s", self.directory, trunc_exc)
        for item in failed:
            if not item.future.done():
                item.future.set_exception(error)
        self._wake_waiters()  # offsets were handed back: waiters such as seal_active re-check

    def _refuse_queued(self, batch: list[PendingAppend], exc: Exception) -> None:
        """The offsets of ``batch`` could not be reserved (:attr:`offset_guard`): fail it and
        everything queued after it with ``exc``, unwritten, and hand the offsets back."""
        failed = batch + self._queue
        self._queue = []
        assert self._active is not None
        self._next_offset = self._active.end + 1
        log.warning("WAL %s: %d appends refused: offsets not reserved: %s", self.directory, len(failed), exc)
        for item in failed:
            if not item.future.done():
                item.future.set_exception(exc)
        self._wake_waiters()

    def _fail_queued(self, exc: OSError) -> None:
        """No active segment to write to: fail everything queued (nothing was written)."""
        failed, self._queue = self._queue, []
        error = self._report_failure(exc, len(failed))
        assert self._active is not None
        self._next_offset = self._active.end + 1
        for item in failed:
            if not item.future.done():
                item.future.set_exception(error)
        self._wake_waiters()

    def _report_failure(self, exc: BaseException, appends: int) -> Exception:
        """Log a failed write (a full disk once per episode) and return the error the
        appends fail with."""
        error = storage_error(exc, self.directory)
        if isinstance(error, StorageFullError):
            if not self._storage_full:
                self._storage_full = True
                log.warning(
                    "WAL %s: disk full, appends refused until space is freed (reads go on): %s",
                    self.directory, exc,
                )
                if self.storage_monitor is not None:
                    self.storage_monitor.storage_full(self.directory, error)
            return error
        log.error("WAL %s: write failed, failing %d queued appends: %s", self.directory, appends, exc)
        return error if isinstance(error, Exception) else OSError(str(error))

    @property
    def storage_full(self) -> bool:
        """Whether the last write failed for lack of space (cleared by the next good write)."""
        return self._storage_full

    # ------------------------------------------------------------------ sealing

    async def seal_active(self) -> SealedSegment | None:
        """Seal the active segment now, after every message enqueued before this call is written.

        Returns:
            The new sealed segment, or ``None`` if the active segment held no record.

        Raises:
            OSError: sync, rename or directory sync failed.
        """
        target = self._next_offset
        # Wait until every append enqueued before this call is either durable or failed: a
        # failed write hands its offsets back (``_next_offset`` drops), which ends the wait too.
        while True:
            event = self._advanced
            if self._closed or self.durable_end >= min(target, self._next_offset):
                break
            await event.wait()
        async with self._io_lock:
            return await self._seal_locked()

    async def _seal_locked(self) -> SealedSegment | None:
        """Seal the active segment; the caller holds the I/O lock.

        Cancellation-safe: once started, the seal (sync, rename, new active segment, state
        update) runs to its end even if the caller is cancelled, and the caller's
        cancellation is delivered only afterwards, so the I/O lock is never released while
        the files and the in-memory state disagree.
        """
        if self._roll_pending:
            await run_to_completion(self._finish_roll())
            return None
        active = self._active
        if active is None or active.end < active.start or active.fd is None:
            return None
        if self._quarantine is not None:  # its bytes go past the corruption: never seal them
            return None
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
        self._active_first_append_s = None
        if new_active is not None:
            self._active = new_active
            self._remember_sealed_fd(active)
        else:
            # ``_active`` stays the sealed segment (for reads and durable_end) until a new
            # active segment exists; the writer creates it before its next write.
            self._roll_pending = True
        log.info("WAL %s: sealed %s (%d bytes)", self.directory, new_path.name, active.length)
        if create_error is not None:
            log.error("WAL %s: cannot create the next active segment: %s", self.directory, create_error)
            raise create_error
        return active.info()

    async def _finish_roll(self) -> None:
        """Create the active segment that a seal could not create; the caller holds the lock."""
        sealed = self._active
        assert sealed is not None and self._roll_pending
        new_active = await asyncio.to_thread(self._create_active, sealed.end + 1)
        self._active = new_active
        self._roll_pending = False
        self._remember_sealed_fd(sealed)

    async def _age_timer(self) -> None:
        interval = min(1.0, max(0.01, self.segment_max_age_s / 4))
        while True:
            await asyncio.sleep(interval)
            first = self._active_first_append_s
            if first is None or time.time() - first < self.segment_max_age_s:
                continue
            try:
                async with self._io_lock:
                    if self._closed:
                        return
                    first = self._active_first_append_s
                    if first is not None and time.time() - first >= self.segment_max_age_s:
                        await self._seal_locked()
                        self._seal_outage.succeeded()
            except OSError as exc:
                self._seal_outage.failed(exc)

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
        if self._active is not None and not self._roll_pending:
            total += self._active.length
        return total

    async def delete_oldest_sealed(self, start_offset: int) -> int:
        """Delete the oldest sealed segment from disk (local retention).

        Only the oldest one may go, so the offsets held locally stay contiguous:
        :attr:`first_offset` becomes the next segment's start. The caller decides that the
        segment's offsets live on elsewhere (object storage) or have expired.

        Args:
            start_offset: the segment's first offset; it must be the oldest sealed segment.

        Returns:
            The bytes freed.

        Raises:
            ValueError: ``start_offset`` is not the oldest sealed segment.
            OSError: the file could not be removed (the WAL no longer serves it; the next
                open finds it again).
        """
        async with self._io_lock:
            if not self._sealed or self._sealed[0].start != start_offset:
                raise ValueError(f"WAL {self.directory}: {start_offset} is not the oldest sealed segment")
            seg = self._sealed[0]
            if seg is self._active:  # sealed, but the next active segment does not exist yet
                raise ValueError(f"WAL {self.directory}: segment {start_offset} is still the newest")
            path = seg.path
            # Drop it from the state first, in one step: from here on readers go to object
            # storage for these offsets and never open the file again.
            self._sealed.pop(0)
            self._sealed_starts.pop(0)
            if seg in self._open_sealed_fds:
                self._open_sealed_fds.remove(seg)
            if seg.fd is not None:
                os.close(seg.fd)
                seg.fd = None
            # A failed unlink leaves the file behind; recovery takes it back at the next open.
            await asyncio.to_thread(os.unlink, path)
            try:
                await asyncio.to_thread(fsync_dir, self.directory)
            except OSError as exc:  # the unlink happened; a crash may bring the name back
                log.warning("WAL %s: directory sync after deleting %s failed: %s", self.directory, path.name, exc)
            log.info("WAL %s: deleted %s (%d bytes, offsets %d..%d)", self.directory, path.name, seg.length, seg.start, seg.end)
            return seg.length

    @property
    def active_path(self) -> Path:
        """Path of the active ``.log`` segment."""
        assert self._active is not None
        return self._active.path

    # ------------------------------------------------------------------ reading

    def _remember_sealed_fd(self, seg: Segment) -> None:
        if seg in self._open_sealed_fds:
            self._open_sealed_fds.remove(seg)
        self._open_sealed_fds.append(seg)
        while len(self._open_sealed_fds) > _MAX_OPEN_SEALED_FDS:
            old = self._open_sealed_fds.pop(0)
            if old.fd is not None:
                os.close(old.fd)
                old.fd = None

    def _sealed_fd(self, seg: Segment) -> int:
        if seg.fd is None:
            seg.fd = os.open(seg.path, os.O_RDONLY)
        self._remember_sealed_fd(seg)
        return seg.fd

    def read(self, from_offset: int, max_records: int, *, max_bytes: int = 4 * 1024 * 1024) -> list[StoredBatch]:
        """Read durable batches holding ``from_offset`` and the offsets after it.

        Uses each segment's sparse index, so a read costs at most one index interval of extra
        bytes. Crosses from sealed segments into later ones as needed. The first batch may
        start before ``from_offset`` (a batch is read whole).

        Args:
            from_offset: first offset wanted; below :attr:`first_offset` reads start there.
            max_records: stop once the batches hold this many records from ``from_offset`` on.
            max_bytes: stop once this many bytes were read (at least one batch is returned if
                available).

        Returns:
            Batches with contiguous offsets (possibly none when nothing is durable yet).

        Raises:
            CorruptRecordError: a durable batch fails its CRC (disk corruption).
        """
        out: list[StoredBatch] = []
        if self._active is None or max_records <= 0:
            return out
        offset = max(from_offset, self.first_offset)
        budget = max_bytes
        records = 0
        while records < max_records and offset < self.durable_end and budget > 0:
            seg = self._segment_for(offset)
            if seg is None:
                break
            if seg is self._active:
                assert seg.fd is not None
                fd = seg.fd
            else:
                fd = self._sealed_fd(seg)
            seg.ensure_index(fd, self.index_interval_bytes)
            got, used = seg.read(fd, offset, max_records - records, budget)
            if not got:
                break
            out.extend(got)
            budget -= used
            records += got[-1].last_offset + 1 - offset
            offset = got[-1].last_offset + 1
        return out

    def _segment_for(self, offset: int) -> Segment | None:
        active = self._active
        assert active is not None
        if offset >= active.start:
            return active
        i = bisect.bisect_right(self._sealed_starts, offset) - 1
        if i < 0:
            return None
        seg = self._sealed[i]
        return seg if offset <= seg.end else None
