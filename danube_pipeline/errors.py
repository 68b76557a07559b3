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
"""

from __future__ import annotations

from typing import ClassVar

import grpc


class DanubeError(Exception):
    """Root of every Danube Pipeline error."""

    # Class-level flags; an error of no known class that came over the wire sets them on the
    # instance from its status code (error_codec.RemoteError.from_status).
    retriable: bool = False
    invalid_metadata: bool = False
    grpc_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL


class InvalidNameError(DanubeError, ValueError):
    """A namespace, topic or subscription name is malformed."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, kind: str, name: str, reason: str) -> None:
        self.kind = kind
        self.name = name
        self.reason = reason
        super().__init__(f"invalid {kind} name {bounded(name)!r}: {reason}")


class MessageTooLargeError(DanubeError, ValueError):
    """A message exceeds the namespace policy's ``max_message_size`` (``docs/etcd-layout.md`` §2.1)."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, size_bytes: int, max_message_size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self.max_message_size_bytes = max_message_size_bytes
        super().__init__(
            f"message of {size_bytes} bytes exceeds max_message_size of "
            f"{max_message_size_bytes} bytes"
        )


class MalformedRequestError(DanubeError, ValueError):
    """A request is structurally invalid (missing field, bad value)."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"malformed request: {reason}")


class SchemaMismatchError(DanubeError, ValueError):
    """A payload does not decode with, or does not match, its registered schema."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, subject: str, schema_id: int, reason: str) -> None:
        self.subject = subject
        self.schema_id = schema_id
        self.reason = reason
        super().__init__(f"payload does not match schema {subject!r} (id {schema_id}): {reason}")


class TopicNotFoundError(DanubeError, LookupError):
    """The topic does not exist in the cluster metadata."""

    grpc_code = grpc.StatusCode.NOT_FOUND

    def __init__(self, topic: str) -> None:
        self.topic = topic
        super().__init__(f"topic {topic!r} not found")


class NotServedHereError(DanubeError):
    """The topic exists but is not assigned to the broker that received the request.

    The client must look the topic up again (``invalid_metadata``).
    """

    retriable = True
    invalid_metadata = True
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, topic: str, broker_id: int) -> None:
        self.topic = topic
        self.broker_id = broker_id
        super().__init__(f"topic {topic!r} is not served by broker {broker_id}")


class ProducerNotFoundError(DanubeError, LookupError):
    """A request named a producer id the broker does not know (closed or never created)."""

    invalid_metadata = True
    grpc_code = grpc.StatusCode.NOT_FOUND

    def __init__(self, producer_id: int) -> None:
        self.producer_id = producer_id
        super().__init__(f"producer {producer_id} not found")


class ConsumerNotFoundError(DanubeError, LookupError):
    """A request named a consumer id the broker does not know."""

    grpc_code = grpc.StatusCode.NOT_FOUND

    def __init__(self, consumer_id: int) -> None:
        self.consumer_id = consumer_id
        super().__init__(f"consumer {consumer_id} not found")


class SubscriptionBusyError(DanubeError):
    """An Exclusive subscription already has a consumer, or the type requested differs."""

    grpc_code = grpc.StatusCode.ALREADY_EXISTS

    def __init__(self, subscription: str, reason: str) -> None:
        self.subscription = subscription
        self.reason = reason
        super().__init__(f"subscription {subscription!r} is busy: {reason}")


class SubscriptionNotFoundError(DanubeError, LookupError):
    """The topic has no subscription of that name (``docs/etcd-layout.md`` §3.4)."""

    grpc_code = grpc.StatusCode.NOT_FOUND

    def __init__(self, topic: str, subscription: str) -> None:
        self.topic = topic
        self.subscription = subscription
        super().__init__(f"topic {topic!r} has no subscription {bounded(subscription)!r}")


class TopicInUseError(DanubeError):
    """A topic still has producers or consumers connected, and the operation (deleting the
    topic) was not forced."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, topic: str, producers: int, consumers: int) -> None:
        self.topic = topic
        self.producers = producers
        self.consumers = consumers
        super().__init__(
            f"topic {topic!r} is in use ({producers} producer(s), {consumers} consumer(s) connected): "
            "close them first, or force the deletion, which closes them"
        )


