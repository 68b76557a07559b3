"""The producer facade: batches messages and pipelines them on its lane of a ``ProduceStream``.

Messages are framed by the :class:`~danube_pipeline.client._accumulator.Accumulator` into
record batches (:mod:`danube_pipeline.format.batches`). With ``linger_ms=0`` (the default) a batch is
sent as soon as one of the ``max_in_flight_batches`` slots is free, so a lone message goes at
once and a burst goes as one batch, while under load batches grow with the acks' round trip
(Nagle's rule with pipelining); with ``linger_ms > 0`` a batch waits that long for more
messages (Kafka's ``linger.ms``). Each closed batch travels as one
``SendBatchRequest`` with a client-chosen ``sequence_id``, its header carrying this producer's
id, name and schema and a CRC32C, on the producer's lane of the client's one ``ProduceStream``
to the topic's owner (shared by every producer of the client on that broker; the batches ready
together go in one request, :mod:`~danube_pipeline.client._produce_stream`). The broker checks
the batch and appends its bytes unchanged, in the order it reads them, and answers each lane in
the same order, so the answer at the head of the lane belongs to the oldest unanswered batch,
whose message ``i`` gets the offset ``first_offset + i``. At most ``max_in_flight_batches``
batches are unanswered at once.

When the lane fails (an error answer on it, or the failure of the whole stream):

* with an error whose ``invalid_metadata`` flag is set (``UNAVAILABLE``,
  ``NotServedHereError``, ``ProducerNotFoundError``), the producer waits ``retry_backoff_ms``,
  looks the topic up again, re-creates itself on the (possibly new) owner and resends every
  unanswered batch in order, framed again under its new producer id: delivery is at least once;
* with an error that is only ``retriable`` (``StorageFullError``: the broker's disk is full),
  it waits ``retry_backoff_ms`` and resends on a new lane as the same producer;
* either way, the oldest unanswered batch fails with the error once it was tried
  ``1 + metadata_retries`` times;
* with any other error (``MessageTooLargeError``, ``SchemaMismatchError``), exactly the futures
  of the batch the broker was answering fail; the producer opens a new lane and the later
  batches are sent again.

**Partitioned topics** (``docs/etcd-layout.md`` §3.1). When the lookup on open says the topic is
partitioned (:class:`~danube_pipeline.errors.PartitionedTopicError`), the producer opens one
inner producer per partition ``{topic}-part-{i}``, with the same name, schema and options, and
routes each message (:mod:`danube_pipeline.client._partitioner`): by the murmur2 hash of its
``key`` (Kafka's default partitioner: one key, one partition, in order), or round-robin per
message when it has none. Each inner producer batches, retries and follows its partition's
owner on its own; ``send`` answers a :class:`~danube_pipeline.client.types.MessageId` whose
``partition`` says where the message went.

The machinery lives in private modules: :mod:`~danube_pipeline.client._send_stream` (the
lane, its answers and the resends), :mod:`~danube_pipeline.client._produce_stream` (the shared
stream), :mod:`~danube_pipeline.client._accumulator` (batching)
and :mod:`~danube_pipeline.client._partitioned` (the inner producers of a partitioned topic).
"""

from __future__ import annotations

import asyncio
import typing
from collections.abc import Mapping, Sequence
from types import TracebackType

from danube_pipeline.client._context import Context
from danube_pipeline.client._partitioned import in_partition, open_all
from danube_pipeline.client._partitioner import Partitioner
from danube_pipeline.client._send_stream import BatchSender
from danube_pipeline.client.types import MessageId, Schema
from danube_pipeline.errors import MessageTooLargeError, PartitionedTopicError, ProducerClosedError
from danube_pipeline.names import TopicName, validate_part
from danube_pipeline.partitions import partition_names


