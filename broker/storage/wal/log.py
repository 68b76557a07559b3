"""The per-topic write-ahead log: append with group commit, seal, read.

A topic's WAL is a directory of segment files (:mod:`broker.storage.wal.segment`): sealed, immutable
``{start:020d}-{end:020d}.dnb1`` files and one active ``{start:020d}.log``; offsets are
contiguous across them. :mod:`broker.storage.wal.recovery` brings the directory back at open,
:mod:`broker.storage.wal.local_log` holds the segments (roll, read, delete), and
:mod:`broker.storage.wal.group_commit` writes the appends: everything queued since the previous
write in ONE ``os.pwritev`` and ONE ``os.fdatasync``, in a worker thread; a producer is
acknowledged only after the ``fdatasync`` that covers its batch. :class:`WriteAheadLog` is the facade over them.

A full disk (``ENOSPC``, ``EDQUOT``) fails the appends of that write with
:class:`~danube_pipeline.errors.StorageFullError`; the file is cut back to its last good byte,
reads go on, and the next write that fits succeeds. The WAL tells its
:class:`~broker.storage.wal.commit_failures.StorageMonitor` when it becomes full and when a write
succeeds again, and logs once per episode.

For topic replication the facade also records leader epochs, appends a follower's copies of
the owner's batches, caps reads and rolls at the high watermark and truncates
(:mod:`broker.storage.wal.replica_log`); none of it is used unless called.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from danube_pipeline.aio import HandoffLock, wait_set
from danube_pipeline.outages import OutageLog
from danube_pipeline.format.segments import StoredBatch

from broker.storage.wal.abandoned import AbandonedRange
from broker.storage.wal.commit_failures import OffsetGuard, StorageMonitor
from broker.storage.wal.group_commit import GroupCommit
from broker.storage.wal.local_log import LocalLog
from broker.storage.wal.recovery import Quarantine
from broker.storage.wal.replica_log import ReplicaLogMixin
from broker.storage.wal.segment import DEFAULT_INDEX_INTERVAL_BYTES, SealedSegment

log = logging.getLogger(__name__)


class WriteAheadLog(ReplicaLogMixin):
    """Durable, append-only log of one topic, made of ``dnb1`` segment files.

    Open it with :meth:`open` and close it with :meth:`close`. ``sync_count``,
    ``record_count`` and ``byte_count`` count the ``fdatasync`` calls, the records and the
    record-batch bytes written since it was opened. The replication side (leader epochs,
    replica appends, high watermark, truncation) is :class:`~broker.storage.wal.replica_log.ReplicaLogMixin`.
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
        self._local = LocalLog(directory, index_interval_bytes=index_interval_bytes)
        self._advanced = asyncio.Event()
        self._io_lock = HandoffLock()
        self._timer_task: asyncio.Task[None] | None = None
        self._seals_after: asyncio.Event | None = None
        self._closed = False
        self._listeners: list[Callable[[int], None]] = []
        self._seal_outage = OutageLog(log, f"sealing WAL segments in {directory}")
        self._commit = GroupCommit(
            self._local, io_lock=self._io_lock, segment_max_bytes=segment_max_bytes, seal_outage=self._seal_outage,
            on_written=self._signal_advanced, on_handed_back=self._wake_waiters,
        )

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
        seals_after: asyncio.Event | None = None,
    ) -> WriteAheadLog:
        """Open (or create) the WAL in ``directory``, recovering its files.

        Recovery follows :mod:`broker.storage.wal.recovery`: a torn tail of the active segment
        (nothing valid after the first bad batch, or the rest of a group commit torn by a power
        cut) is truncated (and logged), and appends continue at the last good offset + 1;
        corruption followed by valid batches, or a damaged header that cannot be rebuilt,
        quarantines the segment (:attr:`quarantine`): reads stop before it and appends are
        refused until an operator runs ``python -m broker.storage.wal.repair``. Appends never
        reuse an offset recorded as abandoned (:attr:`abandoned`).

        Args:
            directory: the topic's WAL directory, created if missing.
            segment_max_bytes: the active segment is sealed once it reaches this size.
            segment_max_age_s: a non-empty active segment is sealed once its first record is
                this old.
            initial_offset: the first offset when the WAL holds no record at all
                (``docs/etcd-layout.md`` §5.3: ``last_committed_offset + 1`` after a topic move).
            index_interval_bytes: spacing of the sparse read index.
            seals_after: seals by age wait until this event is set (the broker sets it once
                the topics assigned to it at start are loaded, :meth:`Broker.start`); seals by
                size do not wait.

        Raises:
            CorruptRecordError: a sealed segment's name or header is unusable, the newest one
                holds fewer records than its name says, or the active segment overlaps the
                sealed ones with records beyond them (the same offsets would exist twice).
            ValueError: ``abandoned.json`` or ``leader-epochs.json`` is not valid
                (:mod:`broker.storage.wal.abandoned`, :mod:`broker.storage.wal.epochs`).
            OSError: the directory or files cannot be read or written.
        """
        wal = cls(
            Path(directory),
            segment_max_bytes=segment_max_bytes,
            segment_max_age_s=segment_max_age_s,
            index_interval_bytes=index_interval_bytes,
        )
        wal._seals_after = seals_after
        wal._commit.next_offset = await asyncio.to_thread(wal._local.load, initial_offset)
        wal._commit.start()
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
        await self._commit.stop()
        async with self._io_lock:
            await self._local.close()
        self._advanced.set()

    # ------------------------------------------------------------------ appending

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (appends fail from then on)."""
        return self._closed

    @property
    def next_offset(self) -> int:
        """The offset the next enqueued message will get."""
        return self._commit.next_offset

    @property
    def durable_end(self) -> int:
        """One past the last durable offset: every offset below it is on disk and readable."""
        return self._local.durable_end

    @property
    def first_offset(self) -> int:
        """The lowest offset still held locally (the first segment's start)."""
        return self._local.first_offset

    @property
    def quarantine(self) -> Quarantine | None:
        """The segment recovery quarantined (corruption in the middle, valid batches after it;
        :mod:`broker.storage.wal.recovery`), or ``None``. While set, reads serve offsets up to its last
        good offset and appends are refused; ``python -m broker.storage.wal.repair`` lifts it offline."""
        return self._local.quarantine

    @property
    def abandoned(self) -> list[AbandonedRange]:
        """Offset ranges handed out once and lost for good, recorded in the WAL directory
        (:mod:`broker.storage.wal.abandoned`); never handed out again. Reads step over them."""
        return list(self._local.abandoned)

    @property
    def abandoned_offset_count(self) -> int:
        """How many offsets :attr:`abandoned` holds."""
        return sum(rng.offset_count for rng in self._local.abandoned)

    @property
    def sync_count(self) -> int:
        """``fdatasync`` calls since the WAL was opened (writes and seals)."""
        return self._commit.sync_count + self._local.sync_count

    @property
    def record_count(self) -> int:
        """Records written since the WAL was opened."""
        return self._commit.record_count

    @property
    def byte_count(self) -> int:
        """Record-batch bytes written since the WAL was opened."""
        return self._commit.byte_count

    @property
    def storage_monitor(self) -> StorageMonitor | None:
        """Told when the disk becomes full and when it takes writes again."""
        return self._commit.storage_monitor

    @storage_monitor.setter
    def storage_monitor(self, monitor: StorageMonitor | None) -> None:
        self._commit.storage_monitor = monitor

    @property
    def offset_guard(self) -> OffsetGuard | None:
        """Reserves offsets before the WAL writes them (checked before every write), or ``None``."""
        return self._commit.offset_guard

    @offset_guard.setter
    def offset_guard(self, guard: OffsetGuard | None) -> None:
        self._commit.offset_guard = guard

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
        self._check_writable()
        return self._commit.enqueue(batch, record_count)

    def _check_writable(self) -> None:
        """Raise unless the WAL takes writes (see :meth:`enqueue`)."""
        if self._closed:
            raise RuntimeError(f"WAL {self.directory} is closed")
        quarantine = self._local.quarantine
        if quarantine is not None:
            raise quarantine.append_error()
        if self._commit.failed is not None:
            raise RuntimeError(f"WAL {self.directory} failed: {self._commit.failed}")

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
            if not await wait_set(event, remaining):
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

    @property
    def storage_full(self) -> bool:
        """Whether the last write failed for lack of space (cleared by the next good write)."""
        return self._commit.storage_full

    # ------------------------------------------------------------------ sealing

    async def seal_active(self, *, timeout_s: float | None = None) -> SealedSegment | None:
        """Seal the active segment now, after every message enqueued before this call is written.

        While a :attr:`high_watermark` is set, a segment is sealed only once the watermark
        reached its end (:attr:`~broker.storage.wal.local_log.LocalLog.high_watermark`): the
        seal waits for it, at most ``timeout_s`` seconds (``None``: without limit).

        Returns:
            The new sealed segment, or ``None`` if the active segment held no record (or the
            WAL was closed meanwhile).

        Raises:
            TimeoutError: the high watermark stayed below the end for ``timeout_s``.
            OSError: sync, rename or directory sync failed.
        """
        target = self._commit.next_offset
        # Wait until every append enqueued before this call is either durable or failed: a
        # failed write hands its offsets back (``next_offset`` drops), which ends the wait too.
        while True:
            event = self._advanced
            if self._closed or self.durable_end >= min(target, self._commit.next_offset):
                break
            await event.wait()
        await self._wait_for_high_watermark(timeout_s)
        async with self._io_lock:
            return await self._local.seal()

    async def _age_timer(self) -> None:
        """Seal the active segment once its first record is ``segment_max_age_s`` old.

        An idle WAL's timer sleeps until the active segment gets a record, then until it is
        due: a broker with thousands of idle topics wakes none of them. A seal that failed or
        was held (the high watermark below the segment) is retried every quarter of the age,
        at most every second. A seal that is due waits for the ``seals_after`` event of
        :meth:`open`: a broker loading thousands of topics whose segments are all due spends
        its start on making them available, not on sealing them.
        """
        retry_s = min(1.0, max(0.01, self.segment_max_age_s / 4))
        while True:
            first = self._local.active_first_append_s
            if first is None:
                await self._local.first_append.wait()
                continue
            due_s = first + self.segment_max_age_s - time.time()
            if due_s > 0:
                await asyncio.sleep(due_s)
                continue
            if self._seals_after is not None and not self._seals_after.is_set():
                await self._seals_after.wait()
                continue
            try:
                async with self._io_lock:
                    if self._closed:
                        return
                    first = self._local.active_first_append_s
                    if first is not None and time.time() - first >= self.segment_max_age_s:
                        await self._local.seal()
                        self._seal_outage.succeeded()
            except OSError as exc:
                self._seal_outage.failed(exc)
            await asyncio.sleep(retry_s)

    def sealed_segments(self) -> list[SealedSegment]:
        """Every sealed segment, ascending by start offset."""
        return self._local.sealed_segments()

    def sealed_segment(self, start_offset: int) -> SealedSegment | None:
        """The sealed segment starting at ``start_offset``, or ``None``."""
        return self._local.sealed_segment(start_offset)

    @property
    def size_bytes(self) -> int:
        """Bytes of every segment file on disk, sealed and active (headers included)."""
        return self._local.size_bytes

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
            return await self._local.delete_oldest_sealed(start_offset)

    @property
    def active_path(self) -> Path:
        """Path of the active ``.log`` segment."""
        return self._local.active_path

    # ------------------------------------------------------------------ reading

    def close_read_files(self) -> None:
        """Close the sealed segments' files that reads opened, after a read that will not be
        repeated soon (the producer state rebuilt at load): a broker of 10,000 topics would
        otherwise hold one more file per topic. A later read opens them again."""
        self._local.close_read_files()

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

        While a :attr:`high_watermark` is set, only whole batches below it are returned
        (consumers never see an offset the in-sync replicas do not all hold).

        Returns:
            Batches with contiguous offsets (possibly none when nothing is durable yet).

        Raises:
            CorruptRecordError: a durable batch fails its CRC (disk corruption).
        """
        high_watermark = self._local.high_watermark
        if high_watermark is None:
            return self._local.read(from_offset, max_records, max_bytes=max_bytes)
        if from_offset >= high_watermark:
            return []
        got = self._local.read(from_offset, max_records, max_bytes=max_bytes)
        return [batch for batch in got if batch.last_offset < high_watermark]