class OffsetOutOfRangeError(DanubeError):
    """An offset lies outside what a subscription of the topic can be positioned at: from the
    earliest retained offset to the next offset the topic hands out (both included)."""

    grpc_code = grpc.StatusCode.OUT_OF_RANGE

    def __init__(self, topic: str, offset: int, earliest_offset: int, next_offset: int) -> None:
        self.topic = topic
        self.offset = offset
        self.earliest_offset = earliest_offset
        self.next_offset = next_offset
        super().__init__(
            f"offset {offset} is out of range for topic {topic!r}: a position must lie from the "
            f"earliest offset {earliest_offset} to the next offset {next_offset}"
        )


class SchemaNotFoundError(DanubeError, LookupError):
    """No schema is registered under that id, subject or version (``docs/etcd-layout.md`` §4)."""

    grpc_code = grpc.StatusCode.NOT_FOUND

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"schema not found: {what}")


class InvalidSchemaError(DanubeError, ValueError):
    """A schema definition does not parse (e.g. not valid Avro)."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, subject: str, reason: str) -> None:
        self.subject = subject
        self.reason = reason
        super().__init__(f"invalid schema for subject {bounded(subject)!r}: {reason}")


class SchemaEvolutionError(DanubeError, ValueError):
    """A table cannot take a schema in place: a change outside Iceberg's in-place evolution
    (Iceberg spec, "Schema Evolution"), such as ``int`` to ``string``; rewriting the table's
    data files (the ``schema_rewrite`` asset) is needed.

    Attributes:
        table: the table's identifier, ``ns.topic``.
        changes: one line per change that cannot be made in place.
    """

    def __init__(self, table: str, changes: list[str]) -> None:
        self.table = table
        self.changes = changes
        super().__init__(f"table {table} needs schema_rewrite: {'; '.join(changes)}")


class IncompatibleSchemaError(DanubeError):
    """A new schema version breaks its subject's compatibility mode (``docs/etcd-layout.md`` §4.2
    ``compatibility_mode``; rules in :mod:`danube_pipeline.schemas.compatibility`). Nothing is written.

    Args:
        subject: the subject.
        mode: the compatibility mode checked (Danube spelling, e.g. ``Backward``).
        version: the earlier version the schema conflicts with.
        path: the field, dotted (``""`` for the whole schema).
        rule: the rule broken, e.g. ``FIELD_ADDED_WITHOUT_DEFAULT``.
        reason: what is wrong.
    """

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, subject: str, mode: str, version: int, path: str, rule: str, reason: str) -> None:
        self.subject = subject
        self.mode = mode
        self.version = version
        self.path = path
        self.rule = rule
        self.reason = reason
        where = f"field {bounded(path)!r}" if path else "the whole schema"
        super().__init__(
            f"schema for subject {bounded(subject)!r} is incompatible with version {version} under "
            f"compatibility mode {mode}: {rule} at {where}: {reason}"
        )


class SchemaRequiredError(DanubeError):
    """A producer without a schema was refused on a topic that carries one, and whose schema
    policy does not allow raw messages (``docs/etcd-layout.md`` §3.7)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, topic: str, subject: str) -> None:
        self.topic = topic
        self.subject = subject
        super().__init__(
            f"topic {bounded(topic)!r} carries schema subject {bounded(subject)!r}: a producer without a schema is "
            f"refused; produce with the subject's schema, or allow raw messages on the topic "
            f"(danube-admin topics set-schema-policy {bounded(topic)} --allow-raw)"
        )


class SegmentNotFoundError(DanubeError, LookupError):
    """No sealed segment starts at the requested offset."""

    grpc_code = grpc.StatusCode.NOT_FOUND

    def __init__(self, topic: str, start_offset: int) -> None:
        self.topic = topic
        self.start_offset = start_offset
        super().__init__(f"topic {topic!r} has no sealed segment starting at offset {start_offset}")


class CorruptRecordError(DanubeError):
    """A record or segment failed its framing or CRC32C check."""

    grpc_code = grpc.StatusCode.DATA_LOSS

    def __init__(self, where: str, position: int, reason: str) -> None:
        self.where = where
        self.position = position
        self.reason = reason
        super().__init__(f"corrupt record in {where} at byte {position}: {reason}")


class BrokerUnavailableError(DanubeError):
    """No broker answered (connection refused, deadline exceeded, shutting down)."""

    retriable = True
    invalid_metadata = True
    grpc_code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, address: str, reason: str) -> None:
        self.address = address
        self.reason = reason
        super().__init__(f"broker at {address} unavailable: {reason}")


