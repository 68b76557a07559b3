"""The gRPC servicers: producer, consumer, discovery, admin and schema registry.

Servicers only translate between protobuf messages and :class:`broker.server.BrokerServer`,
:class:`broker.topic.Topic` and :class:`broker.dispatch.Subscription`; every exception is
turned into a status by :func:`broker.status.rpc` (the single mapping point).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from danube_pipeline.errors import (
    BrokerUnavailableError,
    ConsumerNotFoundError,
    InvalidSchemaError,
    MalformedRequestError,
    ProducerNotFoundError,
    SegmentNotFoundError,
    TopicNotFoundError,
)
from danube_pipeline.metadata import keys, values
from danube_pipeline.names import TopicName, validate_part
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc
from danube_pipeline.schema_registry import parse_avro

from broker.dispatch import Delivery, SubscriptionType
from broker.status import rpc
from broker.topic import OutgoingMessage, Producer, Topic
from broker.wal import SealedSegment

if TYPE_CHECKING:
    from broker.server import BrokerServer

log = logging.getLogger(__name__)

SEGMENT_CHUNK_BYTES = 1024 * 1024


def _delivery_name(mode: int) -> str:
    return values.NON_RELIABLE if mode == pb.NON_RELIABLE else values.RELIABLE


def _outgoing(messages: Any) -> list[OutgoingMessage]:
    return [
        OutgoingMessage(payload=m.payload, attributes=dict(m.attributes), publish_time_us=m.publish_time_us)
        for m in messages
    ]


def _segment_info(seg: SealedSegment) -> pb.SegmentInfo:
    return pb.SegmentInfo(
        start_offset=seg.start_offset,
        end_offset=seg.end_offset,
        size_bytes=seg.size_bytes,
        record_count=seg.record_count,
        created_at_ms=seg.created_at_ms,
        sealed_at_ms=seg.sealed_at_ms,
    )


def _stream_message(d: Delivery) -> pb.StreamMessage:
    r = d.record
    return pb.StreamMessage(
        offset=r.offset,
        payload=r.payload,
        attributes=dict(r.attributes),
        publish_time_us=r.publish_time_us,
        producer_id=r.producer_id,
        producer_name=r.producer_name,
        schema_id=r.schema_id,
        schema_version=r.schema_version,
        redelivery_count=d.redelivery_count,
    )


class ProducerServicer(pb_grpc.ProducerServiceServicer):
    """``danube.v1.ProducerService``."""

    def __init__(self, broker: BrokerServer) -> None:
        self._broker = broker

    def _served_producer(self, producer_id: int) -> tuple[Producer, Topic]:
        producer = self._broker.producer(producer_id)
        topic = self._broker.served_topic(producer.topic.path)
        if topic is not producer.topic:  # the topic was reloaded: the producer is stale
            self._broker.producers.pop(producer_id, None)
            raise ProducerNotFoundError(producer_id)
        return producer, topic

    @rpc
    async def CreateProducer(self, request: pb.CreateProducerRequest, context: Any) -> pb.CreateProducerResponse:
        broker = self._broker
        name = TopicName.parse(request.topic)
        producer_name = validate_part("producer", request.producer_name)
        schema = None
        parsed = None
        if request.HasField("schema") and request.schema.schema_id != 0:
            schema = await broker.registry.get_by_id(
                request.schema.schema_id, version=request.schema.schema_version or None
            )
            if schema.schema_type != "Avro":
                raise InvalidSchemaError(schema.subject, f"unsupported schema type {schema.schema_type}")
            parsed = parse_avro(schema.subject, schema.raw_schema)
        topic = await broker.topic_for(name, create=True, delivery=_delivery_name(request.delivery))
        producer_id = broker.new_id(broker.producers)
        producer = Producer(
            id=producer_id,
            name=producer_name,
            access_mode=request.access_mode,
            topic=topic,
            schema=schema,
            parsed_schema=parsed,
        )
        await broker.store.put(keys.topic_producer(name, producer_id), producer.metadata(status=True))
        broker.producers[producer_id] = producer
        topic.producers[producer_id] = producer
        log.info("producer %d (%s) on %s", producer_id, producer_name, name)
        return pb.CreateProducerResponse(
            producer_id=producer_id, broker_id=broker.broker_id, max_message_size=topic.max_message_size()
        )

    @rpc
    async def SendMessage(self, request: pb.SendMessageRequest, context: Any) -> pb.SendMessageResponse:
        producer, topic = self._served_producer(request.producer_id)
        first, _ = await asyncio.shield(topic.publish(producer, _outgoing([request.message])))
        return pb.SendMessageResponse(offset=first)

    @rpc
    async def SendBatch(self, request: pb.SendBatchRequest, context: Any) -> pb.SendBatchResponse:
        producer, topic = self._served_producer(request.producer_id)
        first, last = await asyncio.shield(topic.publish(producer, _outgoing(request.messages)))
        return pb.SendBatchResponse(first_offset=first, last_offset=last, sequence_id=request.sequence_id)

    @rpc
    async def SendStream(
        self, request_iterator: AsyncIterator[pb.SendBatchRequest], context: Any
    ) -> AsyncIterator[pb.SendBatchResponse]:
        """Read requests in order, enqueue each append at once, answer in order."""
        pending: asyncio.Queue[tuple[int, asyncio.Future[tuple[int, int]] | BaseException] | None] = asyncio.Queue()

        async def reader() -> None:
            last: asyncio.Future[tuple[int, int]] | None = None
            try:
                async for request in request_iterator:
                    if last is not None and last.done() and not last.cancelled() and last.exception() is not None:
                        # An earlier write failed (and with it everything queued behind it):
                        # publishing later requests would persist them after a gap, so a
                        # client resending from the failed one would duplicate and reorder.
                        await pending.put((request.sequence_id, last.exception() or RuntimeError("write failed")))
                        return
                    try:
                        producer, topic = self._served_producer(request.producer_id)
                        fut = topic.publish(producer, _outgoing(request.messages))
                    except Exception as exc:  # noqa: BLE001 - answered in order, then the stream ends
                        await pending.put((request.sequence_id, exc))
                        return
                    last = fut
                    await pending.put((request.sequence_id, fut))
            finally:
                await pending.put(None)

        reader_task = asyncio.create_task(reader())
        try:
            while True:
                item = await pending.get()
                if item is None:
                    break
                sequence_id, outcome = item
                if isinstance(outcome, BaseException):
                    raise outcome
                first, last = await asyncio.shield(outcome)
                yield pb.SendBatchResponse(first_offset=first, last_offset=last, sequence_id=sequence_id)
            await reader_task
        finally:
            if not reader_task.done():
                reader_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader_task

    @rpc
    async def CloseProducer(self, request: pb.CloseProducerRequest, context: Any) -> pb.CloseProducerResponse:
        broker = self._broker
        producer = broker.producer(request.producer_id)
        broker.producers.pop(producer.id, None)
        producer.topic.producers.pop(producer.id, None)
        await broker.store.put(keys.topic_producer(producer.topic.name, producer.id), producer.metadata(status=False))
        return pb.CloseProducerResponse()


class ConsumerServicer(pb_grpc.ConsumerServiceServicer):
    """``danube.v1.ConsumerService``."""

    def __init__(self, broker: BrokerServer) -> None:
        self._broker = broker

    @rpc
    async def Subscribe(self, request: pb.SubscribeRequest, context: Any) -> pb.SubscribeResponse:
        broker = self._broker
        name = TopicName.parse(request.topic)
        subscription = validate_part("subscription", request.subscription)
        consumer_name = validate_part("consumer", request.consumer_name) if request.consumer_name else subscription
        try:
            sub_type = SubscriptionType(request.subscription_type)
        except ValueError as exc:
            raise MalformedRequestError(f"unknown subscription type {request.subscription_type}") from exc
        topic = await broker.topic_for(name)
        consumer_id = broker.new_id(broker.consumers)
        consumer = await topic.subscribe(
            subscription=subscription,
            subscription_type=sub_type,
            consumer_id=consumer_id,
            consumer_name=consumer_name,
            earliest=request.initial_position == pb.EARLIEST,
            receiver_queue_size=request.receiver_queue_size,
        )
        broker.remember_consumer(consumer)
        log.info("consumer %d (%s) subscribed %s/%s as %s", consumer_id, consumer_name, name, subscription, sub_type.name)
        return pb.SubscribeResponse(consumer_id=consumer_id, broker_id=broker.broker_id)

    @rpc
    async def Receive(self, request: pb.ReceiveRequest, context: Any) -> AsyncIterator[pb.MessageBatch]:
        consumer = self._broker.consumer(request.consumer_id)
        if consumer.closed:
            raise ConsumerNotFoundError(request.consumer_id)
        sub = consumer.subscription
        try:
            async for batch in consumer.batches():
                yield pb.MessageBatch(messages=[_stream_message(d) for d in batch])
        finally:
            task = asyncio.get_running_loop().create_task(sub.flush_cursor())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    @rpc
    async def Ack(self, request: pb.AckRequest, context: Any) -> pb.AckResponse:
        consumer = self._broker.consumer(request.consumer_id)
        consumer.subscription.ack(request.offsets)
        return pb.AckResponse()

    @rpc
    async def CloseConsumer(self, request: pb.CloseConsumerRequest, context: Any) -> pb.CloseConsumerResponse:
        consumer = self._broker.consumer(request.consumer_id)
        sub = consumer.subscription
        sub.remove_consumer(consumer, reason="closed by client")
        await sub.flush_cursor()
        return pb.CloseConsumerResponse()


class DiscoveryServicer(pb_grpc.DiscoveryServicer):
    """``danube.v1.Discovery``: answered from the LocalCache."""

    def __init__(self, broker: BrokerServer) -> None:
        self._broker = broker

    @rpc
    async def TopicLookup(self, request: pb.TopicLookupRequest, context: Any) -> pb.TopicLookupResponse:
        broker = self._broker
        name = TopicName.parse(request.topic)
        if not broker.cache.contains(keys.topic_root(name)):
            raise TopicNotFoundError(name.path)
        broker_id = broker.assigned_broker(name)
        if broker_id is None:  # unassigned: a broker alone in the cluster takes it
            await broker.topic_for(name)
            broker_id = broker.broker_id
        raw = broker.cache.get(keys.broker_register(broker_id))
        if raw is None:
            raise BrokerUnavailableError(f"broker {broker_id}", f"serves {name.path} but is not registered")
        registration = values.BrokerRegistration.from_json(raw)
        return pb.TopicLookupResponse(broker_id=broker_id, broker_addr=registration.advertised_addr)

    @rpc
    async def ClusterMetadata(self, request: pb.ClusterMetadataRequest, context: Any) -> pb.ClusterMetadataResponse:
        cache = self._broker.cache
        brokers = []
        for key, raw in cache.get_prefix(keys.BROKER_REGISTER_PREFIX).items():
            suffix = key[len(keys.BROKER_REGISTER_PREFIX) :]
            if not suffix.isdigit():
                continue
            broker_id = int(suffix)
            try:
                registration = values.BrokerRegistration.from_json(raw)
            except ValueError:
                continue
            state = cache.get(keys.broker_state(broker_id))
            mode = state.get("mode", "") if isinstance(state, dict) else ""
            brokers.append(pb.BrokerInfo(broker_id=broker_id, broker_addr=registration.advertised_addr, mode=mode))
        leader = cache.get(keys.CLUSTER_LEADER)
        return pb.ClusterMetadataResponse(
            cluster_name=self._broker.config.cluster_name,
            brokers=brokers,
            leader_broker_id=leader if isinstance(leader, int) and not isinstance(leader, bool) else 0,
        )


class AdminServicer(pb_grpc.AdminServicer):
    """``danube.v1.Admin``."""

    def __init__(self, broker: BrokerServer) -> None:
        self._broker = broker

    @rpc
    async def CreateTopic(self, request: pb.CreateTopicRequest, context: Any) -> pb.CreateTopicResponse:
        name = TopicName.parse(request.topic)
        created = await self._broker.create_topic(name, delivery=_delivery_name(request.delivery))
        if not created:
            await self._broker.topic_for(name)  # load it if it is ours; NotServedHere if not
        return pb.CreateTopicResponse(created=created)

    @rpc
    async def ListTopics(self, request: pb.ListTopicsRequest, context: Any) -> pb.ListTopicsResponse:
        if request.namespace:
            validate_part("namespace", request.namespace)
        out = []
        for path, topic in sorted(self._broker.topics.items()):
            if request.namespace and topic.name.namespace != request.namespace:
                continue
            out.append(
                pb.TopicInfo(
                    topic=path,
                    next_offset=topic.wal.next_offset,
                    sealed_segments=len(topic.wal.sealed_segments()),
                    wal_syncs=topic.wal.sync_count,
                )
            )
        return pb.ListTopicsResponse(topics=out)

    async def _topic(self, raw: str) -> Topic:
        return await self._broker.topic_for(TopicName.parse(raw))

    @rpc
    async def ListSealedSegments(
        self, request: pb.ListSealedSegmentsRequest, context: Any
    ) -> pb.ListSealedSegmentsResponse:
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
        topic = await self._topic(request.topic)
        segment = topic.wal.sealed_segment(request.start_offset)
        if segment is None:
            raise SegmentNotFoundError(topic.path, request.start_offset)
        with open(segment.path, "rb") as f:  # sealed files are immutable
            position = 0
            while True:
                data = await asyncio.to_thread(f.read, SEGMENT_CHUNK_BYTES)
                if not data:
                    break
                yield pb.SegmentChunk(position=position, data=data)
                position += len(data)


class SchemaRegistryServicer(pb_grpc.SchemaRegistryServicer):
    """``danube.v1.SchemaRegistry`` over :class:`danube_pipeline.schema_registry.SchemaRegistry`."""

    def __init__(self, broker: BrokerServer) -> None:
        self._broker = broker

    @rpc
    async def RegisterSchema(self, request: pb.RegisterSchemaRequest, context: Any) -> pb.RegisterSchemaResponse:
        if request.schema_type != pb.AVRO:
            raise MalformedRequestError(f"unsupported schema type {request.schema_type}")
        if not request.subject:
            raise MalformedRequestError("subject is required")
        registered = await self._broker.registry.register_avro(
            request.subject, request.raw_schema, created_by=request.created_by or "danube-client"
        )
        return pb.RegisterSchemaResponse(
            schema_id=registered.schema_id, version=registered.version, fingerprint=registered.fingerprint
        )

    @rpc
    async def GetSchema(self, request: pb.GetSchemaRequest, context: Any) -> pb.GetSchemaResponse:
        registered = await self._broker.registry.get_by_id(request.schema_id, version=request.version or None)
        return pb.GetSchemaResponse(
            subject=registered.subject,
            schema_id=registered.schema_id,
            version=registered.version,
            schema_type=pb.AVRO,
            raw_schema=registered.raw_schema,
            fingerprint=registered.fingerprint,
        )


__all__ = [
    "AdminServicer",
    "ConsumerServicer",
    "DiscoveryServicer",
    "ProducerServicer",
    "SchemaRegistryServicer",
]
