"""The ``bulk_table`` asset: a topic's segment objects into an Iceberg table with Spark.

Run on demand, from the UI's "Materialize" with a run config, for what is too big for
``iceberg_table``'s one-snapshot-per-object loop: the first load of a topic with a long
history, a replay into a new table after a schema rewrite or after fixing the registry (dead
letters decode again), a backfill from an offset. :func:`danube_pipeline.lake.bulk.bulk_load` does
the work, exactly once with ``iceberg_table`` (each continues after the other's committed end
offset). Its Spark master is the ``spark`` resource's (``$DANUBE_SPARK_MASTER``, default
``local[*]``).

No ``from __future__ import annotations`` here: Dagster reads the asset function's ``config``
annotation at run time to build the run config schema.
"""

import asyncio
from typing import Any

from dagster import (
    AssetExecutionContext,
    Config,
    MaterializeResult,
    MetadataValue,
    asset,
)
from pydantic import Field

from assets.assets import TIERING_GROUP, segment_objects
from assets.metadata import table_metadata
from assets.partitions import topics_partitions
from assets.resources import (
    EtcdResource,
    IcebergCatalogResource,
    ObjectStoreResource,
    SparkResource,
)
from danube_pipeline.lake.bulk import BulkLoadReport, bulk_load
from danube_pipeline.names import TopicName
from danube_pipeline.schemas.registry import SchemaRegistry

__all__ = ["BulkLoadConfig", "bulk_metadata", "bulk_table"]


class BulkLoadConfig(Config):
    """Run-time knobs of ``bulk_table`` (the launchpad's ``ops.bulk_table.config``)."""

    target: str | None = Field(
        default=None,
        description=(
            "Table to write: a name in the topic's namespace (flights_v2) or /ns/name. "
            "Default: the topic's own table."
        ),
    )
    from_offset: int | None = Field(
        default=None,
        description="First offset to load. Default: the first retained object (offsets already committed are skipped).",
    )
    replay: bool = Field(
        default=False,
        description="Replay every retained object into target, which must be a table other than the topic's own.",
    )


def bulk_metadata(report: BulkLoadReport, catalog_name: str) -> dict[str, Any]:
    """The materialization metadata of a :class:`~danube_pipeline.lake.bulk.BulkLoadReport`: rows,
    bytes, offsets, snapshot id, files before and after (unknown values left out)."""
    values: dict[str, Any] = {
        "table": f"{catalog_name}.{report.table}",
        "topic": report.topic,
        "partition": report.partition,
        "rows_appended": MetadataValue.int(report.rows_appended),
        "row_count": MetadataValue.int(report.row_count) if report.row_count is not None else None,
        "objects_read": report.objects_read,
        "bytes_read": MetadataValue.int(report.bytes_read),
        "first_offset": report.first_offset,
        "last_offset": report.last_offset,
        "committed_end_offset_before": report.committed_end_offset_before,
        "committed_end_offset": report.committed_end_offset,
        "snapshot_id": MetadataValue.text(str(report.snapshot_id)) if report.snapshot_id is not None else None,
        "data_files_before": report.data_files_before,
        "data_files_after": report.data_files_after,
        "dead_letter_records": MetadataValue.int(report.dead_letter_records),
        "dead_letter_table": report.dead_letter_table,
        "table_created": report.created,
        "schema_changes": MetadataValue.json(report.schema_changes),
        "attempts": report.attempts,
    }
    standard = table_metadata(f"{catalog_name}.{report.table}", report.row_count)
    return standard | {key: value for key, value in values.items() if value is not None}


@asset(
    partitions_def=topics_partitions,
    group_name=TIERING_GROUP,
    deps=[segment_objects],
    kinds={"iceberg", "spark"},
    description=(
        "The topic's segment objects loaded with Spark (mapInArrow decode, Iceberg's Spark writer) into "
        "its Iceberg table or a target table, exactly once with iceberg_table: for first loads of long "
        "histories, replays into new tables and backfills."
    ),
)
def bulk_table(
    context: AssetExecutionContext,
    config: BulkLoadConfig,
    etcd: EtcdResource,
    object_store: ObjectStoreResource,
    iceberg_catalog: IcebergCatalogResource,
    spark: SparkResource,
) -> MaterializeResult[Any]:
    """Load every segment object of the partition's topic not yet in the target table."""
    topic = TopicName.from_partition_key(context.partition_key)
    objects = object_store.checked_store(etcd)
    catalog = iceberg_catalog.load()

    with spark.session() as session:

        async def run() -> BulkLoadReport:
            async with await etcd.connect() as store:
                return await bulk_load(
                    session, catalog, topic, store=store, objects=objects, registry=SchemaRegistry(store),
                    target=config.target, from_offset=config.from_offset, replay=config.replay,
                    catalog_name=spark.resolved_catalog_name(),
                )

        report = asyncio.run(run())
    context.log.info(
        f"{report.table}: {report.rows_appended} rows from {report.objects_read} objects "
        f"({report.bytes_read} bytes) in snapshot {report.snapshot_id}, committed through offset "
        f"{report.committed_end_offset}"
    )
    return MaterializeResult(metadata=bulk_metadata(report, iceberg_catalog.catalog_name()))