class MetadataStoreError(DanubeError):
    """etcd could not be reached or refused an operation."""

    retriable = True
    grpc_code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, operation: str, reason: str) -> None:
        self.operation = operation
        self.reason = reason
        super().__init__(f"metadata store {operation} failed: {reason}")


class StorageFullError(DanubeError):
    """The broker's disk has no room for a write (``ENOSPC`` or ``EDQUOT``).

    Nothing of the refused batch was kept. Retriable: the broker keeps serving reads, and
    publishing resumes by itself once space is freed.
    """

    retriable = True
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"storage full at {bounded(path)}: {reason}")


class BatchNotAppendedError(DanubeError):
    """A batch of a ``SendStream`` was not appended because an earlier batch of the same stream
    failed: resend from the failed batch, on a new stream, to keep the order."""

    retriable = True
    grpc_code = grpc.StatusCode.ABORTED

    def __init__(self, sequence_id: int, failed_sequence_id: int) -> None:
        self.sequence_id = sequence_id
        self.failed_sequence_id = failed_sequence_id
        super().__init__(
            f"batch {sequence_id} not appended: batch {failed_sequence_id} of this stream failed before it"
        )


class OffsetRangeError(DanubeError):
    """Offsets were not contiguous where the design requires them to be."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, expected_offset: int, actual_offset: int, where: str) -> None:
        self.expected_offset = expected_offset
        self.actual_offset = actual_offset
        self.where = where
        super().__init__(f"{where}: expected offset {expected_offset}, found {actual_offset}")


class PositionBelowRetentionError(DanubeError):
    """A subscription's position lies below the earliest retained offset of its topic: those
    messages expired (namespace retention, ``docs/etcd-layout.md`` §2.1) and the broker is
    configured to stop the consumer rather than jump (``--position-below-retention error``)."""

    grpc_code = grpc.StatusCode.OUT_OF_RANGE

    def __init__(self, topic: str, subscription: str, position: int, earliest_offset: int) -> None:
        self.topic = topic
        self.subscription = subscription
        self.position = position
        self.earliest_offset = earliest_offset
        super().__init__(
            f"{topic}/{subscription}: position {position} is below the earliest retained offset "
            f"{earliest_offset}; offsets {position}..{earliest_offset - 1} expired"
        )


class SegmentQuarantinedError(DanubeError):
    """A topic's WAL found corruption in the middle of a segment, with valid, acknowledged
    batches after it, and quarantined the segment: appends are refused until an operator
    decides (``python -m broker.storage.wal.repair``, see :mod:`broker.storage.wal.recovery`).

    Not retriable: the condition lasts until the broker is stopped and the WAL repaired.

    Args:
        path: the quarantined segment file.
        position: byte position of the bad batch in it.
        last_good_offset: the last offset before the bad batch (the segment's start - 1 if none).
        next_valid_offset: the base offset of the first valid batch found after the bad one.
    """

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, path: str, position: int, last_good_offset: int, next_valid_offset: int) -> None:
        self.path = path
        self.position = position
        self.last_good_offset = last_good_offset
        self.next_valid_offset = next_valid_offset
        super().__init__(
            f"WAL segment {bounded(path)} is quarantined: corrupt data at byte {position} after offset "
            f"{last_good_offset}, with valid batches from offset {next_valid_offset} after it; appends are "
            "refused until an operator repairs the WAL (python -m broker.storage.wal.repair)"
        )


class BrokerIdUnreadableError(DanubeError):
    """The broker's id file (``data_dir/broker_id``) exists but holds no valid id: it is empty,
    not a u64 in decimal, or cannot be read. The broker refuses to start rather than pick a new
    id, which would make it take its own topics over as a failed broker's (its WAL moved aside,
    its acknowledged messages unreadable).

    Not retriable: the file must be repaired by hand.

    Args:
        path: the id file.
        reason: what is wrong with it.
    """

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(
            f"broker id file {bounded(path)} is unreadable ({reason}); the broker will not start with a new id. "
            "Write this broker's id back into it (one decimal u64: the id in an earlier log line "
            "'broker <id> serving on ...', or the broker_id in /danube-data/storage/topics/{ns}/{topic}/reservation "
            "of a topic under this data directory's wal/); delete the file only if the whole data directory is "
            "given up"
        )


class PartitionedTopicError(DanubeError):
    """The topic is partitioned: it holds no messages itself, its partitions
    ``{topic}-part-{i}`` (``i`` in ``0..partitions-1``) do (``docs/etcd-layout.md`` §3.1).

    Raised by a broker asked to produce to, subscribe to or administer the partitioned topic
    itself, and by the client's metadata lookup, which the client's producer and consumer
    take as the signal to open one inner producer or consumer per partition.
    """

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, topic: str, partitions: int) -> None:
        self.topic = topic
        self.partitions = partitions
        last = f"{topic}-part-{partitions - 1}"
        super().__init__(
            f"topic {bounded(topic)!r} is partitioned into {partitions} partitions "
            f"({bounded(topic)}-part-0 .. {bounded(last)}): produce to and subscribe to its partitions "
            "(the Danube client does so by itself)"
        )


class DuplicateSequenceError(DanubeError):
    """A producer sent sequence numbers the topic's owner has written already, in a batch it
    does not remember as such (an old resend, or one overlapping the last batch in part); the
    batch is not written (idempotent produce, ``broker/topics/producer_sequences.py``)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, topic: str, producer_name: str, base_sequence: int, last_sequence: int) -> None:
        self.topic = topic
        self.producer_name = producer_name
        self.base_sequence = base_sequence
        self.last_sequence = last_sequence
        super().__init__(
            f"producer {bounded(producer_name)!r} on {bounded(topic)!r}: sequence {base_sequence} was written "
            f"already (its highest written sequence is {last_sequence}); the batch is not written again"
        )


