"""A consumer attached to a subscription: its window of unacknowledged messages and the queue
its ``Receive`` stream drains."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from danube_pipeline.errors import MalformedRequestError
from danube_pipeline.records import Record

if TYPE_CHECKING:
    from broker.subscription import Subscription

DEFAULT_RECEIVER_QUEUE_SIZE = 1000
"""Unacknowledged messages a consumer may hold when it asks for no window of its own."""
MAX_BATCH_MESSAGES = 100
"""Messages per ``MessageBatch`` a ``Receive`` stream sends, at most."""


@dataclass(frozen=True, slots=True)
class Delivery:
    """One message handed to a consumer."""

    record: Record
    redelivery_count: int


class Consumer:
    """One consumer attached to a subscription.

    Attributes:
        id: u64 consumer id.
        name: the consumer's name.
        receiver_queue_size: most unacknowledged messages outstanding at once.
    """

    def __init__(self, consumer_id: int, name: str, subscription: Subscription, receiver_queue_size: int) -> None:
        self.id = consumer_id
        self.name = name
        self.subscription = subscription
        self.receiver_queue_size = receiver_queue_size
        self.outstanding: set[int] = set()
        self.queue: deque[Delivery] = deque()
        self.attached = False
        self.closed = False
        self._wake = asyncio.Event()

    @property
    def permits(self) -> int:
        """How many more messages may be handed to this consumer now."""
        return self.receiver_queue_size - len(self.outstanding)

    def push(self, delivery: Delivery) -> None:
        """Hand ``delivery`` to this consumer: it counts against the window until acknowledged."""
        self.outstanding.add(delivery.record.offset)
        self.queue.append(delivery)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    async def batches(self, *, max_messages: int = MAX_BATCH_MESSAGES) -> AsyncIterator[list[Delivery]]:
        """Yield batches of at most ``max_messages`` deliveries until the consumer closes.

        When the iteration ends (stream closed by the client, consumer closed, broker stopping)
        the consumer leaves its subscription and its unacknowledged messages are redelivered.

        Raises:
            MalformedRequestError: if another stream already receives for this consumer.
        """
        if self.attached:
            raise MalformedRequestError(f"consumer {self.id} already has a Receive stream")
        if self.closed:
            return
        self.attached = True
        self.subscription.consumer_attached(self)
        try:
            while not self.closed:
                if not self.queue:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                batch: list[Delivery] = []
                while self.queue and len(batch) < max_messages:
                    d = self.queue.popleft()
                    if d.record.offset in self.outstanding:  # not acked meanwhile
                        batch.append(d)
                if batch:
                    yield batch
        finally:
            self.subscription.remove_consumer(self, reason="stream ended")
