"""The tiering steps behind the assets, as plain async functions over the real systems.

* :func:`tier_sealed_segments`: sealed WAL segments → objects in object storage plus their
  descriptors in etcd (``docs/etcd-layout.md`` §5.1, §5.2).
* :func:`commit_objects_to_table`: segment objects → one Iceberg snapshot per object, exactly
  once: each snapshot's summary records the last offset it holds, and a commit succeeds only if
  the table's current snapshot is still the one the writer read (the catalog's atomic swap of
  the metadata pointer; Iceberg spec, "Optimistic Concurrency"). The table evolves in place
  with the topic's schema versions, and records that cannot be rows go to its dead-letter
  table (:mod:`danube_pipeline.lake.iceberg.commit`).
* :func:`descriptor_gaps`, :func:`descriptor_record_count`, :func:`object_mismatches`: what
  the asset checks compare (descriptors against each other, the object store and the table).

They meet the broker only through its gRPC admin API and never read its disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import Table

from danube_pipeline.lake import iceberg
from danube_pipeline.lake.iceberg.layout import apply_layout, describe_spec, read_table_layout
from danube_pipeline.errors import (
    CorruptRecordError,
    InvalidSchemaError,
    OffsetRangeError,
    SchemaNotFoundError,
    TopicNotFoundError,
)
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.descriptors import blocking_range, passable, read_descriptors, read_unavailable_ranges
from danube_pipeline.metadata.values import ObjectDescriptor, ObjectsCursor, TableLayout, UnavailableRange
from danube_pipeline.modes import DeliveryMode
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore, segment_object_path
from danube_pipeline.partitions import partition_count, partition_of
from danube_pipeline.format.records import Record, object_id
from danube_pipeline.lake.segment_columns import decode_segment_columns, schema_keys

if TYPE_CHECKING:
    from danube_pipeline.client.types import SegmentInfo
    from danube_pipeline.metadata.store import MetadataStore

log = logging.getLogger(__name__)

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


class SchemaLookup(Protocol):
    """The part of ``SchemaRegistry`` the table commit uses."""

    async def get_by_id(self, schema_id: int, *, version: int | None = None) -> Any: ...


# --------------------------------------------------------------------------- descriptors


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
    0 / the first sealed segment when no descriptor exists); put its descriptor with
    ``completed=false``; fetch its bytes through the broker admin API; verify them with
    :func:`~danube_pipeline.lake.segment_columns.decode_segment_columns` (which also builds the sparse offset
    index); write the object ``topics/{ns}/{topic}/data-{start}-{end}.dnb1``; then put the
    descriptor with ``completed=true``, size, etag and offset index together with
    ``objects/cur`` in one etcd transaction.

    Idempotent: a segment whose completed descriptor exists and whose object exists with the
    stated size is skipped; one whose object is missing or the wrong size is uploaded again,
    once its bytes match the descriptor's size and MD5 etag. Offsets are never registered
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
    sealed = sorted(await admin.list_sealed_segments(topic.path), key=lambda s: s.start_offset)
    sealed = [s for s in sealed if s.end_offset >= s.start_offset]
    descriptors, _ = await read_descriptors(store, topic)
    ranges = await read_unavailable_ranges(store, topic)
    sealed, sources = await with_released_segments(topic, sealed, descriptors, admin)
    report.sealed_segments = len(sealed)
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
        descriptor_key = keys.object_descriptor(topic, seg.start_offset)
        if existing is None or not existing.completed:
            await store.put(
                descriptor_key,
                ObjectDescriptor(
                    completed=False,
                    created_at=created_at,
                    end_offset=seg.end_offset,
                    etag=None,
                    object_id=oid,
                    offset_index=[],
                    size=seg.size_bytes,
                    start_offset=seg.start_offset,
                ),
            )
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
        completed_ends[seg.start_offset] = seg.end_offset
        newest = max(completed_ends)
        await store.put_many(
            [
                (descriptor_key, completed),
                (keys.objects_cur(topic), ObjectsCursor(start=keys.pad_offset(newest))),
            ]
        )
        report.objects_written += 1
        report.bytes_written += info.size_bytes
        report.records_written += len(decoded.records)
        report.object_ids_written.append(oid)
        log.info("%s: tiered %s (%d records, %d bytes)", topic.path, oid, len(decoded.records), info.size_bytes)

    descriptors, cur = await read_descriptors(store, topic)
    done = [d for d in descriptors if d.completed]
    report.descriptors_total = len(done)
    report.cursor = cur
    if done:
        report.first_offset = done[0].start_offset
        report.last_offset = done[-1].end_offset
    return report


# --------------------------------------------------------------------------- Iceberg


@dataclass
class TableReport:
    """What :func:`commit_objects_to_table` did.

    Attributes:
        table: ``ns.topic``, the table's identifier in the catalog (for a partition
            ``{topic}-part-{i}``, the partitioned topic's table).
        partition: the partition index ``i`` when the topic is a partition of a partitioned
            topic, ``None`` otherwise.
        objects_appended: objects appended by this call, one snapshot each.
        objects_skipped: completed objects already in the table.
        rows_appended: rows appended by this call.
        snapshot_id: the table's current snapshot afterwards, ``None`` without a table.
        committed_end_offset: the table's committed end offset afterwards (the partition's,
            for a partition), ``None`` when nothing was ever appended.
        row_count: rows in the whole table afterwards, every partition's (its snapshot summary's
            ``total-records``), ``None`` without a table or when the summary lacks it.
        data_files: live data files afterwards.
        snapshots: ids of the snapshots this call created, in order.
        schema_ids: registry schema ids of the records appended.
        dead_letter_table: ``ns.topic__dlq`` when this call dead-lettered records, else ``None``.
        dead_letter_records: records this call added to the dead-letter table.
        schema_changes: the in-place changes this call made to the table's schema, as text.
        layout_changes: the changes this call made to the table's partition spec and sort order
            (:func:`danube_pipeline.lake.iceberg.layout.apply_layout`), as text.
        partition_spec: the table's partition spec afterwards, e.g. ``"day(_publish_time)"``.
        data_files_before: live data files before this call (0 without a table).
        bytes_read: bytes of the segment objects this call read and appended.
        first_offset: the first offset this call appended, ``None`` when it appended none.
        last_offset: the last offset this call appended, ``None`` when it appended none.
    """

    table: str
    partition: int | None = None
    objects_appended: int = 0
    objects_skipped: int = 0
    rows_appended: int = 0
    snapshot_id: int | None = None
    committed_end_offset: int | None = None
    row_count: int | None = None
    data_files: int = 0
    snapshots: list[int] = field(default_factory=list)
    schema_ids: list[int] = field(default_factory=list)
    dead_letter_table: str | None = None
    dead_letter_records: int = 0
    schema_changes: list[str] = field(default_factory=list)
    layout_changes: list[str] = field(default_factory=list)
    partition_spec: str | None = None
    data_files_before: int = 0
    bytes_read: int = 0
    first_offset: int | None = None
    last_offset: int | None = None


def _schema_dict(raw: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    parsed = json.loads(raw)
    return parsed if isinstance(parsed, dict) else {"type": parsed}


async def _schemas_for(
    records: Sequence[Record], registry: SchemaLookup
) -> tuple[dict[str, Any] | None, dict[tuple[int, int], dict[str, Any]]]:
    """Avro only: the latest version widened with fields older writers still carry
    (:func:`~danube_pipeline.lake.iceberg.widen_avro_schema`) and each ``(schema_id, version)``'s
    writer schema, for :func:`~danube_pipeline.lake.iceberg.append_records`. Tiering itself resolves
    writers of every format with :func:`_writers_for` instead."""
    pairs = [k for k in schema_keys(records) if k[0] != 0]
    if not pairs:
        return None, {}
    writers: dict[tuple[int, int], dict[str, Any]] = {}
    for schema_id, version in pairs:
        registered = await registry.get_by_id(schema_id, version=version or None)
        writers[(schema_id, version)] = _schema_dict(registered.raw_schema)
    newest_id = pairs[-1][0]
    latest = await registry.get_by_id(newest_id)
    # Fields a later version removed still hold data in records written before the removal.
    table_schema = iceberg.widen_avro_schema(_schema_dict(latest.raw_schema), writers.values())
    return table_schema, writers


SchemaParser = Callable[..., Any]
"""``parse(schema_type, raw_schema, *, subject) -> parsed`` with the attributes
:func:`~danube_pipeline.lake.iceberg.writer_for_parsed` reads (``schema_type``, ``avro``,
``json_schema``, ``message_descriptor``): ``danube_pipeline.schemas.formats.parse_schema``."""


def default_schema_parser() -> SchemaParser:
    """The registry's ``danube_pipeline.schemas.formats.parse_schema``; where that module is
    missing, a parser of Avro and JSON Schema texts (``json.loads``) that refuses Protobuf."""
    try:
        module = importlib.import_module("danube_pipeline.schemas.formats")
    except ImportError:
        return _json_parser
    parser: SchemaParser = module.parse_schema
    return parser


def _json_parser(schema_type: str, raw_schema: str, *, subject: str) -> Any:
    if schema_type not in (iceberg.writer.AVRO, iceberg.writer.JSON_SCHEMA):
        raise InvalidSchemaError(subject, f"no parser for {schema_type} schemas here")
    loaded = json.loads(raw_schema) if raw_schema.strip()[:1] in ("{", "[", '"') else raw_schema
    return SimpleNamespace(schema_type=schema_type, avro=loaded, json_schema=loaded)


_PARSE_ERRORS = (InvalidSchemaError, ValueError, TypeError, KeyError, AttributeError)
"""What a schema that cannot be parsed or mapped raises: its records are dead-lettered."""


async def _writer_for(
    key: tuple[int, int], registry: SchemaLookup, parse: SchemaParser
) -> iceberg.RegisteredWriter:
    """What the registry has for ``(schema_id, version)``, parsed (version 0: the latest)."""
    schema_id, version = key
    try:
        registered = await registry.get_by_id(schema_id, version=version or None)
    except SchemaNotFoundError as exc:
        return iceberg.RegisteredWriter(
            schema_id, version,
            error=f"{iceberg.DeadLetterReason.UNKNOWN_SCHEMA}: schema id {schema_id} version {version} "
            f"is not in the registry ({exc})",
        )
    schema_type = getattr(registered, "schema_type", iceberg.writer.AVRO)
    subject = getattr(registered, "subject", None)
    try:
        parsed = await asyncio.to_thread(parse, schema_type, registered.raw_schema, subject=subject or "?")
        writer = iceberg.writer_for_parsed(parsed)
    except _PARSE_ERRORS as exc:
        return iceberg.RegisteredWriter(
            schema_id, version, subject, schema_type,
            error=f"{iceberg.DeadLetterReason.UNREADABLE_SCHEMA}: schema id {schema_id} version {version} "
            f"({schema_type}): {exc}",
        )
    return iceberg.RegisteredWriter(schema_id, version, subject, schema_type, writer)


async def _writers_for(
    records: Sequence[Record],
    registry: SchemaLookup,
    parse: SchemaParser,
    cache: dict[tuple[int, int], iceberg.RegisteredWriter],
) -> dict[tuple[int, int], iceberg.RegisteredWriter]:
    """The :class:`~danube_pipeline.lake.iceberg.RegisteredWriter` of each ``(schema_id,
    schema_version)`` of ``records`` that has a schema, asking the registry once per pair
    (``cache``). An id the registry lacks is not an error: its records are dead-lettered."""
    out: dict[tuple[int, int], iceberg.RegisteredWriter] = {}
    for key in [k for k in schema_keys(records) if k[0] != 0]:
        if key not in cache:
            cache[key] = await _writer_for(key, registry, parse)
        out[key] = cache[key]
    return out


async def commit_objects_to_table(
    topic: TopicName,
    *,
    store: MetadataStore,
    objects: ObjectStore,
    catalog: Catalog,
    registry: SchemaLookup,
    parse_schema: SchemaParser | None = None,
) -> TableReport:
    """Append every completed segment object not yet in the topic's table, one snapshot each.

    Objects whose end offset is at or below the table's committed end offset are not even
    read. Each object is checked against its descriptor (size, MD5 etag, offsets), decoded,
    and committed with :func:`danube_pipeline.lake.iceberg.commit_object`, which is told the first
    completed descriptor's start offset: when retention deleted the descriptors right above
    the table's committed end offset before their objects reached the table (they had
    expired), the table resumes at the first descriptor left instead of reporting a gap.

    Per object (:mod:`danube_pipeline.lake.iceberg.commit`): the table is created from the first
    writer schema of its records (``_payload`` when none has a schema), evolved in place for
    newer versions (:mod:`danube_pipeline.lake.iceberg.evolution`), and every record decoded with
    the schema it was written with, in any of the registry's formats. A record that cannot be a
    row (unknown schema id, corrupt payload, a value that does not fit, no schema on a table
    with one, a version that needs ``schema_rewrite``) goes to the dead-letter table
    ``{topic}__dlq`` (:mod:`danube_pipeline.lake.iceberg.dead_letter`) and its offset is committed
    all the same: bad data never stops tiering.

    A partition ``{topic}-part-{i}`` of a partitioned topic (``docs/etcd-layout.md`` §3.1,
    :func:`danube_pipeline.partitions.partition_of`) appends to the partitioned topic's table,
    with ``_partition = i`` and its own committed end offset
    (``danube.committed-end-offset.part-{i}``; :mod:`danube_pipeline.lake.iceberg.append`).

    Args:
        topic: the topic whose objects to append.
        store: the connected metadata store (descriptors).
        objects: the object store holding the segment objects.
        catalog: the shared Iceberg catalog.
        registry: the schema registry (``SchemaRegistry``).
        parse_schema: parses a registered schema's text (:data:`SchemaParser`); defaults to
            :func:`default_schema_parser`.

    Returns:
        A :class:`TableReport`.

    Raises:
        OffsetRangeError: the descriptors or the table leave a gap.
        CorruptRecordError: an object does not match its descriptor or fails decoding.
        MetadataStoreError: etcd failed.
        InvalidNameError: a table named like the dead-letter table exists and is not one.
    """
    parse = parse_schema or default_schema_parser()
    part = await partition_of(store, topic)
    table_topic = part.parent if part is not None else topic
    partition = part.index if part is not None else None
    ident = iceberg.table_identifier(table_topic)
    report = TableReport(table=".".join(ident), partition=partition)
    descriptors, _ = await read_descriptors(store, topic)
    completed = [d for d in descriptors if d.completed]
    ranges = await read_unavailable_ranges(store, topic)
    table = catalog.load_table(ident) if catalog.table_exists(ident) else None
    layout = await read_table_layout(store, table_topic)
    if table is not None:
        report.data_files_before = iceberg.data_file_count(table)
        report.layout_changes = _apply_layout(catalog, ident, table, layout)
        table = catalog.load_table(ident)
    committed = iceberg.committed_end_offset(table, partition=partition) if table is not None else None
    cache: dict[tuple[int, int], iceberg.RegisteredWriter] = {}

    for d in completed:
        if committed is not None and d.end_offset <= committed:
            report.objects_skipped += 1
            continue
        path = segment_object_path(topic, d.object_id)
        data = objects.get_bytes(path)
        where = f"{topic.path}/{d.object_id}"
        if len(data) != d.size:  # d.size: the descriptor's recorded size in bytes (§5.1)
            raise CorruptRecordError(where, len(data), f"object is {len(data)} bytes, descriptor says {d.size}")
        if d.etag and hashlib.md5(data).hexdigest() != d.etag:
            raise CorruptRecordError(where, 0, f"MD5 does not match the descriptor's etag {d.etag}")
        decoded = decode_segment_columns(data, where=where)
        records = decoded.records
        if not records or records[0].offset != d.start_offset or records[-1].offset != d.end_offset:
            raise OffsetRangeError(d.start_offset, records[0].offset if records else -1, where)
        payload_table = table is not None and iceberg.PAYLOAD_COLUMN in {f.name for f in table.schema().fields}
        writers = {} if payload_table else await _writers_for(records, registry, parse, cache)
        recorded = None
        ids = iceberg.recorded_schema(table) if table is not None and not payload_table else None
        if ids is not None and ids not in writers:
            if ids not in cache:
                cache[ids] = await _writer_for(ids, registry, parse)
            recorded = cache[ids]
        result = iceberg.commit_object(
            catalog,
            table_topic,
            table,
            records,
            writers,
            d.object_id,
            topic=topic.path,
            recorded=recorded,
            first_offset=_resume_offset(completed, d, committed, ranges),
            partition=partition,
            layout=layout,
        )
        table = result.table
        committed = result.append.committed_end_offset
        report.schema_changes += [str(c) for c in result.schema_changes]
        if result.dead_letters_appended:
            report.dead_letter_records += result.dead_letters_appended
            report.dead_letter_table = ".".join(iceberg.dead_letter_identifier(table_topic))
        if result.append.snapshot_id is not None:
            report.objects_appended += 1
            report.rows_appended += result.append.rows_appended
            report.snapshots.append(result.append.snapshot_id)
            report.bytes_read += d.size
            if report.first_offset is None:
                report.first_offset = d.start_offset
            report.last_offset = d.end_offset
        else:
            report.objects_skipped += 1
        for sid, _ in writers:
            if sid not in report.schema_ids:
                report.schema_ids.append(sid)
        del data, decoded, records

    if table is not None:
        table.refresh()
        snapshot = table.current_snapshot()
        report.snapshot_id = snapshot.snapshot_id if snapshot else None
        report.committed_end_offset = iceberg.committed_end_offset(table, partition=partition)
        report.row_count = iceberg.snapshot_row_count(table)
        report.data_files = iceberg.data_file_count(table)
        report.partition_spec = describe_spec(table)
    return report


def _apply_layout(catalog: Catalog, ident: tuple[str, str], table: Table, layout: TableLayout) -> list[str]:
    """:func:`~danube_pipeline.lake.iceberg.layout.apply_layout`, retried on a concurrent commit
    (another writer appended meanwhile) with the table reloaded, up to 5 times."""
    for attempt in range(5):
        try:
            return apply_layout(table, layout)
        except CommitFailedException:
            if attempt == 4:
                raise
            table = catalog.load_table(ident)
    return []


def _resume_offset(
    completed: Sequence[ObjectDescriptor], d: ObjectDescriptor, committed: int | None, ranges: Sequence[UnavailableRange]
) -> int:
    """Where the table may resume for object ``d``: its own start when the offsets between the
    table's committed end and it were never handed out or were abandoned (§5.5), else the first
    completed descriptor's start (offsets below it expired)."""
    after = 0 if committed is None else committed + 1
    if d.start_offset > after and passable(ranges, after, d.start_offset - 1):
        return d.start_offset
    return completed[0].start_offset


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


