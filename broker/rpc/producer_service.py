"""``danube.v1.ProducerService``: creating producers, sending batches, closing producers.

``CreateProducer`` with ``idempotent`` also assigns (a new instance) or confirms (the same
instance re-creating its producer) the producer's idempotent identity in etcd, and fences the
older instances of the name (:mod:`broker.topics.producer_identity`).

The servicer only translates: protobuf requests become calls on the broker core
(:class:`ProducerBroker`, implemented by :class:`broker.core.Broker`), results become protobuf
answers. Every exception becomes a status in one place, :func:`broker.rpc.status.rpc`; on a
``SendStream`` or a ``ProduceStream`` (:mod:`broker.rpc.produce_stream`, the batches of many
producers on one stream) a refused batch is answered with its error as data instead.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any, Protocol

from danube_pipeline.error_codec import (
    ERROR_CLASS_METADATA_KEY,
    ERROR_FIELDS_METADATA_KEY,
    encode_error_metadata,
)
from danube_pipeline.errors import BatchNotAppendedError, DanubeError, MalformedRequestError
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.modes import DeliveryMode
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

from broker.cluster.partitions import refuse_partitioned
from broker.config import DEFAULT_MAX_STREAM_UNANSWERED_BYTES
from broker.rpc.produce_stream import BATCH_CHECK, produce_stream
from broker.rpc.produce_stream import failed as _failed
from broker.rpc.produce_stream import ms as _ms
from broker.rpc.request_ids import RecentRequests
from broker.rpc.status import rpc
from broker.topics.producer import Producer
from broker.topics.producer_identity import MAX_EPOCH, MAX_PRODUCER_ID, ProducerIdentity, assign_identity

__all__ = ["ProducerBroker", "ProducerServicer"]


def _error_status(error: DanubeError) -> pb.ErrorStatus:
    """``error`` as data, with what a failed RPC carries as its status and trailing metadata."""
    metadata = dict(encode_error_metadata(error))
    return pb.ErrorStatus(
        code=error.grpc_code.value[0],
        message=str(error),
        error_class=metadata[ERROR_CLASS_METADATA_KEY],
        fields=metadata[ERROR_FIELDS_METADATA_KEY],
    )


class ProducerBroker(Protocol):
    """What :class:`ProducerServicer` needs of the broker core (:class:`broker.core.Broker`)."""

    broker_id: int
    requests: RecentRequests
    cache: LocalCache
    store: MetadataStore

    async def create_producer(
        self,
        topic_path: str,
        producer_name: str,
        *,
        access_mode: int,
        schema_id: int = 0,
        schema_version: int = 0,
        delivery: DeliveryMode = DeliveryMode.RELIABLE,
    ) -> Producer: ...

    def publish(self, producer_id: int, batch: bytes) -> asyncio.Future[tuple[int, int]]: ...

    def publish_unless_limited(self, producer_id: int, batch: bytes) -> asyncio.Future[tuple[int, int]] | None: ...

    async def throttle_publish(self, producer_id: int, batch: bytes) -> float: ...

    async def close_producer(self, producer_id: int) -> None: ...


class ProducerServicer(pb_grpc.ProducerServiceServicer):
    """``danube.v1.ProducerService``.

    Args:
        broker: the broker core.
        max_unanswered_bytes: batch bytes one ``SendStream`` may have received and not
            answered yet; above it the stream's requests are not read until answers go out.
    """

    def __init__(self, broker: ProducerBroker, *, max_unanswered_bytes: int = DEFAULT_MAX_STREAM_UNANSWERED_BYTES) -> None:
        self._broker = broker
        self._max_unanswered_bytes = max_unanswered_bytes

    @rpc
    async def CreateProducer(self, request: pb.CreateProducerRequest, context: Any) -> pb.CreateProducerResponse:
        await refuse_partitioned(self._broker, request.topic)
        held = None
        if request.idempotent and request.idempotent_producer_id:
            if request.idempotent_producer_id > MAX_PRODUCER_ID or request.producer_epoch > MAX_EPOCH:
                raise MalformedRequestError(
                    f"idempotent_producer_id is at most {MAX_PRODUCER_ID} and producer_epoch at most {MAX_EPOCH}"
                )
            held = ProducerIdentity(request.idempotent_producer_id, request.producer_epoch)
        producer = await self._broker.requests.run(
            "producer",
            request.request_id,
            functools.partial(self._create_producer, request, held),
            scope=(request.topic, request.producer_name, str(request.idempotent_producer_id),
                   str(request.producer_epoch)),
            still_valid=lambda p: not p.closed,
        )
        identity = producer.identity
        return pb.CreateProducerResponse(
            producer_id=producer.id,
            broker_id=self._broker.broker_id,
            max_message_size_bytes=producer.topic.max_message_size_bytes(),
            max_batch_bytes=producer.topic.max_batch_bytes,
            idempotent_producer_id=identity.producer_id if identity else 0,
            producer_epoch=identity.epoch if identity else 0,
        )

    async def _create_producer(self, request: pb.CreateProducerRequest, held: ProducerIdentity | None) -> Producer:
        """Create the producer; with ``idempotent``, assign or confirm its identity in etcd
        (:mod:`broker.topics.producer_identity`) and start or resume its sequence state.

        Raises:
            ProducerFencedError: ``held`` belongs to an instance a newer one fenced; the
                producer is closed again.
            DanubeError: what :meth:`ProducerBroker.create_producer` raises.
        """
        schema = request.schema if request.HasField("schema") else None
        producer = await self._broker.create_producer(
            request.topic,
            request.producer_name,
            access_mode=request.access_mode,
            schema_id=schema.schema_id if schema else 0,
            schema_version=schema.schema_version if schema else 0,
            delivery=DeliveryMode.from_wire(request.delivery),
        )
        if not request.idempotent:
            return producer
        try:
            identity = await assign_identity(
                self._broker.store, producer.topic.name, request.producer_name, held=held
            )
        except BaseException:
            with contextlib.suppress(DanubeError):
                await self._broker.close_producer(producer.id)
            raise
        producer.identity = identity
        producer.topic.sequences.begin(request.producer_name, identity)
        return producer

    @rpc
    async def SendBatch(self, request: pb.SendBatchRequest, context: Any) -> pb.SendBatchResponse:
        # max_publish_rate: the answer is held back (nothing appended yet) until the rate admits it.
        waited_s = await self._broker.throttle_publish(request.producer_id, request.batch)
        first, last = await asyncio.shield(self._broker.publish(request.producer_id, request.batch))
        return pb.SendBatchResponse(
            first_offset=first, last_offset=last, sequence_id=request.sequence_id, throttled_ms=_ms(waited_s)
        )

    @rpc
    async def SendStream(
        self, request_iterator: AsyncIterator[pb.SendBatchRequest], context: Any
    ) -> AsyncIterator[pb.SendBatchResponse]:
        """Read requests in order, enqueue each append at once, answer in the same order.

        A batch that is refused or whose append fails is answered with its error as data
        (``SendBatchResponse.error``). Nothing after it is appended: later batches would be
        persisted after a gap, so a client resending from the failed one would duplicate and
        reorder; each is answered with :class:`~danube_pipeline.errors.BatchNotAppendedError`.
        The broker keeps the stream open until the client ends it, so no write of the client
        runs into a finished call and every answer arrives, in order.

        Memory is bounded per stream: once ``max_unanswered_bytes`` of batches are received
        and not answered, no more requests are read until answers go out (gRPC flow control
        then holds the producer back). The topic's ``max_publish_rate`` holds the stream back
        the same way: no request is read while the rate does not admit the last one, and each
        answer says how long its batch waited (``throttled_ms``).
        """
        # The reader appends (sequence id, batch size, append future or error, throttled ms);
        # None marks the end. The answering loop below wakes only when the oldest entry can be
        # answered: an append future wakes it once it is resolved (a done callback), so each
        # batch costs it one wake-up, after its group commit, not a task switch per awaited future.
        # It never awaits an append future itself, so the stream dying (the client cancels or
        # disconnects) cannot cancel one: the append and the producer's sequence state follow
        # the WAL, not this call; a cancelled future would make the broker forget a batch the
        # WAL still writes, and write its resend a second time.
        pending: collections.deque[
            tuple[int, int, asyncio.Future[tuple[int, int]] | BaseException, int] | None
        ] = collections.deque()
        ready = asyncio.Event()
        room = asyncio.Event()
        unanswered = 0

        def wake(fut: asyncio.Future[tuple[int, int]]) -> None:
            if not fut.cancelled():
                fut.exception()  # seen here even if the stream ends before it is answered
            ready.set()

        def put(item: tuple[int, int, asyncio.Future[tuple[int, int]] | BaseException, int] | None) -> None:
            pending.append(item)
            if item is not None and isinstance(item[2], asyncio.Future) and not item[2].done():
                item[2].add_done_callback(wake)
            else:
                ready.set()

        async def reader() -> None:
            nonlocal unanswered
            last: tuple[int, asyncio.Future[tuple[int, int]]] | None = None
            failed: int | None = None  # sequence id of the first batch that failed
            try:
                async for request in request_iterator:
                    if failed is None and last is not None and _failed(last[1]):
                        failed = last[0]
                    if failed is not None:
                        put((request.sequence_id, 0, BatchNotAppendedError(request.sequence_id, failed), 0))
                        continue
                    size = len(request.batch)
                    throttled_ms = _ms(await self._broker.throttle_publish(request.producer_id, request.batch))
                    try:
                        fut = self._broker.publish(request.producer_id, request.batch)
                    except Exception as exc:  # noqa: BLE001 - answered in order
                        failed = request.sequence_id
                        put((request.sequence_id, 0, exc, throttled_ms))
                        continue
                    last = (request.sequence_id, fut)
                    unanswered += size
                    put((request.sequence_id, size, fut, throttled_ms))
                    while unanswered > self._max_unanswered_bytes:
                        room.clear()
                        await room.wait()
            finally:
                put(None)

        def answerable() -> bool:
            if not pending:
                return False
            head = pending[0]
            return head is None or not isinstance(head[2], asyncio.Future) or head[2].done()

        reader_task = asyncio.create_task(reader())
        try:
            while True:
                while not answerable():
                    ready.clear()
                    await ready.wait()
                item = pending.popleft()
                if item is None:
                    break
                sequence_id, size, outcome, throttled_ms = item
                if isinstance(outcome, asyncio.Future):
                    try:
                        first, last = outcome.result()
                    except DanubeError as exc:
                        outcome = exc
                    else:
                        yield pb.SendBatchResponse(
                            first_offset=first, last_offset=last, sequence_id=sequence_id, throttled_ms=throttled_ms
                        )
                if isinstance(outcome, DanubeError):
                    yield pb.SendBatchResponse(sequence_id=sequence_id, error=_error_status(outcome))
                elif isinstance(outcome, BaseException):
                    raise outcome
                unanswered -= size
                room.set()
            await reader_task
        finally:
            if not reader_task.done():
                reader_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader_task

    @rpc
    async def ProduceStream(
        self, request_iterator: AsyncIterator[pb.ProduceRequest], context: Any
    ) -> AsyncIterator[pb.ProduceResponse]:
        """The batches of many producers on lanes of one stream (:mod:`broker.rpc.produce_stream`),
        with the same memory bound per stream as ``SendStream``."""
        async for response in produce_stream(
            self._broker, request_iterator, max_unanswered_bytes=self._max_unanswered_bytes,
            check=BATCH_CHECK.get(), error_status=_error_status,
        ):
            yield response

    @rpc
    async def CloseProducer(self, request: pb.CloseProducerRequest, context: Any) -> pb.CloseProducerResponse:
        await self._broker.close_producer(request.producer_id)
        return pb.CloseProducerResponse()
