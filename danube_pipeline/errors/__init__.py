"""One root exception for Danube Pipeline, with typed subclasses.

Every error raised by the shared library, the broker and the client derives from
:class:`DanubeError`. Subclasses carry typed fields and build their own message, and carry
two behaviour flags read by the client's retry and metadata-refresh logic (the aiokafka
``KafkaError`` pattern):

* ``retriable``: the same request may succeed if sent again later.
* ``invalid_metadata``: the client's view of the cluster (which broker owns a topic) is
  stale and must be refreshed before retrying.

gRPC status codes are mapped to these classes in exactly one place on each side of the RPC:
``broker.rpc.status`` (server, with :func:`~danube_pipeline.error_codec.encode_error_metadata`)
and ``danube_pipeline.client.status`` (client, with
:func:`~danube_pipeline.error_codec.error_from_status`). The error's class name and constructor
arguments travel in trailing metadata (the encoding is :mod:`danube_pipeline.error_codec`), so
the client rebuilds the same typed error with the same fields.

The classes live in one module per kind (``base``, ``requests``, ``schemas``, ``cluster``,
``storage``, ``produce``, ``security``); import them from here.
"""

from danube_pipeline.errors.base import (
    DanubeError,
    MAX_WIRE_STRING_CHARS,
    bounded,
)
from danube_pipeline.errors.requests import (
    InvalidNameError,
    MessageTooLargeError,
    MalformedRequestError,
    ProducerNotFoundError,
    ConsumerNotFoundError,
    SubscriptionBusyError,
    SubscriptionNotFoundError,
    TopicInUseError,
    OffsetOutOfRangeError,
    InvalidAckError,
    PolicyLimitError,
    ProducerClosedError,
    ConsumerClosedError,
)
from danube_pipeline.errors.schemas import (
    SchemaMismatchError,
    SchemaNotFoundError,
    InvalidSchemaError,
    SchemaEvolutionError,
    IncompatibleSchemaError,
    SchemaRequiredError,
)
from danube_pipeline.errors.cluster import (
    TopicNotFoundError,
    NotServedHereError,
    BrokerUnavailableError,
    StreamEndedError,
    MetadataStoreError,
    PartitionedTopicError,
    UnavailableRangeNotFoundError,
    BrokerIdUnreadableError,
    ObjectStoreMismatchError,
)
from danube_pipeline.errors.storage import (
    SegmentNotFoundError,
    CorruptRecordError,
    LogTruncationError,
    StorageFullError,
    OffsetRangeError,
    PositionBelowRetentionError,
    SegmentQuarantinedError,
    SegmentUnreadableError,
    TableReadError,
)
from danube_pipeline.errors.produce import (
    BatchNotAppendedError,
    DuplicateSequenceError,
    NotEnoughReplicasError,
    ProducerFencedError,
)
from danube_pipeline.errors.security import (
    AuthenticationError,
    PermissionDeniedError,
)

__all__ = [
    "AuthenticationError",
    "BatchNotAppendedError",
    "BrokerIdUnreadableError",
    "BrokerUnavailableError",
    "ConsumerClosedError",
    "ConsumerNotFoundError",
    "CorruptRecordError",
    "DanubeError",
    "DuplicateSequenceError",
    "IncompatibleSchemaError",
    "InvalidAckError",
    "InvalidNameError",
    "InvalidSchemaError",
    "LogTruncationError",
    "MAX_WIRE_STRING_CHARS",
    "MalformedRequestError",
    "MessageTooLargeError",
    "MetadataStoreError",
    "NotEnoughReplicasError",
    "NotServedHereError",
    "ObjectStoreMismatchError",
    "OffsetOutOfRangeError",
    "OffsetRangeError",
    "PartitionedTopicError",
    "PermissionDeniedError",
    "PolicyLimitError",
    "PositionBelowRetentionError",
    "ProducerClosedError",
    "ProducerFencedError",
    "ProducerNotFoundError",
    "SchemaEvolutionError",
    "SchemaMismatchError",
    "SchemaNotFoundError",
    "SchemaRequiredError",
    "SegmentNotFoundError",
    "SegmentQuarantinedError",
    "SegmentUnreadableError",
    "StorageFullError",
    "StreamEndedError",
    "SubscriptionBusyError",
    "SubscriptionNotFoundError",
    "TableReadError",
    "TopicInUseError",
    "TopicNotFoundError",
    "UnavailableRangeNotFoundError",
    "bounded",
]
