"""Errors about a request itself: bad names and payloads, limits, unknown producers, consumers and subscriptions, closed handles.

Part of :mod:`danube_pipeline.errors`, which re-exports every name."""

from __future__ import annotations

import grpc

from danube_pipeline.errors.base import DanubeError, bounded


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
