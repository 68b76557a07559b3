"""The bridge to Iceberg's Java API: the Java table behind a Spark catalog table, and the Spark
rewrite plumbing (``ScanTaskSetManager``, ``FileRewriteCoordinator``; Iceberg Spark docs,
"Procedures") that ``rewrite_data_files`` uses, driven over Py4J to plan, read, write and
commit one partition's files."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from danube_pipeline.lake.rewrite.planning import DataFileStats
from danube_pipeline.lake.rewrite.properties import PUBLISH_TIME_COLUMN, REWRITE_VERSION_COLUMN

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "SPLIT_SIZE_BYTES",
    "JavaTable",
    "load_java_table",
]

log = logging.getLogger(__name__)

SPLIT_SIZE_BYTES = 512 * 1024 * 1024
"""Bytes of input per Spark read task of a rewrite (``split-size``): a partition up to this
size becomes one task and, per output partition, one new file."""


def load_java_table(spark: SparkSession, name: str) -> Any:
    """The Iceberg Java ``Table`` behind a Spark catalog table (``Spark3Util.loadIcebergTable``),
    for the Iceberg API calls Spark SQL has no statement for (``newRewrite``, ``planFiles``).

    Each call loads the table's current metadata from the catalog (the session's catalog
    cache is off: :func:`~danube_pipeline.lake.spark.session.spark_conf`).

    Args:
        spark: a session from :func:`~danube_pipeline.lake.spark.session.build_spark_session`.
        name: ``catalog.ns.table`` (parts may be back-quoted), e.g.
            :func:`~danube_pipeline.lake.spark.procedures.spark_table_name`.

    Returns:
        A Py4J proxy of ``org.apache.iceberg.Table``.

    Raises:
        Py4JJavaError: the table does not exist (``NoSuchTableException``) or is not Iceberg.
    """
    jvm: Any = getattr(spark, "_jvm")  # noqa: B009 - Py4J's view of the JVM, untyped
    return jvm.org.apache.iceberg.spark.Spark3Util.loadIcebergTable(spark._jsparkSession, name)


class JavaTable:
    """The Iceberg Java table behind a Spark catalog table, and the Spark rewrite plumbing
    (``ScanTaskSetManager``, ``FileRewriteCoordinator``) that ``rewrite_data_files`` uses."""

    def __init__(self, spark: SparkSession, name: str) -> None:
        self.spark = spark
        self.name = name
        self.jvm: Any = getattr(spark, "_jvm")  # noqa: B009 - Py4J's view of the JVM, untyped
        self.table: Any = load_java_table(spark, name)
        self.tasks: Any = self.jvm.org.apache.iceberg.spark.ScanTaskSetManager.get()
        self.coordinator: Any = self.jvm.org.apache.iceberg.spark.FileRewriteCoordinator.get()

    def refresh(self) -> None:
        """Reload the table's current metadata from the catalog."""
        self.table.refresh()

    def current_snapshot_id(self) -> int | None:
        """The current snapshot's id, ``None`` for a table without one."""
        snapshot = self.table.currentSnapshot()
        return int(snapshot.snapshotId()) if snapshot is not None else None

    def current_spec_id(self) -> int:
        """The id of the partition spec new files are written with."""
        return int(self.table.spec().specId())

    def plan(self, snapshot_id: int) -> dict[str, tuple[DataFileStats, Any]]:
        """Every live data file of the snapshot: path → (stats, Java ``FileScanTask``)."""
        schema = self.table.schema()
        conversions = self.jvm.org.apache.iceberg.types.Conversions
        specs = self.table.specs()

        def field_of(name: str) -> tuple[int, Any] | None:
            f = schema.findField(name)
            return (int(f.fieldId()), f.type()) if f is not None else None

        publish = field_of(PUBLISH_TIME_COLUMN)
        marker = field_of(REWRITE_VERSION_COLUMN)

        def bound(bounds: Any, column: tuple[int, Any] | None) -> int | None:
            if bounds is None or column is None or not bounds.containsKey(column[0]):
                return None
            return int(conversions.fromByteBuffer(column[1], bounds.get(column[0])))

        def count(counts: Any, column: tuple[int, Any] | None) -> int | None:
            if counts is None or column is None or not counts.containsKey(column[0]):
                return None
            return int(counts.get(column[0]))

        planned: dict[str, tuple[DataFileStats, Any]] = {}
        tasks = self.table.newScan().useSnapshot(snapshot_id).includeColumnStats().planFiles()
        try:
            iterator = tasks.iterator()
            while iterator.hasNext():
                task = iterator.next()
                f = task.file()
                spec_id = int(f.specId())
                lower, upper = f.lowerBounds(), f.upperBounds()
                stats = DataFileStats(
                    path=str(f.location()),
                    spec_id=spec_id,
                    partition=str(specs.get(spec_id).partitionToPath(f.partition())),
                    record_count=int(f.recordCount()),
                    size_bytes=int(f.fileSizeInBytes()),
                    publish_time_min_us=bound(lower, publish),
                    publish_time_max_us=bound(upper, publish),
                    marker_min=bound(lower, marker),
                    marker_nulls=count(f.nullValueCounts(), marker),
                    marker_values=count(f.valueCounts(), marker),
                )
                planned[stats.path] = (stats, task)
        finally:
            tasks.close()
        return planned

    def staged_read(self, group_id: str, tasks: Sequence[Any]) -> DataFrame:
        """A DataFrame of exactly ``tasks``' rows, in the table's current schema."""
        java_tasks = self.jvm.java.util.ArrayList()
        for task in tasks:
            java_tasks.add(task)
        self.tasks.stageTasks(self.table, group_id, java_tasks)
        return (
            self.spark.read.format("iceberg")
            .option("scan-task-set-id", group_id)
            .option("split-size", str(SPLIT_SIZE_BYTES))
            .option("file-open-cost", "0")
            .load(self.name)
        )

    def tasks_for_new_files(self, files: Sequence[Any]) -> list[Any]:
        """Scan tasks over files not (yet) in the table, read with the current schema."""
        schema_json = self.jvm.org.apache.iceberg.SchemaParser.toJson(self.table.schema())
        specs = self.table.specs()
        residuals = self.jvm.org.apache.iceberg.expressions.ResidualEvaluator.unpartitioned(
            self.jvm.org.apache.iceberg.expressions.Expressions.alwaysTrue()
        )
        gateway: Any = getattr(self.spark.sparkContext, "_gateway")  # noqa: B009
        no_deletes = gateway.new_array(self.jvm.org.apache.iceberg.DeleteFile, 0)
        out = []
        for f in files:
            spec_json = self.jvm.org.apache.iceberg.PartitionSpecParser.toJson(specs.get(f.specId()))
            out.append(self.jvm.org.apache.iceberg.BaseFileScanTask(f, no_deletes, schema_json, spec_json, residuals))
        return out

    def release(self, group_id: str) -> None:
        """Forget the tasks staged and the files written under ``group_id``."""
        self.tasks.removeTasks(self.table, group_id)
        self.coordinator.clearRewrite(self.table, group_id)

    def written_files(self, group_id: str) -> list[Any]:
        """The Java ``DataFile`` objects a write under ``group_id`` produced (not yet committed)."""
        return list(self.coordinator.fetchNewFiles(self.table, group_id))

    def delete_files(self, files: Iterable[Any]) -> None:
        """Delete uncommitted files, best effort (a failure is logged and left to
        ``remove_orphan_files``)."""
        io = self.table.io()
        for f in files:
            try:
                io.deleteFile(f.location())
            except Exception:  # best effort: an orphan is removed by remove_orphan_files later
                log.warning("%s: could not delete uncommitted file %s", self.name, f.location())

    def commit_rewrite(
        self, old: Sequence[Any], new: Sequence[Any], *, from_snapshot: int, summary: Mapping[str, str]
    ) -> None:
        """One ``RewriteFiles`` commit (a ``replace`` snapshot): ``old`` out, ``new`` in."""
        old_set, new_set = self.jvm.java.util.HashSet(), self.jvm.java.util.HashSet()
        for f in old:
            old_set.add(f)
        for f in new:
            new_set.add(f)
        update = self.table.newRewrite().validateFromSnapshot(from_snapshot).rewriteFiles(old_set, new_set)
        for key, value in summary.items():
            update = update.set(key, value)
        update.commit()

    def snapshot_with(self, key: str, value: str) -> int | None:
        """The newest snapshot whose summary has ``key = value``."""
        self.refresh()
        snapshot = self.table.currentSnapshot()
        while snapshot is not None:
            if str(snapshot.summary().get(key)) == value:
                return int(snapshot.snapshotId())
            parent = snapshot.parentId()
            snapshot = self.table.snapshot(parent) if parent is not None else None
        return None
