"""The producer facade: batches messages and pipelines them over one ``SendStream``.

Messages are framed by the :class:`~danube_pipeline.client._accumulator.Accumulator` into
record batches (:mod:`danube_pipeline.format.batches`). With ``linger_ms=0`` (the default) a batch is
sent as soon as one of the ``max_in_flight_batches`` slots is free, so a lone message goes at
once and a burst goes as one batch, while under load batches grow with the acks' round trip
(Nagle's rule with pipelining); with ``linger_ms > 0`` a batch waits that long for more
messages (Kafka's ``linger.ms``). Each closed batch travels as one
``SendBatchRequest`` with a client-chosen ``sequence_id``, its header carrying this producer's
id, name and schema and a CRC32C. The broker checks the batch and appends its bytes unchanged,
in the order it reads them, and answers in the same order, so the answer at the head of the
stream belongs to the oldest unanswered batch, whose message ``i`` gets the offset
``first_offset + i``. At most ``max_in_flight_batches`` batches are unanswered at once.

When the stream fails:

* with an error whose ``invalid_metadata`` flag is set (``UNAVAILABLE``,
  ``NotServedHereError``, ``ProducerNotFoundError``), the producer waits ``retry_backoff_ms``,
  looks the topic up again, re-creates itself on the (possibly new) owner and resends every
  unanswered batch in order, framed again under its new producer id: delivery is at least once;
* with an error that is only ``retriable`` (``StorageFullError``: the broker's disk is full),
  it waits ``retry_backoff_ms`` and resends on a new stream as the same producer;
* either way, the oldest unanswered batch fails with the error once it was tried
  ``1 + metadata_retries`` times;
* with any other error (``MessageTooLargeError``, ``SchemaMismatchError``), exactly the futures
  of the batch the broker was answering fail; the producer opens a new stream and the later
  batches are sent again.

**Partitioned topics** (``docs/etcd-layout.md`` §3.1). When the lookup on open says the topic is
partitioned (:class:`~danube_pipeline.errors.PartitionedTopicError`), the producer opens one
inner producer per partition ``{topic}-part-{i}``, with the same name, schema and options, and
routes each message (:mod:`danube_pipeline.client._partitioner`): by the murmur2 hash of its
``key`` (Kafka's default partitioner: one key, one partition, in order), or round-robin per
message when it has none. Each inner producer batches, retries and follows its partition's
owner on its own; ``send`` answers a :class:`~danube_pipeline.client.types.MessageId` whose
``partition`` says where the message went.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
import typing
import uuid
from collections.abc import Iterator, Mapping
from types import TracebackType

import grpc

from danube_pipeline.client._accumulator import Accumulator, Batch
from danube_pipeline.client._connection import Stubs
from danube_pipeline.client._context import Context
from danube_pipeline.client._partitioner import Partitioner
from danube_pipeline.client._status import from_rpc_error, rpc_errors, unavailable
from danube_pipeline.client._tasks import cancel_and_wait
from danube_pipeline.client.types import _SCHEMA_TYPE_TO_PB, MessageId, Schema
from danube_pipeline.errors import (
    BrokerUnavailableError,
    DanubeError,
    MalformedRequestError,
    OffsetRangeError,
    PartitionedTopicError,
    ProducerClosedError,
    error_from_status,
)
from danube_pipeline.modes import DeliveryMode
from danube_pipeline.names import TopicName, validate_part
from danube_pipeline.partitions import partition_names
from danube_pipeline.proto import danube_pb2 as pb

log = logging.getLogger(__name__)

_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


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
        self._max_in_flight = max_in_flight_batches
        self._max_batch_bytes = max_batch_bytes
        self._adaptive = linger_ms == 0
        self._accumulator = Accumulator(
            max_batch_messages=max_batch_messages,
            max_batch_bytes=max_batch_bytes,
            linger_ms=linger_ms,
            on_ready=self._batch_ready,
        )
        self.producer_id = 0
        self.schema_id = 0
        self.schema_version = 0
        self.max_message_size_bytes = 0
        self._state = "new"
        self._pending: collections.deque[Batch] = collections.deque()
        self._inflight: collections.deque[Batch] = collections.deque()
        self._wakeup = asyncio.Event()
        self._stream: grpc.aio.StreamStreamCall | None = None
        self._stream_gen = 0
        self._owner_address: str | None = None
        self._needs_lookup = False
        self._needs_producer = False
        self._retry_at = 0.0
        self._sequence = itertools.count(1)
        # Message sequence numbers for idempotent produce (the broker's ``broker/topics/producer_sequences.py``):
        # they start at the wall clock in µs, so a producer re-opened under the same name starts
        # above the numbers its earlier incarnation used (while it sent under 1 message per µs).
        self._next_message_sequence = time.time_ns() // 1000
        self._runner: asyncio.Task[None] | None = None
        self._reader: asyncio.Task[None] | None = None

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
            await self._connect(refresh=False, create=True)
        except PartitionedTopicError as exc:
            await self._open_partitions(exc.partitions)
            self._state = "open"
            self._ctx.children.add(self)
            return self
        self._state = "open"
        self._ctx.children.add(self)
        self._runner = asyncio.get_running_loop().create_task(self._run())
        return self

    async def _open_partitions(self, partitions: int) -> None:
        """Open one inner producer per partition of the topic, all at once; if one fails, close
        those that opened and raise its error."""
        inners = [
            Producer(self._ctx, name.path, producer_name=self.producer_name, schema=self._schema, **self._options)
            for name in partition_names(TopicName.parse(self.topic), partitions)
        ]
        results = await asyncio.gather(*(p.open() for p in inners), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(p.close() for p in inners), return_exceptions=True)
            raise failed[0]
        self.partition_producers = inners
        self.partitions = partitions
        self._partitioner = Partitioner(partitions)
        self.max_message_size_bytes = min(p.max_message_size_bytes for p in inners)
        self.schema_id = inners[0].schema_id
        self.schema_version = inners[0].schema_version

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
            closed = ProducerClosedError(f"producer {self.producer_name!r} closed")
            self._accumulator.abort(closed)
            for batch in itertools.chain(self._inflight, self._pending):
                batch.fail(closed)
            self._inflight.clear()
            self._pending.clear()
            await cancel_and_wait(self._runner, self._reader)
            if self._stream is not None:
                self._stream.cancel()
                self._stream = None
            await self._close_on_broker()

    async def _close_on_broker(self, timeout_s: float | None = None) -> None:
        if not self.producer_id or self._owner_address is None:
            return
        stubs = self._ctx.pool.stubs(self._owner_address)
        try:
            with rpc_errors(stubs.address):
                await stubs.producer.CloseProducer(
                    pb.CloseProducerRequest(producer_id=self.producer_id),
                    timeout=timeout_s or self._ctx.request_timeout_s,
                )
        except DanubeError as exc:
            log.info("CloseProducer %d on %s failed: %s", self.producer_id, stubs.address, exc)

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
        """
        if self._state != "open":
            raise ProducerClosedError(f"producer {self.producer_name!r} is not open ({self._state})")
        if self._partitioner is not None:
            index = self._partitioner.partition(key)
            inner = self.partition_producers[index].send_nowait(payload, attributes=attributes, key=key)
            return _in_partition(inner, index)
        future = self._accumulator.append(payload, attributes, key)
        if self._adaptive:
            self._wakeup.set()
        return future

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
            DanubeError: another refusal from the broker.
        """
        return typing.cast(MessageId, await self.send_nowait(payload, attributes=attributes, key=key))

    async def flush(self) -> None:
        """Close the current batch and wait until every queued message is answered.

        Does not raise for failed messages: their futures carry the errors.
        """
        if self.partition_producers:
            await asyncio.gather(*(p.flush() for p in self.partition_producers))
            return
        self._accumulator.close_batch()
        futures = [f for b in itertools.chain(self._inflight, self._pending) for f in b.futures]
        futures = [f for f in futures if not f.done()]
        if futures:
            await asyncio.wait(futures)

    def _batch_ready(self, batch: Batch) -> None:
        self._pending.append(batch)
        self._wakeup.set()

    # ------------------------------------------------------------------ connection

    async def _connect(self, *, refresh: bool, create: bool) -> None:
        """(Re-)create the producer on the topic's owner if needed and open a stream."""
        if not create and self._owner_address is not None:
            self._open_stream(self._ctx.pool.stubs(self._owner_address))
            return

        if self.producer_id:
            # Replacing a producer: close the old one if its broker still has it (a stream can
            # fail while the broker lives), so its key does not stay ``status: true``. A broker
            # that restarted forgot it and closes its key when it loads the topic.
            await self._close_on_broker(timeout_s=min(1.0, self._ctx.request_timeout_s))

        request_id = uuid.uuid4().hex  # the same on every retry of this creation

        async def create_producer(stubs: Stubs) -> tuple[Stubs, pb.CreateProducerResponse]:
            timeout = self._ctx.request_timeout_s
            if self._schema is not None and not self.schema_id:
                registered = await stubs.schema.RegisterSchema(
                    pb.RegisterSchemaRequest(
                        subject=self._schema.subject,
                        schema_type=_SCHEMA_TYPE_TO_PB[self._schema.schema_type],
                        raw_schema=self._schema.raw_schema,
                        created_by=self.producer_name,
                    ),
                    timeout=timeout,
                )
                self.schema_id = registered.schema_id
                self.schema_version = registered.version
            schema_ref = None
            if self._schema is not None:
                schema_ref = pb.SchemaReference(
                    schema_id=self.schema_id,
                    schema_version=self.schema_version,
                    subject=self._schema.subject,
                )
            response = await stubs.producer.CreateProducer(
                pb.CreateProducerRequest(
                    topic=self.topic,
                    producer_name=self.producer_name,
                    access_mode=0,
                    schema=schema_ref,
                    delivery=DeliveryMode.RELIABLE.name,
                    request_id=request_id,
                ),
                timeout=timeout,
            )
            return stubs, response

        stubs, response = await self._ctx.call_owner(
            self.topic, create_producer, refresh=refresh, create_missing=True
        )
        self.producer_id = response.producer_id
        self.max_message_size_bytes = response.max_message_size_bytes
        self._accumulator.max_message_size_bytes = response.max_message_size_bytes
        if response.max_batch_bytes:
            self._accumulator.max_batch_bytes = min(self._max_batch_bytes, response.max_batch_bytes)
        self._needs_lookup = False
        self._needs_producer = False
        self._open_stream(stubs)

    def _open_stream(self, stubs: Stubs) -> None:
        call = stubs.producer.SendStream()
        self._stream_gen += 1
        self._stream = call
        self._owner_address = stubs.address
        # Unanswered batches go first on the new stream, in their original order.
        self._pending.extendleft(reversed(self._inflight))
        self._inflight.clear()
        self._reader = asyncio.get_running_loop().create_task(
            self._read(call, self._stream_gen, stubs.address)
        )
        self._wakeup.set()

    def _stream_failed(self, gen: int, exc: DanubeError) -> None:
        """React to the end of stream ``gen`` (ignored if a newer stream already replaced it)."""
        if gen != self._stream_gen or self._stream is None:
            return
        call, self._stream = self._stream, None
        call.cancel()
        if exc.retriable or exc.invalid_metadata:
            log.info("producer %s: stream failed (%s); reconnecting", self.producer_name, exc)
            self._needs_lookup = self._needs_lookup or exc.invalid_metadata
            # A broker that is gone or no longer owns the topic forgot the producer; one that
            # only refused for now (storage full) still has it: a new stream is enough.
            self._needs_producer = self._needs_producer or exc.invalid_metadata
            self._retry_at = asyncio.get_running_loop().time() + self._ctx.backoff_s
            if isinstance(exc, BrokerUnavailableError) and self._owner_address is not None:
                self._ctx.pool.discard(self._owner_address)
                self._ctx.metadata.invalidate(self.topic)
            if self._inflight:
                head = self._inflight[0]
                head.attempts += 1
                if head.attempts > self._ctx.retries:
                    self._inflight.popleft().fail(exc)
        elif self._inflight:
            # The broker answers in order: the error belongs to the oldest unanswered batch.
            self._inflight.popleft().fail(exc)
        self._wakeup.set()

    @contextlib.contextmanager
    def _stream_failures(self, gen: int, address: str) -> Iterator[None]:
        """The one place deciding what a failed ``SendStream`` read or write means: the stream
        of generation ``gen`` failed (:meth:`_stream_failed`). Cancellation of the task itself
        (close) propagates; a cancelled call is a failed stream."""
        try:
            yield
        except grpc.aio.AioRpcError as exc:
            self._stream_failed(gen, from_rpc_error(exc, address))
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            self._stream_failed(gen, unavailable(address, "SendStream cancelled"))

    async def _read(self, call: grpc.aio.StreamStreamCall, gen: int, address: str) -> None:
        with self._stream_failures(gen, address):
            while True:
                response = await call.read()
                if gen != self._stream_gen:
                    return
                if response is grpc.aio.EOF:
                    self._stream_failed(gen, unavailable(address, "SendStream ended by the broker"))
                    return
                if not self._inflight:
                    self._stream_failed(gen, MalformedRequestError("SendStream answer without a batch"))
                    return
                batch = self._inflight[0]
                if response.sequence_id and response.sequence_id != batch.sequence_id:
                    self._stream_failed(
                        gen,
                        unavailable(
                            address,
                            f"answer for sequence {response.sequence_id}, expected {batch.sequence_id}",
                        ),
                    )
                    return
                if response.HasField("error"):
                    # The broker refused or failed this batch; later ones of this stream are
                    # not appended. The error belongs to the oldest unanswered batch.
                    error = response.error
                    code = _STATUS_CODES.get(error.code, grpc.StatusCode.UNKNOWN)
                    self._stream_failed(gen, error_from_status(code, error.message, error.error_class, error.fields))
                    return
                self._inflight.popleft()
                count = batch.message_count
                if response.last_offset - response.first_offset + 1 != count:
                    batch.fail(
                        OffsetRangeError(
                            response.first_offset + count - 1, response.last_offset, "SendStream answer"
                        )
                    )
                else:
                    batch.resolve(response.first_offset)
                self._wakeup.set()

    async def _run(self) -> None:
        """The sender: keeps a stream open while there is work and writes ready batches."""
        while True:
            self._wakeup.clear()
            waiting = self._pending or self._inflight or (self._adaptive and self._accumulator.has_open_batch)
            if self._stream is None and waiting:
                delay_s = self._retry_at - asyncio.get_running_loop().time()
                if delay_s > 0:  # back off after a retriable failure
                    await asyncio.sleep(delay_s)
                try:
                    await self._connect(refresh=self._needs_lookup, create=self._needs_producer)
                except DanubeError as exc:
                    log.warning("producer %s: cannot reconnect: %s", self.producer_name, exc)
                    for batch in itertools.chain(self._inflight, self._pending):
                        batch.fail(exc)
                    self._inflight.clear()
                    self._pending.clear()
                    self._needs_lookup = True
                    self._needs_producer = True
                    continue
            while self._stream is not None and len(self._inflight) < self._max_in_flight:
                if not self._pending:
                    if not self._adaptive or not self._accumulator.has_open_batch:
                        break
                    # A free in-flight slot and no linger: send what has accumulated now. Under
                    # load every slot is busy and batches grow until one frees (self-clocking).
                    self._accumulator.close_batch()
                await self._write(self._stream, self._pending.popleft())
            await self._wakeup.wait()

    async def _write(self, call: grpc.aio.StreamStreamCall, batch: Batch) -> None:
        if not batch.sequence_id:
            batch.sequence_id = next(self._sequence)
        if batch.base_sequence < 0:
            batch.base_sequence = self._next_message_sequence
            self._next_message_sequence += batch.message_count
        gen = self._stream_gen
        address = self._owner_address or ""
        self._inflight.append(batch)
        request = pb.SendBatchRequest(
            producer_id=self.producer_id,
            batch=batch.builder.build(
                producer_id=self.producer_id,
                producer_name=self.producer_name,
                schema_id=self.schema_id,
                schema_version=self.schema_version,
                base_sequence=batch.base_sequence,
            ),
            sequence_id=batch.sequence_id,
        )
        try:
            await call.write(request)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            # The call has ended: the reader reports why (the broker's answers, then the
            # call's status). A failed write can also make gRPC replace that status with its
            # own INTERNAL "Internal error from Core" (grpc/grpc#36066), so it is not reported
            # here.
            log.debug("producer %s: SendStream write failed: %s", self.producer_name, exc)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            self._stream_failed(gen, unavailable(address, "SendStream cancelled"))

    def __repr__(self) -> str:
        return (
            f"Producer(topic={self.topic!r}, producer_name={self.producer_name!r}, "
            f"producer_id={self.producer_id}, partitions={self.partitions}, state={self._state!r})"
        )


def _in_partition(inner: asyncio.Future[int], partition: int) -> asyncio.Future[int]:
    """A future following ``inner``, whose result (a :class:`MessageId`) carries ``partition``."""
    outer: asyncio.Future[int] = inner.get_loop().create_future()

    def copy(done: asyncio.Future[int]) -> None:
        if outer.done():
            return
        if done.cancelled():
            outer.cancel()
            return
        error = done.exception()
        if error is not None:
            outer.set_exception(error)
        else:
            outer.set_result(MessageId.in_partition(done.result(), partition))

    inner.add_done_callback(copy)
    return outer
