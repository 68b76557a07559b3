from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeliveryMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELIABLE: _ClassVar[DeliveryMode]
    NON_RELIABLE: _ClassVar[DeliveryMode]

class SubscriptionType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXCLUSIVE: _ClassVar[SubscriptionType]
    SHARED: _ClassVar[SubscriptionType]
    FAILOVER: _ClassVar[SubscriptionType]
    KEY_SHARED: _ClassVar[SubscriptionType]

class InitialPosition(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LATEST: _ClassVar[InitialPosition]
    EARLIEST: _ClassVar[InitialPosition]

class SchemaType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AVRO: _ClassVar[SchemaType]
    JSON_SCHEMA: _ClassVar[SchemaType]
    PROTOBUF: _ClassVar[SchemaType]
RELIABLE: DeliveryMode
NON_RELIABLE: DeliveryMode
EXCLUSIVE: SubscriptionType
SHARED: SubscriptionType
FAILOVER: SubscriptionType
KEY_SHARED: SubscriptionType
LATEST: InitialPosition
EARLIEST: InitialPosition
AVRO: SchemaType
JSON_SCHEMA: SchemaType
PROTOBUF: SchemaType

class SchemaReference(_message.Message):
    __slots__ = ("schema_id", "schema_version", "subject")
    SCHEMA_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    schema_id: int
    schema_version: int
    subject: str
    def __init__(self, schema_id: _Optional[int] = ..., schema_version: _Optional[int] = ..., subject: _Optional[str] = ...) -> None: ...

class CreateProducerRequest(_message.Message):
    __slots__ = ("topic", "producer_name", "access_mode", "schema", "delivery", "request_id", "idempotent", "idempotent_producer_id", "producer_epoch")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_NAME_FIELD_NUMBER: _ClassVar[int]
    ACCESS_MODE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENT_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENT_PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    topic: str
    producer_name: str
    access_mode: int
    schema: SchemaReference
    delivery: DeliveryMode
    request_id: str
    idempotent: bool
    idempotent_producer_id: int
    producer_epoch: int
    def __init__(self, topic: _Optional[str] = ..., producer_name: _Optional[str] = ..., access_mode: _Optional[int] = ..., schema: _Optional[_Union[SchemaReference, _Mapping]] = ..., delivery: _Optional[_Union[DeliveryMode, str]] = ..., request_id: _Optional[str] = ..., idempotent: _Optional[bool] = ..., idempotent_producer_id: _Optional[int] = ..., producer_epoch: _Optional[int] = ...) -> None: ...

class CreateProducerResponse(_message.Message):
    __slots__ = ("producer_id", "broker_id", "max_message_size_bytes", "max_batch_bytes", "idempotent_producer_id", "producer_epoch")
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENT_PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    producer_id: int
    broker_id: int
    max_message_size_bytes: int
    max_batch_bytes: int
    idempotent_producer_id: int
    producer_epoch: int
    def __init__(self, producer_id: _Optional[int] = ..., broker_id: _Optional[int] = ..., max_message_size_bytes: _Optional[int] = ..., max_batch_bytes: _Optional[int] = ..., idempotent_producer_id: _Optional[int] = ..., producer_epoch: _Optional[int] = ...) -> None: ...

class SendBatchRequest(_message.Message):
    __slots__ = ("producer_id", "sequence_id", "batch", "stream_id")
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    producer_id: int
    sequence_id: int
    batch: bytes
    stream_id: int
    def __init__(self, producer_id: _Optional[int] = ..., sequence_id: _Optional[int] = ..., batch: _Optional[bytes] = ..., stream_id: _Optional[int] = ...) -> None: ...

class ProduceRequest(_message.Message):
    __slots__ = ("batches", "closed_streams")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    CLOSED_STREAMS_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[SendBatchRequest]
    closed_streams: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batches: _Optional[_Iterable[_Union[SendBatchRequest, _Mapping]]] = ..., closed_streams: _Optional[_Iterable[int]] = ...) -> None: ...

class ProduceResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SendBatchResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[SendBatchResponse, _Mapping]]] = ...) -> None: ...

