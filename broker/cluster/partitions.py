"""Partitioned topics on the broker: creating them, and refusing to serve the partitioned topic
itself (``docs/etcd-layout.md`` §2.2, §3.1; the names are :mod:`danube_pipeline.partitions`).

A partitioned topic ``/{ns}/{topic}`` is its root key holding the partition count N and its
registration in the namespace; it has no delivery of its own to serve, no owner (§1.4) and never
enters the unassigned queue (§1.5). Its partitions ``{topic}-part-{i}`` are plain topics, created
through :meth:`broker.core.Broker.create_topic` like any other (so each goes through the
unassigned queue to the leader's assignment, and is assigned and moved on its own).

The servicers (:mod:`broker.rpc`) answer ``TopicLookup`` of a partitioned topic with its
count and no broker, and refuse ``CreateProducer``, ``Subscribe`` and the per-topic ``Admin``
calls on it with :class:`~danube_pipeline.errors.PartitionedTopicError`, before anything could
ask the leader to assign it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from danube_pipeline.errors import InvalidNameError, PartitionedTopicError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.modes import DeliveryMode
from danube_pipeline.names import TopicName
from danube_pipeline.partitions import partition_count, partition_names

from broker.topics.lifecycle import created_by_request, topic_registration

__all__ = ["create_partitioned_topic", "refuse_partitioned", "topic_partitions"]

log = logging.getLogger(__name__)


class _Metadata(Protocol):
    """What these functions need of the broker core (:class:`broker.core.Broker`)."""

    cache: LocalCache
    store: MetadataStore


class _Creator(_Metadata, Protocol):
    async def create_topic(self, name: TopicName, *, delivery: DeliveryMode = DeliveryMode.RELIABLE) -> bool: ...


async def topic_partitions(broker: _Metadata, name: TopicName) -> int:
    """The partition count in ``name``'s root (§3.1): N > 0 for a partitioned topic, 0 for a
    plain topic or one that does not exist. Read from the cache; a key missing there is read
    from etcd (another broker may have created the topic a moment ago).

    Raises:
        MetadataStoreError: etcd unreachable (on a cache miss only).
    """
    root = keys.topic_root(name)
    if broker.cache.contains(root):
        return partition_count(broker.cache.get(root))
    kv = await broker.store.get(root)
    return partition_count(kv.value) if kv is not None else 0


async def refuse_partitioned(broker: _Metadata, topic: str) -> None:
    """Refuse a request that names a partitioned topic itself: only its partitions carry
    messages, subscriptions and a WAL.

    Args:
        broker: the broker core.
        topic: the request's ``/{namespace}/{topic}``.

    Raises:
        PartitionedTopicError: ``topic`` is partitioned (its count and partitions named).
        InvalidNameError: ``topic`` is malformed.
        MetadataStoreError: etcd unreachable (on a cache miss only).
    """
    name = TopicName.parse(topic)
    count = await topic_partitions(broker, name)
    if count:
        raise PartitionedTopicError(name.path, count)


async def create_partitioned_topic(
    broker: _Creator,
    name: TopicName,
    partitions: int,
    *,
    delivery: DeliveryMode = DeliveryMode.RELIABLE,
    request_id: str = "",
) -> bool:
    """Create the partitioned topic ``name`` with ``partitions`` partitions.

    One etcd transaction writes the root with the count (§3.1), the namespace registration
    (§2.2) and the delivery mode (§3.2, given to partitions re-created later); it succeeds only
    if neither the root nor any partition's root exists. Then every partition is created with
    :meth:`broker.core.Broker.create_topic`, concurrently, each waiting for its assignment.

    Asked for a partitioned topic that exists, it creates the partitions that are missing (an
    earlier creation that failed half-way), with the stored count and delivery mode, and
    answers ``False``; the ``partitions`` asked for are not compared with the stored count.
    It answers ``True`` instead when the registration (§2.2) records ``request_id``: a retry of
    the creation that wrote it, whose first answer was lost.

    Args:
        broker: the broker core.
        name: the partitioned topic.
        partitions: the partition count, 1 to :data:`~danube_pipeline.partitions.MAX_PARTITIONS`.
        delivery: the delivery mode of every partition.
        request_id: the client's id of this creation, the same on each retry (``""``: none).

    Returns:
        True if created; False if ``name`` already existed (partitioned or plain).

    Raises:
        MalformedRequestError: ``partitions`` is out of range.
        InvalidNameError: a partition's name breaks the topic grammar (too long), or is taken
            by an existing topic.
        MetadataStoreError: etcd unreachable.
        BrokerUnavailableError: a partition was not assigned in time (retriable: a retry
            creates what is missing).
    """
    names = partition_names(name, partitions)
    root = keys.topic_root(name)
    if broker.cache.contains(root):
        await _complete(broker, name, partition_count(broker.cache.get(root)))
        return await _created_by(broker, name, request_id)
    revision = await broker.store.transaction(
        created={root: 0, **{keys.topic_root(p): 0 for p in names}},
        puts=[
            (keys.namespace_topic(name), topic_registration(request_id)),
            (root, partitions),
            (keys.topic_delivery(name), delivery.value),
        ],
    )
    if revision is None:
        kv = await broker.store.get(root)
        if kv is not None:
            await broker.cache.wait_for_revision(kv.mod_revision)
            await _complete(broker, name, partition_count(kv.value))
            return await _created_by(broker, name, request_id)
        for p in names:
            if await broker.store.get(keys.topic_root(p)) is not None:
                raise InvalidNameError("topic", name.path, f"its partition name {p.path} is taken by an existing topic")
        raise InvalidNameError("topic", name.path, "a partition's name was taken meanwhile")  # pragma: no cover
    await broker.cache.wait_for_revision(revision)
    await _create_partitions(broker, names, delivery)
    log.info("partitioned topic %s created (%d partitions, %s)", name, partitions, delivery.value)
    return True


async def _created_by(broker: _Creator, name: TopicName, request_id: str) -> bool:
    """Whether the request ``request_id`` created the existing ``name`` (its §2.2 registration).

    Raises:
        MetadataStoreError: etcd unreachable.
    """
    if not request_id:
        return False
    kv = await broker.store.get(keys.namespace_topic(name))
    return kv is not None and created_by_request(kv.value, request_id)


async def _complete(broker: _Creator, name: TopicName, count: int) -> None:
    """Create the missing partitions of an existing partitioned topic (none for a plain one)."""
    if count:
        delivery = DeliveryMode.from_stored(broker.cache.get(keys.topic_delivery(name)))
        await _create_partitions(broker, partition_names(name, count), delivery)


async def _create_partitions(broker: _Creator, names: list[TopicName], delivery: DeliveryMode) -> None:
    """``create_topic`` for each partition, all at once; the first failure is raised once every
    attempt has ended (the others are not cancelled half-way)."""
    results = await asyncio.gather(*(broker.create_topic(p, delivery=delivery) for p in names), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
