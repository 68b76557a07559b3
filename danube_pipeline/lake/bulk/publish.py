"""Dead letters, staged write and publish of a bulk load: steps 3 to 5 of :mod:`danube_pipeline.lake.bulk`.

:func:`write_and_publish` runs the decode job, appends its dead letters to ``{table}__dlq``
first (:func:`~danube_pipeline.lake.iceberg.dead_letter.commit_dead_letters`, as tiering does),
writes the rows with Iceberg's Spark writer as a *staged* snapshot (write-audit-publish) and
publishes it with one pyiceberg commit that also sets the committed end offset, under the
requirement that ``main`` is still the snapshot the load started from.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.table import Table
from pyiceberg.table.update.snapshot import ManageSnapshots

from danube_pipeline.format.records import Record
from danube_pipeline.lake import iceberg
from danube_pipeline.lake.bulk.plan import BulkLoadError, BulkObject
from danube_pipeline.lake.bulk.tasks import (
    ERROR_FIELD,
    PAYLOAD_FIELD,
    DecodeTask,
    decode_rows_job,
    output_schema,
    spark_schema,
)
from danube_pipeline.lake.iceberg.dead_letter import DeadLetter
from danube_pipeline.names import TopicName
from danube_pipeline.storage.table_columns import KEY_COLUMN, KEY_VALUE_FIELD

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["SUMMARY_ENGINE", "WAP_ENABLED_PROPERTY", "PublishedLoad", "ensure_wap", "write_and_publish"]

log = logging.getLogger(__name__)

SUMMARY_ENGINE = "danube.engine"
"""Summary field of a bulk load's snapshot: ``spark``."""
WAP_ENABLED_PROPERTY = "write.wap.enabled"
"""Iceberg table property that lets a Spark write with ``spark.wap.id`` stage its snapshot."""
_WAP_ID_CONF = "spark.wap.id"
_WAP_ID_SUMMARY = "wap.id"


def _collect_dead_letters(decoded: DataFrame) -> list[DeadLetter]:
    """The decode job's dead-letter rows, collected on the driver as :class:`DeadLetter`, in
    offset order (``_publish_time`` read back as µs since the epoch)."""
    from pyspark.sql import functions as F

    keyed = KEY_COLUMN in decoded.columns  # the table has _key (raw_payload on)
    rows = (
        decoded.filter(F.col(ERROR_FIELD).isNotNull())
        .select(
            "_offset", F.unix_micros("_publish_time").alias("publish_time_us"), "_producer_id", "_producer_name",
            "_schema_id", "_schema_version", "_attributes", PAYLOAD_FIELD, ERROR_FIELD,
            *([KEY_COLUMN] if keyed else []),
        )
        .collect()
    )
    letters = [
        DeadLetter(
            Record(
                offset=int(r["_offset"]),
                publish_time_us=int(r["publish_time_us"] or 0),
                producer_id=int(r["_producer_id"] or 0) & 0xFFFF_FFFF_FFFF_FFFF,
                producer_name=r["_producer_name"] or "",
                schema_id=int(r["_schema_id"] or 0),
                schema_version=int(r["_schema_version"] or 0),
                payload=bytes(r[PAYLOAD_FIELD] or b""),
                attributes=dict(r["_attributes"] or {}),
                key=r[KEY_COLUMN][KEY_VALUE_FIELD] if keyed and r[KEY_COLUMN] is not None else None,
            ),
            str(r[ERROR_FIELD]),
        )
        for r in rows
    ]
    letters.sort(key=lambda d: d.record.offset)
    return letters


def ensure_wap(table: Table) -> Table:
    """Turn on write-audit-publish staging (``write.wap.enabled``) once per table.

    Args:
        table: the target table.

    Returns:
        The table, refreshed after the property was set (up to 5 tries on a conflict).
    """
    if table.properties.get(WAP_ENABLED_PROPERTY) == "true":
        return table
    for _ in range(5):
        try:
            table.transaction().set_properties({WAP_ENABLED_PROPERTY: "true"}).commit_transaction()
            break
        except CommitFailedException:
            table.refresh()
    table.refresh()
    return table


