"""Errors of idempotent produce: batches not appended, duplicate sequences, fenced producers.

Part of :mod:`danube_pipeline.errors`, which re-exports every name."""

from __future__ import annotations

import grpc

from danube_pipeline.errors.base import DanubeError, bounded


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


class ProducerFencedError(DanubeError):
    """A newer instance of the producer holds its name on the topic: the broker bumped the
    producer's epoch when that instance was created (idempotent produce,
    ``broker/topics/producer_identity.py``, ``docs/etcd-layout.md`` §5.6.1). The batch or the
    creation is refused; the older instance cannot send again (not retriable).

    Attributes:
        topic: ``/ns/topic``.
        producer_name: the producer's name.
        producer_epoch: the epoch the refused instance holds.
        current_epoch: the epoch of the newer instance.
    """

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, topic: str, producer_name: str, producer_epoch: int, current_epoch: int) -> None:
        self.topic = topic
        self.producer_name = producer_name
        self.producer_epoch = producer_epoch
        self.current_epoch = current_epoch
        super().__init__(
            f"producer {bounded(producer_name)!r} on {bounded(topic)!r} was fenced: its epoch is {producer_epoch}, "
            f"a newer instance holds epoch {current_epoch}"
        )


class NotEnoughReplicasError(DanubeError):
    """A replicated topic's in-sync replica set is smaller than its ``min_insync_replicas``
    (``docs/etcd-layout.md`` §2.1, §5.9), so the batch cannot be acknowledged: refused before it
    is written, or, when the set shrank while the batch waited for its followers, after (its
    resend is then answered with the offsets it was written at, once enough replicas hold it).
    Retriable: the set grows again when a follower catches up (Kafka's ``NOT_ENOUGH_REPLICAS``,
    ``min.insync.replicas``)."""

    retriable = True
    grpc_code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, topic: str, in_sync: int, min_insync_replicas: int) -> None:
        self.topic = topic
        self.in_sync = in_sync
        self.min_insync_replicas = min_insync_replicas
        super().__init__(
            f"topic {bounded(topic)!r}: {in_sync} in-sync replicas, {min_insync_replicas} needed to acknowledge"
        )
