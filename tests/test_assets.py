"""The Dagster definitions, and the tiering assets and their checks against a real etcd and broker."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from dagster import (
    AssetCheckEvaluation,
    AssetKey,
    AssetsDefinition,
    AssetSelection,
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    Definitions,
    DynamicPartitionsDefinition,
    EnvVar,
    ExecuteInProcessResult,
    RunRequest,
    SensorResult,
    build_sensor_context,
    instance_for_test,
    materialize,
)
from helpers import eventually_sync

from assets.assets import TIERING_RETRY_POLICY, compacted_table, iceberg_table, retention, segment_objects
from assets.checks import tiering_checks
from assets.definitions import default_resources, defs
from assets.partitions import TOPICS_PARTITIONS_NAME, topic_days_partitions
from assets.resources import BrokerResource, EtcdResource, ObjectStoreResource
from assets.sensors import (
    MAX_RETRIES_TAG,
    SEALED_END_TAG,
    TIERING_RUN_MAX_RETRIES,
    sealed_segments_sensor,
    topic_partitions_sensor,
)
from danube_pipeline.lake import iceberg
from danube_pipeline.dev import flights
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.descriptors import read_descriptors
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import ObjectDescriptor
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore, segment_object_path

TOPIC = TopicName.parse(flights.FLIGHTS_TOPIC)
REPO = Path(__file__).resolve().parents[1]
CHECK_NAMES = {
    "descriptors_contiguous",
    "objects_exist_with_recorded_size",
    "offsets_match_descriptors",
    "row_count_matches_descriptors",
    "no_duplicate_offsets",
    "complete",
    "fresh",
}
TIERING_ASSETS: list[AssetsDefinition] = [segment_objects, iceberg_table, *tiering_checks]


@pytest.mark.unit
def test_definitions_load() -> None:
    Definitions.validate_loadable(defs)
    tiering = defs.resolve_job_def("tiering_job")
    assert {k.to_user_string() for k in tiering.asset_layer.executable_asset_keys} == {
        "segment_objects",
        "iceberg_table",
    }
    # the job's runs execute the checks of its assets
    nodes = {node.name for node in tiering.graph.nodes}
    assert {f"segment_objects_{n}" for n in ("descriptors_contiguous", "objects_exist_with_recorded_size")} <= nodes
    assert {
        f"iceberg_table_{n}"
        for n in ("offsets_match_descriptors", "row_count_matches_descriptors", "no_duplicate_offsets")
    } <= nodes
    compaction = defs.resolve_job_def("compaction_job")
    assert {k.to_user_string() for k in compaction.asset_layer.executable_asset_keys} == {"compacted_table"}
    assert defs.resolve_schedule_def("compaction_schedule").cron_schedule == "0 * * * *"
    retention_job = defs.resolve_job_def("retention_job")
    assert {k.to_user_string() for k in retention_job.asset_layer.executable_asset_keys} == {"retention"}
    retention_schedule_def = defs.resolve_schedule_def("retention_schedule")
    assert retention_schedule_def.cron_schedule == "30 * * * *" and retention_schedule_def.job_name == "retention_job"
    assert defs.resolve_sensor_def("topic_partitions_sensor") is not None
    assert defs.resolve_sensor_def("sealed_segments_sensor").job_name == "tiering_job"
    assert defs.resolve_sensor_def("freshness_sensor") is not None
    graph = defs.resolve_asset_graph()
    assert graph.get(AssetKey("iceberg_table")).parent_keys == {AssetKey("segment_objects")}
    assert graph.get(AssetKey("compacted_table")).parent_keys == {AssetKey("iceberg_table")}
    assert graph.get(AssetKey("retention")).parent_keys == {AssetKey("iceberg_table")}
    checks = {k.name: k for k in graph.asset_check_keys}
    assert set(checks) == CHECK_NAMES
    partitioned = [
        *(graph.get(AssetKey(name)).partitions_def for name in ("segment_objects", "iceberg_table")),
        *(graph.get(check_key).partitions_def for check_key in graph.asset_check_keys),
    ]
    for partitions_def in partitioned:
        assert isinstance(partitions_def, DynamicPartitionsDefinition)
        assert partitions_def.name == TOPICS_PARTITIONS_NAME
    # the maintenance assets: topic x UTC day
    for name in ("compacted_table", "retention", "schema_rewrite"):
        assert graph.get(AssetKey(name)).partitions_def == topic_days_partitions
        assert graph.get(AssetKey(name)).group_name == "maintenance"
    assert set(topic_days_partitions.partition_dimension_names) == {"topic", "day"}
    assert checks["descriptors_contiguous"].asset_key == AssetKey("segment_objects")
    assert checks["no_duplicate_offsets"].asset_key == AssetKey("iceberg_table")


@pytest.mark.unit
def test_resources_read_endpoints_through_env_vars() -> None:
    resources = defs.resources
    assert resources is not None
    bound = {
        ("etcd", "endpoints"): "DANUBE_ETCD_ENDPOINTS",
        ("broker", "bootstrap_addresses"): "DANUBE_BROKER_ADDRESSES",
        ("object_store", "root_url"): "DANUBE_OBJECT_STORE_URL",
        ("iceberg_catalog", "name"): "DANUBE_CATALOG_NAME",
        ("iceberg_catalog", "uri"): "DANUBE_CATALOG_URI",
        ("iceberg_catalog", "warehouse"): "DANUBE_WAREHOUSE",
        ("spark", "catalog_name"): "DANUBE_CATALOG_NAME",
        ("spark", "catalog_uri"): "DANUBE_CATALOG_URI",
        ("spark", "warehouse"): "DANUBE_WAREHOUSE",
    }
    for (resource, field), variable in bound.items():
        value = getattr(resources[resource], field)
        assert isinstance(value, EnvVar) and value.env_var_name == variable, (resource, field)


@pytest.mark.unit
def test_tiering_assets_retry_their_steps() -> None:
    for asset_def in (segment_objects, iceberg_table, retention):
        assert asset_def.op.retry_policy == TIERING_RETRY_POLICY
    assert TIERING_RETRY_POLICY.max_retries >= 1
    assert [TIERING_RETRY_POLICY.calculate_delay(n) for n in (1, 2, 3)] == [2.0, 6.0, 14.0]


@pytest.mark.unit
def test_instance_config_enables_run_retries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dagster_home/dagster.yaml turns on the daemon's run retries that the sensor's
    ``dagster/max_retries`` tag relies on, for step failures too."""
    monkeypatch.setenv("DANUBE_DAGSTER_STORAGE", str(tmp_path))
    with DagsterInstance.from_config(str(REPO / "dagster_home")) as instance:
        assert instance.run_retries_enabled
        assert instance.run_retries_retry_on_asset_or_op_failure


