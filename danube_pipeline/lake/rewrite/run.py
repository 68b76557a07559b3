"""One rewrite run over a table: stage if needed, find the files that need work, rewrite
each partition's files into one verified ``replace`` commit, and finalize once nothing is
left (:func:`rewrite_table`)."""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from danube_pipeline.lake.rewrite.errors import RewriteConflictError, RewriteVerificationError
from danube_pipeline.lake.rewrite.java_table import JavaTable
from danube_pipeline.lake.rewrite.planning import DataFileStats, RewriteUnit, rewrite_units
from danube_pipeline.lake.rewrite.properties import (
    SUMMARY_REWRITE_GROUP,
    SUMMARY_REWRITE_PARTITION,
    SUMMARY_REWRITE_VERSION,
)
from danube_pipeline.lake.rewrite.reports import RewriteReport, UnitResult
from danube_pipeline.lake.rewrite.shape import (
    RewriteShape,
    quoted,
    shape_of,
    validate_before_staging,
    validate_expressions,
)
from danube_pipeline.lake.rewrite.spec import read_rewrite_spec
from danube_pipeline.lake.rewrite.staging import (
    check_against_state,
    finalize_rewrite,
    read_rewrite_state,
    stage_rewrite,
)
from danube_pipeline.lake.spark.checksums import RowChecksum, checksum_of, row_hash
from danube_pipeline.lake.spark.procedures import spark_table_name
from danube_pipeline.names import TopicName

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyspark.sql import SparkSession

__all__ = [
    "rewrite_table",
]

log = logging.getLogger(__name__)

_WORK = "__danube_work__"


def _files_needing_work(
    java: JavaTable,
    shape: RewriteShape,
    planned: Mapping[str, tuple[DataFileStats, Any]],
    paths: Iterable[str],
    current_spec_id: int,
) -> set[str]:
    """The files among ``paths`` that sit in an older partition spec or hold a row a rewrite
    would change (:meth:`RewriteShape.work_condition`).

    Files whose metrics show every row written by this rewrite version
    (``_rewrite_version >= version``, no nulls) are settled without reading; the others are
    read once (only the columns the condition needs) and counted per ``_file``.
    """
    needing: set[str] = set()
    to_read: list[str] = []
    for path in paths:
        stats, _ = planned[path]
        if stats.spec_id != current_spec_id:
            needing.add(path)
        elif not stats.all_converted(shape.spec.version):
            to_read.append(path)
    if not to_read:
        return needing
    group_id = f"danube-rewrite-check-{uuid.uuid4()}"
    try:
        df = java.staged_read(group_id, [planned[p][1] for p in to_read])
        pre = shape.pre_rewrite_view(df, extra=["_file"])
        rows = pre.where(shape.work_condition()).groupBy("_file").count().collect()
    finally:
        java.release(group_id)
    needing.update(str(r["_file"]) for r in rows if int(r["count"]) > 0)
    return needing


def _java_error(error: Exception) -> str | None:
    """The Java exception class name inside a Py4J error, or ``None``."""
    java_exception = getattr(error, "java_exception", None)
    if java_exception is None:
        return None
    return str(java_exception.getClass().getName())


_CONFLICTS = (
    "org.apache.iceberg.exceptions.ValidationException",
    "org.apache.iceberg.exceptions.CommitFailedException",
)


