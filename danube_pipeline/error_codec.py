"""The wire encoding of Danube errors: how a :class:`~danube_pipeline.errors.DanubeError` crosses gRPC.

The broker sends the error's class name and its constructor arguments in trailing metadata
(:func:`encode_error_metadata`, under :data:`ERROR_CLASS_METADATA_KEY` and
:data:`ERROR_FIELDS_METADATA_KEY`); the client rebuilds the same typed error with the same
fields through the class's own constructor (:func:`error_from_status`), as a
:class:`RemoteError` that is also an instance of that class. The classes that travel this way
are :data:`WIRE_ERRORS`. The two ends that use this module are ``broker.rpc.status`` (server)
and ``danube_pipeline.client.status`` (client).
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import grpc

from danube_pipeline.errors import (
    AuthenticationError,
    BatchNotAppendedError,
    NotEnoughReplicasError,
    BrokerIdUnreadableError,
    BrokerUnavailableError,
    ConsumerNotFoundError,
    CorruptRecordError,
    DanubeError,
    DuplicateSequenceError,
    IncompatibleSchemaError,
    InvalidAckError,
    InvalidNameError,
    InvalidSchemaError,
    LogTruncationError,
    MalformedRequestError,
    MessageTooLargeError,
    MetadataStoreError,
    NotServedHereError,
    ObjectStoreMismatchError,
    OffsetOutOfRangeError,
    OffsetRangeError,
    PartitionedTopicError,
    PermissionDeniedError,
    PolicyLimitError,
    PositionBelowRetentionError,
    ProducerFencedError,
    ProducerNotFoundError,
    SchemaMismatchError,
    SchemaNotFoundError,
    SchemaRequiredError,
    SegmentNotFoundError,
    SegmentQuarantinedError,
    SegmentUnreadableError,
    StorageFullError,
    SubscriptionBusyError,
    SubscriptionNotFoundError,
    TopicInUseError,
    TopicNotFoundError,
    UnavailableRangeNotFoundError,
    bounded,
)

WIRE_ERRORS: tuple[type[DanubeError], ...] = (
    InvalidNameError,
    MessageTooLargeError,
    MalformedRequestError,
    SchemaMismatchError,
    TopicNotFoundError,
    NotServedHereError,
    ProducerNotFoundError,
    ConsumerNotFoundError,
    SubscriptionBusyError,
    SubscriptionNotFoundError,
    TopicInUseError,
    OffsetOutOfRangeError,
    SchemaNotFoundError,
    InvalidSchemaError,
    IncompatibleSchemaError,
    SchemaRequiredError,
    SegmentNotFoundError,
    CorruptRecordError,
    BrokerUnavailableError,
    MetadataStoreError,
    OffsetRangeError,
    StorageFullError,
    BatchNotAppendedError,
    NotEnoughReplicasError,
    PositionBelowRetentionError,
    SegmentQuarantinedError,
    SegmentUnreadableError,
    LogTruncationError,
    BrokerIdUnreadableError,
    ObjectStoreMismatchError,
    PartitionedTopicError,
    UnavailableRangeNotFoundError,
    DuplicateSequenceError,
    ProducerFencedError,
    InvalidAckError,
    PolicyLimitError,
    AuthenticationError,
    PermissionDeniedError,
)
"""The error classes that travel from broker to client with their typed fields."""

_BY_NAME: dict[str, type[DanubeError]] = {cls.__name__: cls for cls in WIRE_ERRORS}

ERROR_CLASS_METADATA_KEY = "danube-error-class"
"""gRPC trailing-metadata key carrying the :class:`DanubeError` subclass name."""
ERROR_FIELDS_METADATA_KEY = "danube-error-fields"
"""gRPC trailing-metadata key carrying the error's constructor arguments as a JSON object
(ASCII, so it is a valid text metadata value)."""

def _field_names(cls: type[DanubeError]) -> list[str]:
    return [
        name
        for name, param in inspect.signature(cls.__init__).parameters.items()
        if name != "self" and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
    ]


def error_fields(error: DanubeError) -> dict[str, Any]:
    """The constructor arguments of ``error``, read back from its attributes.

    Every wire error class stores each ``__init__`` argument under the same attribute name;
    string values are cut with :func:`bounded`.

    Returns:
        A JSON-encodable ``{argument: value}`` mapping.
    """
    fields: dict[str, Any] = {}
    for name in _field_names(type(error)):
        value = getattr(error, name, None)
        fields[name] = bounded(value) if isinstance(value, str) else value
    return fields


def encode_error_metadata(error: DanubeError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that carries ``error`` to the client: its class name and its
    fields (:data:`ERROR_CLASS_METADATA_KEY`, :data:`ERROR_FIELDS_METADATA_KEY`)."""
    fields = json.dumps(error_fields(error), ensure_ascii=True, separators=(",", ":"))
    return ((ERROR_CLASS_METADATA_KEY, type(error).__name__), (ERROR_FIELDS_METADATA_KEY, fields))


