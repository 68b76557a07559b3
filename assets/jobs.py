"""Jobs over the tiering assets."""

from __future__ import annotations

from dagster import AssetSelection, define_asset_job

from assets.assets import compacted_table, iceberg_table, segment_objects
from assets.partitions import topics_partitions

tiering_job = define_asset_job(
    "tiering_job",
    selection=AssetSelection.assets(segment_objects, iceberg_table),
    partitions_def=topics_partitions,
    description="Sealed segments → objects + descriptors → Iceberg snapshots, for one topic.",
)

compaction_job = define_asset_job(
    "compaction_job",
    selection=AssetSelection.assets(compacted_table),
    partitions_def=topics_partitions,
    description="Spark rewrite_data_files on one topic's Iceberg table.",
)
