"""Deleting a topic and moving a subscription's cursor: ``Admin.DeleteTopic`` and
``Admin.ResetCursor`` (``docs/etcd-layout.md`` §1.4, §1.5, §2.2, §3, §5).

Both run on the topic's owner; another broker answers
:class:`~danube_pipeline.errors.NotServedHereError` and the client looks the topic up again.
The one exception is a partitioned topic (its root holds N > 0, §3.1): it has no owner, so any
broker deletes it, each partition through the partition's owner.

Deleting a topic removes, in this order:

1. the topic from this broker: it is fenced against loading again for the rest of the call,
   its producers are closed (their next batch is answered ``ProducerNotFoundError``) and its
   consumers' streams end;
2. its WAL directory and the segments this broker kept after releasing it earlier
   (:attr:`broker.topics.released.ReleasedSegments.directory`);
3. its segment objects in object storage (``topics/{ns}/{topic}/``: those the descriptors
   name, §5.1, and anything else under that folder);
4. every etcd key of the topic: everything under ``/topics/{ns}/{topic}/`` (delivery mode,
   producers, subscriptions and cursors, local retention override: §3.2 to §3.6) and under
   ``/danube-data/storage/topics/{ns}/{topic}/`` (descriptors, ``objects/cur``, sealed state,
   reservation, unavailable ranges, in-sync replicas: §5), then, in one transaction, the root
   (§3.1), the namespace registration (§2.2), the assignment (§1.4), any unassigned entry (§1.5)
   and any replica assignment (§1.9);
   a last pass deletes keys written under the two prefixes meanwhile;
5. the topic from its schema subject's ``topics_using`` (§4.2; the subject named by its §3.7
   key), best effort: a failure is logged, the topic is deleted all the same.

The topic root goes last, so a deletion that fails half-way (etcd or object storage down) leaves
a topic that still exists: deleting it again finishes the work. Once the root is gone the name
can be created again, starting at offset 0.

Not deleted: the topic's Iceberg table and its rows, and segments that *other* brokers kept
after releasing the topic (their local retention never finds them tiered any more). A topic
created again under the name starts at offset 0 with a new root key, whose etcd create revision
is its incarnation: tiering finds the old table recording an earlier incarnation, renames it to
``{topic}__incarnation_{id}`` (kept for readers) and starts a new table
(:mod:`danube_pipeline.lake.tiering.incarnation`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil

import grpc

from danube_pipeline.format.batches import iter_batch
from danube_pipeline.error_codec import (
    ERROR_CLASS_METADATA_KEY,
    ERROR_FIELDS_METADATA_KEY,
    error_from_status,
)
from danube_pipeline.errors import (
    BrokerUnavailableError,
    DanubeError,
    MalformedRequestError,
    NotServedHereError,
    OffsetOutOfRangeError,
    SubscriptionNotFoundError,
    TopicInUseError,
    TopicNotFoundError,
)
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.connection import remaining_budget_s
from danube_pipeline.names import TopicName, validate_part
from danube_pipeline.storage.objectstore import segment_object_path
from danube_pipeline.partitions import partition_names
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

from broker.config import BrokerConfig
from broker.core import Broker
from broker.cluster.partitions import refuse_partitioned, topic_partitions
from broker.topics.schema_policy import topic_schema
from broker.rpc.tls import broker_channel
from broker.topics.topic import Topic

__all__ = ["delete_topic", "reset_cursor", "resolve_position"]

log = logging.getLogger(__name__)

FORWARD_TIMEOUT_S = 30.0
"""Deadline of a ``DeleteTopic`` forwarded to a partition's owner, in seconds, when the
request being served has none (or a later one)."""

_SCAN_RECORDS = 10_000
"""Records read from the WAL per step of a timestamp search."""


# ---------------------------------------------------------------------------- DeleteTopic


async def delete_topic(broker: Broker, name: TopicName, *, force: bool = False) -> list[str]:
    """Delete ``name`` with every trace of it (see the module docstring for what and in which
    order).

    A plain topic is deleted on its owner only. A partitioned topic (root value N > 0, §3.1) is
    deleted on any broker: each partition that still exists is deleted through its owner (this
    broker, or a ``DeleteTopic`` forwarded to the owner: its broker-to-broker port when it
    registered one, else its advertised address), in index order,
    then the partitioned topic's own keys.

    Args:
        broker: the broker core.
        name: the topic.
        force: delete even with producers or consumers connected; they are closed (a client
            producer that keeps sending creates the topic again, as any producer would).

    Returns:
        The topics deleted: ``[name.path]``, or the partitions' paths of a partitioned topic.

    Raises:
        TopicNotFoundError: the topic does not exist.
        NotServedHereError: another broker owns it.
        TopicInUseError: producers or consumers are connected and ``force`` is false; nothing
            of that topic was deleted (of a partitioned topic, the partitions before it were).
        MetadataStoreError: etcd unreachable; what was deleted stays deleted, the topic still
            exists, and deleting it again finishes the work.
        OSError: a file or object could not be deleted (same as above).
        BrokerUnavailableError: a partition's owner could not be reached.
    """
    if not await _exists(broker, name):
        raise TopicNotFoundError(name.path)
    count = await topic_partitions(broker, name)
    if count:
        return await _delete_partitioned(broker, name, count, force=force)
    topic = await broker.topic_for(name)
    await _delete_served(broker, topic, force=force)
    return [name.path]


async def _exists(broker: Broker, name: TopicName) -> bool:
    """Whether the root (§3.1) exists; a cache miss is checked against etcd.

    Raises:
        MetadataStoreError: etcd unreachable (on a cache miss only).
    """
    if broker.cache.contains(keys.topic_root(name)):
        return True
    return await broker.store.get(keys.topic_root(name)) is not None


def _users(topic: Topic) -> tuple[int, int]:
    """``(producers, consumers)`` connected to ``topic``."""
    return len(topic.producers), sum(len(sub.consumers) for sub in topic.subscriptions.values())


async def _delete_served(broker: Broker, topic: Topic, *, force: bool) -> None:
    """Delete a topic this broker serves (steps 1 to 4 of the module docstring).

    Raises:
        TopicInUseError: in use and not ``force``.
        NotServedHereError: it is being released or deleted by another call.
        MetadataStoreError, OSError: see :func:`delete_topic`.
    """
    name, path = topic.name, topic.path
    producers, consumers = _users(topic)
    if (producers or consumers) and not force:
        raise TopicInUseError(path, producers, consumers)
    with broker.served.fenced(path):
        if broker.topics.get(path) is topic:
            del broker.topics[path]
        topic.closed = True  # ServedTopics.served refuses it from here on
        for producer_id in list(topic.producers):
            producer = broker.producers.pop(producer_id, None)
            if producer is not None:
                producer.closed = True
        topic.producers.clear()
        try:
            await topic.close()  # ends the consumers' streams, closes the WAL
        except Exception as exc:  # noqa: BLE001 - the WAL is deleted next anyway
            log.warning("topic %s: closing before the deletion failed: %s", path, exc)
        broker.served.changed()  # the load report, as an unload sends it
        log.info("topic %s: deleting (%d producers and %d consumers closed)", path, producers, consumers)
        await _delete_files(broker, name)
        objects = await _delete_objects(broker, name)
        settings = topic_schema(broker, name)
        removed = await _delete_keys(broker, name)
        if settings is not None and settings.subject:
            try:
                await broker.registry.remove_topic(settings.subject, path)
            except DanubeError as exc:
                log.warning("topic %s: not taken out of subject %s's topics_using: %s", path, settings.subject, exc)
    log.info("topic %s deleted: WAL, %d objects and %d etcd keys", path, objects, removed)


async def _delete_files(broker: Broker, name: TopicName) -> None:
    """Delete the topic's WAL directory and its released segments on this broker.

    Raises:
        OSError: a directory could not be deleted.
    """
    for directory in (
        broker.config.wal_dir / name.namespace / name.topic,
        broker.released_dir / name.namespace / name.topic,
    ):
        if directory.exists():
            await asyncio.to_thread(shutil.rmtree, directory)


async def _delete_objects(broker: Broker, name: TopicName) -> int:
    """Delete every segment object of the topic: those its descriptors name (§5.1) and any
    other object under ``topics/{ns}/{topic}/``.

    Returns:
        The objects deleted.

    Raises:
        MetadataStoreError: etcd unreachable.
        OSError: the object store refused.
    """
    kvs, _ = await broker.store.get_prefix(keys.objects_prefix(name))
    paths: set[str] = set()
    for kv in kvs:
        if kv.key == keys.objects_cur(name):
            continue
        try:
            paths.add(segment_object_path(name, values.ObjectDescriptor.from_json(kv.value).object_id))
        except (ValueError, TypeError):
            log.warning("topic %s: ignoring malformed descriptor %s", name, kv.key)
    folder = segment_object_path(name, "")
    objects = broker.objects

    def work() -> int:
        found = paths | {p for p in objects.list(folder) if p.startswith(folder)}
        for path in sorted(found):
            objects.delete(path)
        return len(found)

    return await asyncio.to_thread(work)


async def _delete_keys(broker: Broker, name: TopicName, *, assignment: bool = True) -> int:
    """Delete every etcd key of the topic, the root last (module docstring, step 4).

    Args:
        assignment: also delete the topic's assignment keys (§1.4) found in the cache.

    Returns:
        The keys deleted under the two prefixes (the last transaction's keys not counted).

    Raises:
        MetadataStoreError: etcd unreachable.
    """
    store = broker.store
    prefixes = (keys.topic_root(name) + "/", keys.storage_topic(name) + "/")
    removed = 0
    for prefix in prefixes:
        removed += await store.delete_prefix(prefix)
    suffix = f"/{name.namespace}/{name.topic}"
    owned = [
        key
        for key in broker.cache.get_prefix(keys.BROKERS_PREFIX)
        if assignment and key.endswith(suffix) and key[len(keys.BROKERS_PREFIX) : -len(suffix)].isdigit()
    ]
    revision = await store.transaction(
        deletes=[keys.topic_root(name), keys.namespace_topic(name), keys.unassigned_topic(name),
                 keys.replica_assignment(name), *owned]
    )
    for prefix in prefixes:  # a cursor or descriptor written while the first pass ran
        removed += await store.delete_prefix(prefix)
    if revision is not None:
        await broker.cache.wait_for_revision(revision)
    return removed


async def _delete_partitioned(broker: Broker, name: TopicName, count: int, *, force: bool) -> list[str]:
    """Delete every partition of ``name`` through its owner, then ``name``'s own keys.

    Raises:
        see :func:`delete_topic`.
    """
    deleted: list[str] = []
    for partition in partition_names(name, count):
        if not await _exists(broker, partition):
            continue
        deleted.extend(await _delete_partition(broker, partition, force=force))
    await _delete_keys(broker, name, assignment=False)
    log.info("partitioned topic %s deleted (%d partitions)", name, len(deleted))
    return deleted


async def _delete_partition(broker: Broker, partition: TopicName, *, force: bool) -> list[str]:
    """Delete one partition here if this broker owns it, else on its owner; after a
    ``NotServedHereError`` (the partition moved), look the owner up once more.

    Raises:
        see :func:`delete_topic`.
    """
    for attempt in range(2):
        owner = await broker.lookup(partition)
        try:
            if owner.broker_id == broker.broker_id:
                await _delete_served(broker, await broker.topic_for(partition), force=force)
                return [partition.path]
            return await _forward_delete(broker.config, owner.peer_address, partition, force=force)
        except TopicNotFoundError:
            return []  # deleted meanwhile
        except NotServedHereError:
            if attempt:
                raise
            await asyncio.sleep(0.2)
    raise AssertionError("unreachable")  # pragma: no cover


def _remote_error(exc: grpc.aio.AioRpcError, address: str) -> DanubeError:
    """The typed error another broker answered with (its class and fields travel in trailing
    metadata, :func:`danube_pipeline.error_codec.error_from_status`)."""
    metadata = {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in exc.trailing_metadata() or ()}
    error_class = metadata.get(ERROR_CLASS_METADATA_KEY)
    if error_class is None:
        return BrokerUnavailableError(address, exc.details() or exc.code().name)
    return error_from_status(exc.code(), exc.details() or "", error_class, metadata.get(ERROR_FIELDS_METADATA_KEY))


async def _forward_delete(config: BrokerConfig, address: str, partition: TopicName, *, force: bool) -> list[str]:
    """``Admin.DeleteTopic`` of ``partition`` on the broker at ``address`` (mutual TLS under
    TLS, :func:`broker.rpc.tls.broker_channel`).

    Raises:
        DanubeError: what that broker answered, typed; ``BrokerUnavailableError`` when it
            could not be reached.
    """
    budget = remaining_budget_s()
    timeout_s = FORWARD_TIMEOUT_S if budget is None else min(FORWARD_TIMEOUT_S, budget)
    async with broker_channel(config, address) as channel:
        try:
            response = await pb_grpc.AdminStub(channel).DeleteTopic(
                pb.DeleteTopicRequest(topic=partition.path, force=force), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise _remote_error(exc, address) from exc
    return list(response.deleted)


# ---------------------------------------------------------------------------- ResetCursor


async def resolve_position(
    topic: Topic,
    *,
    offset: int | None = None,
    earliest: bool = False,
    latest: bool = False,
    timestamp_ms: int | None = None,
) -> int:
    """The offset a subscription of ``topic`` moves to, from exactly one position.

    Args:
        topic: a topic served here.
        offset: this offset, from :attr:`Topic.earliest_offset` to the WAL's next offset.
        earliest: the earliest offset a subscription can read (in object storage or the WAL).
        latest: the WAL's next offset (only messages published from now on).
        timestamp_ms: the first offset whose record was published at or after this time (ms
            since the Unix epoch), searched in the WAL (the publish time of each record,
            ``danube_pipeline/format/batches.py``). A time at or before the WAL's first record gives
            the earliest offset (object storage is not searched); a time after every record,
            or a WAL that holds no record, gives the next offset.

    Returns:
        The offset.

    Raises:
        MalformedRequestError: not exactly one position, or a negative value.
        OffsetOutOfRangeError: ``offset`` is below the earliest offset or above the next one.
    """
    given = sum((offset is not None, earliest, latest, timestamp_ms is not None))
    if given != 1:
        raise MalformedRequestError(
            f"give exactly one position (offset, earliest, latest or timestamp_ms), got {given}"
        )
    next_offset = topic.wal.next_offset
    if earliest:
        return topic.earliest_offset
    if latest:
        return next_offset
    if timestamp_ms is not None:
        if timestamp_ms < 0:
            raise MalformedRequestError(f"timestamp_ms must not be negative, got {timestamp_ms}")
        return await _offset_at_time(topic, timestamp_ms * 1000)
    assert offset is not None
    lowest = topic.earliest_offset
    if not lowest <= offset <= next_offset:
        raise OffsetOutOfRangeError(topic.path, offset, lowest, next_offset)
    return offset


async def _offset_at_time(topic: Topic, timestamp_us: int) -> int:
    """The first offset in the WAL published at or after ``timestamp_us`` (see
    :func:`resolve_position`)."""
    wal = topic.wal
    position = wal.first_offset
    first_record = True
    while position < wal.durable_end:
        batches = wal.read(position, _SCAN_RECORDS)
        if not batches:
            break
        for batch in batches:
            header, records = iter_batch(batch.data)
            if first_record and header.first_timestamp_us >= timestamp_us:
                return topic.earliest_offset  # older than the WAL's first record
            first_record = False
            if header.first_timestamp_us >= timestamp_us:  # deltas are >= 0: all of it
                return max(batch.base_offset, position)
            for record_offset, publish_time_us, *_ in records:
                if record_offset >= position and publish_time_us >= timestamp_us:
                    return record_offset
        position = max(position, batches[-1].last_offset + 1)
        await asyncio.sleep(0)  # a long WAL does not hold up the broker's other requests
    return wal.next_offset


async def reset_cursor(
    broker: Broker,
    name: TopicName,
    subscription: str,
    *,
    offset: int | None = None,
    earliest: bool = False,
    latest: bool = False,
    timestamp_ms: int | None = None,
) -> int:
    """Move ``subscription`` of ``name`` so that it delivers from the given position next, on
    the topic's owner; its cursor is stored at once as that offset - 1 (§3.5).

    Unacknowledged deliveries are dropped; connected consumers' streams end and the clients
    subscribe again (:meth:`broker.topics.subscriptions.TopicSubscriptions.reset_cursor`). Acks
    of messages delivered before the reset that a client sends after it may still acknowledge
    offsets delivered again.

    Args:
        broker: the broker core.
        name: the topic.
        subscription: the subscription name.
        offset, earliest, latest, timestamp_ms: exactly one position (:func:`resolve_position`).

    Returns:
        The next offset the subscription delivers.

    Raises:
        InvalidNameError: the subscription name is malformed.
        TopicNotFoundError: the topic does not exist.
        PartitionedTopicError: the topic is partitioned (reset each partition's subscription).
        NotServedHereError: another broker owns it.
        SubscriptionNotFoundError: the topic has no such subscription (§3.4).
        MalformedRequestError: not exactly one position, or a negative value.
        OffsetOutOfRangeError: ``offset`` is out of range.
        MetadataStoreError: the cursor could not be stored (retry: the reset is idempotent).
    """
    validate_part("subscription", subscription)
    await refuse_partitioned(broker, name.path)
    topic = await broker.topic_for(name)
    if subscription not in topic.subscriptions and broker.cache.get(keys.topic_subscription(name, subscription)) is None:
        raise SubscriptionNotFoundError(name.path, subscription)
    target = await resolve_position(topic, offset=offset, earliest=earliest, latest=latest, timestamp_ms=timestamp_ms)
    await topic.subscriptions.reset_cursor(subscription, target)
    log.info("%s/%s: cursor reset, next offset %d", name, subscription, target)
    return target