def _publish(table: Table, wap_id: str, base: int | None, end: int, partition: int | None) -> int:
    """Make the staged snapshot ``wap_id`` the table's current one and set the committed end
    offset, in one commit that requires ``main`` to still be ``base``.

    Args:
        table: the target table.
        wap_id: the ``spark.wap.id`` the rows were written with.
        base: the ``main`` snapshot the load started from, ``None`` for none.
        end: the load's last offset (the committed end offset afterwards).
        partition: the partition index, for a partition of a partitioned topic.

    Returns:
        The published snapshot's id.

    Raises:
        CommitFailedException: ``main`` moved since the load started.
        BulkLoadError: the staged snapshot is missing.
    """
    table.refresh()
    staged = [s for s in table.snapshots() if s.summary is not None and s.summary[_WAP_ID_SUMMARY] == wap_id]
    if len(staged) != 1:
        raise BulkLoadError(".".join(table.name()), f"{len(staged)} staged snapshots carry wap.id {wap_id}")
    snapshot = staged[0]
    current = table.current_snapshot()
    head = current.snapshot_id if current is not None else None
    if head != base or snapshot.parent_snapshot_id != base:
        raise CommitFailedException(f"main is at {head}, the staged snapshot's parent is {snapshot.parent_snapshot_id}")
    handle = iceberg.without_commit_retries(table)
    with handle.transaction() as tx:
        tx.set_properties({iceberg.committed_end_offset_property(partition): str(end)})
        ManageSnapshots(tx).set_current_snapshot(snapshot_id=snapshot.snapshot_id)
    table.refresh()
    return snapshot.snapshot_id


@dataclass(frozen=True, slots=True)
class PublishedLoad:
    """What :func:`write_and_publish` did.

    Attributes:
        snapshot_id: the published snapshot.
        rows: rows it added (its summary's ``added-records``).
        dead_letters: rows appended to the dead-letter table.
    """

    snapshot_id: int
    rows: int
    dead_letters: int


def write_and_publish(
    spark: SparkSession,
    catalog: Catalog,
    table: Table,
    table_topic: TopicName,
    frame: DataFrame,
    task: DecodeTask,
    chosen: Sequence[BulkObject],
    name: str,
    base: int | None,
    partition: int | None,
) -> PublishedLoad:
    """Decode, dead-letter, stage and publish (module docstring).

    Args:
        spark: the session.
        catalog: the shared catalog (for the dead-letter table).
        table: the prepared target table, with write-audit-publish on (:func:`ensure_wap`).
        table_topic: the topic whose table it is (the partitioned topic, for a partition).
        frame: the objects (:func:`~danube_pipeline.lake.bulk.tasks.objects_frame`).
        task: the decode task, with the table's schema and the writers' recipes.
        chosen: the objects, in offset order.
        name: the table's Spark name.
        base: the table's ``main`` snapshot when the load started, ``None`` for none.
        partition: the partition index, for a partition of a partitioned topic.

    Returns:
        A :class:`PublishedLoad`.

    Raises:
        BulkLoadError: the staged snapshot is missing.
        CommitFailedException: ``main`` moved meanwhile (nothing published).
    """
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    assert task.schema is not None
    out_schema = output_schema(schema_to_pyarrow(task.schema, include_field_ids=False))
    decoded = frame.mapInArrow(decode_rows_job(task), spark_schema(out_schema)).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        start, end = task.start_offset, chosen[-1].end_offset
        object_id = chosen[0].object_id if len(chosen) == 1 else f"{chosen[0].object_id}..{chosen[-1].object_id}"
        letters = iceberg.commit_dead_letters(
            catalog, table_topic, _collect_dead_letters(decoded), object_id, topic=task.topic, start_offset=start,
            end_offset=end, partition=partition, raw_payload=task.raw_payload,
        )
        dead = letters.offsets
        rows = decoded.filter(F.col(ERROR_FIELD).isNull()).drop(ERROR_FIELD, PAYLOAD_FIELD)
        if dead:
            rows = rows.filter(~F.col("_offset").isin(sorted(dead)))
        summary = {
            iceberg.SUMMARY_TOPIC: task.topic,
            iceberg.SUMMARY_START_OFFSET: str(start),
            iceberg.SUMMARY_END_OFFSET: str(end),
            iceberg.SUMMARY_OBJECT_ID: object_id,
            iceberg.SUMMARY_DEAD_LETTER_RECORDS: str(len(dead)),
            SUMMARY_ENGINE: "spark",
        }
        if partition is not None:
            summary[iceberg.SUMMARY_PARTITION] = str(partition)
        writer = rows.writeTo(name).option("check-nullability", "false")
        for key, value in summary.items():
            writer = writer.option(f"snapshot-property.{key}", value)
        wap_id = f"danube-bulk-{uuid.uuid4().hex}"
        spark.conf.set(_WAP_ID_CONF, wap_id)
        try:
            writer.append()
        finally:
            spark.conf.unset(_WAP_ID_CONF)
        snapshot_id = _publish(table, wap_id, base, end, partition)
        snapshot = table.snapshot_by_id(snapshot_id)
        added = snapshot.summary["added-records"] if snapshot is not None and snapshot.summary is not None else None
        log.info("%s: bulk load of offsets %d-%d published as snapshot %d", task.topic, start, end, snapshot_id)
        return PublishedLoad(snapshot_id, int(added or 0), letters.rows_appended)
    finally:
        decoded.unpersist()
