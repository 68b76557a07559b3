"""Maintenance procedures on a topic's table in Spark: compaction, row deletes, snapshot
expiry and orphan-file removal, and the table's multi-part name they address it by.

pyiceberg cannot compact; :func:`compact_table` runs Iceberg's ``rewrite_data_files``
procedure. :func:`delete_rows_below`, :func:`expire_snapshots_keeping_files` and
:func:`remove_orphan_files` are the Spark side of :mod:`danube_pipeline.lake.retention`
(:func:`expire_snapshots`, which also deletes the expired files, is the one-call variant).

None of these touch table properties, so the committed end offset that
:func:`danube_pipeline.lake.iceberg.append_records` keeps in the property
``danube.committed-end-offset`` survives all of them (Iceberg commits carry the table's
properties over from the metadata they replace).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from danube_pipeline import settings
from danube_pipeline.lake.iceberg.layout import day_bounds_ms
from danube_pipeline.names import TopicName

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "ORPHAN_MIN_AGE_MS",
    "CompactionResult",
    "compact_table",
    "delete_rows_below",
    "expire_snapshots",
    "expire_snapshots_keeping_files",
    "remove_orphan_files",
    "spark_table_name",
]


@dataclass(frozen=True, slots=True)
class CompactionResult:
    """What :func:`compact_table` did (counts from ``rewrite_data_files`` and ``.files``).

    Attributes:
        data_files_before: live data files before.
        data_files_after: live data files after.
        rewritten_data_files: input files replaced.
        added_data_files: output files written.
        rewritten_bytes: bytes of the replaced files.
        snapshot_id: the table's current snapshot afterwards (``None`` for an empty table).
    """

    data_files_before: int
    data_files_after: int
    rewritten_data_files: int
    added_data_files: int
    rewritten_bytes: int
    snapshot_id: int | None


def _q(part: str) -> str:
    return f"`{part}`"


PARQUET_CODEC_PROPERTY = "write.parquet.compression-codec"
"""The table property naming the Parquet compression codec (Iceberg spec, "Table Properties")."""
PARQUET_LEVEL_PROPERTY = "write.parquet.compression-level"
"""The table property naming the codec's level."""
APPEND_CODEC = "zstd"
"""The codec pyiceberg writes when the table names none (its ``PARQUET_COMPRESSION_DEFAULT``)."""
SPARK_CODEC_CONF = "spark.sql.iceberg.compression-codec"
SPARK_LEVEL_CONF = "spark.sql.iceberg.compression-level"


@contextmanager
def _append_compression(spark: SparkSession, full: str) -> Iterator[str]:
    """Make the session's Iceberg writes use the codec (and level) the table's appends use.

    A table created by pyiceberg carries no ``write.parquet.compression-codec`` property, so
    pyiceberg writes it ``zstd`` while Iceberg's Spark writer falls back to its own default,
    ``gzip``, for a table without the property: compaction would rewrite a day's zstd files
    in another codec (and a rewrite grows a day's bytes for that alone). The session settings
    ``spark.sql.iceberg.compression-codec`` and ``-level`` take precedence over the table
    property and are restored afterwards.

    Yields:
        The codec the rewrite writes.
    """
    rows = spark.sql(f"SHOW TBLPROPERTIES {full}").collect()
    properties = {str(r["key"]): str(r["value"]) for r in rows}
    codec = properties.get(PARQUET_CODEC_PROPERTY, APPEND_CODEC)
    wanted = {SPARK_CODEC_CONF: codec}
    if PARQUET_LEVEL_PROPERTY in properties:
        wanted[SPARK_LEVEL_CONF] = properties[PARQUET_LEVEL_PROPERTY]
    saved = {key: spark.conf.get(key, None) for key in (SPARK_CODEC_CONF, SPARK_LEVEL_CONF)}
    for key, value in wanted.items():
        spark.conf.set(key, value)
    try:
        yield codec
    finally:
        for key, previous in saved.items():
            if previous is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, previous)


