"""Sealed WAL segments into object storage, with their descriptors in etcd.

:func:`tier_sealed_segments` uploads each sealed segment that has no completed descriptor
(``docs/etcd-layout.md`` §5.1, §5.2); :func:`segments_needing_tiering` and
:func:`list_topic_roots` tell the sensor which topics have such segments. They meet the broker
only through its gRPC admin API and never read its disk.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from danube_pipeline.errors import CorruptRecordError, OffsetRangeError, TopicNotFoundError
from danube_pipeline.format.records import object_id
from danube_pipeline.lake.segment_columns import decode_segment_columns
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.descriptors import (
    blocking_range,
    complete_descriptor,
    create_descriptor,
    passable,
    read_descriptors,
    read_descriptors_with_revisions,
    read_unavailable_ranges,
)
from danube_pipeline.metadata.values import ObjectDescriptor
from danube_pipeline.modes import DeliveryMode
from danube_pipeline.names import TopicName
from danube_pipeline.partitions import partition_count
from danube_pipeline.storage.objectstore import ObjectStore, segment_object_path

if TYPE_CHECKING:
    from danube_pipeline.client.types import SegmentInfo
    from danube_pipeline.metadata.store import MetadataStore

__all__ = [
    "OFFSET_INDEX_INTERVAL_RECORDS",
    "SegmentAdmin",
    "TieringReport",
    "list_topic_roots",
    "retained_start",
    "segments_needing_tiering",
    "tier_sealed_segments",
    "untiered_segments",
    "with_released_segments",
]

log = logging.getLogger(__name__)

_MAX_ROUNDS = 1000
"""Passes :func:`tier_sealed_segments` makes over the descriptors before it leaves the rest to
the next run. A pass ends early only when another writer wrote a descriptor first, so every
pass but the last follows that writer's progress."""

OFFSET_INDEX_INTERVAL_RECORDS = 1000
"""Records between entries of a descriptor's sparse ``offset_index``."""


class SegmentAdmin(Protocol):
    """The part of the broker admin API tiering uses (``DanubeClient.admin``)."""

    async def list_sealed_segments(self, topic: str) -> list[SegmentInfo]: ...

    async def list_released_segments(self, topic: str) -> list[tuple[str, SegmentInfo]]: ...

    async def read_segment_bytes(self, topic: str, start_offset: int, *, address: str | None = None) -> bytes: ...


async def with_released_segments(
    topic: TopicName, sealed: list[SegmentInfo], descriptors: Sequence[ObjectDescriptor], admin: SegmentAdmin
) -> tuple[list[SegmentInfo], dict[int, str]]:
    """The owner's sealed segments plus those an earlier owner kept after releasing the topic
    and that fill the range between the last completed descriptor and the owner's first
    segment (a topic move before they were tiered).

    Returns:
        The segments in offset order, and ``start_offset -> broker address`` for those to read
        from an earlier owner.

    Raises:
        RemoteError: the cluster metadata could not be read.
    """
    ends = [d.end_offset for d in descriptors if d.completed]
    need_from = max(ends) + 1 if ends else 0
    owner_first = sealed[0].start_offset if sealed else None
    if owner_first is not None and owner_first <= need_from:
        return sealed, {}
    have = {s.start_offset for s in sealed}
    sources: dict[int, str] = {}
    extra: list[SegmentInfo] = []
    for address, seg in await admin.list_released_segments(topic.path):
        if seg.start_offset < need_from or seg.start_offset in have or seg.start_offset in sources:
            continue
        if owner_first is not None and seg.end_offset >= owner_first:
            continue
        sources[seg.start_offset] = address
        extra.append(seg)
    return sorted([*sealed, *extra], key=lambda s: s.start_offset), sources


def retained_start(descriptors: Sequence[ObjectDescriptor]) -> int | None:
    """The first offset object storage still holds for the topic.

    Retention (:mod:`danube_pipeline.lake.retention`) deletes descriptors oldest first, so a sealed
    segment that ends before the first completed descriptor was tiered once and has expired
    since; it must not be uploaded again while the broker's WAL still lists it.

    Args:
        descriptors: the topic's object descriptors (completed or not).

    Returns:
        The first completed descriptor's start offset, or ``None`` when there is none (then
        every sealed segment is still to be tiered).
    """
    starts = [d.start_offset for d in descriptors if d.completed]
    return min(starts) if starts else None


