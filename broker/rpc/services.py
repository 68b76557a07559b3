"""The gRPC servicers: producer, consumer, discovery, admin and schema registry.

Servicers only translate: protobuf requests become calls on :class:`broker.core.Broker` (and the
topic's WAL for the admin calls), results become protobuf answers. Every exception becomes a
status in one place, :func:`broker.rpc.status.rpc`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from danube_pipeline.errors import (
    ERROR_CLASS_METADATA_KEY,
    ERROR_FIELDS_METADATA_KEY,
    BatchNotAppendedError,
    DanubeError,
    MalformedRequestError,
    SegmentNotFoundError,
    encode_error_metadata,
)
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.modes import DeliveryMode, InitialPosition, SubscriptionType
from danube_pipeline.names import TopicName, validate_part
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

from broker.topics import admin as topic_admin
from broker.config import DEFAULT_MAX_STREAM_UNANSWERED_BYTES
from broker.dispatch.consumer import Delivery
from broker.core import Broker
from broker.rpc.request_ids import RecentRequests
from broker.storage.memory_log import MemoryLog
from broker.cluster.partitions import create_partitioned_topic, refuse_partitioned, topic_partitions
from broker.topics.producer import Producer
from broker.dispatch.redelivery import RedeliverySettings
from broker.topics.schema_policy import set_topic_schema_policy
from broker.rpc.status import rpc
from broker.tasks import spawn
from broker.topics.topic import Topic
from broker.storage.wal import SealedSegment

log = logging.getLogger(__name__)

SEGMENT_CHUNK_BYTES = 1024 * 1024
"""Bytes per ``SegmentChunk`` of ``Admin.ReadSegment``."""


def _segment_info(seg: SealedSegment) -> pb.SegmentInfo:
    return pb.SegmentInfo(
        start_offset=seg.start_offset,
        end_offset=seg.end_offset,
        size_bytes=seg.size_bytes,
        record_count=seg.record_count,
        created_at_ms=seg.created_at_ms,
        sealed_at_ms=seg.sealed_at_ms,
    )


def _failed(fut: asyncio.Future[tuple[int, int]]) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is not None


def _ms(seconds: float) -> int:
    """``seconds`` as whole milliseconds, rounded up (a wait never reads as 0)."""
    return math.ceil(seconds * 1000) if seconds > 0 else 0


def _error_status(error: DanubeError) -> pb.ErrorStatus:
    """``error`` as data, with what a failed RPC carries as its status and trailing metadata."""
    metadata = dict(encode_error_metadata(error))
    return pb.ErrorStatus(
        code=error.grpc_code.value[0],
        message=str(error),
        error_class=metadata[ERROR_CLASS_METADATA_KEY],
        fields=metadata[ERROR_FIELDS_METADATA_KEY],
    )


def _batch_delivery(d: Delivery) -> pb.BatchDelivery:
    counts = d.redelivery_counts() if d.handout.counts else []
    return pb.BatchDelivery(
        batch=d.batch.data,
        first_offset=d.handout.first,
        acked_offsets=d.skipped_offsets(),
        redelivery_count=min(counts, default=0),
        redelivery_counts=counts if any(counts) else (),
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
        schema = request.schema if request.HasField("schema") else None
        producer = await self._broker.requests.run(
            "producer",
            request.request_id,
            functools.partial(
                self._broker.create_producer,
                request.topic,
                request.producer_name,
                access_mode=request.access_mode,
                schema_id=schema.schema_id if schema else 0,
                schema_version=schema.schema_version if schema else 0,
                delivery=DeliveryMode.from_wire(request.delivery),
            ),
            still_valid=lambda p: not p.closed,
        )
        return pb.CreateProducerResponse(
            producer_id=producer.id,
            broker_id=self._broker.broker_id,
            max_message_size_bytes=producer.topic.max_message_size_bytes(),
            max_batch_bytes=producer.topic.max_batch_bytes,
        )

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
        # None marks the end.
        pending: collections.deque[
            tuple[int, int, asyncio.Future[tuple[int, int]] | BaseException, int] | None
        ] = collections.deque()
        arrived = asyncio.Event()
        room = asyncio.Event()
        unanswered = 0

        def put(item: tuple[int, int, asyncio.Future[tuple[int, int]] | BaseException, int] | None) -> None:
            pending.append(item)
            arrived.set()

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

        reader_task = asyncio.create_task(reader())
        try:
            while True:
                while not pending:
                    arrived.clear()
                    await arrived.wait()
                item = pending.popleft()
                if item is None:
                    break
                sequence_id, size, outcome, throttled_ms = item
                if not isinstance(outcome, BaseException):
                    # Not shielded: if the stream dies, the append still completes (the WAL
                    # resolves futures it finds still pending and skips cancelled ones).
                    try:
                        first, last = await outcome
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
    async def CloseProducer(self, request: pb.CloseProducerRequest, context: Any) -> pb.CloseProducerResponse:
        await self._broker.close_producer(request.producer_id)
        return pb.CloseProducerResponse()


class ConsumerServicer(pb_grpc.ConsumerServiceServicer):
    """``danube.v1.ConsumerService``."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    @rpc
    async def Subscribe(self, request: pb.SubscribeRequest, context: Any) -> pb.SubscribeResponse:
        try:
            sub_type = SubscriptionType(request.subscription_type)
        except ValueError as exc:
            raise MalformedRequestError(f"unknown subscription type {request.subscription_type}") from exc
        try:
            position = InitialPosition(request.initial_position)
        except ValueError as exc:
            raise MalformedRequestError(f"unknown initial position {request.initial_position}") from exc
        await refuse_partitioned(self._broker, request.topic)
        consumer = await self._broker.requests.run(
            "consumer",
            request.request_id,
            functools.partial(
                self._broker.subscribe,
                request.topic,
                request.subscription,
                subscription_type=sub_type,
                consumer_name=request.consumer_name or request.subscription,
                initial_position=position,
                receiver_queue_size=request.receiver_queue_size,
                settings=RedeliverySettings.from_pb(request.settings) if request.HasField("settings") else None,
            ),
            still_valid=lambda c: not c.closed,
        )
        return pb.SubscribeResponse(consumer_id=consumer.id, broker_id=self._broker.broker_id)

    @rpc
    async def Receive(self, request: pb.ReceiveRequest, context: Any) -> AsyncIterator[pb.Deliveries]:
        consumer = self._broker.consumer(request.consumer_id, open_only=True)
        sub = consumer.subscription
        topic = self._broker.topics.get(sub.topic)
        limiter = topic.dispatch_limiter(sub.name) if topic is not None else None
        try:
            async for group in consumer.deliveries():
                if limiter is None or not limiter.rate():
                    yield pb.Deliveries(batches=[_batch_delivery(d) for d in group])
                    continue
                # max_subscription_dispatch_rate: one batch at a time, each once the
                # subscription's bucket admits its messages (shared by its consumers).
                for d in group:
                    await limiter.acquire(d.hold.bits.bit_count())
                    if d.hold not in consumer.holds:  # acknowledged or taken back meanwhile
                        continue
                    d.hold.sent_at = time.monotonic()  # the ack timeout runs from the real send
                    yield pb.Deliveries(batches=[_batch_delivery(d)])
        finally:
            # A failure is counted by the cursor writer and retried at the next flush.
            spawn(sub.flush_cursor(), name=f"cursor:{sub.topic}:{sub.name}", on_error=lambda _exc: None)

    @rpc
    async def Ack(self, request: pb.AckRequest, context: Any) -> pb.AckResponse:
        self._broker.ack(
            request.consumer_id,
            itertools.chain(((o, o) for o in request.offsets), ((r.first, r.last) for r in request.ranges)),
        )
        return pb.AckResponse()

    @rpc
    async def Nack(self, request: pb.NackRequest, context: Any) -> pb.NackResponse:
        self._broker.nack(request.consumer_id, [(r.first, r.last) for r in request.ranges], reason=request.reason)
        return pb.NackResponse()

    @rpc
    async def CloseConsumer(self, request: pb.CloseConsumerRequest, context: Any) -> pb.CloseConsumerResponse:
        await self._broker.close_consumer(request.consumer_id)
        return pb.CloseConsumerResponse()


