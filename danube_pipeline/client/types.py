"""User-facing value types of the Danube client.

Generated protobuf types stay inside the client's private modules; everything a caller sees is
one of the enums, frozen dataclasses and named tuples below. The
``_from_pb`` helpers are the only place where wire messages become these types.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

from danube_pipeline.format.batches import iter_batch
from danube_pipeline.modes import DeliveryMode, InitialPosition, SubscriptionType
from danube_pipeline.names import validate_subject
from danube_pipeline.proto import danube_pb2 as pb

__all__ = [
    "AvroSchema",
    "JsonSchema",
    "ProtobufSchema",
    "Schema",
    "SchemaInfo",
    "TopicSchemaPolicy",
    "BrokerAddress",
    "BrokerInfo",
    "ClusterInfo",
    "DeliveryMode",
    "InitialPosition",
    "LocalRetentionResult",
    "Message",
    "MessageId",
    "SegmentInfo",
    "SubscriptionInfo",
    "SubscriptionType",
    "TopicDescription",
    "TopicInfo",
]


class BrokerAddress(NamedTuple):
    """A broker known by id (the client indexes brokers by id once it has learnt them).

    Attributes:
        broker_id: the u64 broker id registered in ``/cluster/register/{id}``.
        address: ``"host:port"`` without a scheme.
    """

    broker_id: int
    address: str


@dataclass(frozen=True)
class AvroSchema:
    """An Avro schema a producer registers before it publishes (``docs/etcd-layout.md`` §4).

    Attributes:
        subject: the schema-registry subject, e.g. ``"flights-value"``
            (:func:`danube_pipeline.names.validate_subject`).
        raw_schema: the Avro schema as JSON text.

    Raises:
        InvalidNameError: ``subject`` breaks the subject grammar (checked on creation).
    """

    subject: str
    raw_schema: str
    schema_type: ClassVar[str] = "Avro"

    def __post_init__(self) -> None:
        validate_subject(self.subject)


@dataclass(frozen=True)
class JsonSchema:
    """A JSON Schema a producer registers before it publishes (``docs/etcd-layout.md`` §4).

    Each payload must then be UTF-8 JSON that validates against it (checked by the broker).

    Attributes:
        subject: the schema-registry subject (:func:`danube_pipeline.names.validate_subject`).
        raw_schema: the JSON Schema as JSON text: an object, draft 2020-12 unless its
            ``$schema`` names draft 7; only local ``$ref``.

    Raises:
        InvalidNameError: ``subject`` breaks the subject grammar (checked on creation).
    """

    subject: str
    raw_schema: str
    schema_type: ClassVar[str] = "JsonSchema"

    def __post_init__(self) -> None:
        validate_subject(self.subject)


@dataclass(frozen=True)
class ProtobufSchema:
    """A Protobuf schema a producer registers before it publishes (``docs/etcd-layout.md`` §4).

    Each payload must then be the serialized record message, without unknown fields (checked
    by the broker).

    Attributes:
        subject: the schema-registry subject (:func:`danube_pipeline.names.validate_subject`).
        raw_schema: ``.proto`` source text with ``syntax = "proto3";``; its first top-level
            message is the record type; it may import Google's well-known types only.

    Raises:
        InvalidNameError: ``subject`` breaks the subject grammar (checked on creation).
    """

    subject: str
    raw_schema: str
    schema_type: ClassVar[str] = "Protobuf"

    def __post_init__(self) -> None:
        validate_subject(self.subject)


Schema = AvroSchema | JsonSchema | ProtobufSchema
"""A schema of any of the three types, as producers and ``client.schemas.register`` take it."""

_SCHEMA_TYPE_TO_PB = {"Avro": pb.AVRO, "JsonSchema": pb.JSON_SCHEMA, "Protobuf": pb.PROTOBUF}
_SCHEMA_TYPE_FROM_PB = {number: name for name, number in _SCHEMA_TYPE_TO_PB.items()}


@dataclass(frozen=True, slots=True)
class SchemaInfo:
    """One registered schema version (``docs/etcd-layout.md`` §4.3).

    Attributes:
        subject: the subject.
        schema_id: the subject's global id (every version shares it).
        version: 1, 2, 3... within the subject.
        schema_type: ``"Avro"``, ``"JsonSchema"`` or ``"Protobuf"``.
        raw_schema: the schema text as registered (empty in a registration's answer).
        fingerprint: ``"sha256:<hex>"``.
    """

    subject: str
    schema_id: int
    version: int
    schema_type: str
    raw_schema: str
    fingerprint: str


@dataclass(frozen=True, slots=True)
class TopicSchemaPolicy:
    """A topic's schema settings (``docs/etcd-layout.md`` §3.7).

    Attributes:
        topic: ``"/{namespace}/{topic}"`` (a partition's, for a partitioned topic).
        subject: the topic's schema subject; ``""`` until a producer with a schema came.
        allow_raw: whether producers without a schema may publish to it.
    """

    topic: str
    subject: str
    allow_raw: bool


class MessageId(int):
    """What a producer's ``send`` answers: the message's offset, as an ``int`` (so
    ``offset == message_id`` and arithmetic work as before), carrying the partition too.

    Attributes:
        partition: the index ``i`` of the partition ``{topic}-part-{i}`` the message went to,
            for a producer on a partitioned topic (``docs/etcd-layout.md`` §3.1); ``None`` on a
            plain topic.
    """

    partition: int | None = None

    @classmethod
    def in_partition(cls, offset: int, partition: int) -> MessageId:
        """``offset`` in partition ``partition``."""
        message_id = cls(offset)
        message_id.partition = partition
        return message_id

    def __str__(self) -> str:
        return int.__repr__(self)  # prints as the offset, like the int it is

    def __repr__(self) -> str:
        if self.partition is None:
            return f"MessageId({int(self)})"
        return f"MessageId({int(self)}, partition={self.partition})"


class Message(NamedTuple):
    """One message delivered to a consumer (an immutable record; a named tuple, because a
    consumer builds one per message and a tuple is the cheapest immutable object to build).

    Attributes:
        topic: ``"/{namespace}/{topic}"``.
        offset: position in the topic, contiguous from 0.
        payload: the message bytes.
        attributes: user key/value pairs set by the producer.
        publish_time_us: microseconds since the Unix epoch.
        producer_id: the id of the producer that published it.
        producer_name: that producer's name.
        schema_id: global schema id; 0 = no schema.
        schema_version: version within the schema's subject; 0 = no schema.
        redelivery_count: how many times the broker delivered it before without an ack
            (it was nacked, its ack timeout passed, or its consumer left); counted per message.
        key: the routing key the producer gave, or ``None``.
        partition: for a consumer of a partitioned topic, the index ``i`` of the partition
            ``{topic}-part-{i}`` it came from (``topic`` is then that partition's name);
            ``None`` on a plain topic.
    """

    topic: str
    offset: int
    payload: bytes
    attributes: Mapping[str, str]
    publish_time_us: int
    producer_id: int
    producer_name: str
    schema_id: int
    schema_version: int
    redelivery_count: int
    key: str | None = None
    partition: int | None = None


@dataclass(frozen=True, slots=True)
class TopicInfo:
    """A topic as listed by a broker.

    Attributes:
        topic: ``"/{namespace}/{topic}"``.
        next_offset: the offset the next appended message will get.
        sealed_segments: number of sealed WAL segments.
        wal_syncs: ``fdatasync`` calls made for the topic since the broker started.
    """

    topic: str
    next_offset: int
    sealed_segments: int
    wal_syncs: int


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """A sealed (immutable) WAL segment.

    Attributes:
        start_offset: first offset in the segment.
        end_offset: last offset in the segment, inclusive.
        size_bytes: file size in bytes, header included.
        record_count: number of records.
        created_at_ms: creation time, milliseconds since the Unix epoch.
        sealed_at_ms: sealing time, milliseconds since the Unix epoch.
    """

    start_offset: int
    end_offset: int
    size_bytes: int
    record_count: int
    created_at_ms: int
    sealed_at_ms: int


@dataclass(frozen=True, slots=True)
class LocalRetentionResult:
    """What ``Admin.ApplyLocalRetention`` did to a topic's WAL.

    Attributes:
        deleted_segments: sealed segments deleted from the broker's disk.
        deleted_bytes: bytes freed.
        first_local_offset: the WAL's first offset afterwards.
        wal_bytes: the WAL's size on disk afterwards, in bytes.
    """

    deleted_segments: int
    deleted_bytes: int
    first_local_offset: int
    wal_bytes: int


@dataclass(frozen=True, slots=True)
class SubscriptionInfo:
    """A subscription loaded on the broker serving its topic.

    Attributes:
        name: the subscription name.
        subscription_type: Exclusive, Shared or Failover.
        cursor: the last offset with everything at or below it acknowledged, ``None`` when
            nothing is.
        read_position: the next offset never handed out.
        consumers: consumers attached.
        records_from_object_storage: records handed out from object storage.
        skipped_below_retention: offsets jumped over because they expired.
        skipped_unavailable: offsets of unavailable ranges skipped (``--unavailable-range
            skip``, or the range was abandoned).
        dispatch_throttled_ms: milliseconds dispatch waited for the topic's
            ``max_subscription_dispatch_rate`` (``docs/etcd-layout.md`` §2.1).
        records_from_table: of ``records_from_object_storage``, records served from the
            topic's Iceberg table (the cold read path, ``docs/etcd-layout.md`` §3.10).
    """

    name: str
    subscription_type: SubscriptionType
    cursor: int | None
    read_position: int
    consumers: int
    records_from_object_storage: int
    skipped_below_retention: int
    skipped_unavailable: int = 0
    dispatch_throttled_ms: int = 0
    records_from_table: int = 0


@dataclass(frozen=True, slots=True)
class UnavailableRangeInfo:
    """Offsets a failed owner may have acknowledged that are not in object storage yet
    (``docs/etcd-layout.md`` §5.5).

    Attributes:
        start_offset, end_offset: the range, inclusive.
        broker_id: the failed owner whose disk holds them.
        since: when the range was recorded, seconds since the epoch.
        last_written: the last offset that broker wrote, once it returned (offsets above it
            were never handed out); ``-1`` if it returned having written none; ``None`` until
            it returned.
        abandoned: an operator gave up waiting: offsets not in object storage are skipped.
    """

    start_offset: int
    end_offset: int
    broker_id: int
    since: int
    last_written: int | None
    abandoned: bool


@dataclass(frozen=True, slots=True)
class TopicDescription:
    """Where a topic's offsets live (``Admin.DescribeTopic``).

    Attributes:
        first_local_offset: the WAL's first offset.
        next_offset: the offset the next message gets.
        wal_bytes: the WAL's size on disk, in bytes.
        sealed_segments: sealed segments in the WAL.
        remote_first_offset: the first offset held in object storage, ``None`` when none is.
        remote_end_offset: the last offset held in object storage (inclusive), or ``None``.
        earliest_offset: the earliest offset a subscription can read.
        subscriptions: the subscriptions loaded, by name.
        cache_bytes: the broker's cache of objects read back (all topics), in bytes.
        broker_id: the owner that answered.
        owner_epoch: its assignment key's create revision (``docs/etcd-layout.md`` §1.4).
        reserved_end_offset: the last offset of its reserved block (§5.4).
        unavailable_ranges: offsets failed owners may hold (§5.5), ascending.
        delivery: the topic's delivery mode (§3.2).
        publish_throttled_ms: milliseconds publishing waited for the topic's
            ``max_publish_rate`` (§2.1).
        dropped_messages: ``NonReliable`` only: messages dropped unread because the in-memory
            buffer was full (oldest first).
        buffered_messages: ``NonReliable`` only: messages held in memory now.
        buffered_bytes: ``NonReliable`` only: batch bytes held in memory now.
        replicas: the brokers holding a copy of the log, the owner included (§1.9); empty at
            replication factor 1.
        isr: the in-sync replicas, the owner included (§5.9); empty at replication factor 1.
        high_watermark: the offset readers and acknowledgements stay below (the next offset at
            replication factor 1).
        followers: each follower's log end, lag and last fetch, as the owner knows them.
    """

    first_local_offset: int
    next_offset: int
    wal_bytes: int
    sealed_segments: int
    remote_first_offset: int | None
    remote_end_offset: int | None
    earliest_offset: int
    subscriptions: list[SubscriptionInfo]
    cache_bytes: int
    broker_id: int = 0
    owner_epoch: int = 0
    reserved_end_offset: int = 0
    unavailable_ranges: list[UnavailableRangeInfo] = field(default_factory=list)
    delivery: DeliveryMode = DeliveryMode.RELIABLE
    publish_throttled_ms: int = 0
    dropped_messages: int = 0
    buffered_messages: int = 0
    buffered_bytes: int = 0
    replicas: list[int] = field(default_factory=list)
    isr: list[int] = field(default_factory=list)
    high_watermark: int = 0
    followers: list[FollowerInfo] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class FollowerInfo:
    """A follower of a replicated topic, as its owner knows it (``Admin.DescribeTopic``).

    Attributes:
        broker_id: the follower.
        log_end_offset: its next offset as its latest fetch reported.
        lag: the owner's log end minus the follower's, in offsets.
        last_fetch_s: seconds since its latest fetch; ``-1`` before one.
        in_sync: whether it is in the ISR.
    """

    broker_id: int
    log_end_offset: int
    lag: int
    last_fetch_s: float
    in_sync: bool


@dataclass(frozen=True, slots=True)
class BrokerInfo:
    """A registered broker (``/cluster/register/{id}``).

    Attributes:
        broker_id: the broker's u64 id.
        address: ``"host:port"`` without a scheme.
        mode: the ``mode`` of ``/cluster/brokers/{id}/state``.
    """

    broker_id: int
    address: str
    mode: str


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    """The cluster as the last metadata refresh saw it.

    Attributes:
        cluster_name: the cluster's name.
        brokers: every registered broker, ascending by id.
        leader_broker_id: the leader's id; 0 = no leader recorded.
    """

    cluster_name: str
    brokers: tuple[BrokerInfo, ...] = field(default_factory=tuple)
    leader_broker_id: int = 0


def _messages_from_delivery(topic: str, delivery: pb.BatchDelivery, partition: int | None = None) -> list[Message]:
    """The messages of one delivered batch: records from ``first_offset`` on, minus those the
    broker reports acknowledged already; ``partition`` is the topic's index when it is a
    partition of a partitioned topic.

    Raises:
        MalformedRequestError: the batch does not parse.
    """
    header, records = iter_batch(delivery.batch)
    first = delivery.first_offset
    skip = set(delivery.acked_offsets)
    count = delivery.redelivery_count
    # per delivered record when they differ, else the batch's count for every record
    counts: Iterator[int] = iter(delivery.redelivery_counts) if delivery.redelivery_counts else itertools.repeat(count)
    return [
        Message(
            topic=topic,
            offset=offset,
            payload=payload,
            attributes=attributes,
            publish_time_us=publish_time_us,
            producer_id=header.producer_id,
            producer_name=header.producer_name,
            schema_id=header.schema_id,
            schema_version=header.schema_version,
            redelivery_count=next(counts, count),
            key=key,
            partition=partition,
        )
        for offset, publish_time_us, key, attributes, payload in records
        if offset >= first and offset not in skip
    ]


def _topic_info_from_pb(t: pb.TopicInfo) -> TopicInfo:
    return TopicInfo(
        topic=t.topic,
        next_offset=t.next_offset,
        sealed_segments=t.sealed_segments,
        wal_syncs=t.wal_syncs,
    )


def _segment_info_from_pb(s: pb.SegmentInfo) -> SegmentInfo:
    return SegmentInfo(
        start_offset=s.start_offset,
        end_offset=s.end_offset,
        size_bytes=s.size_bytes,
        record_count=s.record_count,
        created_at_ms=s.created_at_ms,
        sealed_at_ms=s.sealed_at_ms,
    )


def _topic_description_from_pb(r: pb.DescribeTopicResponse) -> TopicDescription:
    return TopicDescription(
        first_local_offset=r.first_local_offset,
        next_offset=r.next_offset,
        wal_bytes=r.wal_bytes,
        sealed_segments=r.sealed_segments,
        remote_first_offset=r.remote_first_offset if r.HasField("remote_first_offset") else None,
        remote_end_offset=r.remote_end_offset if r.HasField("remote_end_offset") else None,
        earliest_offset=r.earliest_offset,
        subscriptions=[
            SubscriptionInfo(
                name=s.name,
                subscription_type=SubscriptionType(s.type),
                cursor=s.cursor if s.HasField("cursor") else None,
                read_position=s.read_position,
                consumers=s.consumers,
                records_from_object_storage=s.records_from_object_storage,
                skipped_below_retention=s.skipped_below_retention,
                skipped_unavailable=s.skipped_unavailable,
                dispatch_throttled_ms=s.dispatch_throttled_ms,
                records_from_table=s.records_from_table,
            )
            for s in r.subscriptions
        ],
        cache_bytes=r.cache_bytes,
        broker_id=r.broker_id,
        owner_epoch=r.owner_epoch,
        reserved_end_offset=r.reserved_end_offset,
        unavailable_ranges=[
            UnavailableRangeInfo(
                start_offset=u.start_offset,
                end_offset=u.end_offset,
                broker_id=u.broker_id,
                since=u.since,
                last_written=u.last_written if u.HasField("last_written") else (-1 if u.nothing_written else None),
                abandoned=u.abandoned,
            )
            for u in r.unavailable_ranges
        ],
        delivery=DeliveryMode.from_wire(r.delivery),
        publish_throttled_ms=r.publish_throttled_ms,
        dropped_messages=r.dropped_messages,
        buffered_messages=r.buffered_messages,
        buffered_bytes=r.buffered_bytes,
        replicas=list(r.replicas),
        isr=list(r.isr),
        high_watermark=r.high_watermark,
        followers=[
            FollowerInfo(
                broker_id=f.broker_id, log_end_offset=f.log_end_offset, lag=f.lag, last_fetch_s=f.last_fetch_s,
                in_sync=f.in_sync,
            )
            for f in r.followers
        ],
    )


def _cluster_info_from_pb(r: pb.ClusterMetadataResponse) -> ClusterInfo:
    brokers = tuple(
        sorted(
            (BrokerInfo(broker_id=b.broker_id, address=b.broker_addr, mode=b.mode) for b in r.brokers),
            key=lambda b: b.broker_id,
        )
    )
    return ClusterInfo(cluster_name=r.cluster_name, brokers=brokers, leader_broker_id=r.leader_broker_id)