# --------------------------------------------------------------------------- checks


def completed_descriptors(descriptors: Sequence[ObjectDescriptor]) -> list[ObjectDescriptor]:
    """The completed descriptors, in offset order.

    Args:
        descriptors: a topic's object descriptors (completed or not).

    Returns:
        Those with ``completed=true``, sorted by ``start_offset``.
    """
    return sorted((d for d in descriptors if d.completed), key=lambda d: d.start_offset)


@dataclass(frozen=True, slots=True)
class DescriptorGap:
    """A completed descriptor that does not start right after the one before it.

    Attributes:
        object_id: the descriptor's object, ``data-{start}-{end}.dnb1``.
        expected_start_offset: the previous completed descriptor's end offset + 1.
        start_offset: where the descriptor starts instead (lower: overlap; higher: gap).
    """

    object_id: str
    expected_start_offset: int
    start_offset: int


def descriptor_gaps(descriptors: Sequence[ObjectDescriptor]) -> list[DescriptorGap]:
    """Where the completed descriptors are not contiguous (``docs/etcd-layout.md`` §5.1).

    Args:
        descriptors: a topic's object descriptors (incomplete ones are ignored).

    Returns:
        One :class:`DescriptorGap` per completed descriptor whose start offset is not the
        previous completed descriptor's end offset + 1; empty when they are contiguous.
    """
    done = completed_descriptors(descriptors)
    return [
        DescriptorGap(d.object_id, prev.end_offset + 1, d.start_offset)
        for prev, d in zip(done, done[1:])
        if d.start_offset != prev.end_offset + 1
    ]


