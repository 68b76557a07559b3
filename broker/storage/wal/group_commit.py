"""The group-commit writer of one topic's WAL: appends queued since the previous write go to
disk in ONE ``os.pwritev`` and ONE ``os.fdatasync``.

:meth:`GroupCommit.enqueue` takes one producer-framed record batch, assigns its offsets at once
and queues it; one write at a time takes everything queued since the previous one and writes
each batch's bytes as received, behind the base offset it was given, then syncs, and resolves
every waiting future. A producer is acknowledged only after the ``fdatasync`` that covers its batch.
No Python object is made per message.

The write and its ``fdatasync`` always run in a sync thread
(:mod:`broker.storage.wal.sync_thread`), never on the event loop: a slow disk must not stall
lease keep-alives, which an owner's self-fencing depends on. When the ``fdatasync`` returned, the
thread schedules one callback on the loop, which acknowledges the commit's appends at once
(:meth:`GroupCommit._synced`) and starts the next write (one ``pwritev`` + one ``fdatasync`` per
group, in order).

**Writes from the loop's callbacks.** The common write, appends into an active segment with
room, needs no task: an append schedules one callback at the end of its loop turn, which takes
the WAL's I/O lock (:class:`~danube_pipeline.aio.HandoffLock`, without awaiting) and submits
everything queued; the sync thread's callback settles the write, hands the lock to a seal or a
truncation waiting for it, if any, and schedules the same pass for what was queued meanwhile
(written with what comes until the end of that loop turn, as the writer task did). The writer
task does the rest,
which awaits: recording an epoch start, reserving offsets, sealing and rolling a full segment,
holding writes back for the high watermark, draining at stop; a failed write is cut back in a
task of its own. With thousands of topics each written a little, a one-message batch used to
wake its WAL's writer task twice (``benchmarks/README.md``, "Where a one-message batch's broker
time goes").

The commits that the WALs of the process
hand over in the same loop turn share one thread hand-off and one callback, and, when they are
several, one ``syncfs`` in place of their ``fdatasync`` calls (the commit rounds of
:mod:`~broker.storage.wal.sync_thread`). A failed ``fdatasync`` fails every append
of its commit, and everything queued after it, before anything else is written. Each write
also updates the segment header's *write record*
(:func:`~broker.storage.wal.segment.encode_write_record`: where this write starts and its size),
covered by the same ``fdatasync``, so recovery can tell a torn group commit from corruption
(:mod:`broker.storage.wal.recovery`).

After the ``fdatasync`` and before any future is resolved, the writer asks the
:class:`OffsetGuard` again (:meth:`OffsetGuard.refuse_ack`): an owner that went past its
self-fencing deadline during the write (:mod:`broker.cluster.ownership`) does not
acknowledge. Its appends fail with the guard's typed error (retriable), and the write is cut
off again (truncated and synced, its offsets handed back) as a failed write is: the producers
resend it, possibly to a new owner after a failover, and a copy kept here would become a second
copy of a message acknowledged there once this WAL is tiered. Only a crash between the
``fdatasync`` and the truncation leaves such a copy (at least once).

A full disk (``ENOSPC``, ``EDQUOT``) fails the appends of that write with
:class:`~danube_pipeline.errors.StorageFullError`; the file is cut back to its last good byte,
reads go on, and the next write that fits succeeds. The writer tells its
:class:`StorageMonitor` when the disk becomes full and when a write succeeds again, and logs
once per episode.

Replication (all unused unless called, ``docs/etcd-layout.md`` on topic replication): the queue
also carries :class:`~broker.storage.wal.pending.EpochStart` entries, which the writer records
in the leader-epoch cache (:mod:`broker.storage.wal.epochs`), durably, before it writes anything
queued after them (KIP-101: an epoch's start offset is known before its first batch is on
disk); and a follower's copies of the owner's batches (:meth:`GroupCommit.enqueue_replica`),
written at their own offsets through the same group commit, without the
:class:`OffsetGuard` (a follower reserves no offsets).

Every batch written to a version 3 segment (every segment the WAL creates) is preceded by its
leader epoch (:mod:`danube_pipeline.format.segments`): an append gets :attr:`GroupCommit.leader_epoch`
as it is when the append is queued, a replica batch the owner's epoch it came with. A version 2
active segment found at open is appended to in version 2 (no epochs) until it rolls. The first
append of an epoch above every epoch recorded or queued (an unreplicated topic's owner sets
its owner epoch directly, without :meth:`GroupCommit.begin_epoch`) queues that epoch's start
ahead of it, as Kafka's leader-epoch cache is assigned at append: the cache holds every epoch
the batches carry, so reopening the WAL has nothing to rebuild
(:meth:`~broker.storage.wal.epochs.LeaderEpochCache.rebuild_from_segments`), and an epoch
with no append writes no entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from danube_pipeline.aio import HandoffLock, wait_set
from danube_pipeline.format.records import EPOCH_PREFIX_SIZE
from danube_pipeline.format.segments import StoredBatch, has_epoch_prefix
from danube_pipeline.outages import OutageLog

from broker import metrics
from broker.storage.wal.commit_failures import CommitFailures, OffsetGuard, StorageMonitor
from broker.storage.wal.local_log import LocalLog
from broker.storage.wal.pending import (
    EpochStart, PendingAppend, fail_items, mark_seen, plan_write, settle_from_last, unawaited,
)
from broker.storage.wal.segment import WRITE_RECORD_AT, encode_write_record
from broker.storage.wal.sync_thread import CommitJob, Write, in_sync_thread, submit_commit, until_synced
from broker.tasks import run_to_completion

log = logging.getLogger("broker.storage.wal.log")  # the WAL's log lines keep one logger name

ROLL_HOLD_MAX_S = 2.0
"""How long a full active segment holds further writes back while the high watermark is below
its end (:meth:`GroupCommit._hold_for_roll`); past it, writes go on into the segment."""

class GroupCommit(CommitFailures):
    """The append queue of one WAL and what writes it: callbacks, else a writer task (module
    docstring).

    Args:
        local: the WAL's segments (the writer appends to the active one and seals it when full).
        io_lock: the WAL's I/O lock, held for every write and seal (by the writer task, or by
            the callbacks from the submission of a write to its settlement).
        segment_max_bytes: the active segment is sealed once it reaches this size.
        seal_outage: logs failed seals once per outage.
        on_written: called after each successful write (the durable end advanced).
        on_handed_back: called when failed appends handed their offsets back.

    Attributes:
        next_offset: the offset the next enqueued batch gets.
        leader_epoch: the epoch written before each batch :meth:`enqueue` queues (0: unknown),
            set by :meth:`begin_epoch` or by the WAL's owner directly.
        failed: the error that disabled the WAL (a file that could not be cut back), or ``None``.
        storage_full: whether the last write failed for lack of space.
        storage_monitor: told when the disk becomes full and when it takes writes again.
        offset_guard: reserves offsets before they are written, or ``None``.
        sync_count, record_count, byte_count: ``fdatasync`` calls, records and bytes written.
    """

    def __init__(
        self,
        local: LocalLog,
        *,
        io_lock: HandoffLock,
        segment_max_bytes: int,
        seal_outage: OutageLog,
        on_written: Callable[[], None],
        on_handed_back: Callable[[], None],
    ) -> None:
        self._local = local
        self._directory = local.directory
        self._io_lock = io_lock
        self.segment_max_bytes = segment_max_bytes
        self._seal_outage = seal_outage
        self._on_written = on_written
        self._on_handed_back = on_handed_back
        self.sync_count = 0
        self.record_count = 0
        self.byte_count = 0
        self.next_offset = 0
        self.leader_epoch = 0
        self._queue: list[PendingAppend | EpochStart] = []
        self._epoch_starts_queued = 0  # EpochStart entries in _queue
        self._last_queued_epoch = 0  # the epoch of the last of them (queued in rising order)
        self._roll_check = False
        self._roll_hold_since: float | None = None
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._pass_scheduled = False  # a write pass is due at the end of this loop turn (_kick)
        self._direct: Write | None = None  # the write from the loop's callbacks in flight
        self._seal_due = False  # a write from the callbacks filled the segment: the writer seals it
        self._recovery: asyncio.Task[None] | None = None  # a failed write's cut-back, from the callbacks
        self.failed: BaseException | None = None
        self.storage_full = False
        self.storage_monitor: StorageMonitor | None = None
        self.offset_guard: OffsetGuard | None = None
        self._reserve_outage = OutageLog(log, f"offset reservations for WAL {self._directory}")
        """Refused appends (offsets not reserved: fenced, lease stale, etcd down) logged once per episode."""

    def start(self) -> None:
        """Start the writer task."""
        self._task = asyncio.create_task(self._writer(), name=f"wal-writer:{self._directory}")

    async def stop(self) -> None:
        """Write everything queued, then end the writer task. A write from the loop's
        callbacks still in flight holds the I/O lock until it ends (the caller takes it next)."""
        self._stopping = True
        self._wakeup.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._recovery is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._recovery

    def enqueue(self, batch: bytes, record_count: int) -> asyncio.Future[tuple[int, int]]:
        """Give ``batch`` its offsets now and queue it (the caller checked that the WAL takes
        appends). When :attr:`leader_epoch` is above every epoch queued or recorded (an
        unreplicated topic's new owner epoch, set directly), ``(leader_epoch, first offset)``
        is queued for the epoch cache ahead of it, as :meth:`begin_epoch` queues it: recorded
        durably before the batch is written, as Kafka assigns an epoch at its first append.

        Returns:
            A future resolving to ``(first_offset, last_offset)`` once durable.
        """
        loop = asyncio.get_running_loop()
        epoch = self.leader_epoch
        if epoch and self._epoch_is_new(epoch):  # Kafka's rule: assign a new epoch at its first append
            self._queue_epoch_start(EpochStart(epoch, self.next_offset, unawaited(loop)))
        fut: asyncio.Future[tuple[int, int]] = loop.create_future()
        self._queue.append(PendingAppend(self.next_offset, batch, record_count, fut, leader_epoch=epoch))
        self.next_offset += record_count
        self._kick()
        return fut

    def _epoch_is_new(self, epoch: int) -> bool:
        """Whether ``epoch`` is above every epoch queued or recorded (O(1))."""
        latest = self.queued_epoch
        return latest is None or epoch > latest

    @property
    def queued(self) -> bool:
        """Whether appends or epoch starts wait for the writer."""
        return bool(self._queue)

    @property
    def queued_epoch(self) -> int | None:
        """The latest leader epoch once everything queued is written: the last epoch start
        queued (or being recorded), else the epoch cache's latest (``None`` when there is
        none). Counted, not found by scanning the queue: O(1) whatever the backlog."""
        if self._epoch_starts_queued:  # O(1): no scan of the backlog on the event loop
            return self._last_queued_epoch
        return self._local.epochs.latest_epoch

    def begin_epoch(self, epoch: int) -> asyncio.Future[None]:
        """Queue ``(epoch, next_offset)`` for the epoch cache: the writer records it durably
        before it writes anything queued after this call. If appends queued before it fail,
        their offsets are handed out again and the entry moves down with :attr:`next_offset`.
        :attr:`leader_epoch` becomes ``epoch`` at once: appends queued from now on carry it.

        Returns:
            A future resolving once the entry is durable (at once when ``epoch`` is already
            the latest), or failing with the error of the cache write.

        Raises:
            ValueError: ``epoch`` is below the latest epoch (queued or recorded).
        """
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        latest = self.queued_epoch
        if latest is not None and epoch <= latest:
            if epoch < latest:
                raise ValueError(f"WAL {self._directory}: leader epoch {epoch} is below the latest epoch {latest}")
            self.leader_epoch = epoch
            fut.set_result(None)
            return fut
        self.leader_epoch = epoch
        self._queue_epoch_start(EpochStart(epoch, self.next_offset, fut))
        self._wakeup.set()
        return fut

    def enqueue_replica(self, batches: Sequence[tuple[int, StoredBatch]]) -> asyncio.Future[int]:
        """Queue a follower's batches at their own offsets, each one of a new epoch behind an
        :class:`EpochStart` for it. The caller checked them against :attr:`next_offset` and
        :attr:`queued_epoch` (:func:`~broker.storage.wal.pending.check_replica_batches`).

        Returns:
            A future resolving to the offset after the last batch once every batch is durable,
            or failing with the error of the write that lost one of them.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        latest = self.queued_epoch
        last: asyncio.Future[tuple[int, int]] | None = None
        for epoch, item in batches:
            if latest is None or epoch > latest:
                self._queue_epoch_start(EpochStart(epoch, item.base_offset, None))
                latest = epoch
            last = loop.create_future()
            last.add_done_callback(mark_seen)
            self._queue.append(
                PendingAppend(item.base_offset, item.data, item.record_count, last, replica=True, leader_epoch=epoch)
            )
        assert last is not None
        end = batches[-1][1].last_offset + 1
        last.add_done_callback(lambda fut: settle_from_last(done, fut, end))
        self.next_offset = end
        self._kick()
        return done

    def _queue_epoch_start(self, start: EpochStart) -> None:  # counted for queued_epoch
        self._queue.append(start)
        self._epoch_starts_queued += 1
        self._last_queued_epoch = start.epoch

    def request_roll_check(self) -> None:
        """Have the writer seal the active segment if it is full and may roll now (the high
        watermark moved: :attr:`~broker.storage.wal.local_log.LocalLog.high_watermark`)."""
        self._roll_check = True
        self._wakeup.set()

    def _kick(self) -> None:
        """Appends were queued: write them at the end of this loop turn, with whatever else is
        queued by then. A write in flight from the callbacks takes them when it ends."""
        if self._pass_scheduled or self._direct is not None:
            return
        self._pass_scheduled = True
        asyncio.get_running_loop().call_soon(self._write_pass)

    def _write_pass(self) -> None:
        """The end-of-turn pass :meth:`_kick` queued: write what is queued from this callback
        if :meth:`_writes_direct` allows and the I/O lock is free, else wake the writer task."""
        self._pass_scheduled = False
        if self._direct is not None or not self._queue or self._try_direct():
            return
        self._wakeup.set()

    def _try_direct(self) -> bool:
        """Whether what is queued was submitted from the loop's callbacks (:meth:`_start_direct`,
        the I/O lock held until it is settled): :meth:`_writes_direct` allows it, the lock is free
        and the :class:`OffsetGuard` covers it."""
        if self._writes_direct() and self._io_lock.try_acquire():
            if self._start_direct():
                return True
            self._io_lock.release()
        return False

    def _writes_direct(self) -> bool:
        """Whether the head of the queue may be written from the loop's callbacks, without the
        writer task: appends into an active segment with room, nothing to record, seal, roll,
        hold or drain first (those wait in the writer task)."""
        active = self._local.active
        return not (
            self._stopping or self._seal_due or self.failed is not None or self._local.roll_pending
            or active is None or active.fd is None or active.length >= self.segment_max_bytes
            or isinstance(self._queue[0], EpochStart)
        )

    def _start_direct(self) -> bool:
        """Submit the write of the appends queued, from a callback holding the I/O lock; it
        ends in :meth:`_direct_synced`.

        Returns:
            Whether it was submitted: ``False`` when the :class:`OffsetGuard` must reserve
            offsets first (an await: the writer task does it), the queue unchanged.
        """
        batch, last_owned, covered = self._take_write()
        if not covered:
            self._queue[:0] = batch
            return False
        self._reserve_outage.succeeded()
        self._direct = self._submit_write(batch, last_owned, awaited=False)
        return True

    def _direct_synced(self, write: Write, error: BaseException | None) -> None:
        """On the loop, once the sync thread returned a write from the callbacks: settle it
        (:meth:`_synced`), release the I/O lock (to whoever waits for it), and have what was
        queued meanwhile written by a pass at the end of this loop turn, or the writer task woken
        when it is needed. A failed or refused write is cut back in a task of its own, which
        releases the lock."""
        self._synced(write, error)
        if write.error is not None or write.refused is not None:
            self._recovery = asyncio.create_task(self._recover_direct(write), name=f"wal-recovery:{self._directory}")
            return
        self._direct = None
        active = self._local.active
        if active is not None and active.length >= self.segment_max_bytes:
            self._seal_due = True
        self._io_lock.release()  # to a seal or truncation waiting for it, if any
        if self._seal_due or self._roll_check or self._stopping:
            self._wakeup.set()
        elif self._queue:
            self._kick()  # written at the end of this loop turn, with what comes meanwhile

    async def _recover_direct(self, write: Write) -> None:
        """Cut back a failed or refused write from the callbacks (:meth:`_after_write`), then
        release the I/O lock it held and hand what is queued to the writer task."""
        try:
            await self._after_write(write)
        finally:
            self._direct = None
            self._io_lock.release()
            self._wakeup.set()

    async def _writer(self) -> None:
        while True:
            if self._seal_due:  # a write from the callbacks filled the segment
                self._seal_due = False
                async with self._io_lock:
                    await self._seal_if_full()
                continue
            if not self._queue:
                if self._stopping:
                    return
                if self._roll_check:
                    self._roll_check = False
                    async with self._io_lock:
                        await self._seal_if_full()
                    continue
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            if self._direct is None and self._try_direct():  # back to writes from the callbacks
                continue
            if self._direct is not None:  # the callbacks write; they wake this task when it is needed
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            if await self._hold_for_roll():
                continue
            async with self._io_lock:
                if not self._queue:  # written from the callbacks while this task waited for the lock
                    continue
                if self._local.roll_pending:
                    try:
                        await run_to_completion(self._local.finish_roll())
                    except OSError as exc:
                        self._fail_queued(exc)
                        continue
                head = self._queue[0]
                if isinstance(head, EpochStart):
                    await self._record_epoch(head)
                    continue
                batch, last_owned, covered = self._take_write()
                guard = self.offset_guard
                if not covered and guard is not None and last_owned is not None:
                    try:
                        await guard.reserve_through(last_owned)
                    except Exception as exc:  # noqa: BLE001 - fenced or etcd down: nothing is written
                        self._refuse_queued(batch, exc)
                        continue
                self._reserve_outage.succeeded()
                await self._write_batch(batch, last_owned)
                await self._seal_if_full()

    async def _hold_for_roll(self) -> bool:
        """Hold the queued writes back while the active segment is full and the high watermark
        is below its end (a replicated topic: it may not be sealed yet), until the watermark
        passes it and it is sealed, at most :data:`ROLL_HOLD_MAX_S` per segment. Without the
        hold, a steady stream of writes would keep some offset of the active segment above the
        watermark, and it would never roll (nor be tiered). Costs one replication round trip
        per segment.

        Returns:
            Whether it waited (the caller looks at the queue again).
        """
        active = self._local.active
        high_watermark = self._local.high_watermark
        if (
            high_watermark is None or active is None or active.is_empty
            or active.length < self.segment_max_bytes or active.end < high_watermark
        ):
            self._roll_hold_since = None
            return False
        now = time.monotonic()
        if self._roll_hold_since is None:
            self._roll_hold_since = now
        left = self._roll_hold_since + ROLL_HOLD_MAX_S - now
        if left <= 0:
            return False
        self._wakeup.clear()
        await wait_set(self._wakeup, left)
        if self._roll_check:
            self._roll_check = False
            async with self._io_lock:
                await self._seal_if_full()
        return True

    async def _seal_if_full(self) -> None:
        """Seal the active segment once it reached ``segment_max_bytes`` (the caller holds the
        I/O lock). :meth:`LocalLog.seal` leaves it active while the high watermark is below its
        end; :meth:`request_roll_check` comes back when the watermark moves."""
        active = self._local.active
        if self.failed is None and active is not None and active.length >= self.segment_max_bytes and not active.is_empty:
            try:
                await self._local.seal()
                self._seal_outage.succeeded()
            except OSError as exc:  # keep appending to the active segment; retried next write
                self._seal_outage.failed(exc)

    async def _record_epoch(self, start: EpochStart) -> None:
        """Record the epoch start at the head of the queue in the epoch cache, durably, in the
        sync thread (the caller holds the I/O lock). If that fails, nothing queued after it may
        be written: everything queued fails with the error."""
        self._queue.pop(0)  # still counted in queued_epoch until it is in the cache
        epochs = self._local.epochs
        try:
            await run_to_completion(in_sync_thread(lambda: epochs.assign(start.epoch, start.start_offset)))
        except (OSError, ValueError) as exc:
            log.error("WAL %s: cannot record leader epoch %d: %s", self._directory, start.epoch, exc)
            failed, self._queue = [start, *self._queue], []
            self._epoch_starts_queued = 0
            assert self._local.active is not None
            self.next_offset = self._local.active.end + 1
            fail_items(failed, exc)
        except BaseException:
            self._epoch_starts_queued -= 1
            raise
        else:
            self._epoch_starts_queued -= 1
            if start.future is not None and not start.future.done():
                start.future.set_result(None)
        self._on_handed_back()  # waiters (truncate_to) re-check the queue

    def _take_write(self) -> tuple[list[PendingAppend], int | None, bool]:
        """The next write (:meth:`_take_batch`), the last offset of it the owner assigned
        (``None``: replica batches only), and whether the :class:`OffsetGuard` covers it
        without a reservation."""
        batch = self._take_batch()
        last_owned = next((item.last_offset for item in reversed(batch) if not item.replica), None)
        guard = self.offset_guard
        return batch, last_owned, guard is None or last_owned is None or guard.covers(last_owned)

    def _take_batch(self) -> list[PendingAppend]:
        """The appends queued up to the first epoch start, but no more than fits the active
        segment (at least one append), so segments stay close to ``segment_max_bytes``; the
        rest goes after the roll. While the high watermark holds the roll back, up to
        ``segment_max_bytes`` per write, so the group commit keeps its groups."""
        assert self._local.active is not None
        room = self.segment_max_bytes - self._local.active.length
        if room <= 0 and self._local.high_watermark is not None:
            room = self.segment_max_bytes
        prefix = EPOCH_PREFIX_SIZE if has_epoch_prefix(self._local.active.format_version) else 0
        batch: list[PendingAppend] = []
        size = 0
        for item in self._queue:
            if isinstance(item, EpochStart) or (batch and size + prefix + len(item.data) > room):
                break
            size += prefix + len(item.data)
            batch.append(item)
        del self._queue[: len(batch)]  # no copy of the backlog per commit
        return batch

    async def _write_batch(self, batch: list[PendingAppend], last_owned: int | None) -> None:
        """Write ``batch`` and ``fdatasync`` it in a sync thread; its appends are acknowledged
        from the one loop callback the thread schedules when the sync returned
        (:meth:`_synced`), before this task resumes. A failed or refused write is cut back
        here, before anything queued after it is written."""
        write = self._submit_write(batch, last_owned, awaited=True)
        await until_synced(write)
        await self._after_write(write)

    def _submit_write(self, batch: list[PendingAppend], last_owned: int | None, *, awaited: bool) -> Write:
        """Hand the write of ``batch`` to this loop turn's commit round (the caller holds the
        I/O lock). Its outcome is settled on the loop by :meth:`_synced` (``awaited``: the
        writer task waits for :attr:`Write.waiter`), else by :meth:`_direct_synced`."""
        active = self._local.active
        assert active is not None and active.fd is not None
        fd = active.fd
        start_length = active.length

        buffers, positions, size = plan_write(batch, start_length, epoch_prefix=has_epoch_prefix(active.format_version))
        waiter = asyncio.get_running_loop().create_future() if awaited else None
        write = Write(batch, positions, fd, start_length, size, last_owned, waiter)
        settle = self._synced if awaited else self._direct_synced
        # Never on the event loop (module docstring), in this loop turn's commit round
        # (sync_thread.py: one fdatasync, or one syncfs for the round's WALs). The commit's state
        # follows the file even if the writer task is cancelled meanwhile: it is settled on the
        # loop either way.
        pending = encode_write_record(start_length, size, synced=False)  # made durable with the write
        synced = encode_write_record(start_length, size, synced=True)  # durable with the next sync (or writeback)
        submit_commit(
            CommitJob(fd, pending, WRITE_RECORD_AT, buffers, start_length, synced, lambda error: settle(write, error))
        )
        return write

    def _synced(self, write: Write, error: BaseException | None) -> None:
        """On the loop, once the sync thread's write of ``write`` returned (``error``: how it
        failed): unless it failed or the :class:`OffsetGuard` refuses the acknowledgement now,
        advance the segment and resolve every append's future; then wake the writer task."""
        try:
            if error is not None:
                write.error = error
                return
            guard = self.offset_guard
            if guard is not None and write.last_owned is not None:
                write.refused = guard.refuse_ack(write.last_owned)
                if write.refused is not None:
                    return
            self._committed(write)
        except BaseException as exc:  # noqa: BLE001 - the writer task fails the batch
            write.error = exc
        finally:
            write.finished = True
            if write.waiter is not None and not write.waiter.done():
                write.waiter.set_result(None)

    def _committed(self, write: Write) -> None:
        """The write is durable and may be acknowledged: count it, advance the active
        segment (index, length, end), tell the WAL, resolve the appends' futures."""
        batch = write.batch
        active = self._local.active
        assert active is not None and active.index is not None
        self.sync_count += 1
        self.record_count += sum(item.record_count for item in batch)
        self.byte_count += write.size
        metrics.active().wal.written(batch, write.size)
        for offset, pos in write.positions:
            active.index.add(offset, pos)
        active.length = write.start_length + write.size
        active.end = batch[-1].last_offset
        if self._local.active_first_append_s is None:
            self._local.active_first_append_s = time.time()
        if self.storage_full:
            self.storage_full = False
            log.info("WAL %s: writes succeed again", self._directory)
            if self.storage_monitor is not None:
                self.storage_monitor.storage_available(self._directory)
        self._on_written()
        for item in batch:
            if not item.future.done():
                item.future.set_result((item.first_offset, item.last_offset))