def untiered_segments(sealed: Sequence[SegmentInfo], descriptors: Sequence[ObjectDescriptor]) -> list[SegmentInfo]:
    """Sealed, non-empty segments that have no completed descriptor and did not expire.

    Args:
        sealed: the topic's sealed segments, as the broker lists them.
        descriptors: the topic's object descriptors (completed or not).

    Returns:
        The segments whose start offset no completed descriptor has, in offset order, leaving
        out those that end before the first completed descriptor (:func:`retained_start`:
        tiered before and deleted by retention).
    """
    done = {d.start_offset for d in descriptors if d.completed}
    first = retained_start(descriptors)
    return [
        s
        for s in sorted(sealed, key=lambda s: s.start_offset)
        if s.end_offset >= s.start_offset
        and s.start_offset not in done
        and (first is None or s.end_offset >= first)
    ]


@dataclass
class TieringReport:
    """What :func:`tier_sealed_segments` did.

    Attributes:
        topic: ``/ns/topic``.
        sealed_segments: non-empty sealed segments the broker listed.
        objects_written: objects uploaded by this call (with their descriptors completed).
        objects_skipped: segments already tiered (completed descriptor, object of that size).
        segments_expired: sealed segments left alone because they end before the first
            completed descriptor (tiered before, then deleted by retention; the broker's WAL
            has not dropped them yet).
        bytes_written: bytes uploaded by this call.
        records_written: records in the objects uploaded by this call.
        first_offset: the first offset of the topic's first completed descriptor afterwards,
            ``None`` when there is none.
        last_offset: the end offset of the topic's last completed descriptor afterwards,
            ``None`` when there is none.
        descriptors_total: completed descriptors of the topic afterwards.
        cursor: ``objects/cur``'s padded start offset afterwards, ``None`` if unset.
        object_ids_written: ``data-{start}-{end}.dnb1`` of each object uploaded, in order.
        waiting_at: the offset tiering stopped at because an unavailable range holds it
            (``docs/etcd-layout.md`` §5.5: a failed owner's offsets), ``None`` otherwise.
    """

    topic: str
    sealed_segments: int = 0
    objects_written: int = 0
    objects_skipped: int = 0
    segments_expired: int = 0
    bytes_written: int = 0
    records_written: int = 0
    first_offset: int | None = None
    last_offset: int | None = None
    descriptors_total: int = 0
    cursor: str | None = None
    object_ids_written: list[str] = field(default_factory=list)
    waiting_at: int | None = None


async def tier_sealed_segments(
    topic: TopicName,
    *,
    store: MetadataStore,
    admin: SegmentAdmin,
    objects: ObjectStore,
    now_s: int | None = None,
) -> TieringReport:
    """Upload every sealed segment that has no completed descriptor, in offset order.

    For each: check contiguity (its start is the previous descriptor's end + 1, or it is offset
    0 / the first sealed segment when no descriptor exists); create its descriptor with
    ``completed=false`` if none exists (one left incomplete is kept as is); fetch its bytes
    through the broker admin API; verify them with
    :func:`~danube_pipeline.lake.segment_columns.decode_segment_columns` (which also builds the sparse offset
    index); write the object ``topics/{ns}/{topic}/data-{start}-{end}.dnb1``; then write the
    descriptor with ``completed=true``, size, etag and offset index, iff it is unchanged since
    it was read or created, together with ``objects/cur`` when that moves forward, in one etcd
    transaction.

    Two writers may run at once (the continuous writer and the Dagster asset): a descriptor
    the other one created or completed first is never written over (so a completed
    descriptor never becomes incomplete again, and ``objects/cur`` never moves backwards).
    Losing such a race is not an error: this call reads the descriptors again and goes on
    from there (the other writer did that work; it is not counted in the report).

    Idempotent: a segment whose completed descriptor exists and whose object exists with the
    stated size is skipped, as is one whose descriptor says the object was deleted once the
    table held it (``object_deleted_at``, §5.1); one whose object is missing or the wrong size
    is uploaded again, once its bytes match the descriptor's size and MD5 etag. Offsets are never registered
    twice: a segment with other bytes than the completed descriptor of its offsets, or one that
    overlaps a completed descriptor without matching it, is refused (``docs/etcd-layout.md``
    §5.1).
    After a topic move, the segments the earlier owner had not tiered are read from that
    broker, which keeps them after releasing the topic (:func:`with_released_segments`).

    A segment that ends before the first completed descriptor is skipped too: retention
    deleted its descriptor and object (``docs/etcd-layout.md`` §5.1), and uploading it again
    would bring expired data back.

    Args:
        topic: the topic to tier.
        store: the connected metadata store.
        admin: the broker admin API (``DanubeClient.admin``).
        objects: the object store segment objects are written to.
        now_s: ``created_at`` of new descriptors, seconds since the Unix epoch; default now.

    Returns:
        A :class:`TieringReport`.

    Raises:
        OffsetRangeError: a segment does not follow the previous descriptor, overlaps a
            completed descriptor it does not match, or its bytes do not hold the offsets the
            broker listed.
        CorruptRecordError: the bytes fail the segment checks, or differ (size or MD5) from the
            completed descriptor of the same offsets.
        MetadataStoreError, RemoteError: etcd or the broker failed.
    """
    report = TieringReport(topic=topic.path)
    for _ in range(_MAX_ROUNDS):
        if await _tier_round(topic, store=store, admin=admin, objects=objects, now_s=now_s, report=report):
            break
        log.info("%s: another tiering writer got there first; reading the descriptors again", topic.path)
    else:
        log.warning("%s: lost %d races to other tiering writers in a row; the next run goes on", topic.path, _MAX_ROUNDS)

    descriptors, cur = await read_descriptors(store, topic)
    done = [d for d in descriptors if d.completed]
    report.descriptors_total = len(done)
    report.cursor = cur
    if done:
        report.first_offset = done[0].start_offset
        report.last_offset = done[-1].end_offset
    return report