def _rewrite_unit(
    java: JavaTable,
    shape: RewriteShape,
    planned: Mapping[str, tuple[DataFileStats, Any]],
    unit: RewriteUnit,
    *,
    from_snapshot: int,
    label: str,
) -> UnitResult:
    """Rewrite one unit's files, verify the new files, commit one ``replace`` snapshot.

    Four Spark jobs: the old rows' count and untouched-column checksum; the converted rows'
    rewritten-column checksum, conversion count and kept old values; the write; the new files'
    count and both checksums, read back through Iceberg.

    Raises:
        RewriteVerificationError: a check failed; nothing was committed and the new files (if
            any were written) were deleted.
        RewriteConflictError: the commit's validation failed; the new files were deleted.
    """
    from pyspark.sql import functions as F

    untouched, rewritten = shape.untouched, shape.rewritten
    group_id = f"danube-rewrite-{uuid.uuid4()}"
    old_tasks = [planned[f.path][1] for f in unit.files]
    old_files = [t.file() for t in old_tasks]
    try:
        source = java.staged_read(group_id, old_tasks)
        row = source.agg(F.count(F.lit(1)), checksum_of(row_hash(source, untouched))).collect()[0]
        before = RowChecksum(int(row[0]), int(row[1]))

        projected = shape.project(source, work_flag=_WORK)
        checks = [checksum_of(row_hash(projected, rewritten)), F.count_if(F.col(_WORK))]
        for column, old in shape.retired.items():  # old value set, new one null: a lossy CAST
            old_set = F.col(quoted(old)).isNotNull()
            checks += [F.count_if(old_set), F.count_if(old_set & F.col(quoted(column)).isNotNull())]
        row = projected.agg(*checks).collect()[0]
        expected, converted = int(row[0]), int(row[1])
        for i, column in enumerate(shape.retired):
            had, has = int(row[2 + 2 * i]), int(row[3 + 2 * i])
            if had != has:  # before anything is written
                raise RewriteVerificationError(label, unit.label, f"values of {column}", had, has)
        (
            projected.drop(_WORK)
            .write.format("iceberg")
            .option("rewritten-file-scan-task-set-id", group_id)
            .option("fanout-enabled", "true")
            .option("distribution-mode", "none")
            .mode("append")
            .save(java.name)
        )
        new_files = java.written_files(group_id)
    finally:
        java.release(group_id)

    check_id = group_id + "-check"
    after, after_rewritten = RowChecksum(0, 0), 0
    try:
        if new_files:
            written = java.staged_read(check_id, java.tasks_for_new_files(new_files))
            written = written.select(*[F.col(quoted(c)) for c in shape.columns])
            row = written.agg(
                F.count(F.lit(1)), checksum_of(row_hash(written, untouched)), checksum_of(row_hash(written, rewritten))
            ).collect()[0]
            after, after_rewritten = RowChecksum(int(row[0]), int(row[1])), int(row[2])
    finally:
        java.release(check_id)
    metadata_rows = sum(int(f.recordCount()) for f in new_files)
    mismatches = [
        ("rows", before.rows, after.rows),
        ("rows in the new files' metadata", before.rows, metadata_rows),
        ("untouched checksum", before.checksum, after.checksum),
        ("rewritten checksum", expected, after_rewritten),
    ]
    for what, was, now in mismatches:
        if was != now:
            java.delete_files(new_files)
            raise RewriteVerificationError(label, unit.label, what, was, now)

    summary = {
        SUMMARY_REWRITE_VERSION: str(shape.spec.version),
        SUMMARY_REWRITE_PARTITION: unit.label,
        SUMMARY_REWRITE_GROUP: group_id,
    }
    try:
        java.commit_rewrite(old_files, new_files, from_snapshot=from_snapshot, summary=summary)
    except Exception as e:
        if _java_error(e) in _CONFLICTS:
            java.delete_files(new_files)
            raise RewriteConflictError(label, unit.label, str(getattr(e, "java_exception", e))) from e
        raise  # the commit's outcome may be unknown (CommitStateUnknownException): keep the files
    snapshot_id = java.snapshot_with(SUMMARY_REWRITE_GROUP, group_id)
    log.info(
        "%s %s: %d files (%d rows, %d converted) rewritten into %d in snapshot %s",
        label, unit.label, len(old_files), before.rows, converted, len(new_files), snapshot_id,
    )
    return UnitResult(
        partition=unit.label,
        status="rewritten",
        files_before=len(old_files),
        files_after=len(new_files),
        rows=before.rows,
        rows_converted=converted,
        checksum_before=before.checksum,
        checksum_after=after.checksum,
        snapshot_id=snapshot_id,
    )


