"""The retention run: :func:`apply_retention` applies the retained start to the table's rows,
its snapshots and orphan files, the object descriptors, the segment objects and the broker's
WAL, in that order, and reports what each step did (:class:`RetentionReport`)."""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable
from urllib.parse import unquote, urlparse

from pyiceberg.catalog import Catalog
from pyiceberg.table import Table

from danube_pipeline import faults
from danube_pipeline.format.records import OBJECT_SUFFIX
from danube_pipeline.lake import iceberg
from danube_pipeline.lake.retention.retained_start import (
    expired_descriptors,
    read_policy,
    retained_start_offset,
    table_lookup,
)
from danube_pipeline.lake.retention.expiry import finish_recorded_expiry, record_expiring_files
from danube_pipeline.lake.spark.procedures import (
    delete_rows_below,
    expire_snapshots_keeping_files,
    remove_orphan_files,
)
from danube_pipeline.lake.tiering import completed_descriptors
from danube_pipeline.lake.tiering.incarnation import current_table, topic_incarnation
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.descriptors import read_descriptors
from danube_pipeline.names import TopicName
from danube_pipeline.partitions import partition_of
from danube_pipeline.storage.objectstore import ObjectStore

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from danube_pipeline.metadata.store import MetadataStore

__all__ = [
    "ORPHAN_MIN_AGE_MS",
    "STEPS",
    "LocalRetentionResult",
    "RetentionAdmin",
    "RetentionReport",
    "apply_retention",
]

log = logging.getLogger(__name__)


STEPS = ("rows", "snapshots", "orphans", "descriptors", "objects", "wal")
"""The steps of :func:`apply_retention`, in order; ``after_step`` receives these names."""

ORPHAN_MIN_AGE_MS = 3 * 24 * 3600 * 1000
"""Default age (3 days, Iceberg's own default) below which a file unknown to the table is not
taken for an orphan; Iceberg refuses less than 24 hours."""

_OBJECT_NAME = re.compile(r"^data-(\d+)-(\d+)" + re.escape(OBJECT_SUFFIX) + "$")


@runtime_checkable
class LocalRetentionResult(Protocol):
    """What the broker answers to ``ApplyLocalRetention``.

    Attributes:
        deleted_segments: sealed WAL segments the broker deleted.
        first_local_offset: the WAL's first offset afterwards.
        wal_bytes: the WAL's size on disk afterwards, bytes.
    """

    deleted_segments: int
    first_local_offset: int
    wal_bytes: int


@runtime_checkable
class RetentionAdmin(Protocol):
    """The part of the broker admin API retention uses (``DanubeClient.admin``)."""

    async def apply_local_retention(self, topic: str) -> LocalRetentionResult: ...


class _LazySpark:
    """A Spark session made on first use, so a run with no table work starts no JVM."""

    def __init__(self, source: SparkSession | Callable[[], SparkSession]) -> None:
        self._source = source
        self._session: SparkSession | None = None

    def get(self) -> SparkSession:
        if self._session is None:
            from pyspark.sql import SparkSession

            source = self._source
            self._session = source if isinstance(source, SparkSession) else source()
        return self._session


