"""What the sensors add for ``make dev``'s continuous writer, on a real Dagster instance and a
real etcd: ``commit_checks_sensor`` reads the instance's event log and requests
``commit_checks_job`` runs, which evaluate the exactly-once checks on real descriptors, segment
objects and an Iceberg table; ``topic_partitions_sensor`` adds the day partitions from a topic's
first tiered day on."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import time
from pathlib import Path
from typing import Any

import pytest
from dagster._core.test_utils import create_run_for_test
from dagster import AddDynamicPartitionsRequest, AssetKey, DagsterRunStatus, FloatMetadataValue, AssetSelection, DagsterInstance, SensorResult, build_sensor_context, instance_for_test, materialize
from tiering_helpers import PUBLISH_TIME_US, avro, avro_records, make_env

from assets.assets import iceberg_table, segment_objects
from assets.checks import commit_checks, tiering_checks
from assets.continuous_writer import DagsterReporter, TopicPass
from assets.definitions import defs
from assets.resources import BrokerResource, EtcdResource, IcebergCatalogResource, ObjectStoreResource
from assets.sensors import commit_checks_sensor, topic_partitions_sensor
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.descriptors import read_descriptors
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.lake.tiering import TieringReport

pytestmark = pytest.mark.integration

SCHEMA = avro({"name": "n", "type": "long"})
TOPIC = TopicName("default", "checked")
OTHER = TopicName("default", "quiet")


def _tick(instance: DagsterInstance, cursor: str | None) -> SensorResult:
    result = commit_checks_sensor(build_sensor_context(instance=instance, cursor=cursor))
    assert isinstance(result, SensorResult)
    return result


def test_writer_commits_get_their_exactly_once_checks(etcd_endpoints: list[str], tmp_path: Path) -> None:
    """Two runless commits of one topic since the last tick ask for one check run of that topic
    (none for a topic without commits); the run evaluates the six exactly-once checks, which
    pass; a tick with nothing new requests nothing and gives no skip reason; the next commit
    asks again, once the topic's previous check run has left the queue."""
    env = make_env(etcd_endpoints, tmp_path)
    env.registry.add_avro(1, 1, SCHEMA)
    resources: dict[str, Any] = {
        "etcd": EtcdResource(endpoints=",".join(etcd_endpoints)),
        "object_store": ObjectStoreResource(root_url=env.objects.root_url),
        "iceberg_catalog": IcebergCatalogResource(
            name="danube", uri=f"sqlite:///{tmp_path / 'catalog.db'}", warehouse=(tmp_path / "warehouse").as_uri()
        ),
        "broker": BrokerResource(bootstrap_addresses="127.0.0.1:1"),  # the assets' step is not selected
    }

    def commit(first: int, count: int) -> TopicPass:
        records = avro_records(SCHEMA, 1, [(o, {"n": o}) for o in range(first, first + count)])
        asyncio.run(env.put(records, TOPIC))
        tiering = TieringReport(TOPIC.path, sealed_segments=1, objects_written=1, records_written=count,
                                first_offset=first, last_offset=first + count - 1)
        return TopicPass(TOPIC, first + count - 1, tiering, asyncio.run(env.tier(TOPIC)))

    with instance_for_test() as instance:
        reporter = DagsterReporter(instance, catalog_name="danube", objects=env.objects)
        reporter.prepare()
        instance.add_dynamic_partitions("topics", [OTHER.partition_key])
        assert _tick(instance, None).run_requests == []
        # the writer's way: submitted passes are recorded in order on the reporting thread
        submitted = [reporter.submit(commit(0, 3)), reporter.submit(commit(3, 2))]
        reporter.close()
        assert all(future.result() for future in submitted)
        committed_s = time.time()
        commit_days = instance.get_dynamic_partitions("days")
        [latest] = instance.fetch_materializations(AssetKey("iceberg_table"), limit=1).records
        first = _tick(instance, None)
        [request] = first.run_requests or []
        assert request.tags["dagster/partition"] == TOPIC.partition_key
        result = materialize(
            [segment_objects, iceberg_table, *tiering_checks],
            selection=AssetSelection.checks(*commit_checks),
            tags=dict(request.tags),
            resources=resources,
            instance=instance,
        )
        evaluations = result.get_asset_check_evaluations()
        idle = _tick(instance, first.cursor)
        # a check run of the topic still running: the next commit waits for it
        queued = create_run_for_test(
            instance, job_name="commit_checks_job", status=DagsterRunStatus.STARTED, tags=dict(request.tags)
        )
        assert reporter.report(commit(5, 1))
        waiting = _tick(instance, idle.cursor)
        instance.delete_run(queued.run_id)
        again = _tick(instance, waiting.cursor)
    by_check = {(e.asset_key, e.check_name): e for e in evaluations}
    assert set(by_check) == {
        (AssetKey("segment_objects"), "descriptors_contiguous"),
        (AssetKey("segment_objects"), "objects_exist_with_recorded_size"),
        (AssetKey("iceberg_table"), "offsets_match_descriptors"),
        (AssetKey("iceberg_table"), "row_count_matches_descriptors"),
        (AssetKey("iceberg_table"), "no_duplicate_offsets"),
        (AssetKey("iceberg_table"), "complete"),
    }
    assert all(e.passed and e.partition == TOPIC.partition_key for e in evaluations), evaluations
    assert by_check[(AssetKey("iceberg_table"), "row_count_matches_descriptors")].metadata["table_rows"].value == 5
    # the days from the records' publish day through today, for the maintenance jobs
    published = dt.datetime.fromtimestamp(PUBLISH_TIME_US / 1e6, dt.UTC).date()
    assert commit_days[0] == published.isoformat() and commit_days[-1] == dt.datetime.now(dt.UTC).date().isoformat()
    # the runless commit carries its topic's partition and a publish-to-queryable lag to plot
    mat = latest.asset_materialization
    assert mat is not None and mat.partition == TOPIC.partition_key
    assert mat.metadata["rows_appended"].value == 2  # submitted last, recorded last
    lag = mat.metadata["publish_to_queryable_s"]
    assert isinstance(lag, FloatMetadataValue) and lag.value is not None
    # the records' publish time is PUBLISH_TIME_US; they became queryable just before the tick
    assert abs(lag.value - (committed_s - PUBLISH_TIME_US / 1e6)) < 60
    # the checks' own run wrote no materialization, and nothing was committed since
    assert idle.run_requests == [] and idle.skip_reason is None and idle.cursor == first.cursor
    assert waiting.run_requests == []
    [next_request] = again.run_requests or []
    assert next_request.tags["dagster/partition"] == TOPIC.partition_key
    assert next_request.run_key != request.run_key


