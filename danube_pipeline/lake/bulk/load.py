"""The bulk load itself: plan, schemas, decode, publish, retried when tiering commits meanwhile.

:func:`bulk_load` runs the steps of :mod:`danube_pipeline.lake.bulk` in order, on the driver,
and starts over from the plan when another writer committed to the table while it ran.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException

from danube_pipeline.lake import iceberg
from danube_pipeline.lake.bulk.plan import BulkLoadConflictError, BulkLoadError, plan_objects
from danube_pipeline.lake.bulk.publish import ensure_wap, write_and_publish
from danube_pipeline.lake.bulk.schemas import prepare_table, raw_errors
from danube_pipeline.lake.bulk.tasks import DecodeTask, objects_frame, schema_keys_job
from danube_pipeline.lake.iceberg.layout import apply_layout, read_table_layout
from danube_pipeline.lake.iceberg.schema import PAYLOAD_COLUMN
from danube_pipeline.lake.schema_lookup import SchemaLookup, SchemaParser, default_schema_parser, registered_writer
from danube_pipeline.lake.spark.procedures import spark_table_name
from danube_pipeline.lake.tiering.incarnation import current_table, topic_incarnation
from danube_pipeline.metadata.descriptors import read_descriptors, read_unavailable_ranges
from danube_pipeline.names import TopicName, validate_part
from danube_pipeline.partitions import partition_of
from danube_pipeline.storage.objectstore import ObjectStore

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from danube_pipeline.metadata.store import MetadataStore

__all__ = ["BulkLoadReport", "bulk_load"]

log = logging.getLogger(__name__)


@dataclass
class BulkLoadReport:
    """What :func:`bulk_load` did.

    Attributes:
        topic: ``/ns/topic`` whose objects were read.
        table: ``ns.table`` written to.
        partition: the partition index when ``topic`` is a partition of a partitioned topic.
        objects_read: objects decoded by this load.
        bytes_read: bytes of those objects.
        rows_appended: rows appended to the table.
        dead_letter_table: ``ns.table__dlq`` when the load dead-lettered records, else ``None``.
        dead_letter_records: records appended to the dead-letter table.
        first_offset: the first offset loaded, ``None`` when nothing was pending.
        last_offset: the last offset loaded, ``None`` when nothing was pending.
        committed_end_offset_before: the table's committed end offset before.
        committed_end_offset: the table's committed end offset afterwards.
        snapshot_id: the snapshot the load published, ``None`` when nothing was pending.
        data_files_before: live data files of the table before (0 without a table).
        data_files_after: live data files afterwards.
        row_count: rows in the table afterwards (snapshot summary), ``None`` when unknown.
        created: whether the load created the table.
        schema_changes: in-place schema changes made, as text.
        attempts: plans run (more than 1 after losing a commit race).
    """

    topic: str
    table: str
    partition: int | None = None
    objects_read: int = 0
    bytes_read: int = 0
    rows_appended: int = 0
    dead_letter_table: str | None = None
    dead_letter_records: int = 0
    first_offset: int | None = None
    last_offset: int | None = None
    committed_end_offset_before: int | None = None
    committed_end_offset: int | None = None
    snapshot_id: int | None = None
    data_files_before: int = 0
    data_files_after: int = 0
    row_count: int | None = None
    created: bool = False
    schema_changes: list[str] = field(default_factory=list)
    attempts: int = 0


def _table_topic(source: TopicName, target: str | None) -> TopicName:
    if not target:
        return source
    if target.startswith("/"):
        return TopicName.parse(target)
    return TopicName(source.namespace, validate_part("topic", target))


async def bulk_load(
    spark: SparkSession,
    catalog: Catalog,
    topic: TopicName,
    *,
    store: MetadataStore,
    objects: ObjectStore,
    registry: SchemaLookup,
    target: str | None = None,
    from_offset: int | None = None,
    replay: bool = False,
    catalog_name: str | None = None,
    parse_schema: SchemaParser | None = None,
    max_attempts: int = 3,
) -> BulkLoadReport:
    """Load ``topic``'s segment objects into its table (or ``target``) with Spark, exactly once
    (module docstring).

    Args:
        spark: a session from :func:`danube_pipeline.lake.spark.session.build_spark_session` on ``catalog``'s
            database (any master: ``local[*]`` or a standalone cluster whose workers reach the
            object store).
        catalog: the same catalog, through pyiceberg.
        topic: the topic whose objects to read (for a partition ``{t}-part-{i}``, its rows get
            ``_partition = i`` and the table is ``t``'s, as in tiering).
        store: the connected metadata store (descriptors, §5.1; unavailable ranges, §5.5;
            table layout, §3.9).
        objects: the object store holding the segment objects. Its URL and storage options
            are shipped to the Spark tasks, which open it themselves.
        registry: the schema registry (``SchemaRegistry.get_by_id``).
        target: the table to write: a name in the topic's namespace (``flights_v2``) or
            ``/ns/name``; default the topic's own table. A new table is created with the topic's
            layout (§3.9).
        from_offset: first offset to load; default the first retained object's start. Offsets
            at or below the target's committed end offset are never loaded again.
        replay: a replay into a table other than the topic's own (``target`` must name one):
            every retained object from ``from_offset`` on is read again.
        catalog_name: the Spark catalog name of ``catalog``; default ``settings.catalog_name()``.
        parse_schema: parses a registered schema's text; default
            :func:`danube_pipeline.lake.schema_lookup.default_schema_parser`. Spark tasks call it too, so
            it must pickle (a module-level function).
        max_attempts: plans run when tiering commits to the table meanwhile.

    Returns:
        A :class:`BulkLoadReport`.

    Raises:
        BulkLoadError: ``replay`` without a ``target`` other than the topic's table, or a bad
            ``from_offset``.
        BulkLoadConflictError: another writer kept committing to the table (every attempt).
        OffsetRangeError: the objects leave a gap, or do not continue the table.
        CorruptRecordError: an object does not match its descriptor or fails decoding (raised
            by a Spark task: it reaches the caller inside a ``PythonException``).
        MetadataStoreError: etcd failed.
        InvalidNameError: ``target`` is not a valid name, or a table named like the dead-letter
            table exists and is not one.
    """
    part = await partition_of(store, topic)
    source_table = part.parent if part is not None else topic
    partition = part.index if part is not None else None
    table_topic = _table_topic(source_table, target)
    if replay and table_topic == source_table:
        raise BulkLoadError(topic.path, "replay needs a target table other than the topic's own")
    descriptors, _ = await read_descriptors(store, topic)
    ranges = await read_unavailable_ranges(store, topic)
    layout = await read_table_layout(store, source_table)
    parse = parse_schema or default_schema_parser()
    ident = iceberg.table_identifier(table_topic)
    name = spark_table_name(table_topic, catalog_name)
    report = BulkLoadReport(topic=topic.path, table=".".join(ident), partition=partition)
    # The topic's own table must hold its current incarnation (an earlier one's is retired).
    incarnation = await topic_incarnation(store, source_table) if table_topic == source_table else None

    for attempt in range(1, max_attempts + 1):
        report.attempts = attempt
        table = current_table(catalog, table_topic, incarnation, descriptors=descriptors, partition=partition)
        if table is not None:
            if attempt == 1:
                report.data_files_before = iceberg.data_file_count(table)
            apply_layout(table, layout)
            table = catalog.load_table(ident)
        committed = iceberg.committed_end_offset(table, partition=partition) if table is not None else None
        if attempt == 1:
            report.committed_end_offset_before = committed
        start, chosen = plan_objects(topic, descriptors, ranges, committed=committed, from_offset=from_offset)
        if start is None or not chosen:
            report.committed_end_offset = committed
            break
        task = DecodeTask(topic.path, objects.root_url, objects.storage_options, start, partition=partition)
        frame = objects_frame(spark, chosen)
        keys_job = frame.mapInArrow(schema_keys_job(task), "object_id string, schema_id long, schema_version int")
        key_rows = await asyncio.to_thread(keys_job.collect)
        keys_by_object: dict[str, list[tuple[int, int]]] = {}
        for r in key_rows:
            if int(r["schema_id"]) != 0:
                keys_by_object.setdefault(str(r["object_id"]), []).append((int(r["schema_id"]), int(r["schema_version"])))
        keys = sorted({k for ks in keys_by_object.values() for k in ks})
        payload_table = table is not None and PAYLOAD_COLUMN in {f.name for f in table.schema().fields}
        writers = {} if payload_table else {k: await registered_writer(k, registry, parse) for k in keys}
        recorded = None
        ids = iceberg.recorded_schema(table) if table is not None and not payload_table else None
        if ids is not None and ids not in writers:
            recorded = await registered_writer(ids, registry, parse)
        elif ids is not None:
            recorded = writers[ids]
        prepared = prepare_table(
            catalog, table_topic, table, writers, recorded,
            partitioned=partition is not None, layout=layout, where=f"{topic.path} bulk load",
        )
        report.created = report.created or prepared.created
        report.schema_changes += prepared.changes
        table = ensure_wap(prepared.table)
        if iceberg.committed_end_offset(table, partition=partition) != committed:
            continue  # tiering committed while the table was prepared: plan again
        task = DecodeTask(
            topic.path, objects.root_url, objects.storage_options, start, table.schema(), prepared.recipes,
            parse_schema, partition,
            raw_errors(keys_by_object, [o.object_id for o in chosen], writers, prepared.bound, recorded),
            layout.raw_payload,
        )
        current = table.current_snapshot()
        base = current.snapshot_id if current is not None else None
        try:
            outcome = await asyncio.to_thread(
                write_and_publish, spark, catalog, table, table_topic, frame, task, chosen, name, base, partition
            )
        except CommitFailedException as exc:
            log.warning("%s: bulk load lost the commit race (attempt %d): %s", topic.path, attempt, exc)
            continue
        report.objects_read += len(chosen)
        report.bytes_read += sum(o.size_bytes for o in chosen)
        report.rows_appended = outcome.rows
        report.dead_letter_records = outcome.dead_letters
        if outcome.dead_letters:
            report.dead_letter_table = ".".join(iceberg.dead_letter_identifier(table_topic))
        report.first_offset, report.last_offset = start, chosen[-1].end_offset
        report.snapshot_id = outcome.snapshot_id
        break
    else:
        raise BulkLoadConflictError(topic.path, f"another writer committed to {report.table} during {max_attempts} attempts")

    if catalog.table_exists(ident):
        final = catalog.load_table(ident)
        report.committed_end_offset = iceberg.committed_end_offset(final, partition=partition)
        report.data_files_after = iceberg.data_file_count(final)
        report.row_count = iceberg.snapshot_row_count(final)
    return report
