"""Where a topic is served and whether the cluster can answer: topics, owners, brokers, etcd, the object store's identity.

Part of :mod:`danube_pipeline.errors`, which re-exports every name."""

from __future__ import annotations

import grpc

from danube_pipeline.errors.base import DanubeError, bounded


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


class BrokerUnavailableError(DanubeError):
    """No broker answered (connection refused, deadline exceeded, shutting down)."""

    retriable = True
    invalid_metadata = True
    grpc_code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, address: str, reason: str) -> None:
        self.address = address
        self.reason = reason
        super().__init__(f"broker at {address} unavailable: {reason}")


class StreamEndedError(DanubeError):
    """The broker ended a ``Receive`` or ``SendStream`` stream without an error status: it
    closed the consumer or producer on its side (the topic was unloaded or moved, or the
    broker is stopping).

    Raised on the client only, never sent. The client looks the topic up again and opens the
    consumer or producer again (``retriable``, ``invalid_metadata``). Unlike
    :class:`BrokerUnavailableError` it keeps the connection: the broker answered, and the
    calls of other producers and consumers share that connection.
    """

    retriable = True
    invalid_metadata = True
    grpc_code = grpc.StatusCode.ABORTED

    def __init__(self, address: str, stream: str) -> None:
        self.address = address
        self.stream = stream
        super().__init__(f"broker at {address} ended the {stream} stream")


class MetadataStoreError(DanubeError):
    """etcd could not be reached or refused an operation."""

    retriable = True
    grpc_code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, operation: str, reason: str) -> None:
        self.operation = operation
        self.reason = reason
        super().__init__(f"metadata store {operation} failed: {reason}")


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


class UnavailableRangeNotFoundError(DanubeError, LookupError):
    """No unavailable range of the topic starts at the offset given
    (``docs/etcd-layout.md`` §5.5)."""

    grpc_code = grpc.StatusCode.NOT_FOUND

    def __init__(self, topic: str, start_offset: int) -> None:
        self.topic = topic
        self.start_offset = start_offset
        super().__init__(f"topic {bounded(topic)!r} has no unavailable range starting at offset {start_offset}")


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


class ObjectStoreMismatchError(DanubeError):
    """This process's object store is not the cluster's: its marker ``_danube/store-id`` is
    missing or holds another id than etcd's ``/danube-data/storage/store_id``
    (``docs/etcd-layout.md`` §5.7), so the broker or asset run refuses to start. Not
    retriable: the configuration must be corrected.

    Args:
        who: the process that checked (``broker 7``, ``assets``).
        object_store: the object store's root URL.
        found_id: the id in its marker, ``None`` when it has none.
        expected_id: the id recorded in etcd.
    """

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, who: str, object_store: str, found_id: str | None, expected_id: str) -> None:
        self.who, self.object_store, self.found_id, self.expected_id = who, object_store, found_id, expected_id
        found = f"holds store id {bounded(found_id)}" if found_id is not None else "has no store id marker"
        super().__init__(
            f"{bounded(who)}: object store {bounded(object_store)} {found}, but the cluster's store has id "
            f"{bounded(expected_id)} (etcd /danube-data/storage/store_id): not the store the brokers and the "
            "assets share. Point DANUBE_OBJECT_STORE_URL (a broker's --object-store-url) at the cluster's store"
        )
