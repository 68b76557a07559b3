"""A consumer attached to a subscription: the batches it holds unacknowledged, and the queue its
``Receive`` stream drains."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from danube_pipeline.errors import MalformedRequestError
from danube_pipeline.format.segments import StoredBatch

if TYPE_CHECKING:
    from broker.dispatch.subscription import Subscription

DEFAULT_RECEIVER_QUEUE_SIZE = 1000
"""Unacknowledged messages a consumer may hold when it asks for no window of its own."""
MAX_DELIVERY_BYTES = 4 * 1024 * 1024
"""Batch bytes per ``Receive`` answer, at most (a single larger batch travels alone)."""
DEFAULT_MAX_BUFFER_BYTES = 16 * 1024 * 1024
"""Batch bytes queued for one consumer's stream and not yet sent, at most (by default)."""


def bit_offsets(bits: int, first: int) -> list[int]:
    """The offsets ``first + i`` of the set bits ``i`` of ``bits``, ascending."""
    out: list[int] = []
    while bits:
        low = bits & -bits
        out.append(first + low.bit_length() - 1)
        bits ^= low
    return out


class Handout:
    """One stored batch handed out (whole or in parts), with the delivery state of each of its
    offsets: acknowledged, held by a consumer (a :class:`Hold`), or waiting for (re)delivery.

    Offsets below ``first`` count as acknowledged (the subscription started inside the batch);
    bit ``i`` of ``acked_bits`` marks offset ``first + i`` acknowledged. Every offset from
    ``first`` to ``last`` not acknowledged is in exactly one hold or in ``pending``.

    Attributes:
        base: the batch's base offset.
        last: the batch's last offset.
        first: the first offset of the batch the subscription delivers.
        acked_bits: acknowledged offsets from ``first``, as a bitmap.
        holds: the parts of the batch consumers hold.
        pending: offsets waiting for (re)delivery, with the ``time.monotonic()`` second from
            which they may go out.
        counts: per offset, deliveries before the next one (absent = 0).
        reasons: per offset, why it was last taken back (``"nack: ..."``, ``"ack timeout"``,
            ``"consumer left"``), for the dead-letter topic.
        hashes: Key_Shared only: the sticky-key hash of each offset from ``first``.
    """

    __slots__ = ("base", "last", "first", "acked_bits", "holds", "pending", "counts", "reasons", "hashes")

    def __init__(self, base: int, last: int, first: int) -> None:
        self.base = base
        self.last = last
        self.first = first
        self.acked_bits = 0
        self.holds: list[Hold] = []
        self.pending: dict[int, float] = {}
        self.counts: dict[int, int] = {}
        self.reasons: dict[int, str] = {}
        self.hashes: list[int] | None = None

    @property
    def size(self) -> int:
        """Offsets the subscription delivers from this batch."""
        return self.last - self.first + 1

    @property
    def unacked_count(self) -> int:
        """Offsets not acknowledged yet."""
        return self.size - self.acked_bits.bit_count()

    @property
    def first_unacked(self) -> int:
        """The lowest offset not acknowledged (``last + 1`` when all are)."""
        bits = self.acked_bits
        return self.first + ((bits + 1) & ~bits).bit_length() - 1

    @property
    def redelivery_count(self) -> int:
        """The highest redelivery count of its unacknowledged offsets."""
        return max(self.counts.values(), default=0)

    def mask(self, first: int, last: int) -> int:
        """The bits of offsets ``first..last`` (clipped to this batch)."""
        lo, hi = max(first, self.first), min(last, self.last)
        if lo > hi:
            return 0
        return ((1 << (hi - lo + 1)) - 1) << (lo - self.first)

    def ack_range(self, first: int, last: int) -> int:
        """Acknowledge ``first..last`` (clipped to this batch) in the bitmap only; return how many
        were new (the caller releases them from holds and ``pending``)."""
        mask = self.mask(first, last)
        new = (mask & ~self.acked_bits).bit_count()
        self.acked_bits |= mask
        return new

    def acked_offsets(self) -> list[int]:
        """The acknowledged offsets from ``first``."""
        return bit_offsets(self.acked_bits, self.first)