@dataclass
class RetentionReport:
    """What :func:`apply_retention` did.

    Attributes:
        topic: ``/ns/topic``.
        retention_ms: the policy's time limit in milliseconds (0: none).
        retention_bytes: the policy's size limit in bytes (0: none).
        policy_error: why the stored namespace policy was not used (it did not parse; the
            defaults, without limits, applied), ``None`` when it was or when there is none.
        now_ms: the time the cutoff is counted from, ms since the Unix epoch.
        cutoff_ms: ``now_ms - retention_ms``: records published before it expired; ``None``
            without a time limit.
        retained_start: the first offset kept
            (:func:`~danube_pipeline.lake.retention.retained_start.retained_start_offset`);
            ``None`` without limits or without completed descriptors.
        table: ``ns.topic`` when the topic has a table (the partitioned topic's, for a
            partition), else ``None``.
        rows_deleted: rows deleted from the table by this run.
        day: the UTC day whose table partitions step 1 was limited to, ``None`` for every day.
        data_files_before: live data files of the table before this run, ``None`` without a table.
        data_files_after: live data files of the table after it, ``None`` without a table.
        snapshot_id: the table's current snapshot after this run, ``None`` without one.
        snapshots_expired: table snapshots this run expired.
        data_files_deleted: data and delete files the snapshot expiry deleted (this run's, and
            what a run that died inside its expiry recorded:
            :mod:`~danube_pipeline.lake.retention.expiry`).
        orphan_files_removed: files ``remove_orphan_files`` deleted.
        descriptors_deleted: object descriptors this run deleted from etcd.
        objects_deleted: segment objects this run deleted from object storage.
        deleted_object_ids: their names, ``data-{start}-{end}.dnb1``, in offset order.
        first_object_offset: the first remaining completed descriptor's start offset
            afterwards; ``None`` when there is none.
        earliest_offset: the earliest offset retained afterwards:
            ``max(retained_start, first_object_offset)``; it is the newest descriptor's end
            offset + 1 when every record expired (that descriptor is kept, its rows are not).
            ``None`` when the topic has no completed descriptor.
        wal_step: ``"applied"`` or ``"skipped"`` (the admin API has no
            ``apply_local_retention`` yet).
        wal_deleted_segments, wal_first_local_offset, wal_bytes: the broker's answer, ``None``
            when skipped.
    """

    topic: str
    retention_ms: int = 0
    retention_bytes: int = 0
    policy_error: str | None = None
    now_ms: int = 0
    cutoff_ms: int | None = None
    retained_start: int | None = None
    table: str | None = None
    rows_deleted: int = 0
    day: dt.date | None = None
    data_files_before: int | None = None
    data_files_after: int | None = None
    snapshot_id: int | None = None
    snapshots_expired: int = 0
    data_files_deleted: int = 0
    orphan_files_removed: int = 0
    descriptors_deleted: int = 0
    objects_deleted: int = 0
    deleted_object_ids: list[str] = field(default_factory=list)
    first_object_offset: int | None = None
    earliest_offset: int | None = None
    wal_step: str = "skipped"
    wal_deleted_segments: int | None = None
    wal_first_local_offset: int | None = None
    wal_bytes: int | None = None


def _object_range(name: str) -> tuple[int, int] | None:
    m = _OBJECT_NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _may_hold_orphans(location: str, older_than_ms: int) -> bool:
    """Whether the table's location can hold a file old enough for ``remove_orphan_files``.

    Only answered for local (``file:``) locations, by looking for any file last modified
    before ``older_than_ms``; other stores answer ``True`` (Spark lists them).
    """
    parsed = urlparse(location)
    if parsed.scheme not in ("", "file"):
        return True
    root = unquote(parsed.path) if parsed.scheme else location
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                if os.stat(os.path.join(directory, name)).st_mtime * 1000 < older_than_ms:
                    return True
            except FileNotFoundError:
                continue
    return False


def _count_rows_below(table: Table, offset: int, partition: int | None, day: dt.date | None = None) -> int:
    where = f"_offset < {int(offset)}"
    if partition is not None:
        where = f"{iceberg.PARTITION_COLUMN} = {int(partition)} AND {where}"
    if day is not None:
        start = dt.datetime.combine(day, dt.time(), tzinfo=dt.UTC)
        end = start + dt.timedelta(days=1)
        where = f"_publish_time >= '{start.isoformat()}' AND _publish_time < '{end.isoformat()}' AND {where}"
    scan = table.scan(row_filter=where, selected_fields=("_offset",))
    return sum(batch.num_rows for batch in scan.to_arrow_batch_reader())


