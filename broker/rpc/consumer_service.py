"""``danube.v1.ConsumerService``: subscribing, receiving deliveries, acknowledging, closing.

The servicer only translates: protobuf requests become calls on :class:`broker.core.Broker`,
results become protobuf answers. Every exception becomes a status in one place,
:func:`broker.rpc.status.rpc`.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from danube_pipeline.errors import MalformedRequestError
from danube_pipeline.modes import InitialPosition, SubscriptionType
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

from broker.cluster.partitions import refuse_partitioned
from broker.core import Broker
from broker.dispatch.consumer import Delivery
from broker.dispatch.redelivery import RedeliverySettings
from broker.rpc.status import rpc
from broker.tasks import spawn

__all__ = ["ConsumerServicer"]


def _batch_delivery(d: Delivery) -> pb.BatchDelivery:
    counts = d.redelivery_counts() if d.handout.counts else []
    return pb.BatchDelivery(
        batch=d.batch.data,
        first_offset=d.handout.first,
        acked_offsets=d.skipped_offsets(),
        redelivery_count=min(counts, default=0),
        redelivery_counts=counts if any(counts) else (),
    )


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
                start_publish_time_us=(
                    request.start_publish_time_us if request.HasField("start_publish_time_us") else None
                ),
            ),
            scope=(request.topic, request.subscription, request.consumer_name),
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