class DiscoveryServicer(pb_grpc.DiscoveryServicer):
    """``danube.v1.Discovery``: answered from the LocalCache."""

    def __init__(self, broker: Broker, cluster_name: str) -> None:
        self._broker = broker
        self._cluster_name = cluster_name

    @rpc
    async def TopicLookup(self, request: pb.TopicLookupRequest, context: Any) -> pb.TopicLookupResponse:
        name = TopicName.parse(request.topic)
        partitions = await topic_partitions(self._broker, name)
        if partitions:  # no owner: the client looks up each "{topic}-part-{i}" (§3.1)
            return pb.TopicLookupResponse(partitions=partitions)
        owner = await self._broker.lookup(name)
        return pb.TopicLookupResponse(broker_id=owner.broker_id, broker_addr=owner.address)

    @rpc
    async def ClusterMetadata(self, request: pb.ClusterMetadataRequest, context: Any) -> pb.ClusterMetadataResponse:
        return pb.ClusterMetadataResponse(
            cluster_name=self._cluster_name,
            brokers=[
                pb.BrokerInfo(broker_id=b.broker_id, broker_addr=b.address, mode=b.mode)
                for b in self._broker.registered_brokers()
            ],
            leader_broker_id=self._broker.leader_id(),
        )


class AdminServicer(pb_grpc.AdminServicer):
    """``danube.v1.Admin``."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    async def _topic(self, raw: str) -> Topic:
        await refuse_partitioned(self._broker, raw)
        return await self._broker.topic_for(TopicName.parse(raw))

    @rpc
    async def CreateTopic(self, request: pb.CreateTopicRequest, context: Any) -> pb.CreateTopicResponse:
        name = TopicName.parse(request.topic)
        delivery = DeliveryMode.from_wire(request.delivery)
        if request.partitions:
            created = await self._broker.requests.run(
                "topic",
                request.request_id,
                functools.partial(create_partitioned_topic, self._broker, name, request.partitions, delivery=delivery),
            )
            return pb.CreateTopicResponse(created=created)
        created = await self._broker.requests.run(
            "topic", request.request_id, functools.partial(self._broker.create_topic, name, delivery=delivery)
        )
        if not created and not await topic_partitions(self._broker, name):
            await self._broker.topic_for(name)  # load it if it is ours; NotServedHere if not
        return pb.CreateTopicResponse(created=created)

    @rpc
    async def ListTopics(self, request: pb.ListTopicsRequest, context: Any) -> pb.ListTopicsResponse:
        if request.namespace:
            validate_part("namespace", request.namespace)
        return pb.ListTopicsResponse(
            topics=[
                pb.TopicInfo(
                    topic=path,
                    next_offset=topic.wal.next_offset,
                    sealed_segments=len(topic.wal.sealed_segments()),
                    wal_syncs=topic.wal.sync_count,
                )
                for path, topic in sorted(self._broker.topics.items())
                if not request.namespace or topic.name.namespace == request.namespace
            ]
        )

    @rpc
    async def ListSealedSegments(
        self, request: pb.ListSealedSegmentsRequest, context: Any
    ) -> pb.ListSealedSegmentsResponse:
        if request.released:
            name = TopicName.parse(request.topic)
            return pb.ListSealedSegmentsResponse(
                segments=[
                    pb.SegmentInfo(start_offset=start, end_offset=end, size_bytes=size, record_count=end - start + 1)
                    for _path, start, end, size in self._broker.released_segments(name)
                ]
            )
        topic = await self._topic(request.topic)
        return pb.ListSealedSegmentsResponse(segments=[_segment_info(s) for s in topic.wal.sealed_segments()])

    @rpc
    async def SealActiveSegment(
        self, request: pb.SealActiveSegmentRequest, context: Any
    ) -> pb.SealActiveSegmentResponse:
        topic = await self._topic(request.topic)
        segment = await topic.wal.seal_active()
        if segment is None:
            return pb.SealActiveSegmentResponse(sealed=False)
        return pb.SealActiveSegmentResponse(sealed=True, segment=_segment_info(segment))

    @rpc
    async def ReadSegment(self, request: pb.ReadSegmentRequest, context: Any) -> AsyncIterator[pb.SegmentChunk]:
        if request.released:
            name = TopicName.parse(request.topic)
            found = [p for p, start, _end, _size in self._broker.released_segments(name) if start == request.start_offset]
            if not found:
                raise SegmentNotFoundError(name.path, request.start_offset)
            segment_path = found[0]
        else:
            topic = await self._topic(request.topic)
            segment = topic.wal.sealed_segment(request.start_offset)
            if segment is None:
                raise SegmentNotFoundError(topic.path, request.start_offset)
            segment_path = segment.path
        try:
            f = open(segment_path, "rb")  # noqa: SIM115 - sealed files are immutable
        except FileNotFoundError:  # deleted by local retention meanwhile
            raise SegmentNotFoundError(TopicName.parse(request.topic).path, request.start_offset) from None
        with f:
            position = 0
            while True:
                data = await asyncio.to_thread(f.read, SEGMENT_CHUNK_BYTES)
                if not data:
                    break
                yield pb.SegmentChunk(position=position, data=data)
                position += len(data)


    @rpc
    async def ApplyLocalRetention(
        self, request: pb.ApplyLocalRetentionRequest, context: Any
    ) -> pb.ApplyLocalRetentionResponse:
        topic = await self._topic(request.topic)
        retention_bytes = request.retention_bytes if request.HasField("retention_bytes") else None
        retention_ms = request.retention_ms if request.HasField("retention_ms") else None
        for what, value in (("retention_bytes", retention_bytes), ("retention_ms", retention_ms)):
            if value is not None and value < 0:
                raise MalformedRequestError(f"{what} must not be negative, got {value}")
        outcome = await self._broker.apply_local_retention(
            topic, retention_bytes=retention_bytes, retention_ms=retention_ms
        )
        return pb.ApplyLocalRetentionResponse(
            deleted_segments=outcome.deleted_segments,
            deleted_bytes=outcome.deleted_bytes,
            first_local_offset=outcome.first_local_offset,
            wal_bytes=outcome.wal_bytes,
        )

    @rpc
    async def UnloadTopic(self, request: pb.UnloadTopicRequest, context: Any) -> pb.UnloadTopicResponse:
        name = TopicName.parse(request.topic)
        await self._topic(request.topic)  # served here (loads it if it is ours)
        next_offset = await self._broker.release_topic(name, reason="unload")
        return pb.UnloadTopicResponse(next_offset=next_offset)

    @rpc
    async def DrainBroker(self, request: pb.DrainBrokerRequest, context: Any) -> pb.DrainBrokerResponse:
        return pb.DrainBrokerResponse(topics=await self._broker.drain())

    @rpc
    async def DeleteTopic(self, request: pb.DeleteTopicRequest, context: Any) -> pb.DeleteTopicResponse:
        deleted = await topic_admin.delete_topic(self._broker, TopicName.parse(request.topic), force=request.force)
        return pb.DeleteTopicResponse(deleted=deleted)

    @rpc
    async def ResetCursor(self, request: pb.ResetCursorRequest, context: Any) -> pb.ResetCursorResponse:
        name = TopicName.parse(request.topic)
        which = request.WhichOneof("position")
        if which is None:
            raise MalformedRequestError("no position: set one of offset, earliest, latest, timestamp_ms")
        if which in ("earliest", "latest") and not getattr(request, which):
            raise MalformedRequestError(f"{which} must be true when it is the position")
        next_offset = await topic_admin.reset_cursor(
            self._broker,
            name,
            request.subscription,
            offset=request.offset if which == "offset" else None,
            earliest=which == "earliest",
            latest=which == "latest",
            timestamp_ms=request.timestamp_ms if which == "timestamp_ms" else None,
        )
        return pb.ResetCursorResponse(next_offset=next_offset)

    @rpc
    async def DescribeTopic(self, request: pb.DescribeTopicRequest, context: Any) -> pb.DescribeTopicResponse:
        topic = await self._topic(request.topic)
        remote = topic.remote
        memory = topic.wal if isinstance(topic.wal, MemoryLog) else None
        response = pb.DescribeTopicResponse(
            first_local_offset=topic.wal.first_offset,
            next_offset=topic.wal.next_offset,
            wal_bytes=topic.wal.size_bytes if memory is None else 0,
            sealed_segments=len(topic.wal.sealed_segments()),
            earliest_offset=topic.earliest_offset,
            cache_bytes=self._broker.object_cache.size_bytes,
            broker_id=self._broker.broker_id,
            delivery=pb.NON_RELIABLE if topic.delivery == DeliveryMode.NON_RELIABLE else pb.RELIABLE,
            publish_throttled_ms=int(topic.publish_limiter.throttled_ms),
        )
        if memory is not None:
            response.dropped_messages = memory.dropped_messages
            response.buffered_messages = memory.held_messages
            response.buffered_bytes = memory.size_bytes
        if topic.ownership is not None:
            response.owner_epoch = topic.ownership.epoch
            response.reserved_end_offset = max(topic.ownership.reserved_end, 0)
        for rng in remote.unavailable if remote is not None else []:
            item = pb.UnavailableRange(
                start_offset=rng.start_offset, end_offset=rng.end_offset, broker_id=rng.broker_id,
                since=rng.since, abandoned=rng.abandoned,
            )
            if rng.last_written is not None:
                item.last_written = rng.last_written
            response.unavailable_ranges.append(item)
        if remote is not None and remote.first_offset is not None and remote.end_offset is not None:
            response.remote_first_offset = remote.first_offset
            response.remote_end_offset = remote.end_offset
        for name, sub in sorted(topic.subscriptions.items()):
            state = pb.SubscriptionState(
                name=name,
                type=int(sub.type),  # type: ignore[arg-type]  # an enum number
                read_position=sub.read_position,
                consumers=len(sub.consumers),
                records_from_object_storage=sub.records_from_object_storage,
                skipped_below_retention=sub.skipped_below_retention,
                skipped_unavailable=sub.skipped_unavailable,
            )
            limiter = topic.dispatch_limiters.get(name)
            if limiter is not None:
                state.dispatch_throttled_ms = int(limiter.throttled_ms)
            if sub.cursor is not None:
                state.cursor = sub.cursor
            response.subscriptions.append(state)
        return response


    @rpc
    async def AbandonUnavailableRange(
        self, request: pb.AbandonUnavailableRangeRequest, context: Any
    ) -> pb.AbandonUnavailableRangeResponse:
        name = TopicName.parse(request.topic)
        skipped = await self._broker.abandon_unavailable_range(name, request.start_offset)
        return pb.AbandonUnavailableRangeResponse(skipped=skipped)

    @rpc
    async def SetTopicSchemaPolicy(
        self, request: pb.SetTopicSchemaPolicyRequest, context: Any
    ) -> pb.SetTopicSchemaPolicyResponse:
        written = await set_topic_schema_policy(
            self._broker, TopicName.parse(request.topic), allow_raw=request.allow_raw
        )
        return pb.SetTopicSchemaPolicyResponse(
            policies=[
                pb.TopicSchemaPolicy(topic=path, subject=policy.subject, allow_raw=policy.allow_raw)
                for path, policy in written
            ]
        )


_SCHEMA_TYPES = {pb.AVRO: "Avro", pb.JSON_SCHEMA: "JsonSchema", pb.PROTOBUF: "Protobuf"}
"""``SchemaType`` numbers and the registry's type names (``docs/etcd-layout.md`` §4.3 ``schema_def``)."""
_SCHEMA_TYPE_NUMBERS = {name: number for number, name in _SCHEMA_TYPES.items()}