def compact_table(
    spark: SparkSession,
    topic: TopicName,
    *,
    catalog_name: str | None = None,
    min_input_files: int = 2,
    day: dt.date | None = None,
    rewrite_all: bool = False,
) -> CompactionResult:
    """Rewrite the topic table's small data files into fewer, larger ones, sorted by ``_offset``.

    Runs ``CALL {catalog}.system.rewrite_data_files(table => 'ns.topic', strategy => 'sort',
    options => map('min-input-files', '2'[, 'rewrite-all', ...]), where => ...)``: the ``sort``
    strategy writes each output file in the table's sort order (``_offset``,
    :mod:`danube_pipeline.lake.iceberg.layout`), in the Parquet codec the table's appends use
    (``zstd`` unless the table names one; Spark's own default would be ``gzip``), and with ``day`` only the files holding rows
    published that UTC day are considered, so the other days' partitions are not touched.
    Files written under an older partition spec are rewritten into the current one. The rewrite
    commits a ``replace`` snapshot that carries no ``danube.*`` summary properties and keeps the
    table's properties, among them ``danube.committed-end-offset``, which
    :func:`danube_pipeline.lake.iceberg.committed_end_offset` reads.

    Args:
        spark: a session from :func:`~danube_pipeline.lake.spark.session.build_spark_session` on the table's catalog.
        topic: the topic whose table to compact.
        catalog_name: the Spark catalog name; default ``settings.catalog_name()``.
        min_input_files: rewrite a file group only when it has at least this many files.
        day: compact only the rows of this UTC day (``_publish_time`` in ``[day, day + 1)``);
            ``None``: the whole table.
        rewrite_all: rewrite every selected file, even a lone one (to move files written under
            an older partition spec into the current one).

    Returns:
        A :class:`CompactionResult` (file counts of the whole table).

    Raises:
        pyspark.errors.AnalysisException: the table does not exist.
    """
    name = catalog_name or settings.catalog_name()
    full = f"{_q(name)}.{_q(topic.namespace)}.{_q(topic.topic)}"
    before = int(spark.sql(f"SELECT count(*) AS n FROM {full}.files").collect()[0]["n"])
    where = ""
    if day is not None:
        # the procedure's where is a string literal: double-quoted, so the timestamp literals
        # inside keep their single quotes
        where = f', where => "{_day_predicate(day)}"'
    options = f"'min-input-files', '{int(min_input_files)}'"
    if rewrite_all:
        options += ", 'rewrite-all', 'true'"
    with _append_compression(spark, full):
        row = spark.sql(
            f"CALL {_q(name)}.system.rewrite_data_files("
            f"table => '{topic.namespace}.{topic.topic}', strategy => 'sort', "
            f"options => map({options}){where})"
        ).collect()[0]
    result = row.asDict()
    after = int(spark.sql(f"SELECT count(*) AS n FROM {full}.files").collect()[0]["n"])
    snaps = spark.sql(
        f"SELECT snapshot_id FROM {full}.history WHERE is_current_ancestor "
        "ORDER BY made_current_at DESC LIMIT 1"
    ).collect()
    return CompactionResult(
        data_files_before=before,
        data_files_after=after,
        rewritten_data_files=int(result.get("rewritten_data_files_count") or 0),
        added_data_files=int(result.get("added_data_files_count") or 0),
        rewritten_bytes=int(result.get("rewritten_bytes_count") or 0),
        snapshot_id=int(snaps[0]["snapshot_id"]) if snaps else None,
    )


def _table_ref(topic: TopicName, catalog_name: str | None) -> tuple[str, str]:
    """``(catalog, `catalog`.`ns`.`topic`)`` for SQL statements on the topic's table."""
    name = catalog_name or settings.catalog_name()
    return name, f"{_q(name)}.{_q(topic.namespace)}.{_q(topic.topic)}"


