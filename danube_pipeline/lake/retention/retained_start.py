"""What retention keeps: the namespace policy read from etcd, the *retained start* its time
and size limits give (the first offset kept), the descriptors that fall below it, and the UTC
days of the table holding rows below it."""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pyiceberg.catalog import Catalog

from danube_pipeline.format.segments import decode_segment
from danube_pipeline.lake import iceberg
from danube_pipeline.lake.iceberg.layout import data_files_by_day
from danube_pipeline.lake.object_lifecycle import first_offset_published_since
from danube_pipeline.lake.tiering import completed_descriptors
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.descriptors import read_descriptors
from danube_pipeline.metadata.values import NamespacePolicy, ObjectDescriptor
from danube_pipeline.names import TopicName
from danube_pipeline.partitions import partition_of
from danube_pipeline.storage.objectstore import ObjectStore, segment_object_path

if TYPE_CHECKING:
    from danube_pipeline.metadata.store import MetadataStore

__all__ = [
    "days_with_expired_rows",
    "expired_descriptors",
    "read_policy",
    "retained_start_offset",
    "size_start_offset",
    "time_start_offset",
]

log = logging.getLogger(__name__)


async def read_policy(store: MetadataStore, namespace: str) -> tuple[NamespacePolicy, str | None]:
    """The namespace's policy (``/namespaces/{ns}/policy``, ``docs/etcd-layout.md`` §2.1),
    read straight from etcd.

    A missing or unreadable policy means the defaults, as for the broker (§2.1): no retention
    limit, so nothing is deleted.

    Args:
        store: the connected metadata store.
        namespace: the namespace.

    Returns:
        ``(policy, error)``: the policy, and why the stored value was not used (``None`` when
        it was, or when there is none).

    Raises:
        MetadataStoreError: etcd failed.
    """
    kv = await store.get(keys.namespace_policy(namespace))
    if kv is None or kv.value is None:
        return NamespacePolicy(), None
    try:
        return NamespacePolicy.from_json(kv.value), None
    except (TypeError, ValueError) as exc:
        log.warning("namespace %s: unreadable policy, no retention applied: %s", namespace, exc)
        return NamespacePolicy(), str(exc)


def size_start_offset(completed: Sequence[ObjectDescriptor], retention_bytes: int) -> int:
    """Where the size limit starts keeping: the newest objects are kept while their summed
    ``size`` stays within ``retention_bytes``; the newest one always.

    Args:
        completed: the topic's completed descriptors in offset order, at least one.
        retention_bytes: the limit, bytes (> 0).

    Returns:
        The start offset of the oldest object kept.

    Raises:
        ValueError: ``completed`` is empty.
    """
    if not completed:
        raise ValueError("no completed descriptor")
    kept = completed[-1].size
    start = completed[-1].start_offset
    for d in reversed(completed[:-1]):
        if kept + d.size > retention_bytes:
            break
        kept += d.size
        start = d.start_offset
    return start


TableLookup = Callable[[ObjectDescriptor, int], int | None]
"""For a descriptor whose object was deleted once the table held it (``object_deleted_at``,
``docs/etcd-layout.md`` §5.1) and a cutoff in µs since the epoch: the first offset of its range
published at or after the cutoff, read from the table, or ``None``
(:func:`danube_pipeline.lake.object_lifecycle.first_offset_published_since`)."""


def table_lookup(catalog: Catalog, table_topic: TopicName, partition: int | None) -> TableLookup:
    """The :data:`TableLookup` of a topic's table (the partitioned topic's, for a partition)."""
    identifier = iceberg.table_identifier(table_topic)

    def lookup(descriptor: ObjectDescriptor, cutoff_us: int) -> int | None:
        return first_offset_published_since(catalog, identifier, descriptor, cutoff_us, partition=partition)

    return lookup


def time_start_offset(
    topic: TopicName,
    completed: Sequence[ObjectDescriptor],
    objects: ObjectStore,
    cutoff_ms: int,
    *,
    from_table: TableLookup | None = None,
) -> int:
    """The first offset whose record was published at or after ``cutoff_ms``.

    Reads the objects oldest first and stops in the first one holding such a record (so it
    reads the objects about to expire, and one more). A descriptor whose object was deleted
    once the table held it (``object_deleted_at``, §5.1) is looked up in the table instead.

    Args:
        topic: the topic.
        completed: its completed descriptors in offset order, at least one.
        objects: the object store holding their objects.
        cutoff_ms: ms since the Unix epoch.
        from_table: reads a marked descriptor's range from the table; without it such a
            descriptor's object is read (and is missing).

    Returns:
        That offset, or the newest descriptor's end offset + 1 when every record expired.

    Raises:
        ValueError: ``completed`` is empty.
        FileNotFoundError: a descriptor's object is missing.
        CorruptRecordError: an object fails the segment checks.
    """
    if not completed:
        raise ValueError("no completed descriptor")
    cutoff_us = cutoff_ms * 1000
    for d in completed:
        if d.in_table_only and from_table is not None:
            first = from_table(d, cutoff_us)
            if first is not None:
                return first
            continue
        data = objects.get_bytes(segment_object_path(topic, d.object_id))
        for record in decode_segment(data, where=f"{topic.path}/{d.object_id}").records:
            if record.publish_time_us >= cutoff_us:
                return record.offset
    return completed[-1].end_offset + 1