def rewrite_table(
    spark: SparkSession,
    catalog: Catalog,
    topic: TopicName,
    *,
    catalog_name: str | None = None,
    day: dt.date | None = None,
    after_unit: Callable[[UnitResult], None] | None = None,
) -> RewriteReport:
    """Apply the rewrite declared on the topic's table, for one UTC day or the whole table.

    Stages the spec if needed (:func:`stage_rewrite`), rewrites each partition with files
    touching ``day`` that still needs it in one ``replace`` snapshot, verified
    (:mod:`danube_pipeline.lake.rewrite`), then finalizes (:func:`finalize_rewrite`) when
    nothing in the whole table needs work any more. Re-running is a no-op: done partitions are
    skipped and commit nothing.

    Args:
        spark: a session from
            :func:`~danube_pipeline.lake.spark.session.build_spark_session` on the table's
            catalog.
        catalog: the pyiceberg catalog (same catalog database).
        topic: the topic whose table it is.
        catalog_name: the Spark catalog name; default ``settings.catalog_name()``.
        day: only files whose ``_publish_time`` bounds touch this UTC day (a day-partitioned
            table: that day's partition); ``None`` for every file.
        after_unit: called after each partition's commit (or skip) with its result, before
            the next partition; an exception it raises stops the run there (what a crash
            would do).

    Returns:
        A :class:`RewriteReport`; ``version`` is ``None`` when no rewrite is declared.

    Raises:
        NoSuchTableError: the table does not exist.
        RewriteSpecError: the declared spec is invalid or its expressions do not analyze.
        RewriteStateError: the spec conflicts with the staged rewrite.
        RewriteVerificationError: a partition's new files differ; earlier partitions stay
            committed, this one is not.
        RewriteConflictError: a partition changed during its rewrite; run again.
    """
    ident = (topic.namespace, topic.topic)
    label = ".".join(ident)
    table = catalog.load_table(ident)
    spec = read_rewrite_spec(table)
    if spec is None:
        return RewriteReport(label, None, day)
    state = read_rewrite_state(table)
    check_against_state(table, spec, state)
    if state is not None and state.version == spec.version and state.finalized:
        return RewriteReport(label, spec.version, day, already_finalized=True, retired=dict(state.retired))
    name = spark_table_name(topic, catalog_name)
    staged = False
    if state is None or state.version != spec.version:
        validate_before_staging(spark, name, spec)
        state = stage_rewrite(table, spec)
        staged = True
    shape = shape_of(table, spec, state)
    validate_expressions(spark, name, shape)

    java = JavaTable(spark, name)
    snapshot_before = java.current_snapshot_id()
    results: list[UnitResult] = []
    files_before = 0
    if snapshot_before is not None:
        planned = java.plan(snapshot_before)
        files_before = len(planned)
        current_spec = java.current_spec_id()
        for unit in rewrite_units((stats for stats, _ in planned.values()), day=day):
            needing = _files_needing_work(java, shape, planned, [f.path for f in unit.files], current_spec)
            if not needing:
                result = UnitResult(unit.label, "skipped", len(unit.files), len(unit.files), unit.rows)
            else:
                work = RewriteUnit(unit.spec_id, unit.partition, tuple(f for f in unit.files if f.path in needing))
                result = _rewrite_unit(java, shape, planned, work, from_snapshot=snapshot_before, label=label)
            results.append(result)
            if after_unit is not None:
                after_unit(result)

    java.refresh()
    snapshot_after = java.current_snapshot_id()
    remaining: set[str] = set()
    files_after = 0
    if snapshot_after is not None:
        planned_after = java.plan(snapshot_after)
        files_after = len(planned_after)
        remaining = _files_needing_work(java, shape, planned_after, list(planned_after), java.current_spec_id())
    finalized = False
    if not remaining:
        table.refresh()
        finalize_rewrite(table, spec)
        finalized = True
    return RewriteReport(
        table=label,
        version=spec.version,
        day=day,
        staged=staged,
        finalized=finalized,
        retired=dict(state.retired),
        units=tuple(results),
        snapshot_before=snapshot_before,
        snapshot_after=snapshot_after,
        table_data_files_before=files_before,
        table_data_files_after=files_after,
        remaining_files=len(remaining),
    )