class SchemaRegistryServicer(pb_grpc.SchemaRegistryServicer):
    """``danube.v1.SchemaRegistry`` over :class:`danube_pipeline.schemas.registry.SchemaRegistry`."""

    def __init__(self, broker: Broker) -> None:
        self._registry = broker.registry

    @rpc
    async def RegisterSchema(self, request: pb.RegisterSchemaRequest, context: Any) -> pb.RegisterSchemaResponse:
        schema_type = _SCHEMA_TYPES.get(request.schema_type)
        if schema_type is None:
            raise MalformedRequestError(f"unsupported schema type {request.schema_type}")
        registered = await self._registry.register(
            request.subject,
            schema_type,
            request.raw_schema,
            created_by=request.created_by or "danube-client",
            compatibility_mode=request.compatibility_mode or None,
        )
        return pb.RegisterSchemaResponse(
            schema_id=registered.schema_id, version=registered.version, fingerprint=registered.fingerprint
        )

    @rpc
    async def GetSchema(self, request: pb.GetSchemaRequest, context: Any) -> pb.GetSchemaResponse:
        registered = await self._registry.get_by_id(request.schema_id, version=request.version or None)
        return pb.GetSchemaResponse(
            subject=registered.subject,
            schema_id=registered.schema_id,
            version=registered.version,
            schema_type=_SCHEMA_TYPE_NUMBERS.get(registered.schema_type, pb.AVRO),
            raw_schema=registered.raw_schema,
            fingerprint=registered.fingerprint,
        )

    @rpc
    async def SetCompatibilityMode(
        self, request: pb.SetCompatibilityModeRequest, context: Any
    ) -> pb.SetCompatibilityModeResponse:
        mode = await self._registry.set_compatibility_mode(request.subject, request.compatibility_mode)
        return pb.SetCompatibilityModeResponse(compatibility_mode=mode)


__all__ = [
    "AdminServicer",
    "ConsumerServicer",
    "DiscoveryServicer",
    "ProducerServicer",
    "SchemaRegistryServicer",
]
