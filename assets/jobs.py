"""Jobs over the tiering assets.

An asset selection includes the asset checks of the selected assets (:mod:`assets.checks`), so
``tiering_job`` runs them after their assets. The jobs are partitioned as their assets are: by
topic (tiering), and by (topic, UTC day) for the maintenance jobs.
"""

from __future__ import annotations

from dagster import AssetSelection, define_asset_job

from assets.assets import compacted_table, iceberg_table, retention, schema_rewrite, segment_objects
from assets.bulk import bulk_table
from assets.checks import commit_checks, fresh

tiering_job = define_asset_job(
    "tiering_job",
    selection=AssetSelection.assets(segment_objects, iceberg_table),
    description=(
        "Sealed segments → objects + descriptors → Iceberg snapshots for one topic, then the "
        "checks of both assets."
    ),
)

compaction_job = define_asset_job(
    "compaction_job",
    selection=AssetSelection.assets(compacted_table),
    description=(
        "Spark rewrite_data_files (sort by _offset) on one UTC day's partitions of one topic's "
        "Iceberg table (partition key day|topic)."
    ),
)

retention_job = define_asset_job(
    "retention_job",
    selection=AssetSelection.assets(retention),
    description=(
        "One topic's namespace retention: the day's expired table rows, then snapshots, orphan "
        "files, object descriptors and objects deleted; the broker's local WAL retention applied "
        "(partition key day|topic)."
    ),
)

schema_rewrite_job = define_asset_job(
    "schema_rewrite_job",
    selection=AssetSelection.assets(schema_rewrite),
    description=(
        "The rewrite declared in a topic table's danube.rewrite property, for one UTC day "
        "(partition key day|topic); backfill it over a range of days. Not scheduled."
    ),
)

freshness_check_job = define_asset_job(
    "freshness_check_job",
    selection=AssetSelection.checks(fresh),
    description=(
        "The iceberg_table check `fresh` alone, for one topic (run tag dagster/partition): "
        "requested by freshness_sensor when a topic turns stale or fresh again."
    ),
)

commit_checks_job = define_asset_job(
    "commit_checks_job",
    selection=AssetSelection.checks(*commit_checks),
    description=(
        "The exactly-once checks of segment_objects and iceberg_table (every check but `fresh`) "
        "for one topic (run tag dagster/partition): requested by commit_checks_sensor after the "
        "continuous writer committed to the topic, since the writer's runless commits run no check."
    ),
)

bulk_load_job = define_asset_job(
    "bulk_load_job",
    selection=AssetSelection.assets(bulk_table),
    description=(
        "Spark bulk load of one topic's segment objects into its table or a target table "
        "(run config ops.bulk_table.config: target, from_offset, replay). Not scheduled."
    ),
)
