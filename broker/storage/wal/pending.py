"""Batches accepted for appending and not yet written: what one group commit writes, and the
helpers that settle their futures."""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from danube_pipeline.errors import CorruptRecordError, OffsetRangeError
from danube_pipeline.format.batches import set_base_offset
from danube_pipeline.format.records import EPOCH_PREFIX_SIZE
from danube_pipeline.format.segments import StoredBatch, scan_batches

from broker.tasks import copy_outcome

_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
_EPOCH = struct.Struct("<Q")  # the leader epoch of a version 3 entry


@dataclass(slots=True)
class PendingAppend:
    """One record batch waiting for the next group commit.

    Attributes:
        first_offset: the base offset the WAL assigned.
        data: the batch as the producer framed it (base offset field still 0).
        record_count: records in the batch.
        future: resolved with ``(first_offset, last_offset)`` after the ``fdatasync``.
        replica: a follower's copy of the owner's batch
            (:meth:`~broker.storage.wal.log.WriteAheadLog.append_replica`): its offsets are
            the owner's, not reserved here.
        leader_epoch: the leader epoch written before the batch in a version 3 segment (the
            WAL's :attr:`~broker.storage.wal.log.WriteAheadLog.leader_epoch` when it was
            queued, or the owner's epoch of a replica batch).
    """

    first_offset: int
    data: bytes
    record_count: int
    future: asyncio.Future[tuple[int, int]]
    replica: bool = False
    leader_epoch: int = 0

    @property
    def last_offset(self) -> int:
        """The batch's last offset."""
        return self.first_offset + self.record_count - 1


@dataclass(slots=True)
class EpochStart:
    """A leader epoch to record in the epoch cache (:mod:`broker.storage.wal.epochs`) before
    anything queued after it is written.

    Attributes:
        epoch: the leader epoch.
        start_offset: its first offset (the next offset when it was queued).
        future: resolved once the entry is durable; ``None`` for an entry a replica append
            queued (its batches' futures report the outcome).
    """

    epoch: int
    start_offset: int
    future: asyncio.Future[None] | None


def check_replica_batches(
    batches: Sequence[tuple[int, bytes]], next_offset: int, latest_epoch: int | None, where: str
) -> list[tuple[int, StoredBatch]]:
    """Check the ``(epoch, stored batch)`` pairs a follower is about to append.

    Each must be exactly one whole batch whose length, magic and CRC32C hold
    (:func:`~danube_pipeline.format.segments.scan_batches`); the first must start at
    ``next_offset`` and the rest follow without a gap; epochs never go down.

    Returns:
        ``(epoch, batch)`` for each.

    Raises:
        CorruptRecordError: a batch is torn, corrupt, empty or more than one batch.
        OffsetRangeError: a batch does not start where the previous one (or the log) ends.
        ValueError: an epoch is below ``latest_epoch`` or the epoch before it.
    """
    out: list[tuple[int, StoredBatch]] = []
    expected = next_offset
    floor = -1 if latest_epoch is None else latest_epoch
    for i, (epoch, data) in enumerate(batches):
        scan = scan_batches(data, start_position=0, keep_positions=True)
        if scan.error is not None or len(scan.positions) != 1 or scan.valid_length != len(data):
            raise CorruptRecordError(f"{where}: replica batch {i}", scan.valid_length, scan.error or "not one batch")
        assert scan.first_offset is not None and scan.last_offset is not None
        if scan.first_offset != expected:
            raise OffsetRangeError(expected, scan.first_offset, f"{where}: replica batch {i}")
        if epoch < floor:
            raise ValueError(f"{where}: replica batch {i} has leader epoch {epoch}, below epoch {floor}")
        out.append((epoch, StoredBatch(expected, scan.record_count, data)))
        floor = epoch
        expected = scan.last_offset + 1
    return out


def plan_write(
    pending: Sequence[PendingAppend], start_position: int, *, epoch_prefix: bool = False
) -> tuple[list[bytes | memoryview], list[tuple[int, int]], int]:
    """The buffers to write for ``pending`` and where each batch lands.

    Each batch becomes two buffers, its base offset and the rest of its bytes (unchanged), so
    nothing is copied before the write; with ``epoch_prefix`` (a version 3 segment,
    :mod:`danube_pipeline.format.segments`) its 8-byte leader epoch comes first.

    Returns:
        ``(buffers, positions, size_bytes)``: ``positions`` is each batch's
        ``(base_offset, byte_position)``, the position of its epoch with ``epoch_prefix``.
    """
    buffers: list[bytes | memoryview] = []
    positions: list[tuple[int, int]] = []
    pos = start_position
    for item in pending:
        if epoch_prefix:
            buffers.append(_EPOCH.pack(item.leader_epoch))
        buffers.extend(set_base_offset(item.data, item.first_offset))
        positions.append((item.first_offset, pos))
        pos += len(item.data) + (EPOCH_PREFIX_SIZE if epoch_prefix else 0)
    return buffers, positions, pos - start_position


def write_all(fd: int, buffers: Sequence[bytes | memoryview], position: int) -> None:
    """``os.pwritev`` every buffer from byte ``position`` on, continuing after partial writes
    and in chunks of at most ``IOV_MAX`` buffers.

    Raises:
        OSError: the write failed (e.g. ``ENOSPC``).
    """
    views = [memoryview(b) for b in buffers if len(b)]
    i = 0
    while i < len(views):
        written = os.pwritev(fd, views[i : i + _IOV_MAX], position)
        position += written
        while written:
            size = len(views[i])
            if written >= size:
                written -= size
                i += 1
            else:
                views[i] = views[i][written:]
                written = 0


def fail_items(items: Sequence[PendingAppend | EpochStart], error: BaseException) -> None:
    """Fail the futures of ``items`` not yet done with ``error`` (a replica's epoch start has none)."""
    for item in items:
        fut = item.future
        if fut is not None and not fut.done():
            fut.set_exception(error)


def unawaited(loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
    """The future of an epoch start that
    :meth:`~broker.storage.wal.group_commit.GroupCommit.enqueue` queued: nobody awaits it (the
    appends queued after it report a failed record), so its outcome is marked as seen. Unlike
    a replica's epoch start (no future), it stays queued, moved down, when earlier appends
    fail and hand their offsets back (``GroupCommit._hand_back``)."""
    fut: asyncio.Future[None] = loop.create_future()
    fut.add_done_callback(mark_seen)
    return fut


def mark_seen(fut: asyncio.Future[Any]) -> None:
    """Mark an outcome nobody awaits as seen: a replica batch's
    (:meth:`~broker.storage.wal.group_commit.GroupCommit.enqueue_replica` reports it through
    its last batch) or an epoch start's (:func:`unawaited`)."""
    if not fut.cancelled():
        fut.exception()


def settle_from_last(done: asyncio.Future[int], last: asyncio.Future[tuple[int, int]], end: int) -> None:
    """Resolve a replica append's future from its last batch's: ``end`` or the error."""
    copy_outcome(last, done, lambda _offsets: end)
