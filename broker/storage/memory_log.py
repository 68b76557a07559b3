"""The in-memory log of a ``NonReliable`` topic (``docs/etcd-layout.md`` §3.2).

A ``NonReliable`` topic keeps its messages only in memory, like Pulsar's non-persistent topics
(Pulsar docs, "Non-persistent topics"): a record batch is acknowledged as soon as it is in the
buffer, with no WAL write and no ``fdatasync``, and consumers are served from the buffer.

The buffer is bounded by ``max_messages`` and ``max_bytes`` (batch bytes). When an append goes
past either bound the oldest batches are evicted (drop-oldest; the newest batch always stays,
even alone above ``max_bytes``). Evicted messages that a loaded subscription had not read yet
are *dropped*: counted in :attr:`MemoryLog.dropped_messages` (shown by ``Admin.DescribeTopic``
and ``danube-admin topics describe``) and logged at most every :data:`DROP_LOG_INTERVAL_S`. A
subscription whose position was evicted jumps to the oldest message still held (counted in its
``skipped_below_retention``); messages it had handed out and not yet acknowledged below that
point are settled, and their late acknowledgements are refused.

Offsets increase monotonically as in a WAL: each batch gets the next offsets, and offsets are
reserved in etcd before they are handed out (``docs/etcd-layout.md`` §5.4, one transaction per
offset block), so a broker restarting, or another broker taking the topic over, starts past
every offset handed out before. Nothing is kept across a restart: the buffer is lost, and a
subscription's stored cursor then lies below the new first offset (it jumps, counted).

:class:`MemoryLog` is a :class:`~broker.storage.wal.WriteAheadLog` so that the topic, its subscriptions
and the admin API read it through the WAL's interface; it has no segments, nothing to seal and
nothing to tier.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Callable
from pathlib import Path

from danube_pipeline.format.batches import set_base_offset
from danube_pipeline.format.segments import StoredBatch

from broker.storage.wal import SealedSegment, WriteAheadLog

log = logging.getLogger(__name__)

DROP_LOG_INTERVAL_S = 5.0
"""Dropped messages are logged at most this often per topic, in seconds."""
_COMPACT_AT = 4096


class MemoryLog(WriteAheadLog):
    """Bounded, drop-oldest, in-memory log of one ``NonReliable`` topic.

    Args:
        name: the topic path ``/ns/topic`` (for logs).
        initial_offset: the first offset handed out.
        max_messages: the buffer's bound in messages (> 0; the broker's
            ``nonreliable_buffer_messages``, :class:`broker.config.BrokerConfig`).
        max_bytes: the buffer's bound in batch bytes (> 0; ``nonreliable_buffer_bytes``).

    Attributes:
        dropped_messages: evicted messages some loaded subscription had not read yet.
        evicted_messages: every message evicted to make room (read or not).
        read_floor: returns the lowest read position of the topic's loaded subscriptions, or
            ``None`` without any (set by the topic); decides which evictions are drops.

    Raises:
        ValueError: a bound is not positive.
    """

    def __init__(self, name: str, *, initial_offset: int, max_messages: int, max_bytes: int) -> None:
        if max_messages <= 0 or max_bytes <= 0:
            raise ValueError(f"memory log bounds must be positive, got {max_messages} messages, {max_bytes} bytes")
        super().__init__(Path(f"memory:{name}"), segment_max_bytes=max_bytes, segment_max_age_s=1.0)
        self.name = name
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self._batches: list[StoredBatch] = []
        self._bases: list[int] = []
        self._head = 0  # index of the oldest batch held
        self._held_messages = 0
        self._held_bytes = 0
        self._records_stored = 0
        self._bytes_stored = 0
        self._next_offset = initial_offset
        self._end = initial_offset  # one past the last offset stored (readable)
        self._first = initial_offset
        self._waiting: list[tuple[StoredBatch, asyncio.Future[tuple[int, int]]]] = []  # for a reservation
        self._reserver: asyncio.Task[None] | None = None
        self.dropped_messages = 0
        self.evicted_messages = 0
        self.read_floor: Callable[[], int | None] = lambda: None
        self._drops_unlogged = 0
        self._drop_logged_at = 0.0

    # ------------------------------------------------------------------ state

    @property
    def next_offset(self) -> int:
        """The offset the next appended message will get."""
        return self._next_offset

    @property
    def durable_end(self) -> int:
        """One past the last offset in the buffer (readable; nothing is durable on disk)."""
        return self._end

    @property
    def first_offset(self) -> int:
        """The oldest offset still in the buffer (:attr:`durable_end` when it is empty)."""
        return self._first

    @property
    def size_bytes(self) -> int:
        """Batch bytes held in memory."""
        return self._held_bytes

    @property
    def record_count(self) -> int:
        """Records appended since the log was created."""
        return self._records_stored

    @property
    def byte_count(self) -> int:
        """Batch bytes appended since the log was created."""
        return self._bytes_stored

    @property
    def held_messages(self) -> int:
        """Messages held in memory."""
        return self._held_messages

    def sealed_segments(self) -> list[SealedSegment]:
        """None: an in-memory log has no segment files."""
        return []

    def sealed_segment(self, start_offset: int) -> SealedSegment | None:
        """None: an in-memory log has no segment files."""
        return None

    async def seal_active(self, *, timeout_s: float | None = None) -> SealedSegment | None:
        """Nothing to seal; waits until appends waiting for an offset reservation are stored
        or refused, so the next offset is final (``timeout_s`` is unused: no high watermark)."""
        while self._reserver is not None and not self._reserver.done():
            await asyncio.shield(self._reserver)
        return None

    async def delete_oldest_sealed(self, start_offset: int) -> int:
        """Refused: an in-memory log has no sealed segment.

        Raises:
            ValueError: always.
        """
        raise ValueError(f"{self.name} is NonReliable: it has no sealed segments")

    @property
    def active_path(self) -> Path:
        """Refused: an in-memory log has no file.

        Raises:
            ValueError: always.
        """
        raise ValueError(f"{self.name} is NonReliable: it has no WAL file")

    # ------------------------------------------------------------------ appending

    def enqueue(self, batch: bytes, record_count: int) -> asyncio.Future[tuple[int, int]]:
        """Give a record batch its offsets and keep it in memory.

        The future is already resolved when the offsets lie in the block reserved in etcd
        (nearly always); otherwise it resolves once the next block is reserved.

        Args:
            batch: one batch as the producer framed it (checked by the caller).
            record_count: the records it holds.

        Returns:
            A future of ``(first_offset, last_offset)``; it fails with
            :class:`~danube_pipeline.errors.NotServedHereError` (the topic changed hands) or
            :class:`~danube_pipeline.errors.MetadataStoreError` when the offsets could not be
            reserved (nothing is kept and the offsets are handed back).

        Raises:
            ValueError: ``record_count`` is not positive.
            RuntimeError: the log is closed.
        """
        if record_count < 1:
            raise ValueError("nothing to append")
        if self._closed:
            raise RuntimeError(f"{self.name}: the in-memory log is closed")
        first = self._next_offset
        last = first + record_count - 1
        self._next_offset = last + 1
        stored = StoredBatch(first, record_count, b"".join(set_base_offset(batch, first)))
        fut: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        guard = self.offset_guard
        if self._waiting or (guard is not None and not guard.covers(last)):
            self._waiting.append((stored, fut))
            if self._reserver is None or self._reserver.done():
                self._reserver = asyncio.create_task(self._reserve(), name=f"memory-log-reserve:{self.name}")
            return fut
        self._store(stored)
        fut.set_result((first, last))
        self._signal_advanced()
        return fut

    async def _reserve(self) -> None:
        """Reserve offsets for the batches waiting, then store them in order (or refuse them
        all and hand their offsets back)."""
        guard = self.offset_guard
        while self._waiting:
            last = self._waiting[-1][0].last_offset
            try:
                if guard is not None:
                    await guard.reserve_through(last)
            except Exception as exc:  # noqa: BLE001 - every waiting append fails with it
                failed, self._waiting = self._waiting, []
                self._next_offset = failed[0][0].base_offset
                log.warning("%s: %d appends refused: offsets not reserved: %s", self.name, len(failed), exc)
                for _stored, fut in failed:
                    if not fut.done():
                        fut.set_exception(exc)
                return
            ready = [w for w in self._waiting if w[0].last_offset <= last]
            self._waiting = self._waiting[len(ready):]
            for stored, fut in ready:
                self._store(stored)
                if not fut.done():
                    fut.set_result((stored.base_offset, stored.last_offset))
            self._signal_advanced()

    def _store(self, stored: StoredBatch) -> None:
        self._batches.append(stored)
        self._bases.append(stored.base_offset)
        self._held_messages += stored.record_count
        self._held_bytes += len(stored.data)
        self._end = stored.last_offset + 1
        self._records_stored += stored.record_count
        self._bytes_stored += len(stored.data)
        if self._held_messages - stored.record_count == 0:
            self._first = stored.base_offset
        self._evict()

    def _evict(self) -> None:
        """Drop the oldest batches while the buffer is above a bound (the newest stays)."""
        dropped = 0
        floor: int | None = None
        floor_read = False
        while (self._held_messages > self.max_messages or self._held_bytes > self.max_bytes) and (
            len(self._batches) - self._head > 1
        ):
            oldest = self._batches[self._head]
            self._head += 1
            self._held_messages -= oldest.record_count
            self._held_bytes -= len(oldest.data)
            self.evicted_messages += oldest.record_count
            if not floor_read:
                floor, floor_read = self.read_floor(), True
            if floor is not None and floor <= oldest.last_offset:
                dropped += oldest.last_offset + 1 - max(oldest.base_offset, floor)
        if self._head:
            self._first = self._batches[self._head].base_offset
            if self._head >= _COMPACT_AT and self._head * 2 >= len(self._batches):
                del self._batches[: self._head]
                del self._bases[: self._head]
                self._head = 0
        if dropped:
            self._dropped(dropped)

    def _dropped(self, count: int) -> None:
        self.dropped_messages += count
        self._drops_unlogged += count
        now = time.monotonic()
        if now - self._drop_logged_at >= DROP_LOG_INTERVAL_S:
            log.warning(
                "%s: NonReliable buffer full (%d messages / %d bytes at most): %d unread messages dropped "
                "(oldest first; %d in all)",
                self.name, self.max_messages, self.max_bytes, self._drops_unlogged, self.dropped_messages,
            )
            self._drops_unlogged = 0
            self._drop_logged_at = now

    # ------------------------------------------------------------------ reading

    def read(self, from_offset: int, max_records: int, *, max_bytes: int = 4 * 1024 * 1024) -> list[StoredBatch]:
        """Batches in the buffer holding ``from_offset`` and the offsets after it.

        Args:
            from_offset: first offset wanted; below :attr:`first_offset` reads start there.
            max_records: stop once the batches hold this many records from ``from_offset`` on.
            max_bytes: stop once this many bytes were taken (at least one batch is returned).

        Returns:
            Batches with contiguous offsets, the first possibly starting before ``from_offset``
            (a batch is read whole); none when nothing is held from there on.
        """
        out: list[StoredBatch] = []
        if max_records <= 0:
            return out
        offset = max(from_offset, self._first)
        i = max(self._head, bisect.bisect_right(self._bases, offset, lo=self._head) - 1)
        records = 0
        budget = max_bytes
        while i < len(self._batches) and records < max_records and (budget > 0 or not out):
            batch = self._batches[i]
            i += 1
            if batch.last_offset < offset:
                continue
            out.append(batch)
            records += batch.last_offset + 1 - max(offset, batch.base_offset)
            budget -= len(batch.data)
        return out

    # ------------------------------------------------------------------ lifecycle

    async def close(self) -> None:
        """Forget the buffer; appends fail afterwards. Appends waiting for a reservation fail."""
        if self._closed:
            return
        self._closed = True
        if self._reserver is not None and not self._reserver.done():
            self._reserver.cancel()
        for _stored, fut in self._waiting:
            if not fut.done():
                fut.set_exception(RuntimeError(f"{self.name}: the in-memory log is closed"))
        self._waiting = []
        self._batches, self._bases, self._head = [], [], 0
        self._held_messages = self._held_bytes = 0
        self._wake_waiters()


__all__ = ["DROP_LOG_INTERVAL_S", "MemoryLog"]