def test_commit_checks_job_and_sensor_are_defined() -> None:
    """The one ``Definitions`` holds the job with the six checks and the sensor on it."""
    job = defs.resolve_job_def("commit_checks_job")
    assert {key.name for key in job.asset_layer.asset_graph.asset_check_keys} >= {c.check_key.name for c in commit_checks}
    assert defs.resolve_sensor_def("commit_checks_sensor").job_name == "commit_checks_job"


def test_topic_sensor_adds_days_from_the_first_tiered_day(etcd_endpoints: list[str], tmp_path: Path) -> None:
    """A topic whose oldest completed descriptor was created three days ago gets the day
    partitions of those three days and today, not every day since a fixed date; a topic with
    nothing tiered adds no day; the next tick adds nothing."""
    env = make_env(etcd_endpoints, tmp_path)
    dated, empty = TopicName("default", "dated"), TopicName("default", "empty")
    created = dt.datetime.now(dt.UTC) - dt.timedelta(days=3)

    async def setup() -> None:
        await env.put(avro_records(SCHEMA, 1, [(0, {"n": 0})]), dated)
        async with await MetadataStore.connect(etcd_endpoints) as store:
            [descriptor], _ = await read_descriptors(store, dated)
            aged = dataclasses.replace(descriptor, created_at=int(created.timestamp()))
            await store.put_many([
                (keys.topic_root(dated), 0),
                (keys.topic_root(empty), 0),
                (keys.object_descriptor(dated, descriptor.start_offset), aged.to_json()),
            ])

    asyncio.run(setup())
    resources = {"etcd": EtcdResource(endpoints=",".join(etcd_endpoints))}
    with instance_for_test() as instance:
        first = topic_partitions_sensor(build_sensor_context(instance=instance, resources=resources))
        assert isinstance(first, SensorResult)
        for request in first.dynamic_partitions_requests or []:
            assert isinstance(request, AddDynamicPartitionsRequest)
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        days = instance.get_dynamic_partitions("days")
        topics = instance.get_dynamic_partitions("topics")
        second = topic_partitions_sensor(build_sensor_context(instance=instance, resources=resources, cursor=first.cursor))
    assert sorted(topics) == [dated.partition_key, empty.partition_key]
    assert days == [(created.date() + dt.timedelta(days=n)).isoformat() for n in range(4)]
    assert isinstance(second, SensorResult) and not second.dynamic_partitions_requests and second.skip_reason is None