def _timestamp_literal(epoch_ms: int) -> str:
    """A Spark SQL ``TIMESTAMP`` literal for ``epoch_ms`` (UTC, millisecond precision), read the
    same whatever the session's time zone."""
    moment = dt.datetime.fromtimestamp(epoch_ms / 1000, tz=dt.UTC)
    return f"TIMESTAMP '{moment.strftime('%Y-%m-%d %H:%M:%S.%f')[:-3]}Z'"


def _day_predicate(day: dt.date) -> str:
    """Spark SQL: ``_publish_time`` within the UTC ``day``."""
    start_ms, end_ms = day_bounds_ms(day)
    return f"_publish_time >= {_timestamp_literal(start_ms)} AND _publish_time < {_timestamp_literal(end_ms)}"


def delete_rows_below(
    spark: SparkSession,
    topic: TopicName,
    offset: int,
    *,
    catalog_name: str | None = None,
    partition: int | None = None,
    day: dt.date | None = None,
) -> None:
    """``DELETE FROM {catalog}.{ns}.{topic} WHERE _offset < {offset}`` (``AND _partition = {i}``
    for partition ``i`` of a partitioned topic's table, ``AND _publish_time`` within ``day``
    for one day's table partitions).

    Iceberg drops a data file from the table without rewriting it when every row of it
    matches (its ``_offset`` upper bound is below ``offset``); a file that holds rows on both
    sides is rewritten without the matching rows (copy-on-write, the default
    ``write.delete.mode``). One commit; a ``delete`` or ``overwrite`` snapshot.

    Args:
        spark: a session from :func:`~danube_pipeline.lake.spark.session.build_spark_session` on the table's catalog.
        topic: the topic whose table it is (the partitioned topic, for a partition).
        offset: rows with a smaller ``_offset`` are deleted.
        catalog_name: the Spark catalog name; default ``settings.catalog_name()``.
        partition: only rows of this partition (``_partition``), whose offsets are its own
            (``docs/etcd-layout.md`` §3.1); ``None`` for a plain topic's table.
        day: only rows published on this UTC day (the files of that day's table partitions
            are the only ones read or rewritten); ``None``: every day.

    Raises:
        pyspark.errors.AnalysisException: the table does not exist.
        Py4JJavaError: the commit failed (e.g. a conflicting concurrent commit that Iceberg's
            validation refuses).
    """
    _, full = _table_ref(topic, catalog_name)
    where = f"_offset < {int(offset)}"
    if partition is not None:
        where = f"_partition = {int(partition)} AND {where}"
    if day is not None:
        where = f"{_day_predicate(day)} AND {where}"
    spark.sql(f"DELETE FROM {full} WHERE {where}").collect()


def expire_snapshots(
    spark: SparkSession,
    topic: TopicName,
    *,
    older_than_ms: int,
    retain_last: int = 1,
    catalog_name: str | None = None,
) -> int:
    """``CALL {catalog}.system.expire_snapshots(table => 'ns.topic', older_than => …,
    retain_last => …)``: removes the snapshots older than ``older_than_ms`` beyond the newest
    ``retain_last``, and deletes the files only they referenced (so deleted rows are gone from
    storage, not just from the current snapshot). The current snapshot is never expired.

    Args:
        spark: a session from :func:`~danube_pipeline.lake.spark.session.build_spark_session` on the table's catalog.
        topic: the topic whose table it is.
        older_than_ms: milliseconds since the Unix epoch.
        retain_last: snapshots kept whatever their age (at least 1).
        catalog_name: the Spark catalog name; default ``settings.catalog_name()``.

    Returns:
        Data files deleted (the procedure's ``deleted_data_files_count``).

    Raises:
        pyspark.errors.AnalysisException: the table does not exist.
    """
    name, _ = _table_ref(topic, catalog_name)
    row = spark.sql(
        f"CALL {_q(name)}.system.expire_snapshots("
        f"table => '{topic.namespace}.{topic.topic}', "
        f"older_than => {_timestamp_literal(older_than_ms)}, "
        f"retain_last => {max(1, int(retain_last))})"
    ).collect()[0]
    return int(row.asDict().get("deleted_data_files_count") or 0)


