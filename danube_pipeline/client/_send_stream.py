"""One producer's batches on its lane of the client's ``ProduceStream`` to the topic's owner
(:mod:`danube_pipeline.client._produce_stream`): the producer created on the owner, its batches
sent in order with at most ``max_in_flight_batches`` unanswered, the answers taken in the same
order, and every unanswered batch resent on a new lane after a failure.

What each kind of stream failure leads to is told in :mod:`danube_pipeline.client.producer`;
:meth:`BatchSender._stream_failed` is the one place deciding it.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import uuid
from collections.abc import Mapping, Sequence

import grpc

from danube_pipeline.client._accumulator import Accumulator, Batch, MessageIds, span_offsets
from danube_pipeline.client._connection import Stubs
from danube_pipeline.client._context import Context
from danube_pipeline.client._produce_stream import ProduceStream
from danube_pipeline.client._tasks import cancel_and_wait
from danube_pipeline.client.status import rpc_errors, unavailable
from danube_pipeline.client.types import _SCHEMA_TYPE_TO_PB, Schema
from danube_pipeline.error_codec import error_from_status
from danube_pipeline.errors import (
    BrokerUnavailableError,
    DanubeError,
    MalformedRequestError,
    OffsetRangeError,
    ProducerClosedError,
    ProducerFencedError,
)
from danube_pipeline.modes import DeliveryMode
from danube_pipeline.proto import danube_pb2 as pb

# The facade's logger: users configure one logger per public module.
log = logging.getLogger("danube_pipeline.client.producer")

_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class BatchSender:
    """Sends the batches of one producer of a plain topic, and follows the topic's owner.

    Args:
        ctx: the client's shared context.
        topic: ``"/{namespace}/{topic}"``.
        producer_name: the producer's name.
        schema: the producer's schema, registered before the producer is created; ``None``
            for raw messages.
        linger_ms: how long a batch waits for more messages, in milliseconds; 0 sends a
            batch as soon as an in-flight slot is free.
        max_batch_messages: messages per batch, at most.
        max_batch_bytes: framed bytes per batch, at most (lowered to the broker's limit).
        max_in_flight_batches: unanswered batches on the stream, at most.

    Attributes:
        accumulator: frames messages into batches; each closed batch is queued here.
        producer_id: the broker-assigned id of the producer's session; 0 before the producer
            is created.
        idempotent_producer_id: the idempotent identity's producer id, kept across re-creations
            of the producer (a reconnect, a topic move); 0 before the first creation (or from
            a broker that assigns none).
        producer_epoch: the identity's epoch; a newer instance of the producer name bumps it
            and fences this one (:class:`~danube_pipeline.errors.ProducerFencedError`).
        schema_id: the registered schema's global id; 0 without a schema.
        schema_version: the schema's version within its subject; 0 without a schema.
        max_message_size_bytes: largest payload the broker accepts, in bytes; 0 before.
    """

    def __init__(
        self,
        ctx: Context,
        topic: str,
        *,
        producer_name: str,
        schema: Schema | None,
        linger_ms: int,
        max_batch_messages: int,
        max_batch_bytes: int,
        max_in_flight_batches: int,
    ) -> None:
        self._ctx = ctx
        self._topic = topic
        self._producer_name = producer_name
        self._schema = schema
        self._max_in_flight = max_in_flight_batches
        self._max_batch_bytes = max_batch_bytes
        self._adaptive = linger_ms == 0
        self.accumulator = Accumulator(
            max_batch_messages=max_batch_messages,
            max_batch_bytes=max_batch_bytes,
            linger_ms=linger_ms,
            on_ready=self._batch_ready,
        )
        self.producer_id = 0
        self.schema_id = 0
        self.schema_version = 0
        self.max_message_size_bytes = 0
        self._pending: collections.deque[Batch] = collections.deque()
        self._inflight: collections.deque[Batch] = collections.deque()
        self._wakeup = asyncio.Event()
        self._stream: ProduceStream | None = None
        self._lane = 0  # the producer's lane on self._stream
        self._writing: asyncio.Future[None] | None = None  # the request holding its last batch, until written
        self._stream_gen = 0
        self._owner_address: str | None = None
        self._stream_stubs: Stubs | None = None  # the stubs the current stream was opened on
        self._needs_lookup = False
        self._needs_producer = False
        self._retry_at = 0.0
        self._sequence = itertools.count(1)
        # Message sequence numbers for idempotent produce (the broker's
        # ``broker/topics/producer_sequences.py``): they start at 0 per identity, which the broker
        # assigns at the first CreateProducer and this instance keeps when it re-creates its
        # producer. A new instance gets a new epoch, so no clock is involved.
        self.idempotent_producer_id = 0
        self.producer_epoch = 0
        self._fenced: ProducerFencedError | None = None
        self._next_message_sequence = 0
        self._runner: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ the producer's side

    def start(self) -> None:
        """Start the sending task (after :meth:`connect` created the producer)."""
        self._runner = asyncio.get_running_loop().create_task(self._run())

    def append(
        self, payload: bytes, attributes: Mapping[str, str] | None, key: str | None
    ) -> asyncio.Future[int]:
        """Frame one message into the current batch (see :meth:`Accumulator.append`).

        Returns:
            The message's future, resolved with its :class:`MessageId` once acknowledged.

        Raises:
            MessageTooLargeError: the payload is too large; nothing is queued.
            MalformedRequestError: an attribute breaks a limit of the record format.
            ProducerFencedError: a newer instance of the producer took its name over.
        """
        if self._fenced is not None:
            raise self._fenced
        future = self.accumulator.append(payload, attributes, key)
        self._wake_for_open_batch()
        return future

    def append_many(
        self, payloads: Sequence[bytes], attributes: Mapping[str, str] | None, key: str | None
    ) -> asyncio.Future[MessageIds]:
        """Frame several messages into as few batches as the limits allow (see
        :meth:`Accumulator.append_many`), with one future per batch.

        Returns:
            A future resolved with their offsets (:class:`MessageIds`), in order, once every batch
            holding them is acknowledged; failed with the first batch error.

        Raises:
            MessageTooLargeError: a payload is too large; nothing is queued.
            MalformedRequestError: the key or an attribute breaks a limit of the record format;
                nothing is queued.
            ProducerFencedError: a newer instance of the producer took its name over.
        """
        if self._fenced is not None:
            raise self._fenced
        spans = self.accumulator.append_many(payloads, attributes, key)
        self._wake_for_open_batch()
        return span_offsets(asyncio.get_running_loop(), spans)

    async def flush(self) -> None:
        """Close the current batch and wait until every queued message is answered."""
        self.accumulator.close_batch()
        futures = [f for b in itertools.chain(self._inflight, self._pending) for f in b.waiting()]
        if futures:
            await asyncio.wait(futures)

    async def close(self, closed: ProducerClosedError) -> None:
        """Fail every message not answered yet with ``closed``, stop sending and
        ``CloseProducer`` on the owner (a refusal is logged)."""
        self.accumulator.abort(closed)
        for batch in itertools.chain(self._inflight, self._pending):
            batch.fail(closed)
        self._inflight.clear()
        self._pending.clear()
        await cancel_and_wait(self._runner)
        if self._stream is not None:
            self._stream.close_lane(self._lane)
            self._stream = None
        await self._close_on_broker()

    @property
    def _awaiting_write(self) -> bool:
        """Whether the request holding this producer's last batch is not written yet (the
        written callback, :meth:`_wake_if_batch_waits`, wakes the sender then)."""
        return self._writing is not None and not self._writing.done()

    def _wake_for_open_batch(self) -> None:
        """Adaptive batching: wake the sender for the open batch, unless it waits for the write
        of its previous batch's request (:meth:`_wake_if_batch_waits` wakes it then)."""
        if self._adaptive and not self._awaiting_write:
            self._wakeup.set()

    def _batch_ready(self, batch: Batch) -> None:
        self._pending.append(batch)
        self._wakeup.set()

    # ------------------------------------------------------------------ connection

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

    async def connect(self, *, refresh: bool, create: bool) -> None:
        """(Re-)create the producer on the topic's owner if needed and open a stream.

        Args:
            refresh: look the topic up again first.
            create: create the producer (else a new stream to the same owner is enough).

        Raises:
            PartitionedTopicError: the topic is partitioned (on the first lookup).
            DanubeError: the schema or the producer was refused, or no broker answered.
        """
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
                        created_by=self._producer_name,
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
                    topic=self._topic,
                    producer_name=self._producer_name,
                    access_mode=0,
                    schema=schema_ref,
                    delivery=DeliveryMode.RELIABLE.name,
                    request_id=request_id,
                    idempotent=True,
                    idempotent_producer_id=self.idempotent_producer_id,
                    producer_epoch=self.producer_epoch,
                ),
                timeout=timeout,
            )
            return stubs, response

        stubs, response = await self._ctx.call_owner(
            self._topic, create_producer, refresh=refresh, create_missing=True
        )
        self.producer_id = response.producer_id
        # The identity: the one held, confirmed; or a new one (first creation, or the broker
        # forgot the held one with a topic deleted since). Batches keep their sequences.
        self.idempotent_producer_id = response.idempotent_producer_id
        self.producer_epoch = response.producer_epoch
        self.max_message_size_bytes = response.max_message_size_bytes
        self.accumulator.max_message_size_bytes = response.max_message_size_bytes
        if response.max_batch_bytes:
            self.accumulator.max_batch_bytes = min(self._max_batch_bytes, response.max_batch_bytes)
        self._needs_lookup = False
        self._needs_producer = False
        self._open_stream(stubs)

    def _open_stream(self, stubs: Stubs) -> None:
        """Open a new lane on the client's stream to the broker of ``stubs``."""
        stream = self._ctx.produce_streams.get(stubs)
        self._stream_gen += 1
        gen = self._stream_gen
        self._stream = stream
        self._lane = stream.open_lane(
            lambda response: self._answered(gen, stubs.address, response),
            lambda exc: self._stream_failed(gen, exc),
        )
        self._owner_address = stubs.address
        self._stream_stubs = stubs
        # Unanswered batches go first on the new lane, in their original order.
        self._pending.extendleft(reversed(self._inflight))
        self._inflight.clear()
        self._wakeup.set()

    # ------------------------------------------------------------------ the stream

    def _stream_failed(self, gen: int, exc: DanubeError) -> None:
        """React to the end of lane ``gen`` (ignored if a newer lane already replaced it): an
        error answer on it, or the failure of the whole stream."""
        if gen != self._stream_gen or self._stream is None:
            return
        stream, self._stream = self._stream, None
        stream.close_lane(self._lane)
        if exc.retriable or exc.invalid_metadata:
            log.info("producer %s: stream failed (%s); reconnecting", self._producer_name, exc)
            self._needs_lookup = self._needs_lookup or exc.invalid_metadata
            # A broker that is gone or no longer owns the topic forgot the producer; one that
            # only refused for now (storage full) still has it: a new stream is enough.
            self._needs_producer = self._needs_producer or exc.invalid_metadata
            self._retry_at = asyncio.get_running_loop().time() + self._ctx.backoff_s
            if isinstance(exc, BrokerUnavailableError) and self._owner_address is not None:
                self._ctx.pool.discard(self._owner_address, self._stream_stubs)
                self._ctx.metadata.invalidate(self._topic)
            if self._inflight:
                head = self._inflight[0]
                head.attempts += 1
                if head.attempts > self._ctx.retries:
                    self._inflight.popleft().fail(exc)
        elif isinstance(exc, ProducerFencedError):
            self._fence(exc)
        elif self._inflight:
            # The broker answers in order: the error belongs to the oldest unanswered batch.
            self._inflight.popleft().fail(exc)
        self._wakeup.set()

    def _fence(self, exc: ProducerFencedError) -> None:
        """A newer instance holds the producer's name: every message not answered yet fails
        with ``exc``, and so does every later send."""
        log.warning("producer %s: fenced by a newer instance (%s)", self._producer_name, exc)
        self._fenced = exc
        self.accumulator.abort(exc)
        for batch in itertools.chain(self._inflight, self._pending):
            batch.fail(exc)
        self._inflight.clear()
        self._pending.clear()

    def _answered(self, gen: int, address: str, response: pb.SendBatchResponse) -> None:
        """One answer on lane ``gen``, for the oldest unanswered batch."""
        if gen != self._stream_gen:
            return
        if not self._inflight:
            self._stream_failed(gen, MalformedRequestError("ProduceStream answer without a batch"))
            return
        batch = self._inflight[0]
        if response.sequence_id and response.sequence_id != batch.sequence_id:
            self._stream_failed(
                gen,
                unavailable(address, f"answer for sequence {response.sequence_id}, expected {batch.sequence_id}"),
            )
            return
        if response.HasField("error"):
            # The broker refused or failed this batch; later ones of this lane are not
            # appended. The error belongs to the oldest unanswered batch.
            error = response.error
            code = _STATUS_CODES.get(error.code, grpc.StatusCode.UNKNOWN)
            self._stream_failed(gen, error_from_status(code, error.message, error.error_class, error.fields))
            return
        self._inflight.popleft()
        count = batch.message_count
        if response.last_offset - response.first_offset + 1 != count:
            batch.fail(OffsetRangeError(response.first_offset + count - 1, response.last_offset, "ProduceStream answer"))
        else:
            batch.resolve(response.first_offset)
        self._wake_if_batch_waits()  # a slot is free for what waits; else nothing to wake for

    async def _run(self) -> None:
        """The sender: keeps a stream open while there is work and writes ready batches."""
        while True:
            self._wakeup.clear()
            waiting = self._pending or self._inflight or (self._adaptive and self.accumulator.has_open_batch)
            if self._stream is None and waiting:
                delay_s = self._retry_at - asyncio.get_running_loop().time()
                if delay_s > 0:  # back off after a retriable failure
                    await asyncio.sleep(delay_s)
                try:
                    await self.connect(refresh=self._needs_lookup, create=self._needs_producer)
                except ProducerFencedError as exc:
                    self._fence(exc)
                    continue
                except DanubeError as exc:
                    log.warning("producer %s: cannot reconnect: %s", self._producer_name, exc)
                    for batch in itertools.chain(self._inflight, self._pending):
                        batch.fail(exc)
                    self._inflight.clear()
                    self._pending.clear()
                    self._needs_lookup = True
                    self._needs_producer = True
                    continue
            while self._stream is not None and len(self._inflight) < self._max_in_flight:
                if self._awaiting_write:
                    break  # that write's callback wakes this task if a batch waits by then
                if not self._pending:
                    if not self._adaptive or not self.accumulator.has_open_batch:
                        break
                    # A free in-flight slot and no linger: send what has accumulated now. Under
                    # load every slot is busy and batches grow until one frees (self-clocking).
                    self.accumulator.close_batch()
                written = self._write(self._stream, self._pending.popleft())
                if not written.done():
                    # The connection is busy: let the next batch grow meanwhile. The future is
                    # shared with the other producers on the stream, so it is not awaited (a
                    # cancelled wait would cancel it for them): its callback wakes this task
                    # if, by then, there is something to send, and only then (a producer with
                    # one message in flight is woken once per batch, not twice).
                    self._writing = written
                    written.add_done_callback(lambda _written: self._wake_if_batch_waits())
                    break
            await self._wakeup.wait()

    def _wake_if_batch_waits(self) -> None:
        """Wake the sender if a batch waits to be sent: a closed one, or the open one with
        adaptive batching (called when an in-flight slot frees and when the request holding the
        previous batch was written)."""
        if self._pending or (self._adaptive and self.accumulator.has_open_batch):
            self._wakeup.set()

    def _write(self, stream: ProduceStream, batch: Batch) -> asyncio.Future[None]:
        """Send ``batch`` on the lane; the future is resolved once its request is written."""
        if not batch.sequence_id:
            batch.sequence_id = next(self._sequence)
        if batch.base_sequence < 0:
            batch.base_sequence = self._next_message_sequence
            self._next_message_sequence += batch.message_count
        self._inflight.append(batch)
        request = pb.SendBatchRequest(
            producer_id=self.producer_id,
            batch=batch.builder.build(
                # The identity (epoch << 48 | producer id), which the broker keys sequences
                # by; the session id from a broker that assigned no identity.
                producer_id=(
                    self.producer_epoch << 48 | self.idempotent_producer_id
                    if self.idempotent_producer_id else self.producer_id
                ),
                producer_name=self._producer_name,
                schema_id=self.schema_id,
                schema_version=self.schema_version,
                base_sequence=batch.base_sequence,
            ),
            sequence_id=batch.sequence_id,
            stream_id=self._lane,
        )
        return stream.send(request)
