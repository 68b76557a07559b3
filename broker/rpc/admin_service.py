"""``danube.v1.Admin``: topics (create, list, describe, unload, delete), segments, cursors.

The servicer only translates: protobuf requests become calls on :class:`broker.core.Broker`,
:mod:`broker.topics.admin` and the topic's WAL, results become protobuf answers. Every
exception becomes a status in one place, :func:`broker.rpc.status.rpc`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

from danube_pipeline.errors import MalformedRequestError, SegmentNotFoundError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.values import UnavailableRange
from danube_pipeline.modes import DeliveryMode
from danube_pipeline.names import TopicName, validate_part
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

from broker.cluster.partitions import create_partitioned_topic, refuse_partitioned, topic_partitions
from broker.core import Broker
from broker.replication.manager import replica_set
from broker.rpc.status import rpc
from broker.storage.memory_log import MemoryLog
from broker.storage.wal import SealedSegment
from broker.topics import admin as topic_admin
from broker.topics.schema_policy import set_topic_schema_policy
from broker.topics.topic import Topic

__all__ = ["SEGMENT_CHUNK_BYTES", "AdminServicer"]

log = logging.getLogger(__name__)

SEAL_TIMEOUT_S = 10.0
"""How long ``SealActiveSegment`` waits for a replicated topic's high watermark to pass the
active segment (answered ``sealed = false`` after it)."""

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


def _unavailable_range(rng: UnavailableRange) -> pb.UnavailableRange:
    """The wire form of an unavailable range (``docs/etcd-layout.md`` §5.5).

    A negative ``last_written`` (``-1``: the broker returned with no offset written, its WAL's
    next offset less one) is ``nothing_written``, with ``last_written`` unset: a ``uint64``
    cannot carry it, and the range's offsets were all never handed out.

    Raises:
        TypeError, ValueError: a field of the record has a type or value the wire cannot carry.
    """
    item = pb.UnavailableRange(
        start_offset=rng.start_offset, end_offset=rng.end_offset, broker_id=rng.broker_id,
        since=rng.since, abandoned=rng.abandoned,
    )
    if rng.last_written is not None:
        if rng.last_written < 0:
            item.nothing_written = True
        else:
            item.last_written = rng.last_written
    return item


class AdminServicer(pb_grpc.AdminServicer):
    """``danube.v1.Admin``."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        self._reported_ranges: set[tuple[str, str]] = set()
        """Unavailable range records already logged as unreadable (once each)."""

    async def _topic(self, raw: str) -> Topic:
        await refuse_partitioned(self._broker, raw)
        return await self._broker.topic_for(TopicName.parse(raw))

    async def _caught_up(self, topic: Topic) -> None:
        """Wait until the broker's cache holds every write etcd had when this was called
        (read your writes): object descriptors completed by tiering, in another process, just
        before ``ApplyLocalRetention`` count for it. One etcd read of the topic's ``objects/cur``
        key (``docs/etcd-layout.md`` §5.2) gives the revision. ``DescribeTopic`` answers from
        the cache as it is (the continuous writer polls it; a stale answer is safe there).

        Raises:
            MetadataStoreError: etcd unreachable, or the cache not caught up within 5 s.
        """
        _, revision = await self._broker.store.get_prefix(keys.objects_cur(topic.name))
        await self._broker.cache.wait_for_revision(revision)

    @rpc
    async def CreateTopic(self, request: pb.CreateTopicRequest, context: Any) -> pb.CreateTopicResponse:
        name = TopicName.parse(request.topic)
        delivery = DeliveryMode.from_wire(request.delivery)
        if request.partitions:
            created = await self._broker.requests.run(
                "topic",
                request.request_id,
                functools.partial(
                    create_partitioned_topic,
                    self._broker,
                    name,
                    request.partitions,
                    delivery=delivery,
                    request_id=request.request_id,
                ),
                scope=(name.path,),
            )
            return pb.CreateTopicResponse(created=created)
        created = await self._broker.requests.run(
            "topic",
            request.request_id,
            functools.partial(self._broker.create_topic, name, delivery=delivery, request_id=request.request_id),
            scope=(name.path,),
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
        try:  # a replicated topic seals only below its high watermark (followers are behind)
            segment = await topic.wal.seal_active(timeout_s=SEAL_TIMEOUT_S)
        except TimeoutError:
            segment = None
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
        await self._caught_up(topic)
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
        response.high_watermark = topic.wal.next_offset
        tracker = topic.replication
        if tracker is not None:
            response.high_watermark = tracker.high_watermark
            response.isr.extend(sorted(tracker.isr))
            response.replicas.extend(sorted(replica_set(self._broker.cache, topic.name) | {self._broker.broker_id}))
            for follower in tracker.follower_states():
                response.followers.append(pb.FollowerState(
                    broker_id=follower.broker_id, log_end_offset=follower.log_end_offset, lag=follower.lag,
                    last_fetch_s=follower.last_fetch_s, in_sync=follower.in_sync,
                ))
        for rng in remote.unavailable if remote is not None else []:
            try:
                response.unavailable_ranges.append(_unavailable_range(rng))
            except (TypeError, ValueError) as exc:  # one bad record must not hide the topic
                if (topic.path, repr(rng)) not in self._reported_ranges:
                    self._reported_ranges.add((topic.path, repr(rng)))
                    log.warning("topic %s: unavailable range record %r left out of DescribeTopic: %s",
                                topic.path, rng, exc)
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
                records_from_table=sub.records_from_table,
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