async def _tier_round(
    topic: TopicName,
    *,
    store: MetadataStore,
    admin: SegmentAdmin,
    objects: ObjectStore,
    now_s: int | None,
    report: TieringReport,
) -> bool:
    """One pass of :func:`tier_sealed_segments` over the descriptors read at its start.

    Returns:
        True when done; False when another writer changed a descriptor this pass was about to
        write (a lost compare): nothing is written over it, and the caller reads again.

    Raises:
        The errors of :func:`tier_sealed_segments`.
    """
    sealed = sorted(await admin.list_sealed_segments(topic.path), key=lambda s: s.start_offset)
    sealed = [s for s in sealed if s.end_offset >= s.start_offset]
    read = await read_descriptors_with_revisions(store, topic)
    descriptors = read.descriptors
    ranges = await read_unavailable_ranges(store, topic)
    sealed, sources = await with_released_segments(topic, sealed, descriptors, admin)
    report.sealed_segments = len(sealed)
    report.objects_skipped = report.segments_expired = 0
    report.waiting_at = None
    first_retained = retained_start(descriptors)
    if first_retained is not None:
        expired = [s for s in sealed if s.end_offset < first_retained]
        report.segments_expired = len(expired)
        sealed = [s for s in sealed if s.end_offset >= first_retained]
    by_start = {d.start_offset: d for d in descriptors}
    completed_ends: dict[int, int] = {d.start_offset: d.end_offset for d in descriptors if d.completed}

    def previous_end(start: int) -> int | None:
        ends = [end for s, end in completed_ends.items() if s < start]
        return max(ends) if ends else None

    for index, seg in enumerate(sealed):
        oid = object_id(seg.start_offset, seg.end_offset)
        path = segment_object_path(topic, oid)
        existing = by_start.get(seg.start_offset)
        if existing is not None and existing.completed:
            if existing.end_offset != seg.end_offset:
                raise OffsetRangeError(existing.end_offset, seg.end_offset, f"{topic.path} descriptor {oid}")
            if existing.size != seg.size_bytes:
                # The same offsets with other bytes: never register them over the object.
                raise CorruptRecordError(
                    f"{topic.path}/{oid}", 0,
                    f"the broker's segment is {seg.size_bytes} bytes, the completed descriptor says {existing.size}: "
                    "different content for the same offsets",
                )
            if existing.in_table_only:
                report.objects_skipped += 1  # the table holds it; its object was deleted (§5.1)
                continue
            info = objects.info(path)
            if info is not None and info.size_bytes == existing.size:
                report.objects_skipped += 1
                continue
            log.warning("%s: object %s missing or wrong size (%s); uploading again", topic.path, path, info)
        else:
            overlap = [
                d for d in descriptors
                if d.completed and d.start_offset != seg.start_offset
                and d.start_offset <= seg.end_offset and seg.start_offset <= d.end_offset
            ]
            if overlap:
                d = overlap[0]
                raise OffsetRangeError(
                    d.end_offset + 1, seg.start_offset,
                    f"{topic.path} segment {seg.start_offset}..{seg.end_offset} overlaps object {d.object_id}",
                )
        prev = previous_end(seg.start_offset)
        expected = 0 if prev is None else prev + 1
        waiting = blocking_range(ranges, expected, seg.start_offset - 1) if seg.start_offset > expected else None
        if waiting is not None:
            # A failed owner's offsets may still arrive (§5.5): tier nothing past them yet.
            report.waiting_at = expected
            log.warning("%s: tiering waits at offset %d: unavailable range %d..%d of broker %d",
                        topic.path, expected, waiting.start_offset, waiting.end_offset, waiting.broker_id)
            break
        if prev is None:
            if seg.start_offset != 0 and index != 0 and not passable(ranges, 0, seg.start_offset - 1):
                raise OffsetRangeError(0, seg.start_offset, f"{topic.path} first object")
        elif seg.start_offset != prev + 1 and not passable(ranges, prev + 1, seg.start_offset - 1):
            raise OffsetRangeError(prev + 1, seg.start_offset, f"{topic.path} object {oid}")

        created_at = int(time.time()) if now_s is None else now_s
        if existing is None:
            incomplete = ObjectDescriptor(
                completed=False,
                created_at=created_at,
                end_offset=seg.end_offset,
                etag=None,
                object_id=oid,
                offset_index=[],
                size=seg.size_bytes,
                start_offset=seg.start_offset,
            )
            created = await create_descriptor(store, topic, incomplete)
            if created is None:
                return False  # another writer created it since the read: never write over it
            expected_revision = created
        else:  # completed (its object is re-uploaded) or left incomplete: completed in place
            expected_revision = read.mod_revisions[seg.start_offset]
        data = await admin.read_segment_bytes(topic.path, seg.start_offset, address=sources.get(seg.start_offset))
        decoded = decode_segment_columns(
            data, where=f"{topic.path}/{oid}", index_interval_records=OFFSET_INDEX_INTERVAL_RECORDS
        )
        if not decoded.records:
            raise CorruptRecordError(f"{topic.path}/{oid}", 0, "segment listed as non-empty holds no records")
        if decoded.start_offset != seg.start_offset or decoded.end_offset != seg.end_offset:
            raise OffsetRangeError(seg.end_offset, decoded.end_offset, f"{topic.path}/{oid} contents")
        if existing is not None and existing.completed and existing.etag and hashlib.md5(data).hexdigest() != existing.etag:
            raise CorruptRecordError(
                f"{topic.path}/{oid}", 0,
                f"the broker's segment does not match the completed descriptor's etag {existing.etag}: "
                "different content for the same offsets",
            )
        info = objects.put_bytes(path, data)
        completed = ObjectDescriptor(
            completed=True,
            created_at=created_at,
            end_offset=seg.end_offset,
            etag=info.etag,
            object_id=oid,
            offset_index=decoded.offset_index,
            size=info.size_bytes,
            start_offset=seg.start_offset,
        )
        if not await complete_descriptor(store, topic, completed, expected_mod_revision=expected_revision):
            return False  # another writer completed it (or retention deleted it) since the read
        completed_ends[seg.start_offset] = seg.end_offset
        report.objects_written += 1
        report.bytes_written += info.size_bytes
        report.records_written += len(decoded.records)
        report.object_ids_written.append(oid)
        log.info("%s: tiered %s (%d records, %d bytes)", topic.path, oid, len(decoded.records), info.size_bytes)
    return True


