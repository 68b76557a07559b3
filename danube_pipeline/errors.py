"""One root exception for Danube Pipeline, with typed subclasses.

Every error raised by the shared library, the broker and the client derives from
:class:`DanubeError`. Subclasses carry typed fields and build their own message, and carry
two behaviour flags read by the client's retry and metadata-refresh logic (the aiokafka
``KafkaError`` pattern):

* ``retriable``: the same request may succeed if sent again later.
* ``invalid_metadata``: the client's view of the cluster (which broker owns a topic) is
  stale and must be refreshed before retrying (seed ``004``, "Refreshing metadata").

gRPC status codes are mapped to these classes in exactly one place on each side of the RPC:
``danube_pipeline.client._status`` (client) and ``broker.status`` (server), both built on
:func:`grpc_code_for` / :func:`error_from_status` below.
"""

from __future__ import annotations

from typing import ClassVar

import grpc


class DanubeError(Exception):
    """Root of every Danube Pipeline error."""

    retriable: ClassVar[bool] = False
    invalid_metadata: ClassVar[bool] = False
    grpc_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL


class InvalidNameError(DanubeError, ValueError):
    """A namespace, topic or subscription name is malformed."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, kind: str, name: str, reason: str) -> None:
        self.kind = kind
        self.name = name
        self.reason = reason
        super().__init__(f"invalid {kind} name {name!r}: {reason}")


class MessageTooLargeError(DanubeError, ValueError):
    """A message exceeds the namespace policy's ``max_message_size`` (seed ``000`` §2.1)."""

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


class SchemaNotFoundError(DanubeError, LookupError):
    """No schema is registered under that id, subject or version (seed ``000`` §4)."""

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
        super().__init__(f"invalid schema for subject {subject!r}: {reason}")


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


class OffsetRangeError(DanubeError):
    """Offsets were not contiguous where the design requires them to be."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, expected_offset: int, actual_offset: int, where: str) -> None:
        self.expected_offset = expected_offset
        self.actual_offset = actual_offset
        self.where = where
        super().__init__(f"{where}: expected offset {expected_offset}, found {actual_offset}")


class ProducerClosedError(DanubeError, RuntimeError):
    """A message was given to a client-side producer that is not open (or already closed)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


class ConsumerClosedError(DanubeError, RuntimeError):
    """A receive or ack was asked of a client-side consumer that is not open."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


_BY_NAME: dict[str, type[DanubeError]] = {
    cls.__name__: cls
    for cls in (
        InvalidNameError,
        MessageTooLargeError,
        MalformedRequestError,
        SchemaMismatchError,
        TopicNotFoundError,
        NotServedHereError,
        ProducerNotFoundError,
        ConsumerNotFoundError,
        SubscriptionBusyError,
        SchemaNotFoundError,
        InvalidSchemaError,
        SegmentNotFoundError,
        CorruptRecordError,
        BrokerUnavailableError,
        MetadataStoreError,
        OffsetRangeError,
    )
}

ERROR_CLASS_METADATA_KEY = "danube-error-class"
"""gRPC trailing-metadata key carrying the :class:`DanubeError` subclass name."""


class RemoteError(DanubeError):
    """An error reported by the broker over gRPC.

    Attributes:
        code: the gRPC status code.
        details: the status details string (the server-side message).
        error_class: the server-side :class:`DanubeError` subclass name, if sent.
        retriable: whether the same request may succeed later.
        invalid_metadata: whether the client must refresh its topic-to-broker map.
    """

    def __init__(self, code: grpc.StatusCode, details: str, error_class: str | None = None) -> None:
        self.code = code
        self.details = details
        self.error_class = error_class
        cls = _BY_NAME.get(error_class or "")
        transient = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        self.retriable = cls.retriable if cls else transient  # type: ignore[misc]
        self.invalid_metadata = (  # type: ignore[misc]
            cls.invalid_metadata if cls else code == grpc.StatusCode.UNAVAILABLE
        )
        Exception.__init__(self, f"{code.name}: {details}")


_REMOTE_TYPES: dict[str, type[RemoteError]] = {}


def error_from_status(
    code: grpc.StatusCode, details: str, error_class: str | None
) -> RemoteError:
    """Build the client-side exception for a gRPC status (the single mapping point).

    The broker sends the :class:`DanubeError` subclass name in trailing metadata under
    :data:`ERROR_CLASS_METADATA_KEY`. When it names a known class, the returned error is a
    :class:`RemoteError` that is also an instance of that class, so callers can write
    ``except TopicNotFoundError`` and the retry logic reads that class's flags.

    Args:
        code: the gRPC status code received.
        details: the status details string.
        error_class: the class name from trailing metadata, or ``None``.

    Returns:
        An exception instance, not raised.
    """
    cls = _BY_NAME.get(error_class or "")
    if cls is None:
        return RemoteError(code, details, error_class)
    typed = _REMOTE_TYPES.get(cls.__name__)
    if typed is None:
        typed = type(f"Remote{cls.__name__}", (RemoteError, cls), {})
        _REMOTE_TYPES[cls.__name__] = typed
    err = typed.__new__(typed)
    RemoteError.__init__(err, code, details, error_class)
    return err
