"""A subscription and its dispatch to consumers: Exclusive, Shared and Failover
(``docs/etcd-layout.md`` §3.4).

One :class:`Subscription` per ``(topic, subscription name)`` holds the delivery state:

* ``read_position``: the next WAL offset never handed to any consumer;
* ``unacked``: offsets handed to a consumer and not yet acknowledged;
* ``redeliver``: offsets taken back from a consumer that left, to hand out again with
  ``redelivery_count + 1``;
* the ack floor: the first offset not yet acknowledged. The persisted cursor is the *last
  acknowledged offset* below which everything is acknowledged (§3.5): ``ack_floor - 1``.

One dispatcher task per subscription moves messages from the WAL (and the redelivery set) into
per-consumer queues, respecting each consumer's ``receiver_queue_size`` permits: Exclusive and
Failover hand everything to the active (first) consumer; Shared hands messages out round-robin.
A consumer's ``Receive`` stream drains its queue in batches (:mod:`broker.consumer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable

from danube_pipeline.errors import SubscriptionBusyError
from danube_pipeline.modes import SubscriptionType
from danube_pipeline.records import Record

from broker.consumer import DEFAULT_RECEIVER_QUEUE_SIZE, MAX_BATCH_MESSAGES, Consumer, Delivery
from broker.wal import WriteAheadLog

log = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 30.0
"""A consumer that opens no Receive stream within this time after Subscribe is removed."""
_MAX_READ_PER_ROUND = 500


class Subscription:
    """Delivery state of one subscription on one topic.

    Args:
        topic: the topic path ``/ns/topic`` (for logs and errors).
        name: the subscription name.
        subscription_type: Exclusive, Shared or Failover.
        wal: the topic's WAL to read from.
        start_offset: the first offset to deliver (cursor + 1, or by initial position).
        persisted_cursor: the cursor value already stored in etcd, or ``None``.
        persist_cursor: coroutine storing a cursor value (the last acknowledged offset).
        cursor_flush_acks: persist after this many acks (§3.5: 1000).
        on_active_change: called with the new active consumer (or ``None``) when the active
            consumer leaves (the caller records the first consumer itself).
    """

    def __init__(
        self,
        *,
        topic: str,
        name: str,
        subscription_type: SubscriptionType,
        wal: WriteAheadLog,
        start_offset: int,
        persisted_cursor: int | None,
        persist_cursor: Callable[[int], Awaitable[None]],
        cursor_flush_acks: int = 1000,
        on_active_change: Callable[[Consumer | None], None] | None = None,
    ) -> None:
        self.topic = topic
        self.name = name
        self.type = subscription_type
        self.wal = wal
        # Offsets below the WAL's first offset are not held locally (e.g. a stored cursor
        # older than the WAL start after a topic move): start at the first one held.
        start_offset = max(start_offset, wal.first_offset)
        self.read_position = start_offset
        self.ack_floor = start_offset
        self.acked: set[int] = set()
        self.unacked: dict[int, tuple[Consumer, int]] = {}
        self.redeliver: dict[int, int] = {}
        self.consumers: list[Consumer] = []
        self.cursor_flush_acks = cursor_flush_acks
        self._persisted_cursor = persisted_cursor
        self._persist_cursor = persist_cursor
        self._on_active_change = on_active_change
        self._acks_since_flush = 0
        self._flush_lock = asyncio.Lock()
        self._flush_task: asyncio.Task[None] | None = None
        self._rr = 0
        self._wake = asyncio.Event()
        self._closed = False
        self._remove_listener = wal.add_listener(lambda _end: self._wake.set())
        self._task = asyncio.create_task(self._run(), name=f"dispatch:{topic}:{name}")

    # ------------------------------------------------------------------ consumers

    @property
    def cursor(self) -> int | None:
        """The last acknowledged offset with everything below it acknowledged, or ``None``."""
        return self.ack_floor - 1 if self.ack_floor > 0 else None

    @property
    def active_consumer(self) -> Consumer | None:
        """Exclusive/Failover: the consumer receiving messages; Shared: the first consumer."""
        return self.consumers[0] if self.consumers else None

    def add_consumer(
        self, consumer_id: int, name: str, subscription_type: SubscriptionType, receiver_queue_size: int
    ) -> Consumer:
        """Attach a new consumer.

        Raises:
            SubscriptionBusyError: Exclusive subscription already has a consumer, or consumers
                are attached with a different subscription type.
        """
        if self.consumers and subscription_type != self.type:
            raise SubscriptionBusyError(
                self.name, f"it is {self.type.name} with consumers attached, not {subscription_type.name}"
            )
        if self.type == SubscriptionType.EXCLUSIVE and self.consumers:
            raise SubscriptionBusyError(self.name, "an Exclusive subscription allows one consumer")
        self.type = subscription_type
        consumer = Consumer(consumer_id, name, self, receiver_queue_size or DEFAULT_RECEIVER_QUEUE_SIZE)
        self.consumers.append(consumer)
        asyncio.get_running_loop().call_later(ATTACH_TIMEOUT_S, self._expire_unattached, consumer)
        self._wake.set()
        return consumer

    def _expire_unattached(self, consumer: Consumer) -> None:
        if not consumer.attached and not consumer.closed:
            self.remove_consumer(consumer, reason=f"no Receive stream within {ATTACH_TIMEOUT_S:.0f}s")

    def consumer_attached(self, consumer: Consumer) -> None:
        """A consumer opened its Receive stream: dispatch to it."""
        self._wake.set()

    def remove_consumer(self, consumer: Consumer, *, reason: str) -> None:
        """Detach ``consumer``; its unacknowledged messages go back for redelivery.

        Messages it was sent get ``redelivery_count + 1``; messages still queued but never sent
        keep their count. Idempotent.
        """
        if consumer.closed:
            return
        was_active = self.active_consumer is consumer
        consumer.closed = True
        consumer.wake()
        queued = {d.record.offset for d in consumer.queue}
        for offset in consumer.outstanding:
            entry = self.unacked.pop(offset, None)
            if entry is None:
                continue
            count = entry[1]
            self.redeliver[offset] = count if offset in queued else count + 1
        consumer.outstanding.clear()
        consumer.queue.clear()
        with contextlib.suppress(ValueError):
            self.consumers.remove(consumer)
        log.info(
            "%s/%s: consumer %d left (%s); %d messages to redeliver",
            self.topic, self.name, consumer.id, reason, len(self.redeliver),
        )
        if was_active and self._on_active_change is not None:
            self._on_active_change(self.active_consumer)
        self._wake.set()

    # ------------------------------------------------------------------ acks

    def ack(self, offsets: Iterable[int]) -> None:
        """Mark ``offsets`` acknowledged (by any consumer of the subscription) and advance the
        ack floor; schedules a cursor write every ``cursor_flush_acks`` acks."""
        n = 0
        for offset in offsets:
            n += 1
            entry = self.unacked.pop(offset, None)
            if entry is not None:
                entry[0].outstanding.discard(offset)
            self.redeliver.pop(offset, None)
            if self.ack_floor <= offset < self.read_position:
                self.acked.add(offset)
        while self.ack_floor in self.acked:
            self.acked.discard(self.ack_floor)
            self.ack_floor += 1
        self._acks_since_flush += n
        if self._acks_since_flush >= self.cursor_flush_acks and (self._flush_task is None or self._flush_task.done()):
            self._flush_task = asyncio.create_task(self.flush_cursor())
        self._wake.set()

    @property
    def cursor_dirty(self) -> bool:
        """Whether the in-memory cursor differs from the stored one."""
        return self.cursor is not None and self.cursor != self._persisted_cursor

    async def flush_cursor(self) -> None:
        """Store the cursor if it changed since the last write.

        Raises:
            MetadataStoreError: etcd refused or could not be reached (retried next flush).
        """
        async with self._flush_lock:
            cursor = self.cursor
            if cursor is None or cursor == self._persisted_cursor:
                return
            self._acks_since_flush = 0
            await self._persist_cursor(cursor)
            self._persisted_cursor = cursor

    # ------------------------------------------------------------------ dispatching

    def _eligible(self) -> list[Consumer]:
        if self.type == SubscriptionType.SHARED:
            return [c for c in self.consumers if c.attached and not c.closed]
        active = self.active_consumer
        return [active] if active is not None and active.attached and not active.closed else []

    def _pick(self, eligible: list[Consumer]) -> Consumer | None:
        for _ in range(len(eligible)):
            consumer = eligible[self._rr % len(eligible)]
            self._rr += 1
            if consumer.permits > 0:
                return consumer
        return None

    def _hand_out(self, consumer: Consumer, record: Record, count: int) -> None:
        self.unacked[record.offset] = (consumer, count)
        consumer.push(Delivery(record, count))

    def _skip_below(self, offset: int) -> None:
        """Offsets below ``offset`` can never be delivered: move the read position and the ack
        floor up to it and forget every delivery state below it."""
        if self.read_position < offset:
            self.read_position = offset
        if self.ack_floor >= offset:
            return
        log.warning(
            "%s/%s: offsets %d..%d are no longer available; the cursor skips them",
            self.topic, self.name, self.ack_floor, offset - 1,
        )
        self.ack_floor = offset
        self.acked = {o for o in self.acked if o >= offset}
        for o in [o for o in self.unacked if o < offset]:
            consumer, _ = self.unacked.pop(o)
            consumer.outstanding.discard(o)
        for o in [o for o in self.redeliver if o < offset]:
            del self.redeliver[o]
        while self.ack_floor in self.acked:
            self.acked.discard(self.ack_floor)
            self.ack_floor += 1

    def _dispatch_once(self) -> bool:
        first = self.wal.first_offset
        if self.ack_floor < first or self.read_position < first:
            self._skip_below(first)
        eligible = self._eligible()
        if not eligible or sum(max(c.permits, 0) for c in eligible) <= 0:
            return False
        moved = 0
        if self.redeliver:
            offsets = sorted(self.redeliver)
            i = 0
            while i < len(offsets) and moved < _MAX_READ_PER_ROUND:
                j = i
                while j + 1 < len(offsets) and offsets[j + 1] == offsets[j] + 1 and j - i < MAX_BATCH_MESSAGES:
                    j += 1
                records = self.wal.read(offsets[i], j - i + 1)
                if not records:  # no longer available locally
                    for off in offsets[i : j + 1]:
                        self.redeliver.pop(off, None)
                for record in records:
                    consumer = self._pick(eligible)
                    if consumer is None:
                        return moved > 0
                    count = self.redeliver.pop(record.offset, None)
                    if count is None:
                        continue
                    self._hand_out(consumer, record, count)
                    moved += 1
                i = j + 1
        permits = sum(max(c.permits, 0) for c in eligible)
        if permits > 0 and self.read_position < self.wal.durable_end:
            records = self.wal.read(self.read_position, min(permits, _MAX_READ_PER_ROUND))
            if records and records[0].offset > self.read_position:  # a gap in the WAL
                self._skip_below(records[0].offset)
            for record in records:
                consumer = self._pick(eligible)
                if consumer is None:
                    break
                self._hand_out(consumer, record, 0)
                self.read_position = record.offset + 1
                moved += 1
        return moved > 0

    async def _run(self) -> None:
        while not self._closed:
            self._wake.clear()
            try:
                progressed = self._dispatch_once()
            except Exception:
                log.exception("%s/%s: dispatch failed; retrying", self.topic, self.name)
                await asyncio.sleep(1.0)
                continue
            if progressed:
                await asyncio.sleep(0)
            else:
                await self._wake.wait()

    async def close(self) -> None:
        """Stop dispatching, end every consumer's stream, and store the cursor."""
        if self._closed:
            return
        self._closed = True
        self._remove_listener()
        for consumer in list(self.consumers):
            self.remove_consumer(consumer, reason="subscription closed")
        self._wake.set()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self._flush_task is not None:
            with contextlib.suppress(Exception):
                await self._flush_task
        await self.flush_cursor()
