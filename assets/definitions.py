"""The one Dagster ``Definitions`` of Danube Pipeline (``[tool.dagster] module_name``).

Run ``dg dev -m assets.definitions`` for the UI plus the daemon (``make dev`` does, with the
environment below set), or materialize from the command line::

    dg launch -m assets.definitions --assets segment_objects,iceberg_table --partition default.flights
    dg launch -m assets.definitions --assets schema_rewrite --partition '2026-11-20|default.flights'
    dg launch -m assets.definitions --assets compacted_table --partition '2026-11-20|default.flights'

Backfill a range of days, as the UI's "Materialize" over a day range does, with Dagster's CLI
(one run per (day, topic) partition; the keys are listed because a key range of a
multi-partitioned job runs through every topic between its ends)::

    dagster job backfill -m assets.definitions -j compaction_job --noprompt \
        --partitions '2026-11-18|default.flights,2026-11-19|default.flights,2026-11-20|default.flights'

(the daemon started by ``dg dev`` or ``dagster-daemon run`` executes it). Every command runs
with ``DAGSTER_HOME=$PWD/dagster_home`` and ``DANUBE_DAGSTER_STORAGE`` set
(``dagster_home/README.md``). Every schedule and sensor is on by default
(``DefaultScheduleStatus.RUNNING``, ``DefaultSensorStatus.RUNNING``).

Resources take their endpoints and paths from the ``DANUBE_*`` environment through ``EnvVar``
(resolved when a run or sensor starts; ``danube_pipeline.settings.environment`` sets them all
for a local deployment, and ``danube-pipeline demo`` / ``dev`` export them).
"""

from __future__ import annotations

from typing import Any

from dagster import ConfigurableResource, Definitions, EnvVar, in_process_executor

from assets.assets import compacted_table, iceberg_table, retention, schema_rewrite, segment_objects
from assets.bulk import bulk_table
from assets.checks import tiering_checks
from assets.jobs import (
    bulk_load_job,
    commit_checks_job,
    compaction_job,
    freshness_check_job,
    retention_job,
    schema_rewrite_job,
    tiering_job,
)
from assets.resources import (
    BrokerResource,
    EtcdResource,
    IcebergCatalogResource,
    ObjectStoreResource,
    SparkResource,
)
from assets.schedules import compaction_schedule, retention_schedule
from assets.sensors import commit_checks_sensor, freshness_sensor, sealed_segments_sensor, topic_partitions_sensor


def default_resources() -> dict[str, ConfigurableResource[Any]]:
    """The resources keyed as the assets, checks and sensors ask for them.

    Returns:
        ``etcd``, ``broker``, ``object_store``, ``iceberg_catalog`` and ``spark``, each
        reading its endpoints from ``DANUBE_ETCD_ENDPOINTS``, ``DANUBE_BROKER_ADDRESSES``,
        ``DANUBE_OBJECT_STORE_URL``, ``DANUBE_CATALOG_NAME``, ``DANUBE_CATALOG_URI`` and
        ``DANUBE_WAREHOUSE`` when a run starts.
    """
    catalog_name = EnvVar("DANUBE_CATALOG_NAME")
    catalog_uri = EnvVar("DANUBE_CATALOG_URI")
    warehouse = EnvVar("DANUBE_WAREHOUSE")
    return {
        "etcd": EtcdResource(endpoints=EnvVar("DANUBE_ETCD_ENDPOINTS")),
        "broker": BrokerResource(bootstrap_addresses=EnvVar("DANUBE_BROKER_ADDRESSES")),
        "object_store": ObjectStoreResource(root_url=EnvVar("DANUBE_OBJECT_STORE_URL")),
        "iceberg_catalog": IcebergCatalogResource(name=catalog_name, uri=catalog_uri, warehouse=warehouse),
        "spark": SparkResource(catalog_name=catalog_name, catalog_uri=catalog_uri, warehouse=warehouse),
    }


defs = Definitions(
    assets=[segment_objects, iceberg_table, compacted_table, retention, schema_rewrite, bulk_table],
    asset_checks=tiering_checks,
    jobs=[
        tiering_job,
        compaction_job,
        retention_job,
        schema_rewrite_job,
        freshness_check_job,
        commit_checks_job,
        bulk_load_job,
    ],
    schedules=[compaction_schedule, retention_schedule],
    sensors=[topic_partitions_sensor, sealed_segments_sensor, commit_checks_sensor, freshness_sensor],
    resources=default_resources(),
    # Every step of a run in the run's own process. Dagster's default (the multiprocess
    # executor) starts one Python process per step, each importing Dagster, pyiceberg and
    # pyarrow again: a tiering run's nine steps (two assets, seven checks) took 29-31 s for
    # 1.5 s of work (benchmarks/README.md, "Dagster runs"). The steps of a run depend on one
    # another or are checks of a second or less, so running them in parallel gained nothing.
    executor=in_process_executor,
)
