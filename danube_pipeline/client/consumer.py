"""The consumer facade: ``Subscribe``, then the ``Receive`` server stream into a local queue.

A background task reads ``MessageBatch`` answers into a local queue;
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

The machinery lives in private modules: :mod:`~danube_pipeline.client._receiver` (the local
queue, the stream and the re-subscribe), :mod:`~danube_pipeline.client._acks` (acks and nacks)
and :mod:`~danube_pipeline.client._partitioned` (the inner consumers of a partitioned topic).
"""

from __future__ import annotations

import asyncio
import datetime
import uuid
from types import TracebackType

from danube_pipeline.client._context import Context
from danube_pipeline.client._partitioned import open_all
from danube_pipeline.client._receiver import Inbox, Receiver
from danube_pipeline.client._redelivery import subscription_settings
from danube_pipeline.client.types import InitialPosition, Message, SubscriptionType
from danube_pipeline.errors import ConsumerClosedError, PartitionedTopicError
from danube_pipeline.names import TopicName, validate_part
from danube_pipeline.partitions import partition_names
from danube_pipeline.proto import danube_pb2 as pb



def start_publish_time_us_of(start_publish_time_us: int | None, start_publish_time: datetime.datetime | None) -> int | None:
    """The start publish time of a new subscription in µs since the Unix epoch, from either
    form :meth:`danube_pipeline.client.DanubeClient.consumer` takes.

    Raises:
        ValueError: both are given, or the ``datetime`` is naive (no time zone).
    """
    if start_publish_time is None:
        return start_publish_time_us
    if start_publish_time_us is not None:
        raise ValueError("give start_publish_time_us or start_publish_time, not both")
    if start_publish_time.tzinfo is None:
        raise ValueError("start_publish_time must be timezone-aware (e.g. datetime.now(timezone.utc))")
    delta = start_publish_time - datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
    return delta // datetime.timedelta(microseconds=1)

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
        start_publish_time_us: int | None = None,
    ) -> None:
        if start_publish_time_us is not None and start_publish_time_us < 0:
            raise ValueError("start_publish_time_us must not be negative")
        self._start_publish_time_us = start_publish_time_us
        if receiver_queue_size <= 0 or ack_batch_size <= 0 or ack_flush_ms <= 0:
            raise ValueError("receiver_queue_size, ack_batch_size and ack_flush_ms must be > 0")
        self._settings = subscription_settings(
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
        self.partitions = 0
        self.partition_consumers: list[Consumer] = []
        self._by_topic: dict[str, Consumer] = {}
        self._partition: int | None = None  # this consumer's index, when it is a partition's
        self._inbox = Inbox()
        self._receiver: Receiver | None = None  # once subscribed, on a plain topic (or partition)
        self._state = "new"

    @property
    def consumer_id(self) -> int:
        """The broker-assigned id; 0 before open and on a partitioned topic."""
        return 0 if self._receiver is None else self._receiver.consumer_id

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
        receiver = Receiver(
            self._ctx,
            pb.SubscribeRequest(
                topic=self.topic,
                subscription=self.subscription,
                subscription_type=self._subscription_type.name,
                consumer_name=self.consumer_name,
                initial_position=self._initial_position.name,
                receiver_queue_size=self._receiver_queue_size,
                settings=self._settings,
                start_publish_time_us=self._start_publish_time_us,
            ),
            partition=self._partition,
            inbox=self._inbox,
            ack_batch_size=self._ack_batch_size,
            ack_flush_ms=self._ack_flush_ms,
        )
        try:
            await receiver.subscribe(refresh=False)
        except PartitionedTopicError as exc:
            await self._open_partitions(exc.partitions)
            self._state = "open"
            self._ctx.children.add(self)
            return self
        self._receiver = receiver
        self._state = "open"
        self._ctx.children.add(self)
        receiver.start()
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
                start_publish_time_us=self._start_publish_time_us,
            )
            for name in partition_names(TopicName.parse(self.topic), partitions)
        ]
        for index, inner in enumerate(inners):
            inner._partition = index
            inner._settings = self._settings  # the subscription's settings on every partition
            inner._inbox.arrived = self._inbox.arrived  # a delivery to any partition wakes receive()
        await open_all(inners)
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
            self._inbox.end(ConsumerClosedError(f"consumer {self.consumer_name!r} is closed"))
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            return
        receiver = self._receiver
        assert receiver is not None
        await receiver.close()
        self._inbox.end(ConsumerClosedError(f"consumer {self.consumer_name!r} is closed"))
        error = receiver.acks.take_error()
        if error is not None:
            raise error

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
            return await self._inbox.take_in_turn([c._inbox for c in self.partition_consumers], timeout_ms)
        return await self._inbox.take(timeout_ms)

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> Message:
        try:
            return await self.receive()
        except ConsumerClosedError:
            raise StopAsyncIteration from None

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
        receiver = self._receiver
        assert receiver is not None
        await receiver.acks.add(message.offset if isinstance(message, Message) else int(message))

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
        receiver = self._receiver
        assert receiver is not None
        await receiver.acks.nack(message, reason)

    async def _flush_acks(self) -> None:
        """Send the buffered acks now (see :meth:`AckBuffer.flush
        <danube_pipeline.client._acks.AckBuffer.flush>`)."""
        receiver = self._receiver
        assert receiver is not None
        await receiver.acks.flush()

    def __repr__(self) -> str:
        return (
            f"Consumer(topic={self.topic!r}, subscription={self.subscription!r}, "
            f"consumer_id={self.consumer_id}, partitions={self.partitions}, state={self._state!r})"
        )