def expire_snapshots_keeping_files(
    spark: SparkSession,
    topic: TopicName,
    *,
    older_than_ms: int,
    retain_last: int = 1,
    catalog_name: str | None = None,
) -> None:
    """Commit the same expiry as :func:`expire_snapshots` but delete no file: Iceberg's Java
    ``table.expireSnapshots().expireOlderThan(…).retainLast(…).cleanExpiredFiles(false).commit()``.

    The procedure commits the new metadata first and deletes the expired files afterwards, in
    one call; a process killed in between leaves those files referenced by no snapshot. Split
    in two, the caller records the files before this commit and deletes them after it
    (:mod:`danube_pipeline.lake.retention.expiry`), so a later run can finish a dead one's work.

    Args:
        spark: a session from :func:`~danube_pipeline.lake.spark.session.build_spark_session` on the table's catalog.
        topic: the topic whose table it is.
        older_than_ms: milliseconds since the Unix epoch.
        retain_last: snapshots kept whatever their age (at least 1).
        catalog_name: the Spark catalog name; default ``settings.catalog_name()``.

    Raises:
        Py4JJavaError: the table does not exist, or the commit failed.
    """
    from danube_pipeline.lake.rewrite.java_table import load_java_table

    table = load_java_table(spark, spark_table_name(topic, catalog_name))
    action = table.expireSnapshots().expireOlderThan(int(older_than_ms)).retainLast(max(1, int(retain_last)))
    action.cleanExpiredFiles(False).commit()


ORPHAN_MIN_AGE_MS = 24 * 3600 * 1000
"""The youngest ``older_than`` Iceberg's ``remove_orphan_files`` procedure accepts: files a
writer has written but not committed yet look like orphans, and deleting them would corrupt
the table once the commit lands."""


def remove_orphan_files(
    spark: SparkSession, topic: TopicName, *, older_than_ms: int, catalog_name: str | None = None
) -> list[str]:
    """``CALL {catalog}.system.remove_orphan_files(table => 'ns.topic', older_than => …)``:
    deletes files under the table's location that no snapshot or metadata file references
    and that were last modified before ``older_than_ms``.

    Orphans come from commits that never landed: a writer that died between writing its files
    and committing them, or a commit that lost the optimistic-concurrency race. Files of a
    commit still in flight look the same, hence the age limit.

    Args:
        spark: a session from :func:`~danube_pipeline.lake.spark.session.build_spark_session` on the table's catalog.
        topic: the topic whose table it is.
        older_than_ms: milliseconds since the Unix epoch; at least :data:`ORPHAN_MIN_AGE_MS`
            before now, or Iceberg refuses.
        catalog_name: the Spark catalog name; default ``settings.catalog_name()``.

    Returns:
        The deleted files' locations (``file:/…`` for a local warehouse).

    Raises:
        pyspark.errors.AnalysisException: the table does not exist.
        IllegalArgumentException: ``older_than_ms`` is less than 24 hours ago.
    """
    name, _ = _table_ref(topic, catalog_name)
    rows = spark.sql(
        f"CALL {_q(name)}.system.remove_orphan_files("
        f"table => '{topic.namespace}.{topic.topic}', "
        f"older_than => {_timestamp_literal(older_than_ms)})"
    ).collect()
    return [str(r["orphan_file_location"]) for r in rows]


def spark_table_name(topic: TopicName, catalog_name: str | None = None) -> str:
    """The topic table's multi-part name for Spark: ``danube.default.flights``, each of the
    three parts in back quotes.

    Args:
        topic: the topic whose table it is.
        catalog_name: the Spark catalog name; default ``settings.catalog_name()``.

    Returns:
        The name, usable in SQL, in ``spark.table`` and in ``DataFrameReader.load``.
    """
    return _table_ref(topic, catalog_name)[1]
