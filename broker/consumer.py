"""A consumer attached to a subscription: the batches it holds unacknowledged, and the queue its
``Receive`` stream drains."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from danube_pipeline.errors import MalformedRequestError
from danube_pipeline.segments import StoredBatch

if TYPE_CHECKING:
    from broker.subscription import Subscription

DEFAULT_RECEIVER_QUEUE_SIZE = 1000
"""Unacknowledged messages a consumer may hold when it asks for no window of its own."""
MAX_DELIVERY_BYTES = 4 * 1024 * 1024
"""Batch bytes per ``Receive`` answer, at most (a single larger batch travels alone)."""
DEFAULT_MAX_BUFFER_BYTES = 16 * 1024 * 1024
"""Batch bytes queued for one consumer's stream and not yet sent, at most (by default)."""


class Handout:
    """One stored batch handed to a consumer (or waiting to be handed out again), with the
    acknowledgement state of its offsets.

    Offsets below ``first`` count as acknowledged (the subscription started inside the batch);
    bit ``i`` of ``acked_bits`` marks offset ``first + i`` acknowledged.

    Attributes:
        base: the batch's base offset.
        last: the batch's last offset.
        first: the first offset of the batch the subscription delivers.
        acked_bits: acknowledged offsets from ``first``, as a bitmap.
        redelivery_count: deliveries of this batch before the current one.
        consumer: the consumer holding it, ``None`` while waiting for redelivery.
        sent: whether the consumer's stream sent it (a redelivery then counts one more).
    """

    __slots__ = ("base", "last", "first", "acked_bits", "redelivery_count", "consumer", "sent")

    def __init__(self, base: int, last: int, first: int, redelivery_count: int = 0) -> None:
        self.base = base
        self.last = last
        self.first = first
        self.acked_bits = 0
        self.redelivery_count = redelivery_count
        self.consumer: Consumer | None = None
        self.sent = False

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

    def ack_range(self, first: int, last: int) -> int:
        """Acknowledge ``first..last`` (clipped to this batch); return how many were new."""
        lo, hi = max(first, self.first), min(last, self.last)
        if lo > hi:
            return 0
        mask = ((1 << (hi - lo + 1)) - 1) << (lo - self.first)
        new = (mask & ~self.acked_bits).bit_count()
        self.acked_bits |= mask
        return new

    def acked_offsets(self) -> list[int]:
        """The acknowledged offsets from ``first`` (for a redelivery to skip)."""
        bits, out, i = self.acked_bits, [], 0
        while bits:
            if bits & 1:
                out.append(self.first + i)
            bits >>= 1
            i += 1
        return out


@dataclass(frozen=True, slots=True)
class Delivery:
    """One batch queued for a consumer's stream.

    Attributes:
        batch: the stored batch.
        handout: its acknowledgement state.
        redelivery_count: deliveries of it before this one.
    """

    batch: StoredBatch
    handout: Handout
    redelivery_count: int


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
        handouts: the batches it holds, by base offset.
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
        self.handouts: dict[int, Handout] = {}
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

    def push(self, batch: StoredBatch, handout: Handout) -> None:
        """Hand ``batch`` to this consumer: its unacknowledged offsets count against the window."""
        handout.consumer = self
        handout.sent = False
        self.handouts[handout.base] = handout
        self.unacked += handout.unacked_count
        self.queue.append(Delivery(batch, handout, handout.redelivery_count))
        self.queued_bytes += len(batch.data)
        self._wake.set()

    def release(self, handout: Handout, acked: int) -> None:
        """``acked`` more offsets of ``handout`` were acknowledged; forget it once all are."""
        self.unacked -= acked
        if handout.unacked_count == 0:
            self.handouts.pop(handout.base, None)

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
                while self.queue and (not group or size + len(self.queue[0].batch.data) <= max_bytes):
                    d = self.queue.popleft()
                    self.queued_bytes -= len(d.batch.data)
                    if self.handouts.get(d.handout.base) is d.handout:  # not fully acked meanwhile
                        d.handout.sent = True
                        group.append(d)
                        size += len(d.batch.data)
                if was_full and self.queued_bytes < self.max_buffer_bytes:
                    self.subscription.consumer_has_room(self)
                if group:
                    yield group
        finally:
            self.subscription.remove_consumer(self, reason="stream ended")