async def list_topic_roots(store: MetadataStore) -> list[TopicName]:
    """Topics whose root key ``/topics/{ns}/{topic}`` exists (``docs/etcd-layout.md`` §3.1),
    except partitioned topics: they hold no messages themselves (their root holds the
    partition count), each of their partitions ``{topic}-part-{i}`` is a topic listed here;
    and except ``NonReliable`` topics (§3.2): their messages live only in the owner's memory,
    so there is nothing to tier (logged at debug level).

    Args:
        store: the connected metadata store.

    Returns:
        The topics, in key order; sub-keys, partitioned topics and malformed names are ignored.

    Raises:
        MetadataStoreError: etcd failed.
    """
    kvs, _ = await store.get_prefix(keys.TOPICS + "/")
    found: list[TopicName] = []
    values_by_key = {kv.key: kv.value for kv in kvs}
    for kv in kvs:
        parts = kv.key.split("/")
        if len(parts) != 4 or parts[1] != keys.TOPICS.strip("/") or partition_count(kv.value):
            continue
        try:
            name = TopicName.parse(f"/{parts[2]}/{parts[3]}")
        except ValueError:
            log.warning("ignoring malformed topic key %s", kv.key)
            continue
        if DeliveryMode.from_stored(values_by_key.get(keys.topic_delivery(name))) == DeliveryMode.NON_RELIABLE:
            log.debug("topic %s is NonReliable (in memory only): not tiered", name.path)
            continue
        found.append(name)
    return found


async def segments_needing_tiering(
    topic: TopicName, *, store: MetadataStore, admin: SegmentAdmin
) -> list[SegmentInfo]:
    """Sealed segments of ``topic`` without a completed descriptor (for the sensor).

    Args:
        topic: the topic.
        store: the connected metadata store.
        admin: the broker admin API.

    Returns:
        The untiered segments in offset order; empty when the broker does not know the topic.

    Raises:
        MetadataStoreError: etcd failed.
        RemoteError: the broker failed.
    """
    try:
        sealed = await admin.list_sealed_segments(topic.path)
    except TopicNotFoundError:
        return []
    descriptors, _ = await read_descriptors(store, topic)
    sealed, _sources = await with_released_segments(topic, sorted(sealed, key=lambda s: s.start_offset), descriptors, admin)
    return untiered_segments(sealed, descriptors)