class SendBatchResponse(_message.Message):
    __slots__ = ("first_offset", "last_offset", "sequence_id", "error", "throttled_ms", "stream_id")
    FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    THROTTLED_MS_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    first_offset: int
    last_offset: int
    sequence_id: int
    error: ErrorStatus
    throttled_ms: int
    stream_id: int
    def __init__(self, first_offset: _Optional[int] = ..., last_offset: _Optional[int] = ..., sequence_id: _Optional[int] = ..., error: _Optional[_Union[ErrorStatus, _Mapping]] = ..., throttled_ms: _Optional[int] = ..., stream_id: _Optional[int] = ...) -> None: ...

class ErrorStatus(_message.Message):
    __slots__ = ("code", "message", "error_class", "fields")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    error_class: str
    fields: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., error_class: _Optional[str] = ..., fields: _Optional[str] = ...) -> None: ...

class CloseProducerRequest(_message.Message):
    __slots__ = ("producer_id",)
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    producer_id: int
    def __init__(self, producer_id: _Optional[int] = ...) -> None: ...

class CloseProducerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("topic", "subscription", "subscription_type", "consumer_name", "initial_position", "receiver_queue_size", "request_id", "settings", "start_publish_time_us")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_TYPE_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_NAME_FIELD_NUMBER: _ClassVar[int]
    INITIAL_POSITION_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_QUEUE_SIZE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    START_PUBLISH_TIME_US_FIELD_NUMBER: _ClassVar[int]
    topic: str
    subscription: str
    subscription_type: SubscriptionType
    consumer_name: str
    initial_position: InitialPosition
    receiver_queue_size: int
    request_id: str
    settings: SubscriptionSettings
    start_publish_time_us: int
    def __init__(self, topic: _Optional[str] = ..., subscription: _Optional[str] = ..., subscription_type: _Optional[_Union[SubscriptionType, str]] = ..., consumer_name: _Optional[str] = ..., initial_position: _Optional[_Union[InitialPosition, str]] = ..., receiver_queue_size: _Optional[int] = ..., request_id: _Optional[str] = ..., settings: _Optional[_Union[SubscriptionSettings, _Mapping]] = ..., start_publish_time_us: _Optional[int] = ...) -> None: ...

class SubscriptionSettings(_message.Message):
    __slots__ = ("ack_timeout_ms", "nack_redelivery_delay_ms", "nack_redelivery_max_delay_ms", "max_redeliveries", "dead_letter_topic")
    ACK_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    NACK_REDELIVERY_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    NACK_REDELIVERY_MAX_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_REDELIVERIES_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTER_TOPIC_FIELD_NUMBER: _ClassVar[int]
    ack_timeout_ms: int
    nack_redelivery_delay_ms: int
    nack_redelivery_max_delay_ms: int
    max_redeliveries: int
    dead_letter_topic: str
    def __init__(self, ack_timeout_ms: _Optional[int] = ..., nack_redelivery_delay_ms: _Optional[int] = ..., nack_redelivery_max_delay_ms: _Optional[int] = ..., max_redeliveries: _Optional[int] = ..., dead_letter_topic: _Optional[str] = ...) -> None: ...

class SubscribeResponse(_message.Message):
    __slots__ = ("consumer_id", "broker_id")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    consumer_id: int
    broker_id: int
    def __init__(self, consumer_id: _Optional[int] = ..., broker_id: _Optional[int] = ...) -> None: ...

class ReceiveRequest(_message.Message):
    __slots__ = ("consumer_id",)
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    consumer_id: int
    def __init__(self, consumer_id: _Optional[int] = ...) -> None: ...

class BatchDelivery(_message.Message):
    __slots__ = ("batch", "first_offset", "acked_offsets", "redelivery_count", "redelivery_counts")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ACKED_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    REDELIVERY_COUNT_FIELD_NUMBER: _ClassVar[int]
    REDELIVERY_COUNTS_FIELD_NUMBER: _ClassVar[int]
    batch: bytes
    first_offset: int
    acked_offsets: _containers.RepeatedScalarFieldContainer[int]
    redelivery_count: int
    redelivery_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch: _Optional[bytes] = ..., first_offset: _Optional[int] = ..., acked_offsets: _Optional[_Iterable[int]] = ..., redelivery_count: _Optional[int] = ..., redelivery_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class Deliveries(_message.Message):
    __slots__ = ("batches",)
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[BatchDelivery]
    def __init__(self, batches: _Optional[_Iterable[_Union[BatchDelivery, _Mapping]]] = ...) -> None: ...