def retained_start_offset(
    topic: TopicName,
    completed: Sequence[ObjectDescriptor],
    objects: ObjectStore,
    policy: NamespacePolicy,
    now_ms: int,
    *,
    from_table: TableLookup | None = None,
) -> int | None:
    """The first offset retention keeps: the larger of :func:`time_start_offset` (for
    ``now_ms - policy.retention_ms``) and :func:`size_start_offset` (for
    ``policy.retention_bytes``), for the limits the policy sets.

    Args:
        topic: the topic.
        completed: its completed descriptors in offset order.
        objects: the object store holding their objects.
        policy: the namespace's policy.
        now_ms: ms since the Unix epoch.
        from_table: as for :func:`time_start_offset`.

    Returns:
        The offset; ``None`` when the policy sets no limit or there is no completed descriptor.

    Raises:
        FileNotFoundError, CorruptRecordError: as :func:`time_start_offset`.
    """
    if not completed:
        return None
    starts: list[int] = []
    if policy.retention_bytes > 0:
        starts.append(size_start_offset(completed, policy.retention_bytes))
    if policy.retention_ms > 0:
        starts.append(time_start_offset(topic, completed, objects, now_ms - policy.retention_ms, from_table=from_table))
    return max(starts) if starts else None


def expired_descriptors(completed: Sequence[ObjectDescriptor], retained_start: int | None) -> list[ObjectDescriptor]:
    """The completed descriptors retention deletes: those ending below ``retained_start``,
    never the newest.

    Args:
        completed: the topic's completed descriptors in offset order.
        retained_start: the first offset kept, or ``None`` (nothing expires).

    Returns:
        The descriptors, oldest first (a prefix of ``completed``).
    """
    if retained_start is None:
        return []
    return [d for d in completed[:-1] if d.end_offset < retained_start]


async def days_with_expired_rows(
    topic: TopicName,
    *,
    store: MetadataStore,
    objects: ObjectStore,
    catalog: Catalog,
    now_ms: int | None = None,
) -> tuple[list[dt.date], bool]:
    """Which UTC days of the topic's table hold rows retention would delete now, and whether
    any descriptor expired: what the ``retention_schedule`` asks runs for.

    A day is listed when one of the table's data files holding rows of that day has an
    ``_offset`` lower bound below the retained start (:func:`retained_start_offset`; read from
    the manifests, no data file is read; a partitioned topic's partitions share the table, so a
    day may be listed for another partition's rows: its run then deletes nothing).

    Args:
        topic: the topic (a partition ``{topic}-part-{i}`` reads its partitioned topic's table).
        store: the connected metadata store.
        objects: the object store holding the segment objects.
        catalog: the shared Iceberg catalog.
        now_ms: the time the cutoff counts back from, ms since the Unix epoch; default now.

    Returns:
        ``(days, descriptors_expired)``: the days in order, and whether some completed
        descriptor ends below the retained start.

    Raises:
        FileNotFoundError, CorruptRecordError: an object needed to find the retained start
            is missing or corrupt.
        MetadataStoreError: etcd failed.
    """
    now = int(time.time() * 1000) if now_ms is None else now_ms
    policy, _ = await read_policy(store, topic.namespace)
    if policy.retention_ms <= 0 and policy.retention_bytes <= 0:
        return [], False
    descriptors, _ = await read_descriptors(store, topic)
    completed = completed_descriptors(descriptors)
    part = await partition_of(store, topic)
    table_topic = part.parent if part is not None else topic
    lookup = table_lookup(catalog, table_topic, part.index if part is not None else None)
    retained = retained_start_offset(topic, completed, objects, policy, now, from_table=lookup)
    if retained is None:
        return [], False
    ident = iceberg.table_identifier(table_topic)
    days: list[dt.date] = []
    if catalog.table_exists(ident):
        by_day = data_files_by_day(catalog.load_table(ident))
        days = [d for d, files in by_day.items() if files.min_offset is not None and files.min_offset < retained]
    return days, bool(expired_descriptors(completed, retained))
