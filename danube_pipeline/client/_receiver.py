"""A consumer's receiving side: ``Subscribe`` on the topic's owner, the ``Receive`` server stream
into a local queue, subscribing again after a failure, and ``CloseConsumer``.

When the stream fails with a retriable or ``invalid_metadata`` error, the receiver looks the
topic up again, subscribes again and reopens the stream; messages still in the local queue are
dropped because the broker redelivers every unacked message (at least once).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import uuid
from collections.abc import Sequence

from danube_pipeline.aio import wait_set
from danube_pipeline.client._acks import AckBuffer, reconnectable
from danube_pipeline.client._connection import Stubs
from danube_pipeline.client._context import Context
from danube_pipeline.client._tasks import being_cancelled, cancel_and_wait
from danube_pipeline.client.status import rpc_errors, unavailable
from danube_pipeline.client.types import Message, _messages_from_delivery
from danube_pipeline.errors import BrokerUnavailableError, DanubeError, StreamEndedError
from danube_pipeline.proto import danube_pb2 as pb

# The facade's logger: users configure one logger per public module.
log = logging.getLogger("danube_pipeline.client.consumer")


class Inbox:
    """Messages received and not taken yet, in arrival order, and how receiving ended.

    Attributes:
        messages: the queue.
        terminal: once set, what taking raises after the queued messages, forever.
        arrived: set on each delivery and at the end; a partitioned consumer's inner inboxes
            share their parent's, so that a delivery to any partition wakes the taker.
    """

    def __init__(self) -> None:
        self.messages: collections.deque[Message] = collections.deque()
        self.terminal: BaseException | None = None
        self.arrived = asyncio.Event()
        self._turn = 0

    def deliver(self, messages: list[Message]) -> None:
        """Queue ``messages`` and wake the taker."""
        self.messages.extend(messages)
        self.arrived.set()

    def end(self, error: BaseException) -> None:
        """No message will arrive any more: after the queued ones, ``receive`` raises ``error``
        (the first end wins: a stream failure stays the answer after a later close)."""
        if self.terminal is None:
            self.terminal = error
        self.arrived.set()

    def drop(self) -> None:
        """Forget the messages received on a stream that failed: the broker redelivers them."""
        self.messages.clear()

    async def take(self, timeout_ms: int | None) -> Message:
        """The next queued message, waiting for one at most ``timeout_ms`` (``None``: forever).

        Raises:
            TimeoutError: no message arrived within ``timeout_ms``.
            BaseException: :attr:`terminal`, once the queue is empty.
        """
        messages = self.messages
        if messages:
            return messages.popleft()
        deadline = self._deadline(timeout_ms)
        while not messages:
            if self.terminal is not None:
                raise self.terminal
            await self._wait(deadline, timeout_ms)
        return messages.popleft()

    async def take_in_turn(self, inboxes: Sequence[Inbox], timeout_ms: int | None) -> Message:
        """The next message of a partitioned consumer's partitions (``inboxes``, sharing this
        inbox's :attr:`arrived`), taking them in turn, one message at a time.

        Raises:
            TimeoutError: no message arrived within ``timeout_ms``.
            BaseException: this inbox's :attr:`terminal`, or a partition's once its stream
                failed for good.
        """
        deadline = self._deadline(timeout_ms)
        while True:
            message = self._next_in_turn(inboxes)
            if message is not None:
                return message
            if self.terminal is not None:
                raise self.terminal
            for inbox in inboxes:
                if inbox.terminal is not None:  # a partition's stream failed for good
                    raise inbox.terminal
            await self._wait(deadline, timeout_ms)

    def _next_in_turn(self, inboxes: Sequence[Inbox]) -> Message | None:
        """The next queued message of the partitions, taking them in turn."""
        count = len(inboxes)
        for step in range(count):
            index = (self._turn + step) % count
            queue = inboxes[index].messages
            if queue:
                self._turn = (index + 1) % count
                return queue.popleft()
        return None

    @staticmethod
    def _deadline(timeout_ms: int | None) -> float | None:
        return None if timeout_ms is None else asyncio.get_running_loop().time() + timeout_ms / 1000

    async def _wait(self, deadline: float | None, timeout_ms: int | None) -> None:
        """Wait for the next delivery or end, until ``deadline`` (loop time, s)."""
        self.arrived.clear()
        if deadline is None:
            await self.arrived.wait()
        else:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0 or not await wait_set(self.arrived, remaining):
                raise TimeoutError(f"no message within {timeout_ms} ms")


class Receiver:
    """One consumer of a plain topic (or of one partition) on the topic's owner.

    Args:
        ctx: the client's shared context.
        request: the ``Subscribe`` request, sent with a new ``request_id`` on each subscribe
            (the same on every retry of one subscribe).
        partition: the partition's index, when the topic is one; carried by each message.
        inbox: where received messages are queued.
        ack_batch_size: acks buffered before they are sent.
        ack_flush_ms: how often buffered acks are sent anyway, in milliseconds.

    Attributes:
        stubs: the owner's stubs once subscribed.
        consumer_id: the broker-assigned id (changes after a re-subscribe); 0 before.
        acks: this consumer's acknowledgements.
    """

    def __init__(
        self,
        ctx: Context,
        request: pb.SubscribeRequest,
        *,
        partition: int | None,
        inbox: Inbox,
        ack_batch_size: int,
        ack_flush_ms: int,
    ) -> None:
        self._ctx = ctx
        self._request = request
        self._topic = request.topic
        self._consumer_name = request.consumer_name
        self._partition = partition
        self._inbox = inbox
        self.stubs: Stubs | None = None
        self.consumer_id = 0
        self.acks = AckBuffer(
            ctx, self._consumer_name, self, ack_batch_size=ack_batch_size, ack_flush_ms=ack_flush_ms
        )
        self._receiving: asyncio.Task[None] | None = None
        self._acking: asyncio.Task[None] | None = None

    async def subscribe(self, *, refresh: bool) -> None:
        """``Subscribe`` on the topic's owner.

        Args:
            refresh: look the topic up again first.

        Raises:
            PartitionedTopicError: the topic is partitioned.
            DanubeError: the broker refused, or no broker answered within the retry budget.
        """
        request = pb.SubscribeRequest()
        request.CopyFrom(self._request)
        request.request_id = uuid.uuid4().hex  # the same on every retry of this subscribe

        async def subscribe(stubs: Stubs) -> tuple[Stubs, pb.SubscribeResponse]:
            return stubs, await stubs.consumer.Subscribe(request, timeout=self._ctx.request_timeout_s)

        self.stubs, response = await self._ctx.call_owner(self._topic, subscribe, refresh=refresh)
        self.consumer_id = response.consumer_id

    def start(self) -> None:
        """Start receiving and sending acks in the background (after :meth:`subscribe`)."""
        loop = asyncio.get_running_loop()
        self._receiving = loop.create_task(self._receive_loop())
        self._acking = loop.create_task(self.acks.run())

    async def close(self) -> None:
        """Send the buffered acks, stop receiving and ``CloseConsumer`` (a failure is logged)."""
        # Acks first, while the Receive stream is open: the broker refuses acks of a consumer
        # whose stream ended (its messages went back for redelivery).
        await cancel_and_wait(self._acking)
        try:
            await self.acks.flush()
        except DanubeError as exc:
            log.warning("consumer %s: acks not flushed on close: %s", self._consumer_name, exc)
        await cancel_and_wait(self._receiving)
        await self._close_on_broker()

    async def _close_on_broker(self) -> None:
        stubs = self.stubs
        if stubs is None or not self.consumer_id:
            return
        try:
            with rpc_errors(stubs.address):
                await stubs.consumer.CloseConsumer(
                    pb.CloseConsumerRequest(consumer_id=self.consumer_id),
                    timeout=self._ctx.request_timeout_s,
                )
        except DanubeError as exc:
            log.info("CloseConsumer %d on %s failed: %s", self.consumer_id, stubs.address, exc)

    async def _receive_loop(self) -> None:
        """Receive until the consumer closes; subscribe again when the stream ends or fails
        (:func:`reconnectable`). A stream the broker ended cleanly (it closed the consumer:
        the topic was unloaded or moved) keeps the connection, which other producers and
        consumers share; a stream cancelled under us (a discarded channel) subscribes again
        over a fresh one."""
        while True:
            stubs = self.stubs
            assert stubs is not None
            call = stubs.consumer.Receive(pb.ReceiveRequest(consumer_id=self.consumer_id))
            try:
                with rpc_errors(stubs.address):
                    async for deliveries in call:
                        for delivery in deliveries.batches:
                            self._inbox.deliver(_messages_from_delivery(self._topic, delivery, self._partition))
                error: DanubeError = StreamEndedError(stubs.address, "Receive")
            except DanubeError as exc:
                error = exc
            except asyncio.CancelledError:
                if being_cancelled():
                    raise  # closing
                # The call was cancelled, not this task: its channel was closed under it.
                error = unavailable(stubs.address, "Receive stream cancelled")
            finally:
                call.cancel()
            if not reconnectable(error):
                self._inbox.end(error)
                return
            log.info("consumer %s: stream failed (%s); subscribing again", self._consumer_name, error)
            if isinstance(error, BrokerUnavailableError):
                self._ctx.pool.discard(stubs.address, stubs)
                self._ctx.metadata.invalidate(self._topic)
            self._inbox.drop()
            try:
                await self._resubscribe(refresh=error.invalid_metadata)
            except DanubeError as exc:
                self._inbox.end(exc)
                return

    async def _resubscribe(self, *, refresh: bool) -> None:
        old = self.stubs
        if old is not None and self.consumer_id:
            # Free an Exclusive subscription held by our old consumer if that broker still has it.
            with contextlib.suppress(DanubeError), rpc_errors(old.address):
                await old.consumer.CloseConsumer(
                    pb.CloseConsumerRequest(consumer_id=self.consumer_id),
                    timeout=self._ctx.request_timeout_s,
                )
        await self.acks.drop_unsent()
        await asyncio.sleep(self._ctx.backoff_s)
        await self.subscribe(refresh=refresh)