async def apply_retention(
    topic: TopicName,
    *,
    store: MetadataStore,
    objects: ObjectStore,
    catalog: Catalog,
    spark: SparkSession | Callable[[], SparkSession],
    admin: object,
    now_ms: int | None = None,
    after_step: Callable[[str], None] | None = None,
    catalog_name: str | None = None,
    orphan_min_age_ms: int = ORPHAN_MIN_AGE_MS,
    day: dt.date | None = None,
) -> RetentionReport:
    """Apply the namespace's retention to the topic (:mod:`danube_pipeline.lake.retention` has the steps,
    what is kept, and why a crash after any step is completed by the next run).

    Args:
        topic: the topic.
        store: the connected metadata store (policy, descriptors).
        objects: the object store holding the topic's segment objects.
        catalog: the shared Iceberg catalog.
        spark: a Spark session on the same catalog, or a function making one; it is called
            only when a table step has work (a run with nothing to delete starts no Spark).
        admin: the broker admin API (``DanubeClient.admin``); its ``apply_local_retention``
            (:class:`RetentionAdmin`) is called when it has one.
        now_ms: the time the cutoff counts back from, ms since the Unix epoch; default the
            wall clock. Snapshot and orphan ages always count from the wall clock (they are
            about files, not records).
        after_step: called with each step's name (:data:`STEPS`) once the step is done.
        catalog_name: the Spark catalog name; default ``catalog.name`` (pyiceberg and Spark
            must use the same name to see the same tables).
        orphan_min_age_ms: files unknown to the table younger than this are not orphans;
            at least 24 hours (Iceberg refuses less).
        day: limit step 1 to the rows published on this UTC day, so only that day's table
            partitions are read and rewritten (the ``retention`` asset's topic × day
            partitions;
            :func:`~danube_pipeline.lake.retention.retained_start.days_with_expired_rows` says
            which days have work); the other steps are the topic's, as without it. ``None``:
            every day.

    Returns:
        A :class:`RetentionReport`.

    Raises:
        FileNotFoundError, CorruptRecordError: an object needed to find the retained start
            is missing or corrupt (nothing is deleted then).
        MetadataStoreError: etcd failed.
        RemoteError: the broker failed ``apply_local_retention``.
        pyspark.errors.AnalysisException, Py4JJavaError: a Spark statement failed.
    """
    wall_ms = int(time.time() * 1000)
    now = wall_ms if now_ms is None else now_ms
    sessions = _LazySpark(spark)
    spark_catalog = catalog_name or catalog.name

    def done(step: str) -> None:
        if after_step is not None:
            after_step(step)

    policy, policy_error = await read_policy(store, topic.namespace)
    report = RetentionReport(
        topic=topic.path,
        retention_ms=policy.retention_ms,
        retention_bytes=policy.retention_bytes,
        policy_error=policy_error,
        now_ms=now,
    )
    limited = policy.retention_ms > 0 or policy.retention_bytes > 0
    if policy.retention_ms > 0:
        report.cutoff_ms = now - policy.retention_ms
    descriptors, _ = await read_descriptors(store, topic)
    completed = completed_descriptors(descriptors)
    part = await partition_of(store, topic)
    table_topic = part.parent if part is not None else topic
    partition = part.index if part is not None else None
    retained = retained_start_offset(
        topic, completed, objects, policy, now, from_table=table_lookup(catalog, table_topic, partition)
    )
    report.retained_start = retained
    log.info(
        "%s: retention %s ms / %s bytes, retained start %s",
        topic.path,
        policy.retention_ms,
        policy.retention_bytes,
        retained,
    )

    ident = iceberg.table_identifier(table_topic)
    # a table of an earlier incarnation of the topic is retired first, never cut by this
    # incarnation's retained start (lake/tiering/incarnation.py)
    table = current_table(
        catalog, table_topic, await topic_incarnation(store, table_topic), descriptors=descriptors, partition=partition
    )
    if table is not None:
        report.table = ".".join(ident)
        report.data_files_before = iceberg.data_file_count(table)
    report.day = day

    # what a run that died inside its snapshot expiry left: the files it recorded
    if table is not None:
        report.data_files_deleted += finish_recorded_expiry(table, topic).deleted_data_files

    # 1. rows below the retained start
    if table is not None and retained is not None:
        below = _count_rows_below(table, retained, partition, day)
        if below:
            delete_rows_below(
                sessions.get(), table_topic, retained, catalog_name=spark_catalog, partition=partition, day=day
            )
            report.rows_deleted = below
            log.info("%s: deleted %d rows below offset %d", topic.path, below, retained)
    done("rows")

    # 2. snapshots (and with them the files of deleted rows)
    if table is not None and limited:
        table.refresh()
        current = table.current_snapshot()
        before = {s.snapshot_id for s in table.snapshots()}
        expirable = [
            s
            for s in table.snapshots()
            if (current is None or s.snapshot_id != current.snapshot_id) and s.timestamp_ms < wall_ms
        ]
        if expirable:
            # record, commit, delete: a run that dies after the commit leaves the record,
            # and the next run's finish_recorded_expiry (above) deletes the files
            record_expiring_files(table, topic, expirable)
            expire_snapshots_keeping_files(
                sessions.get(), table_topic, older_than_ms=wall_ms, retain_last=1, catalog_name=spark_catalog
            )
            faults.point(faults.RETENTION_AFTER_EXPIRE_COMMIT)
            finished = finish_recorded_expiry(table, topic)
            report.data_files_deleted += finished.deleted_data_files
            report.snapshots_expired = len(before - {s.snapshot_id for s in table.snapshots()})
            log.info("%s: expired %d snapshots", topic.path, report.snapshots_expired)
    done("snapshots")

    # 3. files no commit references
    if table is not None and limited:
        older_than = wall_ms - orphan_min_age_ms
        if _may_hold_orphans(table.location(), older_than):
            removed = remove_orphan_files(sessions.get(), table_topic, older_than_ms=older_than, catalog_name=spark_catalog)
            report.orphan_files_removed = len(removed)
            if removed:
                log.info("%s: removed %d orphan files", topic.path, len(removed))
    done("orphans")

    # 4. descriptors, oldest first, never the newest
    for d in expired_descriptors(completed, retained):
        if await store.delete(keys.object_descriptor(topic, d.start_offset)):
            report.descriptors_deleted += 1
    done("descriptors")

    # 5. objects below the first remaining descriptor
    descriptors, _ = await read_descriptors(store, topic)
    remaining = completed_descriptors(descriptors)
    if descriptors:
        first_start = min(d.start_offset for d in descriptors)
        prefix = f"topics/{topic.namespace}/{topic.topic}/"
        doomed: list[tuple[int, str]] = []
        for path in objects.list(prefix):
            name = path[len(prefix) :] if path.startswith(prefix) else ""
            bounds = _object_range(name) if "/" not in name else None
            if bounds is not None and bounds[1] < first_start:
                doomed.append((bounds[0], path))
        for _, path in sorted(doomed):
            objects.delete(path)
            report.objects_deleted += 1
            report.deleted_object_ids.append(path[len(prefix) :])
    done("objects")

    if remaining:
        report.first_object_offset = remaining[0].start_offset
        report.earliest_offset = max(remaining[0].start_offset, retained if retained is not None else 0)

    # 6. the broker's WAL
    if isinstance(admin, RetentionAdmin):
        result = await admin.apply_local_retention(topic.path)
        report.wal_step = "applied"
        report.wal_deleted_segments = int(result.deleted_segments)
        report.wal_first_local_offset = int(result.first_local_offset)
        report.wal_bytes = int(result.wal_bytes)
    else:
        log.info("%s: the admin API has no apply_local_retention yet; WAL step skipped", topic.path)
        report.wal_step = "skipped"
    done("wal")
    if table is not None:
        table.refresh()
        report.data_files_after = iceberg.data_file_count(table)
        current = table.current_snapshot()
        report.snapshot_id = current.snapshot_id if current is not None else None
    return report
