"""A subscription and its dispatch to consumers: Exclusive, Shared, Failover and Key_Shared
(``docs/etcd-layout.md`` §3.4), with negative acks, ack timeouts, redelivery counts and the
dead-letter topic.

Dispatch moves stored record batches, as Pulsar dispatches batched entries: a batch, or the
part of it that goes to one consumer, travels whole and the consumer splits it (the records it
does not carry are listed as skipped); acknowledgements are per offset. One
:class:`Subscription` per ``(topic, subscription name)`` holds the delivery state:

* ``read_position``: the next offset never handed to any consumer
  (:mod:`broker.dispatch.read_position`);
* ``handouts``: every batch read and not fully acknowledged (a
  :class:`~broker.dispatch.consumer.Handout` each): each of its unacknowledged offsets is held by one
  consumer (a :class:`~broker.dispatch.consumer.Hold`) or waits for (re)delivery, with its redelivery
  count (:mod:`broker.dispatch.handouts`);
* the ack floor: the first offset not yet acknowledged. The persisted cursor is the *last
  offset at or below which everything is acknowledged* (§3.5): ``ack_floor - 1``;
* ``consumers``: the consumers attached, the first one active for Exclusive and Failover
  (:mod:`broker.dispatch.consumer_set`).

One dispatcher task per subscription (:mod:`broker.dispatch.dispatcher`) reads batches from the
WAL (and re-reads the batches to redeliver) and hands them to consumers while they have room in
their ``receiver_queue_size`` window (:mod:`broker.dispatch.policy`): Exclusive and Failover hand
everything to the active (first) consumer; Shared hands batches out round-robin; Key_Shared hands
each offset to the consumer owning its sticky key's hash range, keeping per-key order
(:mod:`broker.dispatch.key_shared`).

Redelivery (:mod:`broker.dispatch.redelivery`, Pulsar's semantics): an offset goes back to waiting when
its consumer leaves, nacks it (after the subscription's nack delay, doubling with each
redelivery up to a cap) or holds it unacknowledged past the ack timeout; an offset its consumer
had been sent counts one more redelivery. Waiting offsets are redelivered first, in offset
order. An offset that would be redelivered more than ``max_redeliveries`` times is published to
the dead-letter topic and then acknowledged (:mod:`broker.dispatch.dead_letter_topic`). Redelivery counts
live in memory: a broker restart starts them again at 0 (as Pulsar's do).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable

from danube_pipeline.errors import InvalidAckError, PositionBelowRetentionError
from danube_pipeline.metadata.values import TableSnapshot
from danube_pipeline.modes import SubscriptionType

from broker import metrics
from broker.dispatch.consumer import DEFAULT_MAX_BUFFER_BYTES, Consumer, Handout
from broker.dispatch.consumer_set import ConsumerSet
from broker.dispatch.cursor import CursorWriter
from broker.dispatch.dead_letter_topic import DeadLetterPublisher
from broker.dispatch.dispatcher import Dispatcher
from broker.dispatch.handouts import HandoutLedger
from broker.dispatch.key_shared import AutoSplitHashRanges
from broker.dispatch.read_position import BELOW_RETENTION_EARLIEST, UNAVAILABLE_WAIT, ReadPosition
from broker.dispatch.redelivery import RedeliverySettings
from broker.storage.remote import RemoteLog
from broker.storage.wal import WriteAheadLog

log = logging.getLogger(__name__)


class Subscription:
    """Delivery state of one subscription on one topic.

    Args:
        topic: the topic path ``/ns/topic`` (for logs and errors).
        name: the subscription name.
        subscription_type: Exclusive, Shared, Failover or Key_Shared.
        wal: the topic's WAL to read from.
        start_offset: the first offset to deliver (cursor + 1, or by initial position).
        persisted_cursor: the cursor value already stored in etcd, or ``None``.
        persist_cursor: coroutine storing a cursor value (the last acknowledged offset).
        cursor_flush_acks: persist after this many acks (§3.5: 1000).
        on_active_change: called with the new active consumer (or ``None``) when the active
            consumer leaves (the caller records the first consumer itself).
        on_idle: called with this subscription when its last consumer leaves.
        remote: the topic's offsets in object storage, read when the position is below the
            WAL's first offset; ``None`` without an object store.
        below_retention: what happens when the position falls below the earliest retained
            offset: ``"earliest"`` jumps there (logged, counted in
            ``skipped_below_retention``), ``"error"`` ends every consumer's stream (and refuses
            new ones) with :class:`~danube_pipeline.errors.PositionBelowRetentionError`.
        unavailable_range: at an unavailable range (``docs/etcd-layout.md`` §5.5) not in object
            storage: ``"wait"`` until it is tiered, or ``"skip"`` it (counted in
            ``skipped_unavailable``); an abandoned range is always skipped.
        settings: the redelivery settings (nack delay, ack timeout, dead-letter topic).
        dead_letter_publisher: appends a batch to a dead-letter topic
            (:data:`~broker.dispatch.dead_letter_topic.DeadLetterPublisher`); ``None``: messages past
            ``max_redeliveries`` wait (logged) until one is set.
        table_snapshot: the stored table snapshot (``docs/etcd-layout.md`` §3.5.1), or ``None``.
        persist_table_snapshot: coroutine storing a table snapshot beside the cursor, with the
            cursor's writes; ``None``: never stored.

    Attributes:
        ledger: the batches handed out and their acknowledgements
            (:class:`~broker.dispatch.handouts.HandoutLedger`).
        position: the read position and its counters
            (:class:`~broker.dispatch.read_position.ReadPosition`).
        hash_ranges: Key_Shared: the consumers' hash ranges.
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
        on_idle: Callable[[Subscription], None] | None = None,
        remote: RemoteLog | None = None,
        below_retention: str = BELOW_RETENTION_EARLIEST,
        unavailable_range: str = UNAVAILABLE_WAIT,
        settings: RedeliverySettings | None = None,
        dead_letter_publisher: DeadLetterPublisher | None = None,
        table_snapshot: TableSnapshot | None = None,
        persist_table_snapshot: Callable[[TableSnapshot], Awaitable[None]] | None = None,
    ) -> None:
        self.topic = topic
        self.name = name
        self.type = subscription_type
        self.wal = wal
        self.remote = remote
        self.ledger = HandoutLedger()
        self.position = ReadPosition(
            topic=topic, name=name, wal=wal, remote=remote, ledger=self.ledger, start_offset=start_offset,
            below_retention=below_retention, unavailable_range=unavailable_range, table_snapshot=table_snapshot,
        )
        self._stored_table_snapshot = table_snapshot
        self._persist_table_snapshot = persist_table_snapshot
        self.settings = settings or RedeliverySettings()
        self.dead_letter_publisher = dead_letter_publisher
        self._cursor = CursorWriter(
            topic=topic, name=name, cursor=lambda: self.cursor, persisted_cursor=persisted_cursor,
            persist_cursor=persist_cursor, cursor_flush_acks=cursor_flush_acks,
        )
        self.hash_ranges = AutoSplitHashRanges()
        self._consumers = ConsumerSet(
            self, wake=lambda: self._dispatcher.wake(), on_active_change=on_active_change, on_idle=on_idle
        )
        self._closed = False
        self.metrics = metrics.active().subscription(topic, name)  # bound once
        self._dispatcher = Dispatcher(self)
        self.position.wake = self._dispatcher.wake
        self._remove_listener = wal.add_listener(lambda _end: self._dispatcher.wake())
        self._remove_remote_listener = (
            remote.add_listener(self._dispatcher.wake) if remote is not None else (lambda: None)
        )
        earliest = self.earliest_offset
        if self.read_position < earliest:  # e.g. a stored cursor whose offsets expired
            self.position.below_retention(earliest, self.consumers)
        self._dispatcher.start()

    def configure(self, settings: RedeliverySettings) -> None:
        """Apply new redelivery settings (waiting offsets keep the time they were given)."""
        self.settings = settings
        self._dispatcher.wake()

    # ------------------------------------------------------------------ state

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (an unloaded subscription: a new instance owns the
        cursor)."""
        return self._closed

    @property
    def read_position(self) -> int:
        """The next offset never handed to any consumer."""
        return self.position.offset

    @property
    def handouts(self) -> dict[int, Handout]:
        """Every batch read and not fully acknowledged, by base offset."""
        return self.ledger.handouts

    @property
    def records_from_object_storage(self) -> int:
        """Records handed out from object storage."""
        return self.position.records_from_object_storage

    @property
    def records_from_table(self) -> int:
        """Records handed out from the topic's Iceberg table (part of :attr:`records_from_object_storage`)."""
        return self.position.records_from_table

    @property
    def skipped_below_retention(self) -> int:
        """Offsets jumped over because they expired."""
        return self.position.skipped_below_retention

    @property
    def skipped_unavailable(self) -> int:
        """Offsets of unavailable ranges skipped (policy or abandoned)."""
        return self.position.skipped_unavailable

    @property
    def position_error(self) -> PositionBelowRetentionError | None:
        """Set once the position fell below retention in ``"error"`` mode."""
        return self.position.position_error

    @property
    def redelivered(self) -> int:
        """Offsets taken back from a consumer they were sent to (nack, ack timeout, consumer
        left)."""
        return self.ledger.redelivered

    @property
    def dead_lettered(self) -> int:
        """Offsets published to the dead-letter topic and acknowledged here."""
        return self._dispatcher.dead_lettered

    @property
    def earliest_offset(self) -> int:
        """The earliest offset this subscription can read
        (:func:`~broker.dispatch.read_position.earliest_offset`)."""
        return self.position.earliest_offset

    @property
    def ack_floor(self) -> int:
        """The first offset not acknowledged."""
        return self.ledger.ack_floor(self.position.offset)

    @property
    def cursor(self) -> int | None:
        """The last acknowledged offset with everything below it acknowledged, or ``None``."""
        floor = self.ack_floor
        return floor - 1 if floor > 0 else None

    @property
    def waiting_redelivery(self) -> list[Handout]:
        """Batches with offsets waiting for redelivery, in offset order."""
        return self.ledger.waiting_redelivery

    # ------------------------------------------------------------------ consumers

    @property
    def consumers(self) -> list[Consumer]:
        """The consumers attached, in the order they joined
        (:class:`~broker.dispatch.consumer_set.ConsumerSet`)."""
        return self._consumers.consumers

    @property
    def active_consumer(self) -> Consumer | None:
        """Exclusive/Failover: the consumer receiving messages; Shared and Key_Shared: the
        first consumer."""
        return self._consumers.active

    @property
    def idle_s(self) -> float:
        """Seconds since the last consumer left; 0 while a consumer is attached."""
        return self._consumers.idle_s

    def add_consumer(
        self,
        consumer_id: int,
        name: str,
        subscription_type: SubscriptionType,
        receiver_queue_size: int,
        *,
        max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
    ) -> Consumer:
        """Attach a new consumer with a window of ``receiver_queue_size`` messages and at most
        ``max_buffer_bytes`` of batches queued for its stream. A Key_Shared consumer gets its
        hash range when its stream opens.

        Raises:
            SubscriptionBusyError: Exclusive subscription already has a consumer, or consumers
                are attached with a different subscription type.
            PositionBelowRetentionError: the position fell below retention in ``"error"`` mode.
        """
        return self._consumers.add(
            consumer_id, name, subscription_type, receiver_queue_size, max_buffer_bytes=max_buffer_bytes
        )

    def consumer_attached(self, consumer: Consumer) -> None:
        """A consumer opened its Receive stream: dispatch to it (Key_Shared: it takes the
        upper half of the largest hash range)."""
        self._consumers.attached(consumer)

    def consumer_has_room(self, consumer: Consumer) -> None:
        """A consumer's stream took batches from its full buffer: dispatch to it again."""
        self._dispatcher.wake()

    def consumer_sent(self, consumer: Consumer) -> None:
        """A consumer's stream sent batches: their ack timeout runs from now."""
        if self.settings.ack_timeout_ms:
            self._dispatcher.wake()

    def remove_consumer(self, consumer: Consumer, *, reason: str) -> None:
        """Detach ``consumer``; the offsets it holds go back for redelivery at once.

        An offset its stream sent gets ``redelivery_count + 1``; one still queued keeps its
        count. Key_Shared: its hash ranges go to its neighbours. Idempotent.
        """
        self._consumers.remove(consumer, reason=reason)

    # ------------------------------------------------------------------ acks

    def ack(self, offsets: Iterable[int], *, consumer: Consumer | None = None) -> None:
        """Acknowledge single offsets (see :meth:`ack_ranges`)."""
        self.ack_ranges([(o, o) for o in offsets], consumer=consumer)

    def check_ack(self, consumer: Consumer, ranges: list[tuple[int, int]]) -> None:
        """Check that ``consumer`` may acknowledge (or nack) every offset of the inclusive
        ``(first, last)`` ranges: each was sent to it (its stream sent it), it still holds it,
        it is not acknowledged yet, and no offset appears twice in ``ranges``.

        Raises:
            InvalidAckError: for the first refused run of offsets, with its reason.
        """
        if consumer.closed or consumer.subscription is not self or self._closed:
            first = min((f for f, _ in ranges), default=0)
            last = max((la for _, la in ranges), default=0)
            raise InvalidAckError(consumer.id, first, last, "the consumer is closed")
        self.ledger.check(consumer, ranges, self.position.offset)

    def ack_ranges(self, ranges: Iterable[tuple[int, int]], *, consumer: Consumer | None = None) -> None:
        """Acknowledge every offset of the inclusive ``(first, last)`` ranges; schedules a
        cursor write every ``cursor_flush_acks`` acks.

        With ``consumer`` (every ``Ack`` request), the ack is checked first
        (:meth:`check_ack`) and refused whole if any offset is not the consumer's to
        acknowledge. Without it (internal use), offsets not handed out or already acknowledged
        are ignored, and so is every ack once the subscription is closed (unloaded: a new
        instance owns the cursor).

        Raises:
            InvalidAckError: ``consumer`` may not acknowledge an offset; nothing was acknowledged.
        """
        ranges = list(ranges)
        if consumer is not None:
            self.check_ack(consumer, ranges)
        if self._closed:
            return
        self._cursor.acked(self.ledger.ack(ranges), self.flush_cursor)
        self._dispatcher.wake()

    def nack_ranges(self, consumer: Consumer, ranges: Iterable[tuple[int, int]], *, reason: str = "") -> int:
        """Negative acknowledgement: the offsets of the inclusive ``(first, last)`` ranges, sent
        to ``consumer`` and not acknowledged, go back for redelivery after the nack delay
        (``nack_redelivery_delay_ms * 2**redelivery_count``, capped by
        ``nack_redelivery_max_delay_ms``), each with one more redelivery.

        Args:
            consumer: the consumer that was sent them.
            ranges: inclusive offset ranges.
            reason: why processing failed (kept for the dead-letter topic's attributes).

        Returns:
            How many offsets were taken back.

        Raises:
            InvalidAckError: an offset is not the consumer's (as for :meth:`ack_ranges`);
                nothing was taken back.
        """
        ranges = list(ranges)
        self.check_ack(consumer, ranges)
        why = f"nack: {reason}" if reason else "nack"
        n = self.ledger.nack(consumer, ranges, reason=why, nack_delay_s=self.settings.nack_delay_s)
        self.metrics.nacked(n)
        self._dispatcher.wake()
        return n

    @property
    def cursor_dirty(self) -> bool:
        """Whether the in-memory cursor differs from the stored one."""
        return self._cursor.dirty

    async def flush_cursor(self) -> None:
        """Store the cursor if it changed since the last write (not after :meth:`close`).

        Raises:
            MetadataStoreError: etcd refused or could not be reached (retried next flush).
        """
        if self._closed:
            return
        await self._cursor.flush()
        await self._flush_table_snapshot()

    async def _flush_table_snapshot(self) -> None:
        """Store the table snapshot beside the cursor if it changed (§3.5.1).

        Raises:
            MetadataStoreError: etcd refused or could not be reached (retried next flush).
        """
        snapshot = self.position.table_snapshot
        if snapshot is None or snapshot == self._stored_table_snapshot or self._persist_table_snapshot is None:
            return
        await self._persist_table_snapshot(snapshot)
        self._stored_table_snapshot = snapshot

    async def close(self, *, store_cursor: bool = True) -> None:
        """Stop dispatching, end every consumer's stream, and store the cursor (unless
        ``store_cursor`` is false). Dead-letter publishes under way are cancelled (their
        offsets are redelivered by the next instance, and published once: see
        :mod:`broker.dispatch.dead_letter_topic`).

        Raises:
            MetadataStoreError: the cursor could not be stored.
        """
        if self._closed:
            return
        self._closed = True
        self._remove_listener()
        self._remove_remote_listener()
        for consumer in list(self.consumers):
            self.remove_consumer(consumer, reason="subscription closed")
        await self._dispatcher.stop()
        await self._cursor.wait()
        self.position.close()
        if store_cursor:
            await self._cursor.flush()
            await self._flush_table_snapshot()

    async def reset_to(self, offset: int) -> None:
        """Deliver from ``offset`` next, and store the cursor ``offset - 1`` at once
        (``Admin.ResetCursor``; ``docs/etcd-layout.md`` §3.5). The caller checked that
        ``offset`` lies from :attr:`earliest_offset` to the WAL's next offset.

        Every handout is dropped: the offsets consumers hold (sent or still queued for their
        stream) and those waiting for redelivery. The consumers stay attached with their
        windows freed; batches still queued for them are not sent. An ack of a dropped batch
        finds no handout and is refused (:meth:`check_ack`), unless its offset was handed out
        again after the reset to the same consumer (acks carry only offsets):
        :meth:`broker.topics.subscriptions.TopicSubscriptions.reset_cursor` therefore resets a
        fresh instance, and the late acks of the closed old one's consumers are refused.

        A reset to offset 0 stores the cursor ``-1`` (the subscription then resumes at 0 after
        a reload, whatever the initial position of the next ``Subscribe``).

        Args:
            offset: the next offset to deliver.

        Raises:
            MetadataStoreError: the cursor could not be stored. The new position holds on this
                broker; the stored cursor is the old one until a later flush (or a retried reset)
                stores it.
        """
        if self._closed:
            return
        dropped = len(self.handouts)
        for consumer in self.consumers:
            consumer.holds.clear()
            consumer.unacked = 0
            consumer.queue.clear()
            consumer.queued_bytes = 0
        self._dispatcher.cancel_dead_letters()
        self.ledger.clear()
        previous = self.read_position
        self.position.reset(offset)
        self._cursor.forget_acks()
        self._dispatcher.wake()
        log.info(
            "%s/%s: cursor reset to offset %d (was reading at %d; %d batches dropped)",
            self.topic, self.name, offset, previous, dropped,
        )
        await self._cursor.store(offset - 1)