class RemoteError(DanubeError):
    """An error reported by the broker over gRPC.

    A :class:`RemoteError` that names a known class is also an instance of that class, built
    through its own constructor from the fields the broker sent, so ``except
    TopicNotFoundError as e: e.topic`` works on the client.

    Attributes:
        code: the gRPC status code.
        details: the status details string (the server-side message).
        error_class: the server-side :class:`DanubeError` subclass name, if sent.
        retriable: whether the same request may succeed later.
        invalid_metadata: whether the client must refresh its topic-to-broker map.
    """

    code: grpc.StatusCode
    details: str
    error_class: str | None

    @classmethod
    def from_status(cls, code: grpc.StatusCode, details: str, error_class: str | None = None) -> RemoteError:
        """An error of no known class: ``retriable`` for ``UNAVAILABLE`` and
        ``DEADLINE_EXCEEDED``, ``invalid_metadata`` for ``UNAVAILABLE``."""
        err = cls.__new__(cls)
        Exception.__init__(err, f"{code.name}: {details}")
        err._set_status(code, details, error_class)
        err.retriable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        err.invalid_metadata = code == grpc.StatusCode.UNAVAILABLE
        return err

    def _set_status(self, code: grpc.StatusCode, details: str, error_class: str | None) -> None:
        self.code = code
        self.details = details
        self.error_class = error_class


_REMOTE_TYPES: dict[str, type[RemoteError]] = {}


def _remote_type(cls: type[DanubeError]) -> type[RemoteError]:
    typed = _REMOTE_TYPES.get(cls.__name__)
    if typed is None:
        # cls first in the MRO: its __init__, message and flags win.
        typed = type(f"Remote{cls.__name__}", (cls, RemoteError), {})
        _REMOTE_TYPES[cls.__name__] = typed
    return typed


def error_from_status(
    code: grpc.StatusCode, details: str, error_class: str | None, fields_json: str | None = None
) -> RemoteError:
    """Build the client-side exception for a gRPC status (the single mapping point).

    The broker sends the :class:`DanubeError` subclass name and its fields in trailing metadata
    (:func:`encode_error_metadata`). When the name is a known class and the fields fit its
    constructor, the returned error is built through that constructor: it is a
    :class:`RemoteError` and an instance of the class, with the class's typed fields, message
    and ``retriable`` / ``invalid_metadata`` flags. Without usable fields it is still an
    instance of the class, with the flags but without the fields.

    Args:
        code: the gRPC status code received.
        details: the status details string.
        error_class: the class name from trailing metadata, or ``None``.
        fields_json: the JSON object of constructor arguments, or ``None``.

    Returns:
        An exception instance, not raised.
    """
    cls = _BY_NAME.get(error_class or "")
    if cls is None:
        return RemoteError.from_status(code, details, error_class)
    typed = _remote_type(cls)
    try:
        fields = json.loads(fields_json) if fields_json else None
        if not isinstance(fields, dict):
            raise TypeError("no fields")
        err = typed(**fields)
    except (TypeError, ValueError):
        err = typed.__new__(typed)
        Exception.__init__(err, f"{code.name}: {details}")
    err._set_status(code, details, error_class)
    return err
