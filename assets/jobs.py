"""Jobs over the tiering assets.

An asset selection includes the asset checks of the selected assets (:mod:`assets.checks`), so
``tiering_job`` runs them after their assets. The jobs are partitioned as their assets are: by
topic, and ``schema_rewrite_job`` by (topic, day).
"""

from __future__ import annotations

from dagster import AssetSelection, define_asset_job

from assets.assets import compacted_table, iceberg_table, retention, schema_rewrite, segment_objects

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
    description="Spark rewrite_data_files on one topic's Iceberg table.",
)

retention_job = define_asset_job(
    "retention_job",
    selection=AssetSelection.assets(retention),
    description=(
        "One topic's namespace retention: expired table rows, snapshots, orphan files, object "
        "descriptors and objects deleted; the broker's local WAL retention applied."
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
