"""What the Dagster UI shows about the tables, on a real etcd, object store and Iceberg catalog:
Dagster's standard metadata keys on the commits, the tables' freshness policy, and the blocking
``complete`` check (rows plus dead letters against the descriptors, per UTC day), which keeps
the assets downstream of a table that lost rows from running."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from dagster import (
    AssetCheckSeverity,
    AssetKey,
    AssetSelection,
    DagsterInstance,
    asset,
    instance_for_test,
    materialize,
)
from dagster._core.definitions.freshness import TimeWindowFreshnessPolicy
from tiering_helpers import PUBLISH_TIME_US, avro, avro_records, make_env, record

from assets import checks
from assets.assets import TABLE_FRESHNESS_POLICY, iceberg_table
from assets.checks import COMPLETENESS_CHECK, commit_checks, complete, tiering_checks
from assets.definitions import defs
from assets.metadata import PARTITION_ROW_COUNT, ROW_COUNT, TABLE_NAME
from assets.partitions import topics_partitions
from assets.resources import EtcdResource, IcebergCatalogResource, ObjectStoreResource
from danube_pipeline.lake.freshness import freshness_limit_s
from danube_pipeline.names import TopicName

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _one_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """No writer races these tests: a failed count need not be read again (5 readings, 1 s apart)."""
    monkeypatch.setattr(checks, "SETTLE_ATTEMPTS", 1)

SCHEMA = avro({"name": "n", "type": "long"})
DAY_US = 86_400_000_000


@asset(partitions_def=topics_partitions, deps=[iceberg_table])
def downstream_of_table() -> None:
    """A stand-in for the maintenance assets: runs only when the blocking check lets it."""


def _resources(etcd_endpoints: list[str], tmp_path: Path, objects_url: str) -> dict[str, Any]:
    return {
        "etcd": EtcdResource(endpoints=",".join(etcd_endpoints)),
        "object_store": ObjectStoreResource(root_url=objects_url),
        "iceberg_catalog": IcebergCatalogResource(
            name="danube", uri=f"sqlite:///{tmp_path / 'catalog.db'}", warehouse=(tmp_path / "warehouse").as_uri()
        ),
    }


def _add_partition(instance: DagsterInstance, topic: TopicName) -> None:
    instance.add_dynamic_partitions(topics_partitions.name or "topics", [topic.partition_key])


@pytest.mark.unit
def test_the_complete_check_is_blocking_and_always_registered() -> None:
    [spec] = complete.check_specs
    assert spec.blocking and spec.name == COMPLETENESS_CHECK and spec.asset_key == AssetKey("iceberg_table")
    assert complete in commit_checks and complete in tiering_checks
    assert spec.key in defs.resolve_asset_graph().asset_check_keys
    policy = iceberg_table.specs_by_key[AssetKey("iceberg_table")].freshness_policy
    assert policy is TABLE_FRESHNESS_POLICY and isinstance(policy, TimeWindowFreshnessPolicy)
    assert policy.fail_window.to_timedelta() == dt.timedelta(seconds=max(60.0, freshness_limit_s()))


def test_complete_counts_rows_and_dead_letters_per_day_and_fails_on_a_lost_row(
    etcd_endpoints: list[str], tmp_path: Path
) -> None:
    """Two days of rows and one dead letter add up; a row deleted from the second day fails
    the check with severity ERROR and names that day."""
    topic = TopicName("default", "complete-days")
    env = make_env(etcd_endpoints, tmp_path)
    env.registry.add_avro(1, 1, SCHEMA)
    first = avro_records(SCHEMA, 1, [(o, {"n": o}) for o in range(4)])
    second = [dataclasses.replace(r, publish_time_us=PUBLISH_TIME_US + DAY_US + r.offset)
              for r in avro_records(SCHEMA, 1, [(o, {"n": o}) for o in range(4, 7)])]
    bad = record(7, b"\xff\xff", 1, 1)  # dead-lettered: does not decode with the schema
    bad = dataclasses.replace(bad, publish_time_us=PUBLISH_TIME_US + DAY_US + 7)
    asyncio.run(env.put(first, topic))
    asyncio.run(env.put([*second, bad], topic))
    report = asyncio.run(env.tier(topic))
    assert (report.rows_appended, report.dead_letter_records) == (7, 1)
    resources = _resources(etcd_endpoints, tmp_path, env.objects.root_url)

    def run_check(instance: DagsterInstance) -> Any:
        # a checks-only selection takes its partition from the run tag (as commit_checks_job's runs)
        result = materialize([iceberg_table, complete], selection=AssetSelection.checks(complete),
                             tags={"dagster/partition": topic.partition_key}, resources=resources, instance=instance,
                             raise_on_error=False)
        [evaluation] = result.get_asset_check_evaluations()
        return evaluation

    with instance_for_test() as instance:
        _add_partition(instance, topic)
        passed = run_check(instance)
        env.table(topic).delete("_offset = 5")
        failed = run_check(instance)
    assert passed.passed, passed.metadata
    by_day = passed.metadata["by_day"].value
    day1 = dt.datetime.fromtimestamp(PUBLISH_TIME_US / 1e6, dt.UTC).date()
    assert [(d["day"], d["rows"], d["dead_letters"], d["covered"]) for d in by_day] == [
        (day1.isoformat(), 4, 0, 4), ((day1 + dt.timedelta(days=1)).isoformat(), 3, 1, 4),
    ]
    assert passed.metadata["descriptor_records"].value == 8
    assert not failed.passed and failed.severity == AssetCheckSeverity.ERROR
    assert failed.metadata["missing_rows"].value == 1 and failed.metadata["days_failed"].value == 1
    assert failed.metadata["by_day"].value[0]["day"] == (day1 + dt.timedelta(days=1)).isoformat()
    assert "1 days do not add up" in (failed.description or "")


def test_a_failed_complete_check_blocks_downstream_and_commits_carry_standard_metadata(
    etcd_endpoints: list[str], tmp_path: Path
) -> None:
    """``iceberg_table`` commits with ``dagster/row_count`` and ``dagster/table_name``; while its
    rows add up the downstream asset runs in the same run; once a row is lost it does not."""
    topic = TopicName("default", "complete-blocking")
    env = make_env(etcd_endpoints, tmp_path)
    asyncio.run(env.put([record(o, f"m-{o}".encode()) for o in range(5)], topic))  # no schema: bytes
    resources = _resources(etcd_endpoints, tmp_path, env.objects.root_url)

    def run() -> Any:
        return materialize([iceberg_table, complete, downstream_of_table], partition_key=topic.partition_key,
                           resources=resources, instance=instance, raise_on_error=False)

    with instance_for_test() as instance:
        _add_partition(instance, topic)
        ok = run()
        env.table(topic).delete("_offset = 2")
        blocked = run()
    assert ok.success
    [mat] = ok.asset_materializations_for_node("iceberg_table")
    assert mat.metadata[ROW_COUNT].value == 5 and mat.metadata[PARTITION_ROW_COUNT].value == 5
    assert mat.metadata[TABLE_NAME].value == "danube.default.complete-blocking"
    assert ok.asset_materializations_for_node("downstream_of_table")
    [check] = ok.get_asset_check_evaluations()
    assert check.passed
    [check] = blocked.get_asset_check_evaluations()
    assert not check.passed and check.metadata["missing_rows"].value == 1
    assert not blocked.success
    assert blocked.asset_materializations_for_node("downstream_of_table") == []
    assert ok.is_node_success("downstream_of_table") and not blocked.is_node_success("downstream_of_table")
    started = [e for e in blocked.events_for_node("downstream_of_table") if e.event_type_value == "STEP_START"]
    assert started == []  # never started