class OffsetRange(_message.Message):
    __slots__ = ("first", "last")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    first: int
    last: int
    def __init__(self, first: _Optional[int] = ..., last: _Optional[int] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("consumer_id", "offsets", "ranges")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    consumer_id: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    ranges: _containers.RepeatedCompositeFieldContainer[OffsetRange]
    def __init__(self, consumer_id: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., ranges: _Optional[_Iterable[_Union[OffsetRange, _Mapping]]] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NackRequest(_message.Message):
    __slots__ = ("consumer_id", "ranges", "reason")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    consumer_id: int
    ranges: _containers.RepeatedCompositeFieldContainer[OffsetRange]
    reason: str
    def __init__(self, consumer_id: _Optional[int] = ..., ranges: _Optional[_Iterable[_Union[OffsetRange, _Mapping]]] = ..., reason: _Optional[str] = ...) -> None: ...

class NackResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseConsumerRequest(_message.Message):
    __slots__ = ("consumer_id",)
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    consumer_id: int
    def __init__(self, consumer_id: _Optional[int] = ...) -> None: ...

class CloseConsumerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TopicLookupRequest(_message.Message):
    __slots__ = ("topic",)
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    topic: str
    def __init__(self, topic: _Optional[str] = ...) -> None: ...

class TopicLookupResponse(_message.Message):
    __slots__ = ("broker_id", "broker_addr", "partitions")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    BROKER_ADDR_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    broker_id: int
    broker_addr: str
    partitions: int
    def __init__(self, broker_id: _Optional[int] = ..., broker_addr: _Optional[str] = ..., partitions: _Optional[int] = ...) -> None: ...

class ClusterMetadataRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BrokerInfo(_message.Message):
    __slots__ = ("broker_id", "broker_addr", "mode")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    BROKER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    broker_id: int
    broker_addr: str
    mode: str
    def __init__(self, broker_id: _Optional[int] = ..., broker_addr: _Optional[str] = ..., mode: _Optional[str] = ...) -> None: ...

class ClusterMetadataResponse(_message.Message):
    __slots__ = ("cluster_name", "brokers", "leader_broker_id")
    CLUSTER_NAME_FIELD_NUMBER: _ClassVar[int]
    BROKERS_FIELD_NUMBER: _ClassVar[int]
    LEADER_BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    cluster_name: str
    brokers: _containers.RepeatedCompositeFieldContainer[BrokerInfo]
    leader_broker_id: int
    def __init__(self, cluster_name: _Optional[str] = ..., brokers: _Optional[_Iterable[_Union[BrokerInfo, _Mapping]]] = ..., leader_broker_id: _Optional[int] = ...) -> None: ...

class SetTopicSchemaPolicyRequest(_message.Message):
    __slots__ = ("topic", "allow_raw")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    ALLOW_RAW_FIELD_NUMBER: _ClassVar[int]
    topic: str
    allow_raw: bool
    def __init__(self, topic: _Optional[str] = ..., allow_raw: _Optional[bool] = ...) -> None: ...

class TopicSchemaPolicy(_message.Message):
    __slots__ = ("topic", "subject", "allow_raw")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    ALLOW_RAW_FIELD_NUMBER: _ClassVar[int]
    topic: str
    subject: str
    allow_raw: bool
    def __init__(self, topic: _Optional[str] = ..., subject: _Optional[str] = ..., allow_raw: _Optional[bool] = ...) -> None: ...

class SetTopicSchemaPolicyResponse(_message.Message):
    __slots__ = ("policies",)
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    policies: _containers.RepeatedCompositeFieldContainer[TopicSchemaPolicy]
    def __init__(self, policies: _Optional[_Iterable[_Union[TopicSchemaPolicy, _Mapping]]] = ...) -> None: ...

class DeleteTopicRequest(_message.Message):
    __slots__ = ("topic", "force")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    topic: str
    force: bool
    def __init__(self, topic: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class DeleteTopicResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, deleted: _Optional[_Iterable[str]] = ...) -> None: ...

class ResetCursorRequest(_message.Message):
    __slots__ = ("topic", "subscription", "offset", "earliest", "latest", "timestamp_ms")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    EARLIEST_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    subscription: str
    offset: int
    earliest: bool
    latest: bool
    timestamp_ms: int
    def __init__(self, topic: _Optional[str] = ..., subscription: _Optional[str] = ..., offset: _Optional[int] = ..., earliest: _Optional[bool] = ..., latest: _Optional[bool] = ..., timestamp_ms: _Optional[int] = ...) -> None: ...

class ResetCursorResponse(_message.Message):
    __slots__ = ("next_offset",)
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    next_offset: int
    def __init__(self, next_offset: _Optional[int] = ...) -> None: ...

class AbandonUnavailableRangeRequest(_message.Message):
    __slots__ = ("topic", "start_offset")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    topic: str
    start_offset: int
    def __init__(self, topic: _Optional[str] = ..., start_offset: _Optional[int] = ...) -> None: ...

class AbandonUnavailableRangeResponse(_message.Message):
    __slots__ = ("skipped",)
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    skipped: int
    def __init__(self, skipped: _Optional[int] = ...) -> None: ...

class UnavailableRange(_message.Message):
    __slots__ = ("start_offset", "end_offset", "broker_id", "since", "last_written", "abandoned", "nothing_written")
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    LAST_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    NOTHING_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    start_offset: int
    end_offset: int
    broker_id: int
    since: int
    last_written: int
    abandoned: bool
    nothing_written: bool
    def __init__(self, start_offset: _Optional[int] = ..., end_offset: _Optional[int] = ..., broker_id: _Optional[int] = ..., since: _Optional[int] = ..., last_written: _Optional[int] = ..., abandoned: _Optional[bool] = ..., nothing_written: _Optional[bool] = ...) -> None: ...

class UnloadTopicRequest(_message.Message):
    __slots__ = ("topic",)
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    topic: str
    def __init__(self, topic: _Optional[str] = ...) -> None: ...

class UnloadTopicResponse(_message.Message):
    __slots__ = ("next_offset",)
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    next_offset: int
    def __init__(self, next_offset: _Optional[int] = ...) -> None: ...

class DrainBrokerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainBrokerResponse(_message.Message):
    __slots__ = ("topics",)
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    topics: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, topics: _Optional[_Iterable[str]] = ...) -> None: ...

class ApplyLocalRetentionRequest(_message.Message):
    __slots__ = ("topic", "retention_bytes", "retention_ms")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    RETENTION_BYTES_FIELD_NUMBER: _ClassVar[int]
    RETENTION_MS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    retention_bytes: int
    retention_ms: int
    def __init__(self, topic: _Optional[str] = ..., retention_bytes: _Optional[int] = ..., retention_ms: _Optional[int] = ...) -> None: ...

class ApplyLocalRetentionResponse(_message.Message):
    __slots__ = ("deleted_segments", "deleted_bytes", "first_local_offset", "wal_bytes")
    DELETED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    DELETED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOCAL_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    deleted_segments: int
    deleted_bytes: int
    first_local_offset: int
    wal_bytes: int
    def __init__(self, deleted_segments: _Optional[int] = ..., deleted_bytes: _Optional[int] = ..., first_local_offset: _Optional[int] = ..., wal_bytes: _Optional[int] = ...) -> None: ...

class DescribeTopicRequest(_message.Message):
    __slots__ = ("topic",)
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    topic: str
    def __init__(self, topic: _Optional[str] = ...) -> None: ...

class SubscriptionState(_message.Message):
    __slots__ = ("name", "type", "cursor", "read_position", "consumers", "records_from_object_storage", "skipped_below_retention", "skipped_unavailable", "dispatch_throttled_ms", "records_from_table")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    READ_POSITION_FIELD_NUMBER: _ClassVar[int]
    CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FROM_OBJECT_STORAGE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_BELOW_RETENTION_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_THROTTLED_MS_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FROM_TABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: SubscriptionType
    cursor: int
    read_position: int
    consumers: int
    records_from_object_storage: int
    skipped_below_retention: int
    skipped_unavailable: int
    dispatch_throttled_ms: int
    records_from_table: int
    def __init__(self, name: _Optional[str] = ..., type: _Optional[_Union[SubscriptionType, str]] = ..., cursor: _Optional[int] = ..., read_position: _Optional[int] = ..., consumers: _Optional[int] = ..., records_from_object_storage: _Optional[int] = ..., skipped_below_retention: _Optional[int] = ..., skipped_unavailable: _Optional[int] = ..., dispatch_throttled_ms: _Optional[int] = ..., records_from_table: _Optional[int] = ...) -> None: ...

class DescribeTopicResponse(_message.Message):
    __slots__ = ("first_local_offset", "next_offset", "wal_bytes", "sealed_segments", "remote_first_offset", "remote_end_offset", "earliest_offset", "subscriptions", "cache_bytes", "broker_id", "owner_epoch", "reserved_end_offset", "unavailable_ranges", "delivery", "publish_throttled_ms", "dropped_messages", "buffered_messages", "buffered_bytes", "replicas", "isr", "high_watermark", "followers")
    FIRST_LOCAL_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEALED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIRST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REMOTE_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EARLIEST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESERVED_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_RANGES_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_THROTTLED_MS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ISR_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    FOLLOWERS_FIELD_NUMBER: _ClassVar[int]
    first_local_offset: int
    next_offset: int
    wal_bytes: int
    sealed_segments: int
    remote_first_offset: int
    remote_end_offset: int
    earliest_offset: int
    subscriptions: _containers.RepeatedCompositeFieldContainer[SubscriptionState]
    cache_bytes: int
    broker_id: int
    owner_epoch: int
    reserved_end_offset: int
    unavailable_ranges: _containers.RepeatedCompositeFieldContainer[UnavailableRange]
    delivery: DeliveryMode
    publish_throttled_ms: int
    dropped_messages: int
    buffered_messages: int
    buffered_bytes: int
    replicas: _containers.RepeatedScalarFieldContainer[int]
    isr: _containers.RepeatedScalarFieldContainer[int]
    high_watermark: int
    followers: _containers.RepeatedCompositeFieldContainer[FollowerState]
    def __init__(self, first_local_offset: _Optional[int] = ..., next_offset: _Optional[int] = ..., wal_bytes: _Optional[int] = ..., sealed_segments: _Optional[int] = ..., remote_first_offset: _Optional[int] = ..., remote_end_offset: _Optional[int] = ..., earliest_offset: _Optional[int] = ..., subscriptions: _Optional[_Iterable[_Union[SubscriptionState, _Mapping]]] = ..., cache_bytes: _Optional[int] = ..., broker_id: _Optional[int] = ..., owner_epoch: _Optional[int] = ..., reserved_end_offset: _Optional[int] = ..., unavailable_ranges: _Optional[_Iterable[_Union[UnavailableRange, _Mapping]]] = ..., delivery: _Optional[_Union[DeliveryMode, str]] = ..., publish_throttled_ms: _Optional[int] = ..., dropped_messages: _Optional[int] = ..., buffered_messages: _Optional[int] = ..., buffered_bytes: _Optional[int] = ..., replicas: _Optional[_Iterable[int]] = ..., isr: _Optional[_Iterable[int]] = ..., high_watermark: _Optional[int] = ..., followers: _Optional[_Iterable[_Union[FollowerState, _Mapping]]] = ...) -> None: ...

class FollowerState(_message.Message):
    __slots__ = ("broker_id", "log_end_offset", "lag", "last_fetch_s", "in_sync")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOG_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    LAST_FETCH_S_FIELD_NUMBER: _ClassVar[int]
    IN_SYNC_FIELD_NUMBER: _ClassVar[int]
    broker_id: int
    log_end_offset: int
    lag: int
    last_fetch_s: float
    in_sync: bool
    def __init__(self, broker_id: _Optional[int] = ..., log_end_offset: _Optional[int] = ..., lag: _Optional[int] = ..., last_fetch_s: _Optional[float] = ..., in_sync: _Optional[bool] = ...) -> None: ...

class CreateTopicRequest(_message.Message):
    __slots__ = ("topic", "delivery", "request_id", "partitions")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    delivery: DeliveryMode
    request_id: str
    partitions: int
    def __init__(self, topic: _Optional[str] = ..., delivery: _Optional[_Union[DeliveryMode, str]] = ..., request_id: _Optional[str] = ..., partitions: _Optional[int] = ...) -> None: ...

class CreateTopicResponse(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    def __init__(self, created: _Optional[bool] = ...) -> None: ...

class ListTopicsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class TopicInfo(_message.Message):
    __slots__ = ("topic", "next_offset", "sealed_segments", "wal_syncs")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SEALED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    WAL_SYNCS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    next_offset: int
    sealed_segments: int
    wal_syncs: int
    def __init__(self, topic: _Optional[str] = ..., next_offset: _Optional[int] = ..., sealed_segments: _Optional[int] = ..., wal_syncs: _Optional[int] = ...) -> None: ...

class ListTopicsResponse(_message.Message):
    __slots__ = ("topics",)
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    topics: _containers.RepeatedCompositeFieldContainer[TopicInfo]
    def __init__(self, topics: _Optional[_Iterable[_Union[TopicInfo, _Mapping]]] = ...) -> None: ...

class ListSealedSegmentsRequest(_message.Message):
    __slots__ = ("topic", "released")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    topic: str
    released: bool
    def __init__(self, topic: _Optional[str] = ..., released: _Optional[bool] = ...) -> None: ...

class SegmentInfo(_message.Message):
    __slots__ = ("start_offset", "end_offset", "size_bytes", "record_count", "created_at_ms", "sealed_at_ms")
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECORD_COUNT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    SEALED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    start_offset: int
    end_offset: int
    size_bytes: int
    record_count: int
    created_at_ms: int
    sealed_at_ms: int
    def __init__(self, start_offset: _Optional[int] = ..., end_offset: _Optional[int] = ..., size_bytes: _Optional[int] = ..., record_count: _Optional[int] = ..., created_at_ms: _Optional[int] = ..., sealed_at_ms: _Optional[int] = ...) -> None: ...

class ListSealedSegmentsResponse(_message.Message):
    __slots__ = ("segments",)
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[SegmentInfo]
    def __init__(self, segments: _Optional[_Iterable[_Union[SegmentInfo, _Mapping]]] = ...) -> None: ...

class SealActiveSegmentRequest(_message.Message):
    __slots__ = ("topic",)
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    topic: str
    def __init__(self, topic: _Optional[str] = ...) -> None: ...

class SealActiveSegmentResponse(_message.Message):
    __slots__ = ("sealed", "segment")
    SEALED_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    sealed: bool
    segment: SegmentInfo
    def __init__(self, sealed: _Optional[bool] = ..., segment: _Optional[_Union[SegmentInfo, _Mapping]] = ...) -> None: ...

class ReadSegmentRequest(_message.Message):
    __slots__ = ("topic", "start_offset", "released")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    topic: str
    start_offset: int
    released: bool
    def __init__(self, topic: _Optional[str] = ..., start_offset: _Optional[int] = ..., released: _Optional[bool] = ...) -> None: ...

class SegmentChunk(_message.Message):
    __slots__ = ("position", "data")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    position: int
    data: bytes
    def __init__(self, position: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class RegisterSchemaRequest(_message.Message):
    __slots__ = ("subject", "schema_type", "raw_schema", "created_by", "compatibility_mode")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_TYPE_FIELD_NUMBER: _ClassVar[int]
    RAW_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    CREATED_BY_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_MODE_FIELD_NUMBER: _ClassVar[int]
    subject: str
    schema_type: SchemaType
    raw_schema: str
    created_by: str
    compatibility_mode: str
    def __init__(self, subject: _Optional[str] = ..., schema_type: _Optional[_Union[SchemaType, str]] = ..., raw_schema: _Optional[str] = ..., created_by: _Optional[str] = ..., compatibility_mode: _Optional[str] = ...) -> None: ...

class SetCompatibilityModeRequest(_message.Message):
    __slots__ = ("subject", "compatibility_mode")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_MODE_FIELD_NUMBER: _ClassVar[int]
    subject: str
    compatibility_mode: str
    def __init__(self, subject: _Optional[str] = ..., compatibility_mode: _Optional[str] = ...) -> None: ...

class SetCompatibilityModeResponse(_message.Message):
    __slots__ = ("compatibility_mode",)
    COMPATIBILITY_MODE_FIELD_NUMBER: _ClassVar[int]
    compatibility_mode: str
    def __init__(self, compatibility_mode: _Optional[str] = ...) -> None: ...

class RegisterSchemaResponse(_message.Message):
    __slots__ = ("schema_id", "version", "fingerprint")
    SCHEMA_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    schema_id: int
    version: int
    fingerprint: str
    def __init__(self, schema_id: _Optional[int] = ..., version: _Optional[int] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class GetSchemaRequest(_message.Message):
    __slots__ = ("schema_id", "version")
    SCHEMA_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    schema_id: int
    version: int
    def __init__(self, schema_id: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class GetSchemaResponse(_message.Message):
    __slots__ = ("subject", "schema_id", "version", "schema_type", "raw_schema", "fingerprint")
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_TYPE_FIELD_NUMBER: _ClassVar[int]
    RAW_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    subject: str
    schema_id: int
    version: int
    schema_type: SchemaType
    raw_schema: str
    fingerprint: str
    def __init__(self, subject: _Optional[str] = ..., schema_id: _Optional[int] = ..., version: _Optional[int] = ..., schema_type: _Optional[_Union[SchemaType, str]] = ..., raw_schema: _Optional[str] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class FetchLogRequest(_message.Message):
    __slots__ = ("topic", "follower_id", "fetch_offset", "owner_epoch", "max_bytes", "max_wait_ms")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    FOLLOWER_ID_FIELD_NUMBER: _ClassVar[int]
    FETCH_OFFSET_FIELD_NUMBER: _ClassVar[int]
    OWNER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    follower_id: int
    fetch_offset: int
    owner_epoch: int
    max_bytes: int
    max_wait_ms: int
    def __init__(self, topic: _Optional[str] = ..., follower_id: _Optional[int] = ..., fetch_offset: _Optional[int] = ..., owner_epoch: _Optional[int] = ..., max_bytes: _Optional[int] = ..., max_wait_ms: _Optional[int] = ...) -> None: ...

class ReplicaBatch(_message.Message):
    __slots__ = ("leader_epoch", "data")
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    leader_epoch: int
    data: bytes
    def __init__(self, leader_epoch: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class FetchLogResponse(_message.Message):
    __slots__ = ("batches", "high_watermark", "log_start_offset", "log_end_offset", "owner_epoch", "stale")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    HIGH_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    LOG_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LOG_END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    OWNER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[ReplicaBatch]
    high_watermark: int
    log_start_offset: int
    log_end_offset: int
    owner_epoch: int
    stale: bool
    def __init__(self, batches: _Optional[_Iterable[_Union[ReplicaBatch, _Mapping]]] = ..., high_watermark: _Optional[int] = ..., log_start_offset: _Optional[int] = ..., log_end_offset: _Optional[int] = ..., owner_epoch: _Optional[int] = ..., stale: _Optional[bool] = ...) -> None: ...

class OffsetForLeaderEpochRequest(_message.Message):
    __slots__ = ("topic", "follower_id", "leader_epoch")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    FOLLOWER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    topic: str
    follower_id: int
    leader_epoch: int
    def __init__(self, topic: _Optional[str] = ..., follower_id: _Optional[int] = ..., leader_epoch: _Optional[int] = ...) -> None: ...

class OffsetForLeaderEpochResponse(_message.Message):
    __slots__ = ("leader_epoch", "end_offset", "owner_epoch", "log_start_offset")
    LEADER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    END_OFFSET_FIELD_NUMBER: _ClassVar[int]
    OWNER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOG_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    leader_epoch: int
    end_offset: int
    owner_epoch: int
    log_start_offset: int
    def __init__(self, leader_epoch: _Optional[int] = ..., end_offset: _Optional[int] = ..., owner_epoch: _Optional[int] = ..., log_start_offset: _Optional[int] = ...) -> None: ...
