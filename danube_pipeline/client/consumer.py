"""The consumer facade: ``Subscribe``, then the ``Receive`` server stream into a local queue.

A background task reads ``MessageBatch`` answers into an :class:`asyncio.Queue`;
:meth:`Consumer.receive` and ``async for`` take from it. Acks are buffered and sent in one
``Ack`` call every ``ack_batch_size`` acks, every ``ack_flush_ms``, and on close.

When the stream fails with a retriable or ``invalid_metadata`` error, the consumer looks the
topic up again, subscribes again and reopens the stream; messages still in the
local queue are dropped because the broker redelivers every unacked message (at least once).

**Partitioned topics** (``docs/etcd-layout.md`` §3.1). When the lookup on open says the topic is
partitioned (:class:`~danube_pipeline.errors.PartitionedTopicError`), the consumer subscribes
to every partition ``{topic}-part-{i}`` under the same subscription name, through one inner
consumer per partition (each with its own window of ``receiver_queue_size`` messages, stream,
acks and reconnection, following its partition's owner). :meth:`Consumer.receive` takes the
partitions' messages in turn, one at a time, so each partition's messages arrive in their
order; each message's ``topic`` and ``partition`` name its partition, and :meth:`Consumer.ack`
sends the ack to that partition's consumer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import uuid
from types import TracebackType

from danube_pipeline.client._connection import Stubs
from danube_pipeline.client._context import Context
from danube_pipeline.client._status import rpc_errors, unavailable
from danube_pipeline.client._tasks import cancel_and_wait
from danube_pipeline.client.types import (
    InitialPosition,
    Message,
    SubscriptionType,
    _messages_from_delivery,
)
from danube_pipeline.errors import (
    BrokerUnavailableError,
    ConsumerClosedError,
    ConsumerNotFoundError,
    DanubeError,
    InvalidAckError,
    PartitionedTopicError,
)
from danube_pipeline.names import TopicName, validate_part
from danube_pipeline.partitions import partition_names
from danube_pipeline.proto import danube_pb2 as pb

log = logging.getLogger(__name__)

_MAX_REFUSED_ACK_ROUNDS = 16
"""An ``Ack`` refused with :class:`InvalidAckError` is sent again without the refused offsets,
at most this many times per flush (the rest are then dropped: the broker redelivers them)."""


def _ranges(offsets: list[int]) -> list[pb.OffsetRange]:
    """``offsets`` as the fewest inclusive ranges (an ack of 10,000 offsets in order is one)."""
    out: list[pb.OffsetRange] = []
    first = last = -2
    for offset in sorted(offsets):
        if offset == last + 1 or offset == last:
            last = offset
            continue
        if first >= 0:
            out.append(pb.OffsetRange(first=first, last=last))
        first = last = offset
    if first >= 0:
        out.append(pb.OffsetRange(first=first, last=last))
    return out


_MAX_SETTING_MS = 7 * 24 * 3600 * 1000


def _settings(
    *,
    ack_timeout_ms: int | None,
    nack_redelivery_delay_ms: int | None,
    nack_redelivery_max_delay_ms: int | None,
    max_redeliveries: int | None,
    dead_letter_topic: str | None,
) -> pb.SubscriptionSettings | None:
    """The redelivery settings to send on ``Subscribe``; ``None`` when none is given.

    Raises:
        ValueError: a time is negative or over 7 days, or ``max_redeliveries`` is negative.
        InvalidNameError: ``dead_letter_topic`` is not a valid topic name.
    """
    given = (ack_timeout_ms, nack_redelivery_delay_ms, nack_redelivery_max_delay_ms, max_redeliveries, dead_letter_topic)
    if all(v is None for v in given):
        return None
    for name, value in (
        ("ack_timeout_ms", ack_timeout_ms),
        ("nack_redelivery_delay_ms", nack_redelivery_delay_ms),
        ("nack_redelivery_max_delay_ms", nack_redelivery_max_delay_ms),
    ):
        if value is not None and not 0 <= value <= _MAX_SETTING_MS:
            raise ValueError(f"{name} must be from 0 to {_MAX_SETTING_MS} ms, not {value}")
    if max_redeliveries is not None and max_redeliveries < 0:
        raise ValueError(f"max_redeliveries must be >= 0, not {max_redeliveries}")
    if (
        nack_redelivery_delay_ms is not None
        and nack_redelivery_max_delay_ms is not None
        and nack_redelivery_max_delay_ms < nack_redelivery_delay_ms
    ):
        raise ValueError("nack_redelivery_max_delay_ms is below nack_redelivery_delay_ms")
    return pb.SubscriptionSettings(
        ack_timeout_ms=ack_timeout_ms or 0,
        nack_redelivery_delay_ms=nack_redelivery_delay_ms or 0,
        nack_redelivery_max_delay_ms=nack_redelivery_max_delay_ms or 0,
        max_redeliveries=max_redeliveries or 0,
        dead_letter_topic=TopicName.parse(dead_letter_topic).path if dead_letter_topic else "",
    )


def _reconnectable(exc: DanubeError) -> bool:
    # ConsumerNotFoundError: the broker forgot our consumer (restart); subscribing again fixes it.
    return exc.retriable or exc.invalid_metadata or isinstance(exc, ConsumerNotFoundError)


class Consumer:
    """Receives messages of one subscription. An async context manager and async iterator.

    Create with :meth:`DanubeClient.consumer <danube_pipeline.client.DanubeClient.consumer>`.

    Attributes:
        topic: ``"/{namespace}/{topic}"``.
        subscription: the subscription name.
        consumer_name: this consumer's name.
        consumer_id: the broker-assigned id (changes after a re-subscribe); 0 before open,
            and on a partitioned topic (see :attr:`partition_consumers`).
        partitions: the topic's partition count once open: 0 for a plain topic.
        partition_consumers: on a partitioned topic, the inner consumer of each partition
            ``{topic}-part-{i}``, by index; empty on a plain topic.
    """

    def __init__(
        self,
        ctx: Context,
        topic: str,
        *,
        subscription: str,
        subscription_type: SubscriptionType = SubscriptionType.EXCLUSIVE,
        consumer_name: str | None = None,
        initial_position: InitialPosition = InitialPosition.LATEST,
        receiver_queue_size: int = 1000,
        ack_batch_size: int = 500,
        ack_flush_ms: int = 100,
        ack_timeout_ms: int | None = None,
        nack_redelivery_delay_ms: int | None = None,
        nack_redelivery_max_delay_ms: int | None = None,
        max_redeliveries: int | None = None,
        dead_letter_topic: str | None = None,
    ) -> None:
        if receiver_queue_size <= 0 or ack_batch_size <= 0 or ack_flush_ms <= 0:
            raise ValueError("receiver_queue_size, ack_batch_size and ack_flush_ms must be > 0")
        self._settings = _settings(
            ack_timeout_ms=ack_timeout_ms,
            nack_redelivery_delay_ms=nack_redelivery_delay_ms,
            nack_redelivery_max_delay_ms=nack_redelivery_max_delay_ms,
            max_redeliveries=max_redeliveries,
            dead_letter_topic=dead_letter_topic,
        )
        self._ctx = ctx
        self.topic = TopicName.parse(topic).path
        self.subscription = validate_part("subscription", subscription)
        self.consumer_name = validate_part(
            "consumer", consumer_name or f"consumer-{uuid.uuid4().hex[:12]}"
        )
        self._subscription_type = SubscriptionType(subscription_type)
        self._initial_position = InitialPosition(initial_position)
        self._receiver_queue_size = receiver_queue_size
        self._ack_batch_size = ack_batch_size
        self._ack_flush_ms = ack_flush_ms
        self._ack_flush_s = ack_flush_ms / 1000
        self.partitions = 0
        self.partition_consumers: list[Consumer] = []
        self._by_topic: dict[str, Consumer] = {}
        self._partition: int | None = None  # this consumer's index, when it is a partition's
        self._turn = 0
        self.consumer_id = 0
        self._stubs: Stubs | None = None
        self._messages: collections.deque[Message] = collections.deque()
        self._terminal: BaseException | None = None  # after the queued messages: raised forever
        self._arrived = asyncio.Event()
        self._acks: list[int] = []
        self._ack_lock = asyncio.Lock()
        self._ack_error: DanubeError | None = None
        self._state = "new"
        self._receiver: asyncio.Task[None] | None = None
        self._acker: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Consumer:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def open(self) -> Consumer:
        """Subscribe and start receiving.

        Returns:
            This consumer.

        Raises:
            TopicNotFoundError: the topic does not exist (consumers do not create topics).
            SubscriptionBusyError: an Exclusive subscription already has a consumer.
            BrokerUnavailableError: no broker answered within the retry budget.
            DanubeError: another refusal from the broker.
        """
        if self._state != "new":
            raise ConsumerClosedError(f"consumer {self.consumer_name!r} was already opened")
        try:
            await self._subscribe(refresh=False)
        except PartitionedTopicError as exc:
            await self._open_partitions(exc.partitions)
            self._state = "open"
            self._ctx.children.add(self)
            return self
        self._state = "open"
        self._ctx.children.add(self)
        loop = asyncio.get_running_loop()
        self._receiver = loop.create_task(self._receive_loop())
        self._acker = loop.create_task(self._ack_loop())
        return self

    async def _open_partitions(self, partitions: int) -> None:
        """Subscribe to every partition of the topic through one inner consumer each, all at
        once; if one fails, close those that opened and raise its error."""
        inners = [
            Consumer(
                self._ctx,
                name.path,
                subscription=self.subscription,
                subscription_type=self._subscription_type,
                consumer_name=self.consumer_name,
                initial_position=self._initial_position,
                receiver_queue_size=self._receiver_queue_size,
                ack_batch_size=self._ack_batch_size,
                ack_flush_ms=self._ack_flush_ms,
            )
            for name in partition_names(TopicName.parse(self.topic), partitions)
        ]
        for index, inner in enumerate(inners):
            inner._partition = index
            inner._settings = self._settings  # the subscription's settings on every partition
            inner._arrived = self._arrived  # a delivery to any partition wakes receive()
        results = await asyncio.gather(*(c.open() for c in inners), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(c.close() for c in inners), return_exceptions=True)
            raise failed[0]
        self.partition_consumers = inners
        self._by_topic = {c.topic: c for c in inners}
        self.partitions = partitions

    async def close(self) -> None:
        """Flush buffered acks, stop receiving and ``CloseConsumer`` (on a partitioned topic:
        every partition's consumer). Safe to call twice.

        Raises:
            DanubeError: the broker refused buffered acks with a non-retriable error (acks
                lost to a retriable error are redelivered later instead).
        """
        if self._state in ("closed", "new"):
            self._state = "closed"
            return
        self._state = "closed"
        self._ctx.children.discard(self)
        if self.partition_consumers:
            results = await asyncio.gather(*(c.close() for c in self.partition_consumers), return_exceptions=True)
            self._end(ConsumerClosedError(f"consumer {self.consumer_name!r} is closed"))
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            return
        # Acks first, while the Receive stream is open: the broker refuses acks of a consumer
        # whose stream ended (its messages went back for redelivery).
        await cancel_and_wait(self._acker)
        try:
            await self._flush_acks()
        except DanubeError as exc:
            log.warning("consumer %s: acks not flushed on close: %s", self.consumer_name, exc)
        await cancel_and_wait(self._receiver)
        await self._close_on_broker()
        self._end(ConsumerClosedError(f"consumer {self.consumer_name!r} is closed"))
        error, self._ack_error = self._ack_error, None
        if error is not None:
            raise error

    async def _close_on_broker(self) -> None:
        stubs = self._stubs
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

    # ------------------------------------------------------------------ receiving

    async def receive(self, *, timeout_ms: int | None = None) -> Message:
        """The next message.

        Args:
            timeout_ms: how long to wait, in milliseconds; ``None`` waits forever.

        Returns:
            The next :class:`Message`, in offset order for an Exclusive subscription (per
            partition, on a partitioned topic: the partitions take turns).

        Raises:
            TimeoutError: no message arrived within ``timeout_ms``.
            ConsumerClosedError: the consumer is not open.
            BrokerUnavailableError: the stream failed and re-subscribing ran out of retries.
            DanubeError: the stream failed with a non-retriable error.
        """
        if self._state == "new":
            raise ConsumerClosedError(f"consumer {self.consumer_name!r} is not open")
        if self.partition_consumers:
            return await self._receive_partitions(timeout_ms)
        messages = self._messages
        if messages:
            return messages.popleft()
        loop = asyncio.get_running_loop()
        deadline = None if timeout_ms is None else loop.time() + timeout_ms / 1000
        while not messages:
            if self._terminal is not None:
                raise self._terminal
            self._arrived.clear()
            if deadline is None:
                await self._arrived.wait()
            else:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError(f"no message within {timeout_ms} ms")
                await asyncio.wait_for(self._arrived.wait(), remaining)
        return messages.popleft()

    def _next_queued(self) -> Message | None:
        """The next queued message of the partitions, taking them in turn."""
        inners = self.partition_consumers
        count = len(inners)
        for step in range(count):
            index = (self._turn + step) % count
            queue = inners[index]._messages
            if queue:
                self._turn = (index + 1) % count
                return queue.popleft()
        return None

    async def _receive_partitions(self, timeout_ms: int | None) -> Message:
        loop = asyncio.get_running_loop()
        deadline = None if timeout_ms is None else loop.time() + timeout_ms / 1000
        while True:
            message = self._next_queued()
            if message is not None:
                return message
            if self._terminal is not None:
                raise self._terminal
            for inner in self.partition_consumers:
                if inner._terminal is not None:  # a partition's stream failed for good
                    raise inner._terminal
            self._arrived.clear()
            if deadline is None:
                await self._arrived.wait()
            else:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError(f"no message within {timeout_ms} ms")
                await asyncio.wait_for(self._arrived.wait(), remaining)

    def _deliver(self, messages: list[Message]) -> None:
        self._messages.extend(messages)
        self._arrived.set()

    def _end(self, error: BaseException) -> None:
        """No message will arrive any more: after the queued ones, ``receive`` raises ``error``
        (the first end wins: a stream failure stays the answer after a later close)."""
        if self._terminal is None:
            self._terminal = error
        self._arrived.set()

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> Message:
        try:
            return await self.receive()
        except ConsumerClosedError:
            raise StopAsyncIteration from None

    async def _subscribe(self, *, refresh: bool) -> None:
        request = pb.SubscribeRequest(
            topic=self.topic,
            subscription=self.subscription,
            subscription_type=self._subscription_type.name,
            consumer_name=self.consumer_name,
            initial_position=self._initial_position.name,
            receiver_queue_size=self._receiver_queue_size,
            request_id=uuid.uuid4().hex,  # the same on every retry of this subscribe
            settings=self._settings,
        )

        async def subscribe(stubs: Stubs) -> tuple[Stubs, pb.SubscribeResponse]:
            return stubs, await stubs.consumer.Subscribe(request, timeout=self._ctx.request_timeout_s)

        self._stubs, response = await self._ctx.call_owner(self.topic, subscribe, refresh=refresh)
        self.consumer_id = response.consumer_id

    async def _receive_loop(self) -> None:
        while True:
            stubs = self._stubs
            assert stubs is not None
            call = stubs.consumer.Receive(pb.ReceiveRequest(consumer_id=self.consumer_id))
            try:
                with rpc_errors(stubs.address):
                    async for deliveries in call:
                        for delivery in deliveries.batches:
                            self._deliver(_messages_from_delivery(self.topic, delivery, self._partition))
                error: DanubeError = unavailable(stubs.address, "Receive stream ended by the broker")
            except DanubeError as exc:
                error = exc
            finally:
                call.cancel()
            if not _reconnectable(error):
                self._end(error)
                return
            log.info("consumer %s: stream failed (%s); subscribing again", self.consumer_name, error)
            if isinstance(error, BrokerUnavailableError):
                self._ctx.pool.discard(stubs.address)
                self._ctx.metadata.invalidate(self.topic)
            self._drop_queued()
            try:
                await self._resubscribe(refresh=error.invalid_metadata)
            except DanubeError as exc:
                self._end(exc)
                return

    async def _resubscribe(self, *, refresh: bool) -> None:
        old = self._stubs
        if old is not None and self.consumer_id:
            # Free an Exclusive subscription held by our old consumer if that broker still has it.
            with contextlib.suppress(DanubeError), rpc_errors(old.address):
                await old.consumer.CloseConsumer(
                    pb.CloseConsumerRequest(consumer_id=self.consumer_id),
                    timeout=self._ctx.request_timeout_s,
                )
        async with self._ack_lock:
            if self._acks:
                # They were delivered to the old consumer, which is gone: the broker refuses
                # them from the new one and redelivers those messages.
                log.info("consumer %s: %d unsent acks dropped on re-subscribe (redelivered)",
                         self.consumer_name, len(self._acks))
                self._acks = []
        await asyncio.sleep(self._ctx.backoff_s)
        await self._subscribe(refresh=refresh)

    def _drop_queued(self) -> None:
        """Forget the messages received on a stream that failed: the broker redelivers them."""
        self._messages.clear()

    # ------------------------------------------------------------------ acks

    async def ack(self, message: Message | int) -> None:
        """Acknowledge a message (buffered).

        The offset is sent with others every ``ack_batch_size`` acks, every ``ack_flush_ms``
        and on :meth:`close`. An acknowledged message is not delivered to the subscription
        again. The broker takes an ack only from the consumer the message was delivered to
        (``InvalidAckError`` otherwise): an ack it refuses (a message received before a
        re-subscribe and since redelivered, or acked twice) is logged and dropped, and the
        message is delivered again (at-least-once).

        Args:
            message: the :class:`Message`, or its offset (on a plain topic only: on a
                partitioned topic the message says which partition the ack goes to).

        Raises:
            ConsumerClosedError: the consumer is not open.
            ValueError: on a partitioned topic, an offset alone, or a message of another topic.
            DanubeError: an earlier flush was refused with a non-retriable error.
        """
        if self._state != "open":
            raise ConsumerClosedError(f"consumer {self.consumer_name!r} is not open")
        if self.partition_consumers:
            inner = self._by_topic.get(message.topic) if isinstance(message, Message) else None
            if inner is None:
                raise ValueError(
                    f"{self.topic} is partitioned: ack the Message received (it names its partition), "
                    f"not {message!r}"
                )
            await inner.ack(message)
            return
        error, self._ack_error = self._ack_error, None
        if error is not None:
            raise error
        self._acks.append(message.offset if isinstance(message, Message) else int(message))
        if len(self._acks) >= self._ack_batch_size:
            await self._flush_acks_quietly()

    async def nack(self, message: Message, *, reason: str = "") -> None:
        """Negatively acknowledge a message: processing it failed, deliver it again.

        Sent at once (not buffered). The broker redelivers it, to this consumer or another,
        after the subscription's ``nack_redelivery_delay_ms`` doubled for each earlier
        redelivery (at most ``nack_redelivery_max_delay_ms``), with ``redelivery_count + 1``;
        once it was redelivered ``max_redeliveries`` times (when set), the next nack sends it to
        the dead-letter topic instead, with ``reason`` in its ``danube.dlq.reason`` attribute.
        Pulsar's ``negativeAcknowledge``. Per-key order holds no more for a nacked message
        (the messages after it may be processed first).

        Args:
            message: a :class:`Message` this consumer received and did not acknowledge.
            reason: why processing failed (UTF-8 text, kept with a dead-lettered message).

        Raises:
            ConsumerClosedError: the consumer is not open.
            ValueError: on a partitioned topic, a message of another topic.
            InvalidAckError: the message is not this consumer's to nack (acknowledged or nacked
                already, or redelivered elsewhere since a re-subscribe); nothing changed.
            DanubeError: another refusal from the broker. A nack lost to a broken connection
                is not raised: the broker redelivers every message of the old stream.
        """
        if self._state != "open":
            raise ConsumerClosedError(f"consumer {self.consumer_name!r} is not open")
        if self.partition_consumers:
            inner = self._by_topic.get(message.topic)
            if inner is None:
                raise ValueError(f"message of {message.topic} is not of {self.topic}")
            await inner.nack(message, reason=reason)
            return
        stubs = self._stubs
        assert stubs is not None
        request = pb.NackRequest(
            consumer_id=self.consumer_id,
            ranges=[pb.OffsetRange(first=message.offset, last=message.offset)],
            reason=reason,
        )
        try:
            with rpc_errors(stubs.address):
                await stubs.consumer.Nack(request, timeout=self._ctx.request_timeout_s)
        except DanubeError as exc:
            if not _reconnectable(exc) or isinstance(exc, InvalidAckError):
                raise
            log.info("consumer %s: nack of %d not sent (%s); the broker redelivers it", self.consumer_name,
                     message.offset, exc)

    async def _flush_acks(self) -> None:
        async with self._ack_lock:
            offsets, self._acks = self._acks, []
            if not offsets:
                return
            stubs = self._stubs
            assert stubs is not None
            try:
                for _ in range(_MAX_REFUSED_ACK_ROUNDS):
                    try:
                        with rpc_errors(stubs.address):
                            await stubs.consumer.Ack(
                                pb.AckRequest(consumer_id=self.consumer_id, ranges=_ranges(offsets)),
                                timeout=self._ctx.request_timeout_s,
                            )
                        break
                    except InvalidAckError as refused:
                        # Not ours to ack any more (redelivered elsewhere after a re-subscribe,
                        # or acked already by a flush the broker applied before it was
                        # cancelled): the broker applied nothing; send the rest without them.
                        log.info("consumer %s: %s", self.consumer_name, refused)
                        offsets = [o for o in offsets if not refused.first_offset <= o <= refused.last_offset]
                        if not offsets:
                            break
                else:
                    log.info("consumer %s: %d acks dropped after %d refusals (redelivered)",
                             self.consumer_name, len(offsets), _MAX_REFUSED_ACK_ROUNDS)
            except DanubeError as exc:
                if _reconnectable(exc):
                    self._acks[:0] = offsets  # sent again after the re-subscribe
                raise
            except asyncio.CancelledError:
                # close() (or a re-subscribe) cancelled the flush mid-RPC: keep the offsets so the
                # next flush sends them. If the broker applied them, it refuses the repeat and they are dropped.
                self._acks[:0] = offsets
                raise

    async def _flush_acks_quietly(self) -> None:
        try:
            await self._flush_acks()
        except DanubeError as exc:
            if _reconnectable(exc):
                log.info("consumer %s: ack flush deferred: %s", self.consumer_name, exc)
            else:
                self._ack_error = exc

    async def _ack_loop(self) -> None:
        while True:
            await asyncio.sleep(self._ack_flush_s)
            await self._flush_acks_quietly()

    def __repr__(self) -> str:
        return (
            f"Consumer(topic={self.topic!r}, subscription={self.subscription!r}, "
            f"consumer_id={self.consumer_id}, partitions={self.partitions}, state={self._state!r})"
        )
