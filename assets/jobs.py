"""Jobs over the tiering assets.

An asset selection includes the asset checks of the selected assets (:mod:`assets.checks`), so
``tiering_job`` runs them after their assets. Both jobs are partitioned by topic, as their
assets are.
"""

from __future__ import annotations

from dagster import AssetSelection, define_asset_job

from assets.assets import compacted_table, iceberg_table, retention, segment_objects

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
