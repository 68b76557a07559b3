"""The consumers attached to one subscription (``docs/etcd-layout.md`` §3.4): who may join (one
subscription type at a time, a single consumer on Exclusive), the deadline for opening a Receive
stream, the Key_Shared hash ranges as consumers attach and leave, the active consumer of
Exclusive and Failover (the first one; when it leaves, the next one takes over), and the
offsets a leaving consumer held going back for redelivery."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from danube_pipeline.errors import SubscriptionBusyError
from danube_pipeline.modes import SubscriptionType

from broker.dispatch.consumer import DEFAULT_MAX_BUFFER_BYTES, DEFAULT_RECEIVER_QUEUE_SIZE, Consumer, Handout
from broker.dispatch.key_shared import hash_batch

if TYPE_CHECKING:
    from broker.dispatch.subscription import Subscription

log = logging.getLogger("broker.dispatch.subscription")  # the subscription's log lines keep one logger name

ATTACH_TIMEOUT_S = 30.0
"""A consumer that opens no Receive stream within this time after Subscribe is removed."""


class ConsumerSet:
    """The consumers of one subscription, in the order they joined (the first is the active one).

    Args:
        subscription: the subscription they consume; its type, ledger, read position and hash
            ranges are read and updated as consumers join and leave.
        wake: runs a dispatch round soon.
        on_active_change: called with the new active consumer (or ``None``) when the active
            consumer leaves (the caller records the first consumer itself).
        on_idle: called with the subscription when its last consumer leaves.

    Attributes:
        consumers: the consumers attached, in the order they joined.
    """

    def __init__(
        self,
        subscription: Subscription,
        *,
        wake: Callable[[], None],
        on_active_change: Callable[[Consumer | None], None] | None,
        on_idle: Callable[[Subscription], None] | None,
    ) -> None:
        self._sub = subscription
        self._wake = wake
        self.consumers: list[Consumer] = []
        self._on_active_change = on_active_change
        self._on_idle = on_idle
        self._idle_since = time.monotonic()

    @property
    def active(self) -> Consumer | None:
        """Exclusive/Failover: the consumer receiving messages; Shared and Key_Shared: the
        first consumer."""
        return self.consumers[0] if self.consumers else None

    @property
    def idle_s(self) -> float:
        """Seconds since the last consumer left; 0 while a consumer is attached."""
        return 0.0 if self.consumers else time.monotonic() - self._idle_since

    def add(
        self,
        consumer_id: int,
        name: str,
        subscription_type: SubscriptionType,
        receiver_queue_size: int,
        *,
        max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
    ) -> Consumer:
        """Attach a new consumer (:meth:`~broker.dispatch.subscription.Subscription.add_consumer`):
        check that it may join, switch the subscription to its type (Key_Shared: register the
        key hashes of the batches handed out), and remove it unless it opens its Receive stream
        within :data:`ATTACH_TIMEOUT_S`.

        Raises:
            SubscriptionBusyError: the subscription is Exclusive with a consumer, or has
                consumers of another type.
            PositionBelowRetentionError: the position fell below retention in ``"error"`` mode.
        """
        sub = self._sub
        if self.consumers and subscription_type != sub.type:
            raise SubscriptionBusyError(
                sub.name, f"it is {sub.type.name} with consumers attached, not {subscription_type.name}"
            )
        if sub.type == SubscriptionType.EXCLUSIVE and self.consumers:
            raise SubscriptionBusyError(sub.name, "an Exclusive subscription allows one consumer")
        if sub.position_error is not None:
            raise sub.position_error
        if subscription_type != sub.type and sub.handouts:
            sub.ledger.order.clear()
            for handout in sub.handouts.values():
                handout.hashes = None  # recomputed (and re-registered) when redelivered
        sub.type = subscription_type
        if sub.type == SubscriptionType.KEY_SHARED:
            for handout in sub.handouts.values():
                self._register_hashes(handout)
        consumer = Consumer(
            consumer_id, name, sub, receiver_queue_size or DEFAULT_RECEIVER_QUEUE_SIZE, max_buffer_bytes=max_buffer_bytes
        )
        self.consumers.append(consumer)
        asyncio.get_running_loop().call_later(ATTACH_TIMEOUT_S, self._expire_unattached, consumer)
        self._wake()
        return consumer

    def _register_hashes(self, handout: Handout) -> None:
        """Key_Shared: read the sticky-key hashes of a batch taken over from another type
        (all its offsets wait then: no consumer is attached)."""
        if handout.hashes is not None:
            return
        batches = self._sub.position.read(handout.base, 1)
        if not batches or batches[0].base_offset != handout.base:
            return  # registered when it is redelivered (DispatchPolicy.assign)
        hash_batch(handout, batches[0], self._sub.ledger.order)

    def _expire_unattached(self, consumer: Consumer) -> None:
        if not consumer.attached and not consumer.closed:
            self.remove(consumer, reason=f"no Receive stream within {ATTACH_TIMEOUT_S:.0f}s")

    def attached(self, consumer: Consumer) -> None:
        """A consumer opened its Receive stream: dispatch to it (Key_Shared: it takes the
        upper half of the largest hash range)."""
        if self._sub.type == SubscriptionType.KEY_SHARED and not consumer.closed:
            self._sub.hash_ranges.add(consumer.id)
        self._wake()

    def remove(self, consumer: Consumer, *, reason: str) -> None:
        """Detach ``consumer``; the offsets it holds go back for redelivery at once.

        An offset its stream sent gets ``redelivery_count + 1``; one still queued keeps its
        count. Key_Shared: its hash ranges go to its neighbours. Idempotent.
        """
        if consumer.closed:
            return
        sub = self._sub
        was_active = self.active is consumer
        consumer.closed = True
        consumer.wake()
        taken_back = 0
        for hold in list(consumer.holds):
            taken_back += sub.ledger.take_back(hold, hold.bits, reason="consumer left")
        consumer.holds.clear()
        consumer.queue.clear()
        consumer.queued_bytes = 0
        consumer.unacked = 0
        sub.hash_ranges.remove(consumer.id)
        with contextlib.suppress(ValueError):
            self.consumers.remove(consumer)
        log.info(
            "%s/%s: consumer %d left (%s); %d messages to redeliver",
            sub.topic, sub.name, consumer.id, reason, taken_back,
        )
        if was_active and self._on_active_change is not None:
            self._on_active_change(self.active)
        if not self.consumers:
            self._idle_since = time.monotonic()
            if self._on_idle is not None and not sub.closed:
                self._on_idle(sub)
        self._wake()