def descriptor_record_count(descriptors: Sequence[ObjectDescriptor], *, from_offset: int | None = None) -> int:
    """Records the completed descriptors cover, ``end_offset - start_offset + 1`` each, counting
    only offsets at or above ``from_offset`` when it is given.

    Args:
        descriptors: a topic's object descriptors (incomplete ones are ignored).
        from_offset: the first offset to count (e.g. where retention left the table), or
            ``None`` for every offset.

    Returns:
        The record count.
    """
    return sum(
        max(0, d.end_offset - max(d.start_offset, from_offset if from_offset is not None else d.start_offset) + 1)
        for d in completed_descriptors(descriptors)
    )


@dataclass(frozen=True, slots=True)
class ObjectMismatch:
    """A completed descriptor whose object is missing or not the size it records.

    Attributes:
        object_id: ``data-{start}-{end}.dnb1``.
        recorded_size_bytes: the size the descriptor records.
        stored_size_bytes: the object's size in the store, ``None`` when it is missing.
    """

    object_id: str
    recorded_size_bytes: int
    stored_size_bytes: int | None


def object_mismatches(
    topic: TopicName, descriptors: Sequence[ObjectDescriptor], objects: ObjectStore
) -> list[ObjectMismatch]:
    """Completed descriptors whose object is missing or has another size than recorded.

    Incomplete descriptors are ignored: their object may legitimately not be written yet.

    Args:
        topic: the topic the descriptors belong to.
        descriptors: its object descriptors.
        objects: the object store the objects were written to.

    Returns:
        One :class:`ObjectMismatch` per missing or resized object, in offset order.

    Raises:
        OSError: the object store failed.
    """
    found: list[ObjectMismatch] = []
    for d in completed_descriptors(descriptors):
        info = objects.info(segment_object_path(topic, d.object_id))
        stored = info.size_bytes if info is not None else None
        if stored != d.size:
            found.append(ObjectMismatch(d.object_id, d.size, stored))
    return found
