"""Publishing a message that ran out of redeliveries to its subscription's dead-letter topic.

The steps for one message (offset ``o`` of topic ``T``, subscription ``S``):

1. publish one record batch to the dead-letter topic: the message's key, payload and publish
   time, its attributes plus the origin attributes below, under the producer name
   :func:`dead_letter_producer_name` ``(T, S, o)`` with base sequence 0;
2. acknowledge ``o`` on ``S`` and store the cursor.

A broker killed between the two steps (fault point ``dead_letter.after_publish``,
:mod:`danube_pipeline.faults`) redelivers ``o`` after its restart; when ``o`` runs out of
redeliveries again, step 1 sends the very same batch, which the idempotent-produce check
(:mod:`broker.topics.producer_sequences`: producer name plus sequence, Kafka's KIP-98) answers with the
offsets it was written at instead of writing it twice; step 2 then acknowledges it. So the
dead-letter topic holds each message once, and the message is acknowledged on its topic once.
The check rebuilds its memory at restart from the dead-letter topic's newest WAL segments.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable, Mapping

from danube_pipeline.format.batches import BatchBuilder, iter_batch

DeadLetterPublisher = Callable[[str, str, bytes], Awaitable[tuple[int, int]]]
"""``publish(dead_letter_topic, producer_name, batch) -> (first_offset, last_offset)``: append
a one-record batch (producer id 0) to the dead-letter topic, creating the topic if needed, on
this broker or forwarded to the topic's owner (:mod:`broker.dispatch.dead_letter_forwarding`), and answer
once it is durable."""

ATTR_TOPIC = "danube.dlq.topic"
"""Origin attribute: the topic the message came from, ``/ns/topic``."""
ATTR_OFFSET = "danube.dlq.offset"
"""Origin attribute: its offset there (decimal)."""
ATTR_SUBSCRIPTION = "danube.dlq.subscription"
"""Origin attribute: the subscription that gave up on it."""
ATTR_REASON = "danube.dlq.reason"
"""Origin attribute: why its last delivery failed (``"nack: <reason>"``, ``"ack timeout"``,
``"consumer left"``)."""
ATTR_REDELIVERY_COUNT = "danube.dlq.redelivery_count"
"""Origin attribute: how many of its deliveries failed (nack, ack timeout, consumer left), decimal."""


def dead_letter_producer_name(topic: str, subscription: str, offset: int) -> str:
    """The producer name of the dead-letter batch of ``offset`` (deterministic, so a publish
    repeated after a restart is recognised as the same batch).

    It is a valid producer name (1-128 characters of ``[A-Za-z0-9_-]``,
    :func:`danube_pipeline.names.validate_part`), so the batch can also be sent through
    ``ProducerService`` to a dead-letter topic owned by another broker
    (:mod:`broker.dispatch.dead_letter_forwarding`): ``dlq-{h}-{offset}``, where ``h`` is the first 32
    hex digits of the SHA-256 of ``topic`` and ``subscription`` (the origin itself travels in
    the record's attributes).

    Args:
        topic: the source topic, ``/ns/topic``.
        subscription: the subscription that gave up on the message.
        offset: the message's offset in ``topic`` (u64).

    Returns:
        At most 57 characters.
    """
    digest = hashlib.sha256(f"{topic}\0{subscription}".encode()).hexdigest()[:32]
    return f"dlq-{digest}-{offset}"


def dead_letter_batch(
    *,
    producer_name: str,
    key: str | None,
    payload: bytes,
    attributes: Mapping[str, str],
    publish_time_us: int,
    topic: str,
    subscription: str,
    offset: int,
    reason: str,
    redelivery_count: int,
) -> bytes:
    """The one-record batch for the dead-letter topic: the same bytes every time for the same
    arguments.

    Raises:
        MalformedRequestError: the record breaks a limit of the batch format.
    """
    builder = BatchBuilder(publish_time_us)
    builder.append(
        payload,
        timestamp_us=publish_time_us,
        key=key,
        attributes={
            **attributes,
            ATTR_TOPIC: topic,
            ATTR_OFFSET: str(offset),
            ATTR_SUBSCRIPTION: subscription,
            ATTR_REASON: reason,
            ATTR_REDELIVERY_COUNT: str(redelivery_count),
        },
    )
    return builder.build(producer_id=0, producer_name=producer_name, base_sequence=0)


def dead_letter_batch_for_producer(batch: bytes, producer_id: int) -> bytes:
    """The dead-letter ``batch`` (as :func:`dead_letter_batch` built it) with ``producer_id``
    in its header, for a broker that checks the header against a producer it registered
    (:mod:`broker.dispatch.dead_letter_forwarding`). Records, producer name, base sequence and schema
    stay the same, so the idempotence key (name plus sequence) is unchanged.

    Args:
        batch: a one-record dead-letter batch, base offset 0.
        producer_id: the u64 producer id the receiving broker assigned.

    Returns:
        The rebuilt batch, base offset 0, CRC32C computed again.

    Raises:
        MalformedRequestError: the batch header does not parse, or a limit of the format is broken.
    """
    header, records = iter_batch(batch)
    builder = BatchBuilder(header.first_timestamp_us)
    for _offset, timestamp_us, key, attributes, payload in records:
        builder.append(payload, timestamp_us=timestamp_us, key=key, attributes=attributes)
    return builder.build(
        producer_id=producer_id,
        producer_name=header.producer_name,
        schema_id=header.schema_id,
        schema_version=header.schema_version,
        base_sequence=header.base_sequence,
    )


__all__ = [
    "ATTR_OFFSET",
    "ATTR_REASON",
    "ATTR_REDELIVERY_COUNT",
    "ATTR_SUBSCRIPTION",
    "ATTR_TOPIC",
    "DeadLetterPublisher",
    "dead_letter_batch",
    "dead_letter_batch_for_producer",
    "dead_letter_producer_name",
]
