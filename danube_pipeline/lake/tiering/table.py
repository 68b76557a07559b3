"""Completed segment objects into the topic's Iceberg table, one snapshot per object.

:func:`commit_objects_to_table` appends every completed object not yet in the table, exactly
once: each snapshot's summary records the last offset it holds, and a commit succeeds only if
the table's current snapshot is still the one the writer read (the catalog's atomic swap of the
metadata pointer; Iceberg spec, "Optimistic Concurrency"). The table evolves in place with the
topic's schema versions, and records that cannot be rows go to its dead-letter table
(:mod:`danube_pipeline.lake.iceberg.commit`). A table that holds another incarnation of the
topic (it was deleted and created again) is renamed out of the way first
(:mod:`.incarnation`).
"""

from __future__ import annotations

import logging

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import Table

from danube_pipeline.errors import OffsetRangeError
from danube_pipeline.lake import iceberg
from danube_pipeline.lake.iceberg.layout import apply_layout, describe_spec, read_table_layout
from danube_pipeline.lake.iceberg.upkeep import UpkeepPolicy, table_upkeep
from danube_pipeline.lake.object_lifecycle import retire_committed_objects
from danube_pipeline.lake.schema_lookup import (
    SchemaLookup,
    SchemaParser,
    default_schema_parser,
    registered_writer,
    registered_writers,
)
from danube_pipeline.lake.segment_objects import read_segment_object
from danube_pipeline.lake.tiering.incarnation import current_table, topic_incarnation
from danube_pipeline.metadata.descriptors import passable, read_descriptors, read_unavailable_ranges
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.values import ObjectDescriptor, TableCommit, TableLayout, UnavailableRange
from danube_pipeline.names import TopicName
from danube_pipeline.partitions import partition_of
from danube_pipeline.storage.objectstore import ObjectStore, segment_object_path

if TYPE_CHECKING:
    from danube_pipeline.metadata.store import MetadataStore

__all__ = ["TableReport", "commit_objects_to_table"]

log = logging.getLogger(__name__)


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
        oldest_publish_time_us: the broker's publish time of the oldest record this call
            appended, microseconds since the Unix epoch; ``None`` when it appended none.
        committed_at_ms: when the table's current snapshot afterwards was committed, ms since
            the Unix epoch; ``None`` without a table.
        objects_deleted: segment objects this call deleted under the ``after-commit`` object
            lifecycle (:mod:`danube_pipeline.lake.object_lifecycle`).
        object_bytes_deleted: their sizes, bytes.
        snapshots_expired: snapshots the table's upkeep expired after this call's commits
            (:mod:`danube_pipeline.lake.iceberg.upkeep`).
        snapshot_count: snapshots the table keeps afterwards.
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
    oldest_publish_time_us: int | None = None
    committed_at_ms: int | None = None
    objects_deleted: int = 0
    object_bytes_deleted: int = 0
    snapshots_expired: int = 0
    snapshot_count: int = 0

    @property
    def publish_to_queryable_s(self) -> float | None:
        """Seconds from the publish of the oldest record this call appended to the commit of
        the table's snapshot afterwards: the longest a record of this call waited to become
        queryable. ``None`` when the call appended nothing."""
        if self.oldest_publish_time_us is None or self.committed_at_ms is None:
            return None
        return max(0.0, self.committed_at_ms / 1000 - self.oldest_publish_time_us / 1_000_000)