_ = compacted_table  # imported so a broken module fails collection here too


# --------------------------------------------------------------------------- integration


async def _produce(address: str, *, skip_records: int, send_records: int, seal: bool = True) -> int:
    """Publish flights ``skip_records`` .. ``skip_records + send_records - 1`` with their Avro
    schema, then seal the active segment unless ``seal`` is false; returns the last offset."""
    from danube_pipeline.client import AvroSchema, DanubeClient

    async with DanubeClient([address]) as client:
        schema = AvroSchema(subject=flights.FLIGHTS_SUBJECT, raw_schema=flights.FLIGHT_AVRO_SCHEMA_JSON)
        async with client.producer(flights.FLIGHTS_TOPIC, producer_name="test-loader", schema=schema) as producer:
            futures = []
            for i, flight in enumerate(flights.iter_flights(skip_records + send_records)):
                if i >= skip_records:
                    futures.append(producer.send_nowait(flights.encode_flight(flight), attributes={"origin": flight["origin"]}))
            offsets = await asyncio.gather(*futures)
        if seal:
            await client.admin.seal_active_segment(flights.FLIGHTS_TOPIC)
    return int(offsets[-1])


async def _read_descriptors(endpoints: list[str]) -> tuple[list[ObjectDescriptor], str | None]:
    async with await MetadataStore.connect(endpoints) as store:
        return await read_descriptors(store, TOPIC)


