"""A subscription and its dispatch to consumers: Exclusive, Shared, Failover and Key_Shared
(``docs/etcd-layout.md`` §3.4), with negative acks, ack timeouts, redelivery counts and the
dead-letter topic.

Dispatch moves stored record batches, as Pulsar dispatches batched entries: a batch, or the
part of it that goes to one consumer, travels whole and the consumer splits it (the records it
does not carry are listed as skipped); acknowledgements are per offset. One
:class:`Subscription` per ``(topic, subscription name)`` holds the delivery state:

* ``read_position``: the next offset never handed to any consumer;
* ``handouts``: every batch read and not fully acknowledged (a
  :class:`~broker.dispatch.consumer.Handout` each): each of its unacknowledged offsets is held by one
  consumer (a :class:`~broker.dispatch.consumer.Hold`) or waits for (re)delivery, with its redelivery
  count;
* the ack floor: the first offset not yet acknowledged. The persisted cursor is the *last
  offset at or below which everything is acknowledged* (§3.5): ``ack_floor - 1``.

One dispatcher task per subscription reads batches from the WAL (and re-reads the batches to
redeliver) and hands them to consumers while they have room in their ``receiver_queue_size``
window: Exclusive and Failover hand everything to the active (first) consumer; Shared hands
batches out round-robin; Key_Shared hands each offset to the consumer owning its sticky key's
hash range, keeping per-key order (:mod:`broker.dispatch.key_shared`).

Redelivery (:mod:`broker.dispatch.redelivery`, Pulsar's semantics): an offset goes back to waiting when
its consumer leaves, nacks it (after the subscription's nack delay, doubling with each
redelivery up to a cap) or holds it unacknowledged past the ack timeout; an offset its consumer
had been sent counts one more redelivery. Waiting offsets are redelivered first, in offset
order. An offset that would be redelivered more than ``max_redeliveries`` times is published to
the dead-letter topic and then acknowledged (:mod:`broker.dispatch.dead_letter_topic`). Redelivery counts
live in memory: a broker restart starts them again at 0 (as Pulsar's do).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from danube_pipeline.format.batches import iter_batch
from danube_pipeline.errors import InvalidAckError, PositionBelowRetentionError, SubscriptionBusyError
from danube_pipeline.metadata.values import UnavailableRange
from danube_pipeline.modes import SubscriptionType
from danube_pipeline.format.segments import StoredBatch

from broker.dispatch.consumer import (
    DEFAULT_MAX_BUFFER_BYTES,
    DEFAULT_RECEIVER_QUEUE_SIZE,
    Consumer,
    Handout,
    Hold,
    bit_offsets,
)
from broker.dispatch.dead_letter_topic import (
    DeadLetterPublisher,
    dead_letter_batch,
    dead_letter_producer_name,
    fault_point_after_publish,
)
from broker.dispatch.key_shared import AutoSplitHashRanges, KeyOrder, sticky_key_hash
from broker.dispatch.redelivery import RedeliverySettings
from broker.storage.remote import RemoteLog
from broker.tasks import spawn
from broker.storage.wal import WriteAheadLog

log = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 30.0
"""A consumer that opens no Receive stream within this time after Subscribe is removed."""
_MAX_READ_RECORDS_PER_ROUND = 10_000
MAX_KEY_SHARED_WAITING = 10_000
"""Key_Shared: new batches are read only while fewer offsets than this (or than the consumers'
windows together, if more) wait for their key's consumer."""
_DEAD_LETTER_RETRY_S = 1.0
"""Pause before a failed dead-letter publish is tried again (at least)."""
BELOW_RETENTION_EARLIEST = "earliest"
BELOW_RETENTION_ERROR = "error"
BELOW_RETENTION_MODES = (BELOW_RETENTION_EARLIEST, BELOW_RETENTION_ERROR)
UNAVAILABLE_WAIT = "wait"
UNAVAILABLE_SKIP = "skip"
UNAVAILABLE_MODES = (UNAVAILABLE_WAIT, UNAVAILABLE_SKIP)


def earliest_offset(wal: WriteAheadLog, remote: RemoteLog | None) -> int:
    """The earliest offset a subscription of the topic can read.

    Without an object store, the WAL's first offset. With one: object storage's first offset
    when it has any below the WAL's first (offsets below it expired: retention deleted their
    descriptors, ``docs/etcd-layout.md`` §5.1); 0 when object storage holds nothing of the
    topic yet, since offsets below the WAL may still be tiered (an earlier owner's segments).
    """
    local = wal.first_offset
    if remote is None:
        return local
    first = remote.first_offset
    if first is None:
        return 0
    return min(first, local)


