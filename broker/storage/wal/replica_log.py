"""The replication side of a topic's WAL: leader epochs, a follower's appends at the owner's
offsets, reads for followers, the high watermark, and truncation (Kafka's ``UnifiedLog``
methods for the same, KIP-101 and KIP-279).

Everything here is unused unless called: a WAL that never calls these methods writes, rolls
and reads exactly as without them, and writes no epoch file.

* :attr:`ReplicaLogMixin.leader_epoch`: the epoch written before every batch appended from
  now on (segment format version 3, :mod:`danube_pipeline.format.segments`); 0 (unknown)
  until set, directly (an unreplicated topic's owner epoch, recorded in the cache by the first
  append after) or by :meth:`begin_epoch`.
* :meth:`ReplicaLogMixin.begin_epoch`: the owner records ``(epoch, next offset)`` in the
  leader-epoch cache (:mod:`broker.storage.wal.epochs`) at takeover, durably, before any
  later append is written.
* :meth:`ReplicaLogMixin.append_replica`: a follower appends the owner's stored batches at
  their own base offsets, through the same group commit; a batch of a new epoch records that
  epoch first.
* :meth:`ReplicaLogMixin.read_for_replication`: the owner serves ``(epoch, batch)`` pairs to
  followers, up to its durable end.
* :meth:`ReplicaLogMixin.set_high_watermark`: while set, :meth:`WriteAheadLog.read` (what
  subscriptions read) stops below it, and segments are sealed only once every offset they
  hold is below it, so sealed segments never hold offsets that a truncation could remove.
* :meth:`ReplicaLogMixin.truncate_to`: a follower removes the batches the owner does not hold
  (only ever from the active segment).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from danube_pipeline.aio import HandoffLock, wait_set
from danube_pipeline.errors import LogTruncationError
from danube_pipeline.format.segments import StoredBatch

from broker.storage.wal.epochs import LeaderEpochCache
from broker.storage.wal.group_commit import GroupCommit
from broker.storage.wal.local_log import LocalLog
from broker.storage.wal.pending import check_replica_batches

log = logging.getLogger("broker.storage.wal.log")  # the WAL's log lines keep one logger name


class _Wal(Protocol):
    """What the mixin uses of :class:`~broker.storage.wal.log.WriteAheadLog`."""

    directory: Path
    _local: LocalLog
    _commit: GroupCommit
    _io_lock: HandoffLock
    _advanced: asyncio.Event

    @property
    def closed(self) -> bool: ...

    def _check_writable(self) -> None: ...

    def _signal_advanced(self) -> None: ...

    def _wake_waiters(self) -> None: ...


class ReplicaLogMixin:
    """The replication methods of :class:`~broker.storage.wal.log.WriteAheadLog` (module
    docstring)."""

    @property
    def epochs(self: _Wal) -> LeaderEpochCache:
        """The leader-epoch cache, loaded at open (entries above the log end dropped)."""
        return self._local.epochs

    @property
    def leader_epoch(self: _Wal) -> int:
        """The leader epoch stored before each batch :meth:`append` queues from now on (a
        version 3 segment's entry, :mod:`danube_pipeline.format.segments`); 0 = unknown, the
        default. :meth:`begin_epoch` sets it; an unreplicated topic's owner sets it directly
        to its owner epoch, which the first append after that records in the epoch cache
        (:meth:`~broker.storage.wal.group_commit.GroupCommit.enqueue`). A batch keeps the
        epoch it was queued with."""
        return self._commit.leader_epoch

    @leader_epoch.setter
    def leader_epoch(self: _Wal, epoch: int) -> None:
        if epoch < 0:
            raise ValueError(f"leader epoch {epoch} is negative")
        self._commit.leader_epoch = epoch

    @property
    def latest_epoch(self: _Wal) -> int | None:
        """The latest leader epoch recorded, or ``None``."""
        return self._local.epochs.latest_epoch

    async def begin_epoch(self: _Wal, epoch: int) -> None:
        """Record that leader epoch ``epoch`` starts at :attr:`next_offset`, durably, before any
        append made after this call is written (KIP-101: the owner calls it at takeover,
        before it appends), and makes it :attr:`leader_epoch` at once (the epoch written
        before every batch appended after this call). A no-op for the cache when ``epoch`` is
        already the latest. The entry goes
        through the writer's queue: appends queued before the call land before it (and if
        they fail, the entry moves down to the offset handed out again).

        Cancelling the caller does not cancel the entry.

        Raises:
            ValueError: ``epoch`` is negative or below the latest epoch.
            RuntimeError, SegmentQuarantinedError: the WAL takes no writes (see :meth:`enqueue`).
            OSError: the epoch cache could not be written (every append queued after the
                entry fails with it too).
        """
        if epoch < 0:
            raise ValueError(f"leader epoch {epoch} is negative")
        self._check_writable()
        await asyncio.shield(self._commit.begin_epoch(epoch))

    def append_replica(self: _Wal, batches: Sequence[tuple[int, bytes]]) -> asyncio.Future[int]:
        """Append the owner's stored batches at their own base offsets (a follower's copy).

        Everything is checked before anything is queued: each batch's length, magic and
        CRC32C, that the first starts at :attr:`next_offset` and the rest follow without a gap,
        and that epochs never go down. A batch whose epoch is above the latest has
        ``(epoch, base_offset)`` recorded in the epoch cache, durably, before its bytes are
        written. The write goes through the group commit (one ``pwritev`` + one
        ``fdatasync`` with whatever else is queued), without the offset guard (a follower
        reserves no offsets); segments roll as usual.

        Args:
            batches: ``(leader_epoch, batch)`` pairs, each batch as stored (base offset set),
                as :meth:`read_for_replication` returns them on the owner.

        Returns:
            A future resolving to the new durable end (the offset after the last batch) once
            the ``fdatasync`` covering every batch returned, or failing with the error of the
            write (``StorageFullError``, ``OSError``; batches of an earlier write of the same
            call may be durable then: :attr:`durable_end` says how far).

        Raises:
            ValueError: ``batches`` is empty, or an epoch goes down.
            OffsetRangeError: a batch does not start where the log (or the batch before it) ends.
            CorruptRecordError: a batch is torn, corrupt or not exactly one batch.
            RuntimeError, SegmentQuarantinedError: the WAL takes no writes (see :meth:`enqueue`).
        """
        if not batches:
            raise ValueError("nothing to append")
        self._check_writable()
        checked = check_replica_batches(
            batches, self._commit.next_offset, self._commit.queued_epoch, f"WAL {self.directory}"
        )
        return self._commit.enqueue_replica(checked)

    def read_for_replication(self: _Wal, from_offset: int, max_bytes: int) -> list[tuple[int, StoredBatch]]:
        """The durable batches from ``from_offset`` on, for a follower, with their leader epochs.

        Ignores the high watermark (followers fetch what the owner holds). Reads sealed and
        active segments alike; below :attr:`first_offset` the read starts there (the caller
        compares the first base offset with what it asked for).

        Args:
            from_offset: the follower's next offset; the first batch is the one holding it.
            max_bytes: stop once this many bytes were read (at least one batch is returned if
                any is durable).

        Returns:
            ``(epoch, batch)`` pairs: the batch's own epoch in a version 3 segment
            (:attr:`StoredBatch.leader_epoch`), else (0 there, or a version 1/2 segment) the
            epoch of the cache entry whose range holds the batch, 0 when none does (batches
            written before epochs were recorded).

        Raises:
            CorruptRecordError, SegmentUnreadableError: see :meth:`read`.
        """
        epochs = self._local.epochs
        out: list[tuple[int, StoredBatch]] = []
        for batch in self._local.read(from_offset, sys.maxsize, max_bytes=max_bytes):
            epoch = batch.leader_epoch or epochs.epoch_at(batch.base_offset)
            out.append((0 if epoch is None else epoch, batch))
        return out

    @property
    def high_watermark(self: _Wal) -> int | None:
        """The offset below which every in-sync replica holds the log, or ``None`` (no cap,
        the default): :meth:`read` stops below it and segments roll only below it."""
        return self._local.high_watermark

    @property
    def readable_end(self: _Wal) -> int:
        """One past the last offset :meth:`read` serves: :attr:`durable_end`, capped by
        :attr:`high_watermark`."""
        end = self._local.durable_end
        high_watermark = self._local.high_watermark
        return end if high_watermark is None else min(end, high_watermark)

    def set_high_watermark(self: _Wal, high_watermark: int | None) -> None:
        """Set (or with ``None`` lift) the read and roll limit (:attr:`high_watermark`).

        Raising it (or lifting it) wakes what a durable write wakes (``wait_for_offset``,
        :meth:`seal_active`, and the listeners of :meth:`add_listener`, so subscriptions read
        the newly readable batches) and lets the writer seal an active segment that grew past
        ``segment_max_bytes`` meanwhile (an aged one is sealed by the age timer's next round).
        Lowering it wakes nobody. A value above :attr:`durable_end` is allowed (a follower may
        learn the owner's watermark before it holds that far); reads still end at the durable end.

        Raises:
            ValueError: ``high_watermark`` is negative.
        """
        if high_watermark is not None and high_watermark < 0:
            raise ValueError(f"high watermark {high_watermark} is negative")
        old = self._local.high_watermark
        self._local.high_watermark = high_watermark
        if old is not None and (high_watermark is None or high_watermark > old):
            self._commit.request_roll_check()
            self._signal_advanced()

    async def truncate_to(self: _Wal, end_offset: int) -> None:
        """Remove every batch at or above ``end_offset``: it becomes the next offset (KIP-101's
        truncation by leader epoch; Kafka's ``UnifiedLog.truncateTo``).

        Batches are removed whole: when ``end_offset`` falls inside a batch, that batch goes
        too and the next offset becomes its base offset. Only the active segment is ever cut
        (:attr:`high_watermark` keeps segments above it active); an offset at or past the
        next offset removes no batch. Waits for a write in progress; refuses while appends
        are queued. The epoch cache drops the epochs starting at or above the new end (or at
        or above ``end_offset`` when no batch was removed: an epoch this WAL began as owner
        but never wrote to goes too, as Kafka's ``truncateTo`` does), a high watermark above
        the new end comes down to it, and the WAL reopens cleanly and appends continue at the
        new end.

        Raises:
            ValueError: ``end_offset`` is negative.
            LogTruncationError: appends are queued, a sealed segment holds offsets at or
                above ``end_offset``, it lies below the active segment otherwise, or a segment
                is quarantined; nothing changed.
            CorruptRecordError: the active segment does not scan; nothing changed.
            RuntimeError: the WAL is closed or failed.
            OSError: the cut or the epoch cache write failed: the WAL takes no more writes
                (reopen it; recovery brings the files back).
        """
        if end_offset < 0:
            raise ValueError(f"cannot truncate at negative offset {end_offset}")
        self._check_writable()
        queued = LogTruncationError(str(self.directory), end_offset, "appends are queued; truncate when none is pending")
        if self._commit.queued:
            raise queued
        async with self._io_lock:  # a write in progress finishes first
            if self._commit.queued:
                raise queued
            try:
                next_offset = await self._local.truncate(end_offset)
            except OSError as exc:
                self._commit.failed = exc
                log.error("WAL %s: truncation at %d failed; WAL disabled until reopened: %s",
                          self.directory, end_offset, exc)
                raise
            self._commit.next_offset = next_offset
            high_watermark = self._local.high_watermark
            if high_watermark is not None and high_watermark > next_offset:
                self._local.high_watermark = next_offset
        self._wake_waiters()

    async def _wait_for_high_watermark(self: _Wal, timeout_s: float | None) -> None:
        """Wait until no offset held is at or above the high watermark (a seal may proceed),
        the watermark is lifted, or the WAL is closed.

        Raises:
            TimeoutError: still not after ``timeout_s`` seconds.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            high_watermark = self._local.high_watermark
            if self.closed or high_watermark is None or high_watermark >= self._local.durable_end:
                return
            event = self._advanced
            remaining = None if deadline is None else deadline - loop.time()
            if (remaining is not None and remaining <= 0) or not await wait_set(event, remaining):
                raise TimeoutError(
                    f"WAL {self.directory}: the high watermark {high_watermark} stayed below the end "
                    f"{self._local.durable_end} for {timeout_s} s; the active segment is not sealed"
                ) from None