class Hold:
    """The offsets of one batch one consumer holds, from one delivery.

    Attributes:
        handout: the batch's state.
        consumer: the holder.
        bits: the offsets held (bits from ``handout.first``), shrinking as they are
            acknowledged or taken back.
        sent: whether the consumer's stream sent them (a redelivery then counts one more).
        sent_at: ``time.monotonic()`` when the stream sent them (the ack timeout runs from it).
    """

    __slots__ = ("handout", "consumer", "bits", "sent", "sent_at")

    def __init__(self, handout: Handout, consumer: Consumer, bits: int) -> None:
        self.handout = handout
        self.consumer = consumer
        self.bits = bits
        self.sent = False
        self.sent_at = 0.0

    def offsets(self) -> list[int]:
        """The offsets held, ascending."""
        return bit_offsets(self.bits, self.handout.first)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One batch (or the part of it in ``hold``) queued for a consumer's stream.

    Attributes:
        batch: the stored batch.
        handout: its delivery state.
        hold: the offsets this delivery carries.
        redelivery_count: the lowest redelivery count of those offsets when queued.
    """

    batch: StoredBatch
    handout: Handout
    hold: Hold
    redelivery_count: int

    def skipped_offsets(self) -> list[int]:
        """Offsets from ``handout.first`` this delivery does not carry (acknowledged, held
        by another consumer, or waiting)."""
        handout = self.handout
        return bit_offsets(~self.hold.bits & ((1 << handout.size) - 1), handout.first)

    def redelivery_counts(self) -> list[int]:
        """Per offset carried, ascending: deliveries of it before this one."""
        counts = self.handout.counts
        return [counts.get(o, 0) for o in self.hold.offsets()]


class Consumer:
    """One consumer attached to a subscription.

    Two limits decide whether the consumer takes another batch: its window (at most
    ``receiver_queue_size`` unacknowledged messages) and its buffer (at most
    ``max_buffer_bytes`` of batches queued for its stream and not sent yet). The buffer bounds
    the broker's memory for a consumer that asks for a huge window and never reads: the
    stream stops sending when gRPC flow control says the client is not reading, the queue
    fills up to the limit, and dispatch to this consumer pauses.

    Attributes:
        id: u64 consumer id.
        name: the consumer's name.
        receiver_queue_size: most unacknowledged messages outstanding at once; a batch is handed
            out whole while the consumer has room for at least one message.
        max_buffer_bytes: most batch bytes queued and not yet sent; a batch is queued while
            the queue holds less.
        holds: the parts of batches it holds.
        unacked: messages handed to it and not acknowledged.
        queued_bytes: batch bytes in ``queue``.
    """

    def __init__(
        self,
        consumer_id: int,
        name: str,
        subscription: Subscription,
        receiver_queue_size: int,
        *,
        max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
    ) -> None:
        self.id = consumer_id
        self.name = name
        self.subscription = subscription
        self.receiver_queue_size = receiver_queue_size
        self.max_buffer_bytes = max_buffer_bytes
        self.holds: set[Hold] = set()
        self.unacked = 0
        self.queued_bytes = 0
        self.queue: deque[Delivery] = deque()
        self.attached = False
        self.closed = False
        self.error: Exception | None = None
        self._wake = asyncio.Event()

    @property
    def permits(self) -> int:
        """How many more messages may be handed to this consumer now (0 while its buffer is full)."""
        if self.queued_bytes >= self.max_buffer_bytes:
            return 0
        return self.receiver_queue_size - self.unacked

    def push(self, batch: StoredBatch, hold: Hold) -> None:
        """Hand ``hold`` (part of ``batch``) to this consumer: its offsets count against the window."""
        self.holds.add(hold)
        hold.handout.holds.append(hold)
        self.unacked += hold.bits.bit_count()
        counts = hold.handout.counts
        lowest = min((counts.get(o, 0) for o in hold.offsets()), default=0) if counts else 0
        self.queue.append(Delivery(batch, hold.handout, hold, lowest))
        self.queued_bytes += len(batch.data)
        self._wake.set()

    def release(self, hold: Hold, bits: int) -> None:
        """The offsets ``bits`` of ``hold`` were acknowledged or taken back; forget the hold
        once it holds nothing."""
        bits &= hold.bits
        hold.bits &= ~bits
        self.unacked -= bits.bit_count()
        if not hold.bits:
            self.holds.discard(hold)
            with contextlib.suppress(ValueError):
                hold.handout.holds.remove(hold)

    def wake(self) -> None:
        self._wake.set()

    def fail(self, error: Exception) -> None:
        """End this consumer's stream with ``error`` (after the batches already queued are
        not sent: the consumer leaves, and they are redelivered to whoever comes next)."""
        self.error = error
        self._wake.set()

    async def deliveries(self, *, max_bytes: int = MAX_DELIVERY_BYTES) -> AsyncIterator[list[Delivery]]:
        """Yield groups of queued batches (at most ``max_bytes``, or one batch) until the
        consumer closes.

        When the iteration ends (stream closed by the client, consumer closed, broker stopping)
        the consumer leaves its subscription and its unacknowledged batches are redelivered.

        Raises:
            MalformedRequestError: if another stream already receives for this consumer.
            Exception: the error given to :meth:`fail`.
        """
        if self.error is not None:
            raise self.error
        if self.attached:
            raise MalformedRequestError(f"consumer {self.id} already has a Receive stream")
        if self.closed:
            return
        self.attached = True
        self.subscription.consumer_attached(self)
        try:
            while not self.closed:
                if self.error is not None:
                    raise self.error
                if not self.queue:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                group: list[Delivery] = []
                size = 0
                was_full = self.queued_bytes >= self.max_buffer_bytes
                now = time.monotonic()
                while self.queue and (not group or size + len(self.queue[0].batch.data) <= max_bytes):
                    d = self.queue.popleft()
                    self.queued_bytes -= len(d.batch.data)
                    if d.hold in self.holds:  # not fully acknowledged or taken back meanwhile
                        d.hold.sent = True
                        d.hold.sent_at = now
                        group.append(d)
                        size += len(d.batch.data)
                if was_full and self.queued_bytes < self.max_buffer_bytes:
                    self.subscription.consumer_has_room(self)
                if group:
                    self.subscription.consumer_sent(self)
                    self.subscription.metrics.sent(group, size)
                    yield group
        finally:
            self.subscription.remove_consumer(self, reason="stream ended")