def _run_end(bits: int, index: int) -> int:
    """The last index of the run of set bits of ``bits`` that starts at ``index``."""
    rest = bits >> index
    return index + ((rest + 1) & ~rest).bit_length() - 2


def _lowest(bits: int) -> int:
    return (bits & -bits).bit_length() - 1 if bits else -1


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

    Attributes:
        records_from_object_storage: records handed out from object storage.
        skipped_below_retention: offsets jumped over because they expired.
        skipped_unavailable: offsets of unavailable ranges skipped (policy or abandoned).
        position_error: set once the position fell below retention in ``"error"`` mode.
        redelivered: offsets taken back from a consumer they were sent to (nack, ack timeout,
            consumer left).
        dead_lettered: offsets published to the dead-letter topic and acknowledged here.
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
    ) -> None:
        self.topic = topic
        self.name = name
        self.type = subscription_type
        self.wal = wal
        self.remote = remote
        if below_retention not in BELOW_RETENTION_MODES:
            raise ValueError(f"below_retention must be one of {BELOW_RETENTION_MODES}")
        self.below_retention = below_retention
        if unavailable_range not in UNAVAILABLE_MODES:
            raise ValueError(f"unavailable_range must be one of {UNAVAILABLE_MODES}")
        self.unavailable_range = unavailable_range
        self.settings = settings or RedeliverySettings()
        self.dead_letter_publisher = dead_letter_publisher
        self.records_from_object_storage = 0
        self.skipped_below_retention = 0
        self.skipped_unavailable = 0
        self.redelivered = 0
        self.dead_lettered = 0
        self.position_error: PositionBelowRetentionError | None = None
        self._waiting_at: int | None = None
        self.read_position = start_offset
        self.handouts: dict[int, Handout] = {}
        self._bases: list[int] = []  # sorted keys of handouts
        self.consumers: list[Consumer] = []
        self.cursor_flush_acks = cursor_flush_acks
        self._persisted_cursor = persisted_cursor
        self._persist_cursor = persist_cursor
        self._on_active_change = on_active_change
        self._on_idle = on_idle
        self._idle_since = time.monotonic()
        self._acks_since_flush = 0
        self._flush_lock = asyncio.Lock()
        self._flush_task: asyncio.Task[None] | None = None
        self._rr = 0
        self.hash_ranges = AutoSplitHashRanges()
        self._order = KeyOrder()
        self._next_due: float | None = None
        self._dead_letter_tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._closed = False
        self._remove_listener = wal.add_listener(lambda _end: self._wake.set())
        self._remove_remote_listener = remote.add_listener(self._wake.set) if remote is not None else (lambda: None)
        earliest = self.earliest_offset
        if self.read_position < earliest:  # e.g. a stored cursor whose offsets expired
            self._below_retention(earliest)
        self._task = asyncio.create_task(self._run(), name=f"dispatch:{topic}:{name}")

    def configure(self, settings: RedeliverySettings) -> None:
        """Apply new redelivery settings (waiting offsets keep the time they were given)."""
        self.settings = settings
        self._wake.set()

    # ------------------------------------------------------------------ state

    @property
    def ack_floor(self) -> int:
        """The first offset not acknowledged."""
        floor = self.read_position
        for base in self._bases:
            if base >= floor:
                break
            floor = min(floor, self.handouts[base].first_unacked)
        return floor

    @property
    def cursor(self) -> int | None:
        """The last acknowledged offset with everything below it acknowledged, or ``None``."""
        floor = self.ack_floor
        return floor - 1 if floor > 0 else None

    @property
    def waiting_redelivery(self) -> list[Handout]:
        """Batches with offsets waiting for redelivery, in offset order."""
        return [self.handouts[b] for b in self._bases if self.handouts[b].pending]

    def _add_handout(self, handout: Handout) -> None:
        self.handouts[handout.base] = handout
        bisect.insort(self._bases, handout.base)

    def _drop_handout(self, handout: Handout) -> None:
        if self.handouts.pop(handout.base, None) is not None:
            self._bases.pop(bisect.bisect_left(self._bases, handout.base))

    @property
    def _key_shared(self) -> bool:
        return self.type == SubscriptionType.KEY_SHARED

    def _settle(self, handout: Handout, bits: int) -> None:
        """Offsets ``bits`` of ``handout`` are acknowledged (or skipped): release them from
        their holds, from waiting, and from the per-key order."""
        if not bits:
            return
        hashes = handout.hashes
        held = 0
        for hold in list(handout.holds):
            mine = hold.bits & bits
            if mine:
                held |= mine
                if hashes is not None:
                    for o in bit_offsets(mine, handout.first):
                        self._order.release(hashes[o - handout.first], hold.consumer.id, o)
                hold.consumer.release(hold, mine)
        if hashes is None and not handout.pending and not handout.counts and not handout.reasons:
            return  # nothing kept per offset (the common case: no redelivery)
        for o in bit_offsets(bits, handout.first):
            handout.pending.pop(o, None)
            handout.counts.pop(o, None)
            handout.reasons.pop(o, None)
            if hashes is not None and not (held >> (o - handout.first)) & 1:
                self._order.release(hashes[o - handout.first], None, o)

    def _take_back(self, hold: Hold, bits: int, *, reason: str, nack: bool = False) -> int:
        """Offsets ``bits`` of ``hold`` go back to waiting: after the nack backoff when ``nack``,
        else at once; one more redelivery each if the hold was sent. Returns how many."""
        bits &= hold.bits
        if not bits:
            return 0
        handout, consumer = hold.handout, hold.consumer
        now = time.monotonic()
        hashes = handout.hashes
        offsets = bit_offsets(bits, handout.first)
        for o in offsets:
            count = handout.counts.get(o, 0)
            if hold.sent:
                handout.counts[o] = count + 1
            handout.pending[o] = now + (self.settings.nack_delay_s(count) if nack else 0.0)
            handout.reasons[o] = reason
            if hashes is not None:
                self._order.give_back(hashes[o - handout.first], consumer.id, o)
        consumer.release(hold, bits)
        if hold.sent:
            self.redelivered += len(offsets)
        return len(offsets)

    # ------------------------------------------------------------------ consumers

    @property
    def active_consumer(self) -> Consumer | None:
        """Exclusive/Failover: the consumer receiving messages; Shared and Key_Shared: the
        first consumer."""
        return self.consumers[0] if self.consumers else None

    @property
    def idle_s(self) -> float:
        """Seconds since the last consumer left; 0 while a consumer is attached."""
        return 0.0 if self.consumers else time.monotonic() - self._idle_since

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
        if self.consumers and subscription_type != self.type:
            raise SubscriptionBusyError(
                self.name, f"it is {self.type.name} with consumers attached, not {subscription_type.name}"
            )
        if self.type == SubscriptionType.EXCLUSIVE and self.consumers:
            raise SubscriptionBusyError(self.name, "an Exclusive subscription allows one consumer")
        if self.position_error is not None:
            raise self.position_error
        if subscription_type != self.type and self.handouts:
            self._order.clear()
            for handout in self.handouts.values():
                handout.hashes = None  # recomputed (and re-registered) when redelivered
        self.type = subscription_type
        if self._key_shared:
            for handout in self.handouts.values():
                self._register_hashes(handout)
        consumer = Consumer(
            consumer_id, name, self, receiver_queue_size or DEFAULT_RECEIVER_QUEUE_SIZE, max_buffer_bytes=max_buffer_bytes
        )
        self.consumers.append(consumer)
        asyncio.get_running_loop().call_later(ATTACH_TIMEOUT_S, self._expire_unattached, consumer)
        self._wake.set()
        return consumer

    def _register_hashes(self, handout: Handout) -> None:
        """Key_Shared: read the sticky-key hashes of a batch taken over from another type
        (all its offsets wait then: no consumer is attached)."""
        if handout.hashes is not None:
            return
        batches = self._read(handout.base, 1)
        if not batches or batches[0].base_offset != handout.base:
            return  # registered when it is redelivered (_assign)
        self._hash_batch(handout, batches[0])

    def _hash_batch(self, handout: Handout, batch: StoredBatch) -> None:
        _header, records = iter_batch(batch.data)
        handout.hashes = [sticky_key_hash(key) for offset, _ts, key, _a, _p in records if offset >= handout.first]
        for o in handout.pending:
            self._order.wait(handout.hashes[o - handout.first], o)

    def _expire_unattached(self, consumer: Consumer) -> None:
        if not consumer.attached and not consumer.closed:
            self.remove_consumer(consumer, reason=f"no Receive stream within {ATTACH_TIMEOUT_S:.0f}s")

    def consumer_attached(self, consumer: Consumer) -> None:
        """A consumer opened its Receive stream: dispatch to it (Key_Shared: it takes the
        upper half of the largest hash range)."""
        if self._key_shared and not consumer.closed:
            self.hash_ranges.add(consumer.id)
        self._wake.set()

    def consumer_has_room(self, consumer: Consumer) -> None:
        """A consumer's stream took batches from its full buffer: dispatch to it again."""
        self._wake.set()

    def consumer_sent(self, consumer: Consumer) -> None:
        """A consumer's stream sent batches: their ack timeout runs from now."""
        if self.settings.ack_timeout_ms:
            self._wake.set()

    def remove_consumer(self, consumer: Consumer, *, reason: str) -> None:
        """Detach ``consumer``; the offsets it holds go back for redelivery at once.

        An offset its stream sent gets ``redelivery_count + 1``; one still queued keeps its
        count. Key_Shared: its hash ranges go to its neighbours. Idempotent.
        """
        if consumer.closed:
            return
        was_active = self.active_consumer is consumer
        consumer.closed = True
        consumer.wake()
        taken_back = 0
        for hold in list(consumer.holds):
            taken_back += self._take_back(hold, hold.bits, reason="consumer left")
        consumer.holds.clear()
        consumer.queue.clear()
        consumer.queued_bytes = 0
        consumer.unacked = 0
        self.hash_ranges.remove(consumer.id)
        with contextlib.suppress(ValueError):
            self.consumers.remove(consumer)
        log.info(
            "%s/%s: consumer %d left (%s); %d messages to redeliver",
            self.topic, self.name, consumer.id, reason, taken_back,
        )
        if was_active and self._on_active_change is not None:
            self._on_active_change(self.active_consumer)
        if not self.consumers:
            self._idle_since = time.monotonic()
            if self._on_idle is not None and not self._closed:
                self._on_idle(self)
        self._wake.set()

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
        previous_last = -1
        for first, last in sorted(ranges):
            if last < first:
                raise InvalidAckError(consumer.id, first, last, "the range is empty (last < first)")
            if first <= previous_last:
                raise InvalidAckError(
                    consumer.id, first, min(last, previous_last), "acknowledged twice in this request"
                )
            previous_last = last
            self._check_range(consumer, first, last)

    def _check_range(self, consumer: Consumer, first: int, last: int) -> None:
        pos = first
        while pos <= last:
            i = bisect.bisect_right(self._bases, pos) - 1
            handout = self.handouts[self._bases[i]] if i >= 0 else None
            if handout is None or handout.last < pos:  # no handout holds pos
                nxt = self._bases[i + 1] if i + 1 < len(self._bases) else None
                end = last if nxt is None else min(last, nxt - 1)
                if pos >= self.read_position:
                    raise InvalidAckError(consumer.id, pos, end, "never delivered")
                end = min(end, self.read_position - 1)
                raise InvalidAckError(consumer.id, pos, end, "already acknowledged (or skipped)")
            end = min(last, handout.last)
            if pos < handout.first:
                raise InvalidAckError(
                    consumer.id, pos, min(end, handout.first - 1), "never delivered (before the subscription's start)"
                )
            mask = handout.mask(pos, end)
            acked = mask & handout.acked_bits
            mine = unsent = held = 0
            for hold in handout.holds:
                held |= hold.bits
                if hold.consumer is consumer:
                    mine |= hold.bits & mask
                    if not hold.sent:
                        unsent |= hold.bits & mask
            others = mask & ~acked & ~mine
            problems = [(b, kind) for b, kind in ((acked, "acked"), (others, "others"), (unsent, "unsent")) if b]
            if problems:
                bits, kind = min(problems, key=lambda p: _lowest(p[0]))
                index = _lowest(bits)
                offset = handout.first + index
                if kind == "others":
                    pending = sum(1 << (o - handout.first) for o in handout.pending) & bits
                    if (pending >> index) & 1:
                        bits, reason = pending, "not delivered to this consumer (it waits for redelivery)"
                    elif (held >> index) & 1:
                        bits, reason = bits & held, "delivered to another consumer"
                    else:
                        bits, reason = bits & ~held & ~pending, "being published to the dead-letter topic"
                else:
                    reason = "already acknowledged" if kind == "acked" else "not delivered yet (queued for the stream)"
                raise InvalidAckError(consumer.id, offset, handout.first + _run_end(bits, index), reason)
            pos = end + 1

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
        n = 0
        for first, last in ranges:
            if last < first:
                continue
            i = max(bisect.bisect_right(self._bases, first) - 1, 0)
            while i < len(self._bases) and self._bases[i] <= last:
                handout = self.handouts[self._bases[i]]
                new = handout.mask(first, last) & ~handout.acked_bits
                if new:
                    self._settle(handout, new)
                    handout.acked_bits |= new
                    n += new.bit_count()
                if handout.unacked_count == 0:
                    self._drop_handout(handout)
                else:
                    i += 1
        self._acks_since_flush += n
        if self._acks_since_flush >= self.cursor_flush_acks and (self._flush_task is None or self._flush_task.done()):
            # A failure is counted by the cursor writer and retried at the next flush.
            self._flush_task = spawn(
                self.flush_cursor(), name=f"cursor:{self.topic}:{self.name}", on_error=lambda _exc: None
            )
        self._wake.set()

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
        n = 0
        for first, last in ranges:
            i = max(bisect.bisect_right(self._bases, first) - 1, 0)
            while i < len(self._bases) and self._bases[i] <= last:
                handout = self.handouts[self._bases[i]]
                mask = handout.mask(first, last)
                for hold in [h for h in handout.holds if h.consumer is consumer]:
                    n += self._take_back(hold, mask, reason=why, nack=True)
                i += 1
        self._wake.set()
        return n

    @property
    def cursor_dirty(self) -> bool:
        """Whether the in-memory cursor differs from the stored one."""
        cursor = self.cursor
        return cursor is not None and cursor != self._persisted_cursor

    async def flush_cursor(self) -> None:
        """Store the cursor if it changed since the last write (not after :meth:`close`).

        Raises:
            MetadataStoreError: etcd refused or could not be reached (retried next flush).
        """
        if self._closed:
            return
        await self._flush()

    async def _flush(self) -> None:
        async with self._flush_lock:
            cursor = self.cursor
            if cursor is None or cursor == self._persisted_cursor:
                return
            self._acks_since_flush = 0
            await self._persist_cursor(cursor)
            self._persisted_cursor = cursor

    # ------------------------------------------------------------------ dispatching

    def _eligible(self) -> list[Consumer]:
        if self.type in (SubscriptionType.SHARED, SubscriptionType.KEY_SHARED):
            candidates = [c for c in self.consumers if c.attached and not c.closed]
        else:
            active = self.active_consumer
            candidates = [active] if active is not None and active.attached and not active.closed else []
        return [c for c in candidates if c.permits > 0]

    def _pick(self, eligible: list[Consumer]) -> Consumer | None:
        for _ in range(len(eligible)):
            consumer = eligible[self._rr % len(eligible)]
            self._rr += 1
            if consumer.permits > 0:
                return consumer
        return None

    @property
    def earliest_offset(self) -> int:
        """The earliest offset this subscription can read (:func:`earliest_offset`)."""
        return earliest_offset(self.wal, self.remote)

    def _untiered(self, offset: int) -> bool:
        """Whether ``offset``, below the WAL, lies above everything object storage holds: not
        tiered *yet* (an earlier owner's segments after a topic move), so worth waiting for."""
        if self.remote is None:
            return False
        end = self.remote.end_offset
        return end is None or offset > end

    def _read(self, offset: int, max_records: int) -> list[StoredBatch] | None:
        """Batches from ``offset`` on: from the WAL when it holds ``offset``, else from object
        storage; ``None`` while an object is being fetched (the fetch wakes the dispatcher)."""
        if offset >= self.wal.first_offset:
            return self.wal.read(offset, max_records)
        if self.remote is None:
            return []
        return self.remote.read_cached(offset, max_records)

    def _skip_below(self, offset: int) -> None:
        """Move the read position up to ``offset`` and forget the batches below it (they are
        acknowledged in place: nothing can deliver them any more)."""
        self.read_position = max(self.read_position, offset)
        for base in [b for b in self._bases if self.handouts[b].last < offset]:
            handout = self.handouts[base]
            self._settle(handout, handout.mask(handout.first, handout.last) & ~handout.acked_bits)
            handout.acked_bits = handout.mask(handout.first, handout.last)
            self._drop_handout(handout)

    def _below_retention(self, earliest: int) -> bool:
        """The position (or a batch to redeliver) lies below ``earliest``: jump or fail, by
        ``below_retention``. Returns whether dispatch may go on."""
        floor = self.ack_floor
        if self.below_retention == BELOW_RETENTION_ERROR:
            if self.position_error is None:
                self.position_error = PositionBelowRetentionError(self.topic, self.name, floor, earliest)
                log.error("%s", self.position_error)
            for consumer in list(self.consumers):
                consumer.fail(self.position_error)
            return False
        skipped = max(0, earliest - floor)
        self.skipped_below_retention += skipped
        log.warning(
            "%s/%s: offsets %d..%d expired before they were acknowledged; the subscription jumps "
            "to the earliest retained offset %d (%d skipped, %d in all)",
            self.topic, self.name, floor, earliest - 1, earliest, skipped, self.skipped_below_retention,
        )
        self._skip_below(earliest)
        return True

    def _skip_hole(self, offset: int, target: int | None = None) -> None:
        """Nothing holds ``offset`` although offsets above it exist (descriptors or WAL
        segments not contiguous): skip to ``target`` (default: the next offset held), logged
        and counted."""
        if target is None:
            local = self.wal.first_offset
            nxt = self.remote.next_start_after(offset) if self.remote is not None else None
            target = min(nxt, local) if nxt is not None else local
        if target <= offset:
            return
        self.skipped_below_retention += target - offset
        log.error(
            "%s/%s: offsets %d..%d are held neither in object storage nor in the WAL; skipped",
            self.topic, self.name, offset, target - 1,
        )
        self._skip_below(target)

    def _at_unavailable(self, rng: UnavailableRange) -> bool:
        """The read position lies in an unavailable range (``docs/etcd-layout.md`` §5.5) and
        object storage does not hold it. Offsets the failed owner never handed out are passed
        over; the others are waited for, or skipped (counted in ``skipped_unavailable``) when
        the range was abandoned or the subscription's policy is ``"skip"``.

        Returns:
            Whether the position moved.
        """
        position = self.read_position
        unused = rng.unused_from()
        if unused is not None and position >= unused:
            log.info("%s/%s: offsets %d..%d were never handed out (broker %d failed before); passed over",
                     self.topic, self.name, position, rng.end_offset, rng.broker_id)
            self._skip_below(rng.end_offset + 1)
            return True
        if rng.abandoned or self.unavailable_range == UNAVAILABLE_SKIP:
            limit = unused if unused is not None else rng.end_offset + 1
            nxt = self.remote.next_start_after(position) if self.remote is not None else None
            target = min(limit, nxt) if nxt is not None and nxt > position else limit
            self.skipped_unavailable += target - position
            log.error(
                "%s/%s: offsets %d..%d held only by broker %d are skipped (%s; %d skipped in all)",
                self.topic, self.name, position, target - 1, rng.broker_id,
                "range abandoned" if rng.abandoned else "policy skip", self.skipped_unavailable,
            )
            self._skip_below(target)
            return True
        if self._waiting_at != position:
            self._waiting_at = position
            log.warning(
                "%s/%s: offset %d is in an unavailable range (%d..%d, held only by broker %d); waiting until "
                "its segments are tiered",
                self.topic, self.name, position, rng.start_offset, rng.end_offset, rng.broker_id,
            )
        return False

    # ------------------------------------------------------------------ redelivery

    def _expire_ack_timeouts(self, now: float) -> None:
        """Take back every sent hold unacknowledged for ``ack_timeout_ms``; note the next
        deadline."""
        timeout_s = self.settings.ack_timeout_ms / 1000
        if not timeout_s:
            return
        for consumer in list(self.consumers):
            for hold in list(consumer.holds):
                if not hold.sent:
                    continue
                due = hold.sent_at + timeout_s
                if due <= now:
                    n = self._take_back(hold, hold.bits, reason="ack timeout")
                    log.info("%s/%s: %d messages unacknowledged by consumer %d for %d ms: redelivered",
                             self.topic, self.name, n, consumer.id, self.settings.ack_timeout_ms)
                else:
                    self._due(due)

    def _due(self, when: float) -> None:
        if self._next_due is None or when < self._next_due:
            self._next_due = when

    def _assign(self, handout: Handout, batch: StoredBatch, ready: list[int], eligible: list[Consumer]) -> int:
        """Hand the waiting offsets ``ready`` (ascending) of ``handout`` to consumers: all to one
        consumer, or (Key_Shared) each to its hash's consumer when the per-key order allows.
        Returns how many were handed out."""
        first = handout.first
        if not self._key_shared:
            consumer = self._pick(eligible)
            if consumer is None:
                return 0
            bits = 0
            for o in ready:
                bits |= 1 << (o - first)
                del handout.pending[o]
            consumer.push(batch, Hold(handout, consumer, bits))
            return len(ready)
        if handout.hashes is None:
            self._hash_batch(handout, batch)
        hashes = handout.hashes
        assert hashes is not None
        by_id = {c.id: c for c in eligible}
        room = {c.id: c.permits for c in eligible}
        given: dict[int, int] = {}
        for o in ready:
            key_hash = hashes[o - first]
            owner = self.hash_ranges.owner(key_hash)
            if owner is None or room.get(owner, 0) <= 0:
                continue
            if not self._order.may_deliver(key_hash, o, owner):
                continue
            self._order.hold(key_hash, o, owner)
            del handout.pending[o]
            given[owner] = given.get(owner, 0) | (1 << (o - first))
            room[owner] -= 1
        for owner, bits in given.items():
            consumer = by_id[owner]
            consumer.push(batch, Hold(handout, consumer, bits))
        return sum(bits.bit_count() for bits in given.values())

    def _dead_letter(self, handout: Handout, offsets: list[int]) -> None:
        """Publish ``offsets`` (past ``max_redeliveries``) to the dead-letter topic, then
        acknowledge them (:mod:`broker.dispatch.dead_letter_topic`); meanwhile they are neither waiting
        nor held."""
        for o in offsets:
            del handout.pending[o]
        task = spawn(self._publish_dead_letters(handout, offsets), name=f"dlq:{self.topic}:{self.name}")
        self._dead_letter_tasks.add(task)
        task.add_done_callback(self._dead_letter_tasks.discard)

    async def _publish_dead_letters(self, handout: Handout, offsets: list[int]) -> None:
        done: set[int] = set()
        try:
            publisher = self.dead_letter_publisher
            if publisher is None:
                raise RuntimeError("no dead-letter publisher is set for this subscription")
            dead_letter_topic = self.settings.dead_letter_topic_for(self.topic, self.name)
            batches = self._read(handout.base, 1)
            while batches is None:  # being fetched from object storage
                await asyncio.sleep(0.05)
                batches = self._read(handout.base, 1)
            if not batches or batches[0].base_offset != handout.base:
                raise RuntimeError(f"batch {handout.base} is held nowhere any more")
            _header, records = iter_batch(batches[0].data)
            by_offset = {r[0]: r for r in records if r[0] in offsets}
            for o in offsets:
                if self._closed or self.handouts.get(handout.base) is not handout:
                    return  # unloaded or reset meanwhile: the next owner of the cursor decides
                _offset, publish_time_us, key, attributes, payload = by_offset[o]
                count = handout.counts.get(o, 0)
                name = dead_letter_producer_name(self.topic, self.name, o)
                batch = dead_letter_batch(
                    producer_name=name, key=key, payload=payload, attributes=attributes,
                    publish_time_us=publish_time_us, topic=self.topic, subscription=self.name, offset=o,
                    reason=handout.reasons.get(o, ""), redelivery_count=count,
                )
                written, _last = await publisher(dead_letter_topic, name, batch)
                fault_point_after_publish()
                done.add(o)
                self.ack_ranges([(o, o)])
                self.dead_lettered += 1
                log.info("%s/%s: offset %d redelivered %d times; published to %s at offset %d and acknowledged",
                         self.topic, self.name, o, count, dead_letter_topic, written)
            await self.flush_cursor()
        except Exception as exc:  # noqa: BLE001 - retried: the offsets wait again
            log.warning("%s/%s: dead-letter publish of offsets %s failed (%s); retried later",
                        self.topic, self.name, [o for o in offsets if o not in done], exc)
            if self._closed or self.handouts.get(handout.base) is not handout:
                return
            retry_at = time.monotonic() + max(_DEAD_LETTER_RETRY_S, self.settings.nack_redelivery_delay_ms / 1000)
            for o in offsets:
                if o not in done and not (handout.acked_bits >> (o - handout.first)) & 1:
                    handout.pending[o] = retry_at
            self._wake.set()

    def _redeliver(self, now: float, eligible: list[Consumer]) -> tuple[int, bool]:
        """Hand out the waiting offsets that are due, in offset order; send those past
        ``max_redeliveries`` to the dead-letter topic. Returns the offsets handed out and
        whether reading stopped at an object being fetched."""
        moved = 0
        limit = self.settings.max_redeliveries
        for base in list(self._bases):
            handout = self.handouts.get(base)
            if handout is None or not handout.pending:
                continue
            ready: list[int] = []
            for o, due in handout.pending.items():
                if due <= now:
                    ready.append(o)
                else:
                    self._due(due)
            if not ready:
                continue
            ready.sort()
            if limit:
                dead = [o for o in ready if handout.counts.get(o, 0) > limit]
                if dead:
                    self._dead_letter(handout, dead)
                    ready = [o for o in ready if handout.counts.get(o, 0) <= limit]
            eligible = [c for c in eligible if c.permits > 0]
            if not ready or not eligible:
                continue
            batches = self._read(handout.base, 1)
            if batches is None:  # being fetched from object storage
                return moved, True
            if not batches or batches[0].base_offset != handout.base:  # held nowhere any more
                self._skip_batch(handout)
                continue
            moved += self._assign(handout, batches[0], ready, eligible)
        return moved, False

    def _skip_batch(self, handout: Handout) -> None:
        log.error("%s/%s: batch %d..%d to redeliver is held nowhere any more; skipped",
                  self.topic, self.name, handout.base, handout.last)
        bits = handout.mask(handout.first, handout.last) & ~handout.acked_bits
        self._settle(handout, bits)
        handout.acked_bits |= bits
        self._drop_handout(handout)

    def _waiting_count(self) -> int:
        return sum(len(h.pending) for h in self.handouts.values())

    def _dispatch_once(self) -> bool:
        earliest = self.earliest_offset
        if self.read_position < earliest or (self._bases and self._bases[0] < earliest):
            if not self._below_retention(earliest):
                return False
        now = time.monotonic()
        self._next_due = None
        self._expire_ack_timeouts(now)
        eligible = self._eligible()
        moved, fetching = self._redeliver(now, eligible)
        if fetching:
            return moved > 0
        eligible = [c for c in eligible if c.permits > 0]
        if not eligible:
            return moved > 0
        permits = sum(c.permits for c in eligible)
        if self._key_shared and self._waiting_count() >= max(MAX_KEY_SHARED_WAITING, permits):
            return moved > 0  # wait for the keys' consumers to acknowledge
        if self.read_position < self.wal.durable_end:
            cold = self.read_position < self.wal.first_offset
            batches = self._read(self.read_position, min(permits, _MAX_READ_RECORDS_PER_ROUND))
            if batches is None:
                return moved > 0
            if not batches and cold:
                rng = self.remote.unavailable_at(self.read_position) if self.remote is not None else None
                if rng is not None:
                    return self._at_unavailable(rng) or moved > 0
                if self._untiered(self.read_position):
                    # An unavailable range: wait until it is tiered (the descriptors' watch
                    # wakes the dispatcher), never skip it.
                    if self._waiting_at != self.read_position:
                        self._waiting_at = self.read_position
                        log.warning(
                            "%s/%s: offsets %d..%d are not in object storage yet (an earlier owner's "
                            "untiered segments); waiting for them to be tiered",
                            self.topic, self.name, self.read_position, self.wal.first_offset - 1,
                        )
                    return moved > 0
                self._skip_hole(self.read_position)
                return True
            if batches and batches[0].last_offset >= self.read_position and batches[0].base_offset > self.read_position:
                self._skip_hole(self.read_position, batches[0].base_offset)  # a gap in the WAL
            for batch in batches:
                eligible = [c for c in eligible if c.permits > 0]
                if not eligible:
                    break
                if batch.last_offset < self.read_position:
                    continue
                handout = Handout(batch.base_offset, batch.last_offset, max(batch.base_offset, self.read_position))
                handout.pending = dict.fromkeys(range(handout.first, handout.last + 1), 0.0)
                self._add_handout(handout)
                if self._key_shared:
                    self._hash_batch(handout, batch)
                self._assign(handout, batch, list(range(handout.first, handout.last + 1)), eligible)
                if cold:
                    self.records_from_object_storage += batch.last_offset + 1 - handout.first
                self.read_position = batch.last_offset + 1
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
                continue
            due = self._next_due
            if due is None:
                await self._wake.wait()
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, due - time.monotonic()) + 0.001)

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
        self._wake.set()
        self._task.cancel()
        for task in list(self._dead_letter_tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self._flush_task is not None:
            with contextlib.suppress(Exception):
                await self._flush_task
        if store_cursor:
            await self._flush()

    # ------------------------------------------------------------------ admin

    async def reset_to(self, offset: int) -> None:
        """Deliver from ``offset`` next, and store the cursor ``offset - 1`` at once
        (``Admin.ResetCursor``; ``docs/etcd-layout.md`` §3.5). The caller checked that
        ``offset`` lies from :attr:`earliest_offset` to the WAL's next offset.

        Every handout is dropped: the offsets consumers hold (sent or still queued for their
        stream) and those waiting for redelivery. The consumers stay attached with their
        windows freed; batches still queued for them are not sent. An ack of a dropped batch
        finds no handout and is refused (:meth:`check_ack`), unless its offset was handed out
        again after the reset to the same consumer (acks carry only offsets):
        :meth:`broker.topics.topic.Topic.reset_cursor` therefore resets a fresh instance, and the late
        acks of the closed old one's consumers are refused.

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
        for task in list(self._dead_letter_tasks):
            task.cancel()
        self.handouts.clear()
        self._bases.clear()
        self._order.clear()
        previous = self.read_position
        self.read_position = offset
        self.position_error = None
        self._waiting_at = None
        self._acks_since_flush = 0
        self._wake.set()
        log.info(
            "%s/%s: cursor reset to offset %d (was reading at %d; %d batches dropped)",
            self.topic, self.name, offset, previous, dropped,
        )
        async with self._flush_lock:
            await self._persist_cursor(offset - 1)
            self._persisted_cursor = offset - 1