async def commit_objects_to_table(
    topic: TopicName,
    *,
    store: MetadataStore,
    objects: ObjectStore,
    catalog: Catalog,
    registry: SchemaLookup,
    parse_schema: SchemaParser | None = None,
    upkeep: UpkeepPolicy | None = None,
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

    The table must hold the topic's current incarnation (:mod:`.incarnation`): one that holds an
    earlier one (the topic was deleted and created again, starting at offset 0) is renamed to
    ``{topic}__incarnation_{id}`` with its dead-letter table, kept for readers, and a new table
    is started (logged at WARNING); a table that records no incarnation is adopted when its
    committed end offset fits the descriptors. When the topic is re-created while its
    descriptors are read, nothing is committed (the next call does it).

    A partition ``{topic}-part-{i}`` of a partitioned topic (``docs/etcd-layout.md`` §3.1,
    :func:`danube_pipeline.partitions.partition_of`) appends to the partitioned topic's table,
    with ``_partition = i`` and its own committed end offset
    (``danube.committed-end-offset.part-{i}``; :mod:`danube_pipeline.lake.iceberg.append`).

    Under the ``after-commit`` object lifecycle (``docs/etcd-layout.md`` §2.1), the objects the
    table then holds are verified in it and deleted, their descriptors marked
    ``object_deleted_at`` (§5.1; :mod:`danube_pipeline.lake.object_lifecycle`). A marked
    descriptor lies at or below the committed end offset, so a later call never reads its
    object.

    Args:
        topic: the topic whose objects to append.
        store: the connected metadata store (descriptors).
        objects: the object store holding the segment objects.
        catalog: the shared Iceberg catalog.
        registry: the schema registry (``SchemaRegistry``).
        parse_schema: parses a registered schema's text (:data:`~danube_pipeline.lake.schema_lookup.SchemaParser`);
            defaults to :func:`~danube_pipeline.lake.schema_lookup.default_schema_parser`.
        upkeep: the table's upkeep after a call that appended (manifest merging, snapshot
            expiry: :func:`~danube_pipeline.lake.iceberg.upkeep.table_upkeep`); its defaults
            when ``None``.

    Returns:
        A :class:`TableReport`.

    Raises:
        OffsetRangeError: the descriptors or the table leave a gap.
        CorruptRecordError: an object does not match its descriptor or fails decoding.
        MetadataStoreError: etcd failed.
        InvalidNameError: a table named like the dead-letter table exists and is not one.
        TableAlreadyExistsError: an older incarnation's table cannot be renamed: its retired
            name is taken.
    """
    parse = parse_schema or default_schema_parser()
    part = await partition_of(store, topic)
    table_topic = part.parent if part is not None else topic
    partition = part.index if part is not None else None
    ident = iceberg.table_identifier(table_topic)
    report = TableReport(table=".".join(ident), partition=partition)
    incarnation = await topic_incarnation(store, table_topic)
    descriptors, _ = await read_descriptors(store, topic)
    if await topic_incarnation(store, table_topic) != incarnation:
        log.warning("%s: the topic was created again while its objects were listed; nothing committed", topic.path)
        return report
    completed = [d for d in descriptors if d.completed]
    ranges = await read_unavailable_ranges(store, topic)
    table = current_table(catalog, table_topic, incarnation, descriptors=descriptors, partition=partition)
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
        where = f"{topic.path}/{d.object_id}"
        # d.size: the descriptor's recorded size in bytes (§5.1)
        decoded = read_segment_object(objects, path, size_bytes=d.size, etag=d.etag, where=where)
        records = decoded.records
        if not records or records[0].offset != d.start_offset or records[-1].offset != d.end_offset:
            raise OffsetRangeError(d.start_offset, records[0].offset if records else -1, where)
        payload_table = table is not None and iceberg.PAYLOAD_COLUMN in {f.name for f in table.schema().fields}
        writers = {} if payload_table else await registered_writers(records, registry, parse, cache)
        recorded = None
        ids = iceberg.recorded_schema(table) if table is not None and not payload_table else None
        if ids is not None and ids not in writers:
            if ids not in cache:
                cache[ids] = await registered_writer(ids, registry, parse)
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
            incarnation=incarnation,
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
            oldest_us = min(r.publish_time_us for r in records)
            if report.oldest_publish_time_us is None or oldest_us < report.oldest_publish_time_us:
                report.oldest_publish_time_us = oldest_us
        else:
            report.objects_skipped += 1
        for sid, _ in writers:
            if sid not in report.schema_ids:
                report.schema_ids.append(sid)
        del decoded, records

    if table is not None:
        table.refresh()
        if report.objects_appended:
            report.snapshots_expired = table_upkeep(table, upkeep).expiry.snapshots_expired
        report.snapshot_count = len(table.metadata.snapshots)
        snapshot = table.current_snapshot()
        report.snapshot_id = snapshot.snapshot_id if snapshot else None
        report.committed_at_ms = snapshot.timestamp_ms if snapshot else None
        report.committed_end_offset = iceberg.committed_end_offset(table, partition=partition)
        report.row_count = iceberg.snapshot_row_count(table)
        report.data_files = iceberg.data_file_count(table)
        report.partition_spec = describe_spec(table)
        if report.committed_end_offset is not None and report.snapshot_id is not None:
            commit = TableCommit(
                table=report.table,
                committed_end_offset=report.committed_end_offset,
                snapshot_id=report.snapshot_id,
                committed_at_ms=report.committed_at_ms or 0,
                incarnation=incarnation,
            )
            await record_table_commit(store, topic, commit)
        retired = await retire_committed_objects(
            topic, store=store, objects=objects, catalog=catalog, table_topic=table_topic, partition=partition,
            committed_end_offset=report.committed_end_offset, layout=layout,
        )  # fmt: skip
        report.objects_deleted = retired.objects_deleted
        report.object_bytes_deleted = retired.bytes_deleted
    return report


async def record_table_commit(store: MetadataStore, topic: TopicName, commit: TableCommit) -> bool:
    """Write ``commit`` to §5.8 unless the key already records this incarnation at the same or
    a later committed end offset (two writers may commit at once; the key only moves forward).
    Each write compares the key's ``mod_revision`` and is read again on a lost compare.

    Returns:
        Whether it was written.

    Raises:
        MetadataStoreError: etcd failed.
    """
    key = keys.table_commit(topic)
    for _ in range(5):
        kv = await store.get(key)
        if kv is not None:
            try:
                stored = TableCommit.from_json(kv.value)
            except ValueError:
                stored = None
            if (
                stored is not None
                and stored.incarnation == commit.incarnation
                and stored.committed_end_offset >= commit.committed_end_offset
            ):
                return False
        guard = {key: kv.mod_revision if kv is not None else 0}
        if await store.compare_and_put_many([(key, commit)], expected_mod_revisions=guard) is not None:
            return True
    return False


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