class UnavailableRangeNotFoundError(DanubeError, LookupError):
    """No unavailable range of the topic starts at the offset given
    (``docs/etcd-layout.md`` §5.5)."""

    grpc_code = grpc.StatusCode.NOT_FOUND

    def __init__(self, topic: str, start_offset: int) -> None:
        self.topic = topic
        self.start_offset = start_offset
        super().__init__(f"topic {bounded(topic)!r} has no unavailable range starting at offset {start_offset}")


class InvalidAckError(DanubeError):
    """An ack named offsets its consumer may not acknowledge: a consumer acknowledges only
    offsets delivered to it and not acknowledged yet. The whole ``Ack`` request is refused and
    nothing of it is acknowledged (``docs/etcd-layout.md`` §3.5).

    Args:
        consumer_id: the consumer that sent the ack.
        first_offset: the first refused offset.
        last_offset: the last offset of the refused run (every offset from ``first_offset`` to
            it is refused for the same ``reason``).
        reason: why, e.g. ``"never delivered"``, ``"delivered to another consumer"``,
            ``"already acknowledged"``, ``"the consumer is closed"``.
    """

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, consumer_id: int, first_offset: int, last_offset: int, reason: str) -> None:
        self.consumer_id = consumer_id
        self.first_offset = first_offset
        self.last_offset = last_offset
        self.reason = reason
        super().__init__(
            f"ack of offsets {first_offset}..{last_offset} by consumer {consumer_id} refused: {reason}; "
            "nothing of the request was acknowledged"
        )


class PolicyLimitError(DanubeError):
    """A producer or consumer was refused: the topic is at a count limit of its policy (the
    namespace policy, ``docs/etcd-layout.md`` §2.1, or the topic's override, §3.8). Nothing
    was created.

    Args:
        topic: the topic, ``/ns/topic``.
        policy: the policy field, e.g. ``max_producers_per_topic``.
        limit: the field's value (the count already reached).
    """

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, topic: str, policy: str, limit: int) -> None:
        self.topic = topic
        self.policy = policy
        self.limit = limit
        super().__init__(
            f"topic {bounded(topic)!r} is at its policy limit {policy} = {limit}; close one first or raise "
            "the limit (namespace policy or the topic's policy override)"
        )


class ProducerClosedError(DanubeError, RuntimeError):
    """A message was given to a client-side producer that is not open (or already closed)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class ConsumerClosedError(DanubeError, RuntimeError):
    """A receive or ack was asked of a client-side consumer that is not open."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


MAX_WIRE_STRING_CHARS = 256
"""A string field longer than this travels as its first characters plus a note of its length,
so an error quoting bad input (a 10 KB name) stays small on the wire and in logs."""


def bounded(value: str, limit: int = MAX_WIRE_STRING_CHARS) -> str:
    """``value`` if short, else its first ``limit`` characters and ``…(N chars)``."""
    return value if len(value) <= limit else f"{value[:limit]}…({len(value)} chars)"