class Producer:
    """Publishes messages to one topic. Use as an async context manager.

    Create with :meth:`DanubeClient.producer <danube_pipeline.client.DanubeClient.producer>`.
    Entering the context looks the topic up, registers the schema if one was given (Avro, JSON
    Schema or Protobuf; ``SchemaRegistry.RegisterSchema``) and calls ``CreateProducer`` (which
    creates the topic if needed); leaving it flushes and calls ``CloseProducer``.

    Attributes:
        topic: ``"/{namespace}/{topic}"``.
        producer_name: the producer's name.
        producer_id: the broker-assigned id (changes if the producer is re-created after a
            broker failure); 0 before open, and on a partitioned topic (see
            :attr:`partition_producers`).
        idempotent_producer_id: the idempotent identity's producer id, assigned at open
            through etcd per topic and producer name, and kept when the producer is re-created
            after a reconnect or a topic move; 0 before open and on a partitioned topic.
        producer_epoch: the identity's epoch: a newer producer opened under the same name
            bumps it, and this one's later sends fail with
            :class:`~danube_pipeline.errors.ProducerFencedError`.
        schema_id: the registered schema's global id; 0 without a schema.
        schema_version: the schema's version within its subject; 0 without a schema.
        max_message_size_bytes: largest payload accepted, in bytes (the namespace policy's
            ``max_message_size``, ``docs/etcd-layout.md`` §2.1).
        partitions: the topic's partition count once open: 0 for a plain topic.
        partition_producers: on a partitioned topic, the inner producer of each partition
            ``{topic}-part-{i}``, by index; empty on a plain topic.
    """

    def __init__(
        self,
        ctx: Context,
        topic: str,
        *,
        producer_name: str,
        schema: Schema | None = None,
        linger_ms: int = 0,
        max_batch_messages: int = 1000,
        max_batch_bytes: int = 1 << 20,
        max_in_flight_batches: int = 8,
    ) -> None:
        if max_in_flight_batches <= 0:
            raise ValueError("max_in_flight_batches must be > 0")
        self._ctx = ctx
        self.topic = TopicName.parse(topic).path
        self.producer_name = validate_part("producer", producer_name)
        self._options = {
            "linger_ms": linger_ms,
            "max_batch_messages": max_batch_messages,
            "max_batch_bytes": max_batch_bytes,
            "max_in_flight_batches": max_in_flight_batches,
        }
        self.partitions = 0
        self.partition_producers: list[Producer] = []
        self._partitioner: Partitioner | None = None
        self._schema = schema
        self._sender = BatchSender(ctx, self.topic, producer_name=self.producer_name, schema=schema, **self._options)
        self._state = "new"

    @property
    def producer_id(self) -> int:
        """The broker-assigned id; 0 before open and on a partitioned topic."""
        return self._sender.producer_id

    @property
    def idempotent_producer_id(self) -> int:
        """The idempotent identity's producer id; 0 before open and on a partitioned topic."""
        return self._sender.idempotent_producer_id

    @property
    def producer_epoch(self) -> int:
        """The idempotent identity's epoch; 0 before open and on a partitioned topic."""
        return self._sender.producer_epoch

    @property
    def schema_id(self) -> int:
        """The registered schema's global id; 0 without a schema."""
        return self._sender.schema_id

    @property
    def schema_version(self) -> int:
        """The schema's version within its subject; 0 without a schema."""
        return self._sender.schema_version

    @property
    def max_message_size_bytes(self) -> int:
        """Largest payload accepted, in bytes."""
        return self._sender.max_message_size_bytes

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Producer:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def open(self) -> Producer:
        """Look up the topic, register the schema if any, and create the producer (on a
        partitioned topic: one per partition, see the module docstring).

        Returns:
            This producer.

        Raises:
            InvalidSchemaError: the schema does not parse (from the broker).
            IncompatibleSchemaError: the schema breaks its subject's compatibility mode.
            SchemaRequiredError: the producer has no schema and the topic has one (and does
                not allow raw messages).
            TopicNotFoundError: the topic could not be created or resolved.
            BrokerUnavailableError: no broker answered within the retry budget.
            DanubeError: another refusal from the broker.
        """
        if self._state != "new":
            raise ProducerClosedError(f"producer {self.producer_name!r} was already opened")
        try:
            await self._sender.connect(refresh=False, create=True)
        except PartitionedTopicError as exc:
            await self._open_partitions(exc.partitions)
            self._state = "open"
            self._ctx.children.add(self)
            return self
        self._state = "open"
        self._ctx.children.add(self)
        self._sender.start()
        return self

    async def _open_partitions(self, partitions: int) -> None:
        """Open one inner producer per partition of the topic, all at once; if one fails, close
        those that opened and raise its error."""
        inners = [
            Producer(self._ctx, name.path, producer_name=self.producer_name, schema=self._schema, **self._options)
            for name in partition_names(TopicName.parse(self.topic), partitions)
        ]
        await open_all(inners)
        self.partition_producers = inners
        self.partitions = partitions
        self._partitioner = Partitioner(partitions)
        self._sender.max_message_size_bytes = min(p.max_message_size_bytes for p in inners)
        self._sender.schema_id = inners[0].schema_id
        self._sender.schema_version = inners[0].schema_version

    async def close(self) -> None:
        """Flush every queued message, then close the stream and ``CloseProducer`` (on a
        partitioned topic: every partition's producer).

        Safe to call twice. Messages that could not be delivered have their futures failed.
        """
        if self._state in ("closed", "new"):
            self._state = "closed"
            return
        if self.partition_producers:
            self._state = "closing"
            try:
                await asyncio.gather(*(p.close() for p in self.partition_producers), return_exceptions=True)
            finally:
                self._state = "closed"
                self._ctx.children.discard(self)
            return
        self._state = "closing"
        try:
            await self.flush()
        finally:
            self._state = "closed"
            self._ctx.children.discard(self)
            await self._sender.close(ProducerClosedError(f"producer {self.producer_name!r} closed"))

    # ------------------------------------------------------------------ sending

    def send_nowait(
        self, payload: bytes, *, attributes: Mapping[str, str] | None = None, key: str | None = None
    ) -> asyncio.Future[int]:
        """Frame one message into the current batch without waiting.

        Args:
            payload: the message bytes, at most :attr:`max_message_size_bytes` bytes.
            attributes: user key/value pairs (strings; a name at most 65,535 bytes in UTF-8,
                at most 65,535 pairs).
            key: a routing key carried with the message, or ``None``. On a partitioned topic
                it chooses the partition (murmur2 hash, as Kafka's default partitioner);
                without a key the partitions take turns, message by message.

        Returns:
            A future resolved with the message's :class:`MessageId` (its offset, an ``int``,
            and ``partition``, ``None`` on a plain topic; the future is typed ``Future[int]``
            as before) when the broker acknowledges the batch (after its WAL ``fdatasync``),
            or failed with the broker's error.

        Raises:
            MessageTooLargeError: ``len(payload)`` exceeds :attr:`max_message_size_bytes`; checked
                before queueing, nothing is sent.
            MalformedRequestError: an attribute breaks a limit of the record format; nothing
                is sent.
            ProducerClosedError: the producer is not open.
            ProducerFencedError: a newer producer opened under the same name fenced this one
                (idempotent produce); every later send raises it too, and the messages not
                acknowledged before failed with it.
        """
        if self._state != "open":
            raise ProducerClosedError(f"producer {self.producer_name!r} is not open ({self._state})")
        if self._partitioner is not None:
            index = self._partitioner.partition(key)
            inner = self.partition_producers[index].send_nowait(payload, attributes=attributes, key=key)
            return in_partition(inner, index)
        return self._sender.append(payload, attributes, key)

    async def send(
        self, payload: bytes, *, attributes: Mapping[str, str] | None = None, key: str | None = None
    ) -> MessageId:
        """Send one message and wait for its acknowledgement.

        Args:
            payload: the message bytes, at most :attr:`max_message_size_bytes` bytes.
            attributes: user key/value pairs (strings).
            key: a routing key carried with the message, or ``None``; on a partitioned topic
                it chooses the partition (see :meth:`send_nowait`).

        Returns:
            The message's offset in the topic (in its partition, on a partitioned topic), as
            a :class:`MessageId` whose ``partition`` is the partition's index (``None`` on a
            plain topic).

        Raises:
            MessageTooLargeError: the payload is too large (checked before sending).
            SchemaMismatchError: the broker could not decode the payload with the schema.
            BrokerUnavailableError: no broker took the message within the retry budget.
            ProducerClosedError: the producer is not open, or closed before the ack.
            ProducerFencedError: a newer producer opened under the same name fenced this one.
            DanubeError: another refusal from the broker.
        """
        return typing.cast(MessageId, await self.send_nowait(payload, attributes=attributes, key=key))

    def send_many_nowait(
        self,
        payloads: Sequence[bytes],
        *,
        attributes: Mapping[str, str] | None = None,
        key: str | None = None,
    ) -> asyncio.Future[Sequence[MessageId]]:
        """Frame several messages, in order, without waiting: for callers that already hold a
        list. The run is split into batches at ``max_batch_messages`` and ``max_batch_bytes``
        exactly as the same messages sent one by one would be, but each batch's share is
        framed in one call (in C when ``danube_pipeline.format._batch_builder`` is built) and
        each batch has one future instead of one per message.

        Args:
            payloads: the messages' bytes, each at most :attr:`max_message_size_bytes` bytes.
            attributes: user key/value pairs given to every message.
            key: the routing key of every message, or ``None``. On a partitioned topic the
                messages are routed one by one as :meth:`send_nowait` routes them.

        Returns:
            A future resolved with a sequence of one :class:`MessageId` per payload, in order
            (made when read, from each batch's first offset), once every
            batch holding them is acknowledged (after the WAL ``fdatasync``); failed with the
            first error of a batch holding some of them (the messages of the other batches
            may be stored: delivery is at least once, as for :meth:`send_nowait`).

        Raises:
            MessageTooLargeError: a payload exceeds :attr:`max_message_size_bytes`; checked
                for every payload before queueing, nothing is sent.
            MalformedRequestError: the key or an attribute breaks a limit of the record format;
                nothing is sent.
            ProducerClosedError: the producer is not open.
            ProducerFencedError: a newer producer opened under the same name fenced this one.
        """
        if self._state != "open":
            raise ProducerClosedError(f"producer {self.producer_name!r} is not open ({self._state})")
        if not isinstance(payloads, list | tuple):  # e.g. a generator: read once, then framed
            payloads = list(payloads)
        if self._partitioner is None:
            return typing.cast("asyncio.Future[Sequence[MessageId]]", self._sender.append_many(payloads, attributes, key))
        limit = self.max_message_size_bytes
        largest = max(map(len, payloads), default=0)
        if limit and largest > limit:  # checked for all before any is routed
            raise MessageTooLargeError(largest, limit)
        futures = [self.send_nowait(p, attributes=attributes, key=key) for p in payloads]
        return typing.cast("asyncio.Future[Sequence[MessageId]]", asyncio.gather(*futures))

    async def send_many(
        self,
        payloads: Sequence[bytes],
        *,
        attributes: Mapping[str, str] | None = None,
        key: str | None = None,
    ) -> Sequence[MessageId]:
        """Send several messages and wait until all are acknowledged (see
        :meth:`send_many_nowait`, which frames them at the call, before the first ``await``).

        Returns:
            A sequence of one :class:`MessageId` per payload, in order.

        Raises:
            MessageTooLargeError: a payload is too large (checked before sending anything).
            SchemaMismatchError: the broker could not decode a payload with the schema.
            BrokerUnavailableError: no broker took a batch within the retry budget.
            ProducerClosedError: the producer is not open, or closed before the acks.
            ProducerFencedError: a newer producer opened under the same name fenced this one.
            DanubeError: another refusal from the broker.
        """
        return await self.send_many_nowait(payloads, attributes=attributes, key=key)

    async def flush(self) -> None:
        """Close the current batch and wait until every queued message is answered.

        Does not raise for failed messages: their futures carry the errors.
        """
        if self.partition_producers:
            await asyncio.gather(*(p.flush() for p in self.partition_producers))
            return
        await self._sender.flush()

    def __repr__(self) -> str:
        return (
            f"Producer(topic={self.topic!r}, producer_name={self.producer_name!r}, "
            f"producer_id={self.producer_id}, partitions={self.partitions}, state={self._state!r})"
        )