def _meta(result: ExecuteInProcessResult, node: str) -> dict[str, Any]:
    [mat] = result.asset_materializations_for_node(node)
    return {k: v.value for k, v in mat.metadata.items()}


def _checks(result: ExecuteInProcessResult) -> dict[str, AssetCheckEvaluation]:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def _failed_checks(result: ExecuteInProcessResult) -> set[str]:
    evaluations = _checks(result)
    assert set(evaluations) == CHECK_NAMES
    return {name for name, e in evaluations.items() if not e.passed}


def _values(evaluation: AssetCheckEvaluation) -> dict[str, Any]:
    return {k: v.value for k, v in evaluation.metadata.items()}


@dataclass
class Cluster:
    broker: BrokerProcess
    etcd_endpoints: list[str]
    object_store_url: str


@pytest.fixture
def cluster(
    etcd_endpoints: list[str],
    start_broker: Callable[..., BrokerProcess],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Cluster:
    """A broker with small segments, and every ``DANUBE_*`` variable pointing at it and at a
    fresh object store and catalog under ``tmp_path``."""
    home = tmp_path / "danube"
    # the broker on the assets' object store (both check its identity: storage/identity.py)
    broker = start_broker(
        segment_max_bytes=64 * 1024, segment_max_age_s=600.0, extra_args=["--object-store-url", (home / "objects").as_uri()]
    )
    env = {
        "DANUBE_HOME": str(home),
        "DANUBE_ETCD_ENDPOINTS": ",".join(etcd_endpoints),
        "DANUBE_BROKER_ADDRESSES": broker.address,
        "DANUBE_OBJECT_STORE_URL": (home / "objects").as_uri(),
        "DANUBE_CATALOG_URI": f"sqlite:///{home / 'catalog.db'}",
        "DANUBE_WAREHOUSE": (home / "warehouse").as_uri(),
        "DANUBE_CATALOG_NAME": "danube",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return Cluster(broker, etcd_endpoints, env["DANUBE_OBJECT_STORE_URL"])


@pytest.fixture
def instance() -> Iterator[DagsterInstance]:
    with instance_for_test() as instance:
        instance.add_dynamic_partitions(TOPICS_PARTITIONS_NAME, [TOPIC.partition_key])
        yield instance


def _materialize(instance: DagsterInstance, resources: dict[str, Any] | None = None) -> ExecuteInProcessResult:
    """Materialize the two tiering assets of the topic; the run picks up their checks."""
    return materialize(
        TIERING_ASSETS,
        selection=AssetSelection.assets(segment_objects, iceberg_table),
        partition_key=TOPIC.partition_key,
        resources=resources or default_resources(),
        instance=instance,
        raise_on_error=False,
    )


def _run_checks(instance: DagsterInstance) -> ExecuteInProcessResult:
    """A run of the checks alone (the run fails when the blocking ``complete`` does).
    ``materialize(partition_key=…)`` wants a selected asset to validate the key against, so the
    partition goes in as the run's partition tag."""
    result = materialize(
        TIERING_ASSETS,
        selection=AssetSelection.checks(*tiering_checks),
        tags={"dagster/partition": TOPIC.partition_key},
        resources=default_resources(),
        instance=instance,
        raise_on_error=False,  # a failed blocking check (``complete``) fails the run
    )
    assert not result.asset_materializations_for_node("segment_objects")
    return result


@pytest.mark.integration
def test_tiering_assets_exactly_once(cluster: Cluster, instance: DagsterInstance) -> None:
    assert asyncio.run(_produce(cluster.broker.address, skip_records=0, send_records=3000)) == 2999

    # the topic sensor finds /topics/default/flights and asks for its partition
    found = topic_partitions_sensor(build_sensor_context(instance=instance, resources={"etcd": EtcdResource()}))
    assert isinstance(found, SensorResult) and not found.dynamic_partitions_requests  # the fixture added it
    assert found.skip_reason is None  # nothing to do is no "skipped" line
    with instance_for_test() as empty:
        found = topic_partitions_sensor(build_sensor_context(instance=empty, resources={"etcd": EtcdResource()}))
    assert isinstance(found, SensorResult)
    [add] = found.dynamic_partitions_requests or []
    assert list(add.partition_keys or []) == [TOPIC.partition_key]

    # the sealed-segment sensor asks for one tiering run keyed by the last sealed offset, that
    # the daemon re-executes if it fails
    sensor_resources = {"etcd": EtcdResource(), "broker": BrokerResource()}
    wanted = sealed_segments_sensor(build_sensor_context(instance=instance, resources=sensor_resources))
    assert isinstance(wanted, SensorResult)
    [request] = wanted.run_requests or []
    assert isinstance(request, RunRequest)
    assert request.partition_key == TOPIC.partition_key
    assert request.run_key == f"{TOPIC.partition_key}:2999"
    assert request.tags[SEALED_END_TAG] == "2999"
    assert request.tags[MAX_RETRIES_TAG] == str(TIERING_RUN_MAX_RETRIES)
    # With run retries on but no retries by default, only the sensor's tag makes the daemon
    # re-execute a failed run (the instance marks it dagster/will_retry when it fails).
    tiering_job = defs.resolve_job_def("tiering_job")
    with instance_for_test(overrides={"run_retries": {"enabled": True, "max_retries": 0}}) as retrying:
        for tags, will_retry in ((request.tags, "true"), ({}, "false")):
            run = retrying.create_run_for_job(job_def=tiering_job, tags=tags, status=DagsterRunStatus.STARTED)
            retrying.report_run_failed(run)
            stored = retrying.get_run_by_id(run.run_id)
            assert stored is not None and stored.tags["dagster/will_retry"] == will_retry

    first = _materialize(instance)
    assert first.success
    objects_meta = _meta(first, "segment_objects")
    assert objects_meta["objects_written"] >= 3
    assert objects_meta["first_offset"] == 0 and objects_meta["last_offset"] == 2999
    table_meta = _meta(first, "iceberg_table")
    assert table_meta["rows_appended"] == 3000 and table_meta["row_count"] == 3000
    assert table_meta["committed_end_offset"] == 2999
    assert table_meta["data_files"] == objects_meta["objects_written"]
    catalog = iceberg.load_catalog()
    table = catalog.load_table(("default", "flights"))
    snapshot = table.current_snapshot()
    assert snapshot is not None and table_meta["snapshot_id"] == str(snapshot.snapshot_id)

    # the run that materialized the assets ran their checks too, after them, on the partition
    checks = _checks(first)
    assert set(checks) == CHECK_NAMES
    assert all(c.passed and c.partition == TOPIC.partition_key for c in checks.values())
    assert _values(checks["offsets_match_descriptors"])["committed_end_offset"] == 2999
    assert _values(checks["offsets_match_descriptors"])["descriptors_end_offset"] == 2999
    assert _values(checks["row_count_matches_descriptors"])["table_rows"] == 3000
    assert _values(checks["row_count_matches_descriptors"])["descriptor_records"] == 3000
    assert _values(checks["objects_exist_with_recorded_size"])["objects_checked"] == objects_meta["objects_written"]
    latest = instance.event_log_storage.get_latest_asset_check_execution_by_key(
        [e.asset_check_key for e in checks.values()]
    )
    assert {record.run_id for record in latest.values()} == {first.run_id}

    snapshots = len(table.snapshots())
    assert snapshots == objects_meta["objects_written"]

    # a second run changes nothing, and its metadata leaves out nothing it knows
    second = _materialize(instance)
    assert second.success
    assert _meta(second, "segment_objects")["objects_written"] == 0
    assert _meta(second, "iceberg_table")["rows_appended"] == 0
    assert _meta(second, "iceberg_table")["row_count"] == 3000
    table = catalog.load_table(("default", "flights"))
    assert iceberg.row_count(table) == 3000
    assert len(table.snapshots()) == snapshots
    idle = sealed_segments_sensor(build_sensor_context(instance=instance, resources=sensor_resources))
    assert isinstance(idle, SensorResult) and not idle.run_requests and idle.skip_reason is None

    # the typed columns hold the decoded flights
    rows = table.scan(selected_fields=("_offset", "carrier", "origin", "dep_delay", "_schema_id")).to_arrow()
    by_offset = {r["_offset"]: r for r in rows.to_pylist()}
    for i, flight in enumerate(flights.iter_flights(3)):
        assert by_offset[i]["carrier"] == flight["carrier"]
        assert by_offset[i]["origin"] == flight["origin"]
        assert by_offset[i]["dep_delay"] == flight["dep_delay"]
        assert by_offset[i]["_schema_id"] > 0

    # more messages: the Definitions' own job (resources from EnvVar) tiers only the new
    # segments, and runs the checks
    assert asyncio.run(_produce(cluster.broker.address, skip_records=3000, send_records=500)) == 3499
    third = defs.resolve_job_def("tiering_job").execute_in_process(partition_key=TOPIC.partition_key, instance=instance)
    assert third.success
    assert _meta(third, "segment_objects")["objects_written"] >= 1
    assert _meta(third, "iceberg_table")["rows_appended"] == 500
    assert _meta(third, "iceberg_table")["row_count"] == 3500
    assert _failed_checks(third) == set()
    assert _values(_checks(third)["row_count_matches_descriptors"])["table_rows"] == 3500
    table = catalog.load_table(("default", "flights"))
    assert iceberg.read_offsets(table) == list(range(3500))
    assert iceberg.committed_end_offset(table) == 3499

    descriptors, cur = asyncio.run(_read_descriptors(cluster.etcd_endpoints))
    store = ObjectStore(cluster.object_store_url)
    expected_start = 0
    for d in descriptors:
        assert d.completed
        assert d.start_offset == expected_start
        assert d.object_id == f"data-{d.start_offset}-{d.end_offset}.dnb1"
        info = store.info(segment_object_path(TOPIC, d.object_id), compute_etag=True)
        assert info is not None and info.size_bytes == d.size and info.etag == d.etag
        assert d.offset_index[0] == [d.start_offset, 32]
        expected_start = d.end_offset + 1
    assert expected_start == 3500
    assert cur == keys.pad_offset(descriptors[-1].start_offset)


@pytest.mark.integration
def test_metadata_leaves_out_unknown_offsets(cluster: Cluster, instance: DagsterInstance) -> None:
    """A topic with nothing sealed yet: no offsets, no snapshot, and no -1 in their place."""
    assert asyncio.run(_produce(cluster.broker.address, skip_records=0, send_records=10, seal=False)) == 9
    result = _materialize(instance)
    assert result.success
    objects_meta = _meta(result, "segment_objects")
    assert objects_meta["objects_written"] == 0
    assert not {"first_offset", "last_offset", "objects_cur"} & set(objects_meta)
    table_meta = _meta(result, "iceberg_table")
    assert not {"committed_end_offset", "snapshot_id", "row_count"} & set(table_meta)
    assert -1 not in [*objects_meta.values(), *table_meta.values()]
    # nothing tiered and no table agree with each other
    assert _failed_checks(result) == set()
    assert "committed_end_offset" not in _values(_checks(result)["offsets_match_descriptors"])


@pytest.mark.integration
def test_failed_step_is_retried_within_the_run(
    cluster: Cluster, instance: DagsterInstance, tmp_path: Path
) -> None:
    """The object store's root lies under a regular file, so the first attempt of
    ``segment_objects`` fails for real; once the file is replaced (atomically) by a link to the
    cluster's store directory, Dagster's retry succeeds."""
    assert asyncio.run(_produce(cluster.broker.address, skip_records=0, send_records=1000)) == 999
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    resources = {**default_resources(), "object_store": ObjectStoreResource(root_url=(blocker / "objects").as_uri())}

    def retries() -> list[Any]:
        return [
            event
            for run in instance.get_runs()
            for event in instance.all_logs(run.run_id, of_type=DagsterEventType.STEP_UP_FOR_RETRY)
        ]

    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(_materialize, instance, resources)
        # The first retry starts TIERING_RETRY_POLICY.delay (2 s) after the failure.
        eventually_sync(lambda: bool(retries()) or running.done(), timeout_s=120, what="a step retry or the run's end")
        found = retries()
        assert found, "segment_objects failed without a retry"
        first_retry = found[0]
        assert first_retry.step_key == "segment_objects"
        retry_data = first_retry.dagster_event.event_specific_data
        assert "NotADirectoryError" in retry_data.error.to_string()
        assert retry_data.seconds_to_wait == TIERING_RETRY_POLICY.calculate_delay(1)
        assert not any(d.completed for d in asyncio.run(_read_descriptors(cluster.etcd_endpoints))[0])
        # the store becomes the cluster's (its identity marker included) before the retry starts
        link = tmp_path / "link-to-the-store"
        link.symlink_to(Path(cluster.object_store_url.removeprefix("file://")).parent, target_is_directory=True)
        os.replace(link, blocker)
        result = running.result(timeout=120)

    assert result.success  # after one retry, or more if a retry started before the unlink
    assert all(e.step_key == "segment_objects" for e in retries())
    assert _meta(result, "segment_objects")["last_offset"] == 999
    assert _meta(result, "iceberg_table")["row_count"] == 1000
    assert _failed_checks(result) == set()


async def _delete_descriptor(endpoints: list[str], descriptor: ObjectDescriptor) -> None:
    async with await MetadataStore.connect(endpoints) as store:
        assert await store.delete(keys.object_descriptor(TOPIC, descriptor.start_offset))


async def _put_descriptor(endpoints: list[str], descriptor: ObjectDescriptor) -> None:
    async with await MetadataStore.connect(endpoints) as store:
        await store.put(keys.object_descriptor(TOPIC, descriptor.start_offset), descriptor)


@pytest.mark.integration
def test_checks_fail_when_what_they_check_breaks(
    cluster: Cluster, instance: DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each check passes on tiered data and fails when its condition is really broken: an
    object deleted or resized, a descriptor deleted in etcd, rows appended twice to the table.

    No writer races this test, so a check comparing the table with the descriptors takes its
    readings (``SETTLE_ATTEMPTS``, all of them when it fails) without the pause between them."""
    monkeypatch.setattr("assets.checks.SETTLE_INTERVAL_S", 0.0)
    assert asyncio.run(_produce(cluster.broker.address, skip_records=0, send_records=3000)) == 2999
    tiered = _materialize(instance)
    assert tiered.success
    assert _failed_checks(tiered) == set()  # the run evaluated every check on what it tiered
    descriptors, _ = asyncio.run(_read_descriptors(cluster.etcd_endpoints))
    assert len(descriptors) >= 3
    middle, last = descriptors[1], descriptors[-1]
    store = ObjectStore(cluster.object_store_url)
    path = segment_object_path(TOPIC, middle.object_id)
    data = store.get_bytes(path)

    # an object is gone
    store.delete(path)
    result = _run_checks(instance)
    assert _failed_checks(result) == {"objects_exist_with_recorded_size"}
    values = _values(_checks(result)["objects_exist_with_recorded_size"])
    assert values["objects_missing"] == 1 and values["missing_object_ids"] == [middle.object_id]

    # an object is not the size its descriptor records
    store.put_bytes(path, data + b"\0")
    result = _run_checks(instance)
    assert _failed_checks(result) == {"objects_exist_with_recorded_size"}
    assert _values(_checks(result)["objects_exist_with_recorded_size"])["wrong_size_objects"] == [
        {"object_id": middle.object_id, "recorded_size_bytes": len(data), "stored_size_bytes": len(data) + 1}
    ]
    store.put_bytes(path, data)
    assert _failed_checks(_run_checks(instance)) == set()

    # a descriptor in the middle is gone: a gap, and rows no descriptor covers
    asyncio.run(_delete_descriptor(cluster.etcd_endpoints, middle))
    result = _run_checks(instance)
    assert _failed_checks(result) == {"descriptors_contiguous", "row_count_matches_descriptors", "complete"}
    assert _values(_checks(result)["descriptors_contiguous"])["first_gaps"] == [
        {
            "object_id": descriptors[2].object_id,
            "expected_start_offset": descriptors[0].end_offset + 1,
            "start_offset": descriptors[2].start_offset,
        }
    ]
    rows = _values(_checks(result)["row_count_matches_descriptors"])
    assert (rows["table_rows"], rows["descriptor_records"]) == (3000, 3000 - (middle.end_offset - middle.start_offset + 1))
    asyncio.run(_put_descriptor(cluster.etcd_endpoints, middle))

    # the last descriptor is gone: the table is committed past the descriptors
    asyncio.run(_delete_descriptor(cluster.etcd_endpoints, last))
    result = _run_checks(instance)
    assert _failed_checks(result) == {"offsets_match_descriptors", "row_count_matches_descriptors", "complete"}
    offsets = _values(_checks(result)["offsets_match_descriptors"])
    assert (offsets["committed_end_offset"], offsets["descriptors_end_offset"]) == (2999, last.start_offset - 1)
    asyncio.run(_put_descriptor(cluster.etcd_endpoints, last))
    assert _failed_checks(_run_checks(instance)) == set()

    # rows appended a second time with pyiceberg, past the exactly-once append
    table = iceberg.load_catalog().load_table(("default", "flights"))
    table.append(table.scan(row_filter="_offset < 10").to_arrow())
    result = _run_checks(instance)
    assert _failed_checks(result) == {"no_duplicate_offsets", "row_count_matches_descriptors", "complete"}
    duplicates = _values(_checks(result)["no_duplicate_offsets"])
    assert duplicates["duplicated_offsets"] == 10 and duplicates["duplicate_rows"] == 10
    assert duplicates["first_duplicated_offsets"] == list(range(10))
    assert _values(_checks(result)["row_count_matches_descriptors"])["table_rows"] == 3010


@pytest.mark.integration
@pytest.mark.asyncio
async def test_field_removed_by_a_later_schema_keeps_its_old_values(etcd_endpoints: Any, tmp_path: Path) -> None:
    """Tiering that runs after a field was removed (v2) still writes the v1 records' values."""
    import io
    import json

    import fastavro

    from danube_pipeline.format.records import Record
    from danube_pipeline.schemas.registry import SchemaRegistry
    from danube_pipeline.lake.schema_lookup import _schemas_for

    v1 = {"type": "record", "name": "R", "fields": [{"name": "a", "type": "int"}, {"name": "b", "type": "string"}]}
    v2 = {"type": "record", "name": "R", "fields": [{"name": "a", "type": "int"}]}

    def record(offset: int, version: int, schema: dict[str, Any], value: dict[str, Any]) -> Record:
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), value)
        return Record(offset, 1, 1, "p", schema_id, version, buf.getvalue(), {})

    async with await MetadataStore.connect(etcd_endpoints) as store:
        registry = SchemaRegistry(store)
        first = await registry.register_avro("evolving", json.dumps(v1))
        second = await registry.register_avro("evolving", json.dumps(v2))
        schema_id = first.schema_id
        assert (second.schema_id, second.version) == (schema_id, 2)
        # one object tiered late: two v1 records, then one v2 record
        records = [record(0, 1, v1, {"a": 0, "b": "x0"}), record(1, 1, v1, {"a": 1, "b": "x1"}), record(2, 2, v2, {"a": 2})]
        table_schema, writers = await _schemas_for(records, registry)

    catalog = iceberg.load_catalog(name="t", uri=f"sqlite:///{tmp_path / 'c.db'}", warehouse=(tmp_path / "wh").as_uri())
    topic = TopicName("default", "evolving")
    table = iceberg.ensure_table(catalog, topic, table_schema)
    iceberg.append_records(table, records, table_schema, "data-0-2.dnb1", writer_schemas=writers, first_offset=0)
    rows = sorted(table.scan().to_arrow().select(["_offset", "a", "b"]).to_pylist(), key=lambda r: r["_offset"])
    assert rows == [
        {"_offset": 0, "a": 0, "b": "x0"},
        {"_offset": 1, "a": 1, "b": "x1"},
        {"_offset": 2, "a": 2, "b": None},
    ]
