"""The metadata of the tiering assets' materializations, shared by their Dagster runs
(:mod:`assets.assets`) and the continuous writer's runless reports
(:mod:`assets.continuous_writer`), so the UI shows the same entries whichever path committed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dagster import MetadataValue

from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore
from danube_pipeline.lake.tiering import TableReport, TieringReport

__all__ = [
    "PARTITION_ROW_COUNT",
    "ROW_COUNT",
    "TABLE_NAME",
    "iceberg_table_metadata",
    "known",
    "segment_objects_metadata",
    "table_metadata",
]

ROW_COUNT = "dagster/row_count"
"""Dagster's standard key for the rows of a table asset (``TableMetadataSet.row_count``): the UI
shows it on the asset and plots it over materializations."""
PARTITION_ROW_COUNT = "dagster/partition_row_count"
"""Dagster's standard key for the rows of the materialized partition (``TableMetadataSet``)."""
TABLE_NAME = "dagster/table_name"
"""Dagster's standard key for the table's fully qualified name (``catalog.ns.table``)."""


def known(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` without the entries whose value is ``None`` (unknown, so not shown rather
    than written as a sentinel)."""
    return {key: value for key, value in values.items() if value is not None}


def table_metadata(
    table_name: str, row_count: int | None, *, partition_row_count: int | None = None
) -> dict[str, Any]:
    """Dagster's standard table entries (:data:`ROW_COUNT`, :data:`PARTITION_ROW_COUNT`,
    :data:`TABLE_NAME`), unknown ones left out.

    Args:
        table_name: ``catalog.ns.table``.
        row_count: rows in the whole table, ``None`` when unknown.
        partition_row_count: rows of the asset partition materialized (a topic's, a day's),
            ``None`` when unknown.

    Returns:
        Metadata entries to merge into a materialization's.
    """
    return known(
        {
            TABLE_NAME: MetadataValue.text(table_name),
            ROW_COUNT: MetadataValue.int(row_count) if row_count is not None else None,
            PARTITION_ROW_COUNT: MetadataValue.int(partition_row_count) if partition_row_count is not None else None,
        }
    )


def segment_objects_metadata(report: TieringReport, objects: ObjectStore, topic: TopicName) -> dict[str, Any]:
    """The metadata of a ``segment_objects`` materialization, as the asset's runs record it.

    Args:
        report: what :func:`~danube_pipeline.lake.tiering.tier_sealed_segments` did.
        objects: the object store written to.
        topic: the topic.

    Returns:
        Metadata entries; unknown values (no descriptor yet) are left out.
    """
    return known(
        {
            "topic": topic.path,
            "sealed_segments": report.sealed_segments,
            "objects_written": report.objects_written,
            "objects_skipped": report.objects_skipped,
            "bytes_written": MetadataValue.int(report.bytes_written),
            "records_written": report.records_written,
            "first_offset": report.first_offset,
            "last_offset": report.last_offset,
            "descriptors_total": report.descriptors_total,
            "objects_cur": report.cursor,
            "object_ids_written": MetadataValue.json(report.object_ids_written),
            "object_store": objects.url(f"topics/{topic.namespace}/{topic.topic}"),
        }
    )


def iceberg_table_metadata(report: TableReport, catalog_name: str) -> dict[str, Any]:
    """The metadata of an ``iceberg_table`` materialization, as the asset's runs record it.

    Args:
        report: what :func:`~danube_pipeline.lake.tiering.commit_objects_to_table` did.
        catalog_name: the Iceberg catalog's name (``danube``).

    Returns:
        Metadata entries (rows, bytes, offsets, snapshot ids, data files, and
        ``publish_to_queryable_s``: seconds from the publish of the oldest record appended to
        the commit, a float the UI plots per topic partition), with Dagster's standard
        ``dagster/row_count`` and ``dagster/table_name`` (and ``dagster/partition_row_count``
        for a topic with a table of its own: its rows are the partition's); unknown values are
        left out.
    """
    name = f"{catalog_name}.{report.table}"
    standard = table_metadata(
        name, report.row_count, partition_row_count=report.row_count if report.partition is None else None
    )
    return standard | known(
        {
            "table": name,
            "publish_to_queryable_s": (
                MetadataValue.float(round(lag_s, 3)) if (lag_s := report.publish_to_queryable_s) is not None else None
            ),
            "partition": report.partition,
            "row_count": MetadataValue.int(report.row_count) if report.row_count is not None else None,
            "rows_appended": MetadataValue.int(report.rows_appended),
            "objects_appended": report.objects_appended,
            "objects_skipped": report.objects_skipped,
            "snapshot_id": MetadataValue.text(str(report.snapshot_id)) if report.snapshot_id else None,
            "snapshots_created": MetadataValue.json([str(s) for s in report.snapshots]),
            "committed_end_offset": report.committed_end_offset,
            "first_offset": report.first_offset,
            "last_offset": report.last_offset,
            "bytes_read": MetadataValue.int(report.bytes_read),
            "data_files": report.data_files,
            "data_files_before": report.data_files_before,
            "data_files_after": report.data_files,
            "partition_spec": report.partition_spec,
            "layout_changes": MetadataValue.json(report.layout_changes) if report.layout_changes else None,
            "schema_ids": MetadataValue.json(report.schema_ids),
            "dead_letter_records": MetadataValue.int(report.dead_letter_records),
            "dead_letter_table": report.dead_letter_table,
            "schema_changes": MetadataValue.json(report.schema_changes),
            # the after-commit object lifecycle (docs/etcd-layout.md §2.1); left out under keep
            "objects_deleted": report.objects_deleted or None,
            "object_bytes_deleted": MetadataValue.int(report.object_bytes_deleted) if report.object_bytes_deleted else None,
        }
    )
