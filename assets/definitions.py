"""The one Dagster ``Definitions`` of Danube Pipeline (``[tool.dagster] module_name``).

Run ``dagster dev -m assets.definitions`` for the UI plus the daemon, or materialize from the
command line::

    DAGSTER_HOME=$PWD/dagster_home dagster asset materialize -m assets.definitions \\
        --select segment_objects,iceberg_table --partition default.flights

Resources resolve their endpoints from the ``DANUBE_*`` environment at run time
(:mod:`danube_pipeline.settings`).
"""

from __future__ import annotations

from dagster import Definitions

from assets.assets import compacted_table, iceberg_table, segment_objects
from assets.jobs import compaction_job, tiering_job
from assets.resources import (
    BrokerResource,
    EtcdResource,
    IcebergCatalogResource,
    ObjectStoreResource,
    SparkResource,
)
from assets.schedules import compaction_schedule
from assets.sensors import sealed_segments_sensor, topic_partitions_sensor


def default_resources() -> dict[str, object]:
    """The resources keyed as the assets and sensors ask for them, all from the environment."""
    return {
        "etcd": EtcdResource(),
        "broker": BrokerResource(),
        "object_store": ObjectStoreResource(),
        "iceberg_catalog": IcebergCatalogResource(),
        "spark": SparkResource(),
    }


defs = Definitions(
    assets=[segment_objects, iceberg_table, compacted_table],
    jobs=[tiering_job, compaction_job],
    schedules=[compaction_schedule],
    sensors=[topic_partitions_sensor, sealed_segments_sensor],
    resources=default_resources(),
)
