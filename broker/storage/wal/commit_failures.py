"""How a WAL's group commit fails: a write that failed, a write refused after it was durable,
offsets that could not be reserved, a full disk (:mod:`broker.storage.wal.group_commit`); and
who the group commit asks before it writes (:class:`OffsetGuard`) and tells about a full disk
(:class:`StorageMonitor`).

Every failure fails the appends of the write and every append queued after it, and hands their
offsets out again (none was acknowledged); a write that reached the file is cut back to the last
good byte first, synced, in a sync thread. A file that cannot be cut back disables the WAL
(:attr:`GroupCommit.failed`). A full disk (``ENOSPC``, ``EDQUOT``) becomes
:class:`~danube_pipeline.errors.StorageFullError`, logged once per episode, and the
:class:`StorageMonitor` is told.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from danube_pipeline.errors import StorageFullError
from danube_pipeline.outages import OutageLog

from broker.storage.wal.local_log import LocalLog
from broker.storage.wal.pending import EpochStart, PendingAppend, fail_items
from broker.storage.wal.sync_thread import Write, in_sync_thread
from broker.tasks import run_to_completion

log = logging.getLogger("broker.storage.wal.log")  # the WAL's log lines keep one logger name

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

    def covers(self, offset: int) -> bool:
        """Whether offsets up to ``offset`` may be written and acknowledged without
        :meth:`reserve_through` (checked before every write)."""
        ...

    async def reserve_through(self, offset: int) -> None: ...

    def refuse_ack(self, offset: int) -> Exception | None:
        """After a write up to ``offset`` is durable and before it is acknowledged: the typed
        error to fail its appends with when acknowledging is no longer allowed (fenced, or past
        the self-fencing deadline), else ``None``."""
        ...

class _Commit(Protocol):
    """What the failure handling uses of :class:`~broker.storage.wal.group_commit.GroupCommit`."""

    _local: LocalLog
    _directory: Path
    _queue: list[PendingAppend | EpochStart]
    _epoch_starts_queued: int
    _last_queued_epoch: int
    _reserve_outage: OutageLog
    _on_handed_back: Callable[[], None]
    next_offset: int
    failed: BaseException | None
    storage_full: bool
    storage_monitor: StorageMonitor | None

    @property
    def _queued_appends(self) -> int: ...

    async def _fail_batch(self, batch: list[PendingAppend], exc: BaseException, fd: int, good_length: int) -> None: ...

    async def _cut_back(self, batch: list[PendingAppend], error: Exception, fd: int, good_length: int) -> None: ...

    def _hand_back(self, batch: list[PendingAppend], error: BaseException) -> None: ...

    def _report_failure(self, exc: BaseException, appends: int) -> Exception: ...


class CommitFailures:
    """The failure handling of :class:`~broker.storage.wal.group_commit.GroupCommit` (module
    docstring); each method is called holding the WAL's I/O lock."""

    failed: BaseException | None

    @property
    def _queued_appends(self: _Commit) -> int:
        return sum(isinstance(item, PendingAppend) for item in self._queue)

    async def _after_write(self: _Commit, write: Write) -> None:
        """Cut a failed or refused ``write`` back, and everything queued after it, before
        anything else is written (the caller holds the I/O lock); nothing to do otherwise.

        Raises:
            BaseException: the write failed with one that is not an ``Exception`` (after the cut).
        """
        batch, fd, start_length = write.batch, write.fd, write.start_length
        if write.error is not None:
            await self._fail_batch(batch, write.error, fd, start_length)
            if not isinstance(write.error, Exception):
                raise write.error
        elif write.refused is not None:
            # Durable, yet this owner may no longer acknowledge: it may have been failed over,
            # and the producers resend to the new owner. A copy kept here would become a second
            # copy of what the new owner acknowledges, so it is cut off as a failed write is.
            failed = len(batch) + self._queued_appends
            self._reserve_outage.failed(
                f"{failed} appends written but not acknowledged, cut off again: {write.refused}"
            )
            await self._cut_back(batch, write.refused, fd, start_length)

    async def _fail_batch(self: _Commit, batch: list[PendingAppend], exc: BaseException, fd: int, good_length: int) -> None:
        """A write failed: drop the batch and everything queued after it (their offsets were
        never acknowledged), cut the file back, and hand the offsets out again."""
        await self._cut_back(batch, self._report_failure(exc, len(batch) + self._queued_appends), fd, good_length)

    async def _cut_back(self: _Commit, batch: list[PendingAppend], error: Exception, fd: int, good_length: int) -> None:
        """Fail ``batch`` and everything queued after it with ``error``, cut the file back to
        ``good_length`` (synced, in a sync thread), and hand their offsets out again: none was
        acknowledged. Appends queued meanwhile fail with them."""

        def truncate() -> None:
            os.ftruncate(fd, good_length)
            os.fsync(fd)

        try:
            await run_to_completion(in_sync_thread(truncate))
        except OSError as trunc_exc:
            self.failed = trunc_exc
            log.error("WAL %s: cannot truncate after a failed write; WAL disabled: %s", self._directory, trunc_exc)
        finally:
            self._hand_back(batch, error)

    def _refuse_queued(self: _Commit, batch: list[PendingAppend], exc: Exception) -> None:
        """The offsets of ``batch`` could not be reserved (:attr:`offset_guard`): fail it and
        everything queued after it with ``exc``, unwritten, and hand the offsets back."""
        self._reserve_outage.failed(f"{len(batch) + self._queued_appends} appends refused: offsets not reserved: {exc}")
        self._hand_back(batch, exc)

    def _fail_queued(self: _Commit, exc: OSError) -> None:
        """No active segment to write to: fail everything queued (nothing was written)."""
        self._hand_back([], self._report_failure(exc, self._queued_appends))

    def _hand_back(self: _Commit, batch: list[PendingAppend], error: BaseException) -> None:
        """Fail ``batch`` and every append queued after it with ``error`` and hand their offsets
        out again (none was acknowledged). Epoch starts queued by :meth:`begin_epoch` stay
        queued, moved down to the new :attr:`next_offset`; those of replica appends go with
        their batches."""
        assert self._local.active is not None
        self.next_offset = self._local.active.end + 1
        failed: list[PendingAppend] = list(batch)
        kept: list[PendingAppend | EpochStart] = []
        for item in self._queue:
            if isinstance(item, PendingAppend):
                failed.append(item)
            elif item.future is not None:
                item.start_offset = self.next_offset
                kept.append(item)
        self._queue = kept
        starts = [item for item in kept if isinstance(item, EpochStart)]  # all of kept
        self._epoch_starts_queued = len(starts)
        if starts:
            self._last_queued_epoch = starts[-1].epoch
        fail_items(failed, error)
        self._on_handed_back()  # offsets were handed back: waiters such as seal_active re-check

    def _report_failure(self: _Commit, exc: BaseException, appends: int) -> Exception:
        """Log a failed write (a full disk once per episode) and return the error the
        appends fail with."""
        error = storage_error(exc, self._directory)
        if isinstance(error, StorageFullError):
            if not self.storage_full:
                self.storage_full = True
                log.warning(
                    "WAL %s: disk full, appends refused until space is freed (reads go on): %s",
                    self._directory, exc,
                )
                if self.storage_monitor is not None:
                    self.storage_monitor.storage_full(self._directory, error)
            return error
        log.error("WAL %s: write failed, failing %d queued appends: %s", self._directory, appends, exc)
        return error if isinstance(error, Exception) else OSError(str(error))
