"""The Dagster definitions, and the tiering assets against a real etcd and broker."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from dagster import (
    AssetKey,
    Definitions,
    RunRequest,
    SensorResult,
    SkipReason,
    build_schedule_context,
    build_sensor_context,
    instance_for_test,
    materialize,
)

from assets.assets import compacted_table, iceberg_table, segment_objects
from assets.definitions import default_resources, defs
from assets.partitions import TOPICS_PARTITIONS_NAME
from assets.resources import BrokerResource, EtcdResource, ObjectStoreResource
from assets.schedules import compaction_schedule
from assets.sensors import SEALED_END_TAG, sealed_segments_sensor, topic_partitions_sensor
from danube_pipeline import iceberg
from danube_pipeline.dev import flights
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import ObjectDescriptor, ObjectsCursor
from danube_pipeline.names import TopicName
from danube_pipeline.objectstore import ObjectStore, segment_object_path

TOPIC = TopicName.parse(flights.FLIGHTS_TOPIC)


@pytest.mark.unit
def test_definitions_load() -> None:
    Definitions.validate_loadable(defs)
    tiering = defs.resolve_job_def("tiering_job")
    assert {k.to_user_string() for k in tiering.asset_layer.executable_asset_keys} == {
        "segment_objects",
        "iceberg_table",
    }
    compaction = defs.resolve_job_def("compaction_job")
    assert {k.to_user_string() for k in compaction.asset_layer.executable_asset_keys} == {"compacted_table"}
    assert defs.resolve_schedule_def("compaction_schedule").cron_schedule == "0 * * * *"
    assert defs.resolve_sensor_def("topic_partitions_sensor") is not None
    assert defs.resolve_sensor_def("sealed_segments_sensor").job_name == "tiering_job"
    graph = defs.resolve_asset_graph()
    assert graph.get(AssetKey("iceberg_table")).parent_keys == {AssetKey("segment_objects")}
    assert graph.get(AssetKey("compacted_table")).parent_keys == {AssetKey("iceberg_table")}
    for key in ("segment_objects", "iceberg_table", "compacted_table"):
        assert graph.get(AssetKey(key)).partitions_def.name == TOPICS_PARTITIONS_NAME  # type: ignore[union-attr]


@pytest.mark.unit
def test_compaction_schedule_requests_every_topic() -> None:
    with instance_for_test() as instance:
        context = build_schedule_context(instance=instance)
        assert isinstance(list(compaction_schedule(context))[0], SkipReason)
        instance.add_dynamic_partitions(TOPICS_PARTITIONS_NAME, ["default.a", "other.b"])
        requests = list(compaction_schedule(build_schedule_context(instance=instance)))
    assert sorted(r.partition_key for r in requests) == ["default.a", "other.b"]


# --------------------------------------------------------------------------- integration


async def _produce(address: str, start: int, count: int, *, seal: bool = True) -> int:
    """Publish ``count`` flights (skipping the first ``start``) with their Avro schema."""
    from danube_pipeline.client import AvroSchema, DanubeClient

    async with DanubeClient([address]) as client:
        schema = AvroSchema(subject=flights.FLIGHTS_SUBJECT, raw_schema=flights.FLIGHT_AVRO_SCHEMA_JSON)
        async with client.producer(flights.FLIGHTS_TOPIC, producer_name="test-loader", schema=schema) as producer:
            futures = []
            for i, flight in enumerate(flights.iter_flights(start + count)):
                if i >= start:
                    futures.append(producer.send_nowait(flights.encode_flight(flight), attributes={"origin": flight["origin"]}))
            offsets = await asyncio.gather(*futures)
        if seal:
            await client.admin.seal_active_segment(flights.FLIGHTS_TOPIC)
    return int(offsets[-1])


async def _descriptors(endpoints: list[str]) -> tuple[list[ObjectDescriptor], str | None]:
    async with await MetadataStore.connect(endpoints) as store:
        kvs, _ = await store.get_prefix(keys.objects_prefix(TOPIC))
    cur = None
    descs = []
    for kv in kvs:
        if kv.key == keys.objects_cur(TOPIC):
            cur = ObjectsCursor.from_json(kv.value).start
        else:
            descs.append(ObjectDescriptor.from_json(kv.value))
    return descs, cur


def _meta(result: Any, node: str) -> dict[str, Any]:
    [mat] = result.asset_materializations_for_node(node)
    return {k: v.value for k, v in mat.metadata.items()}


@pytest.mark.integration
def test_tiering_assets_exactly_once(
    etcd_endpoints: list[str],
    start_broker: Callable[..., BrokerProcess],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broker = start_broker(segment_max_bytes=64 * 1024, segment_max_age_s=600.0)
    home = tmp_path / "danube"
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

    last = asyncio.run(_produce(broker.address, 0, 3000))
    assert last == 2999

    resources = default_resources()
    with instance_for_test() as instance:
        # the topic sensor finds /topics/default/flights and asks for its partition
        found = topic_partitions_sensor(build_sensor_context(instance=instance, resources={"etcd": EtcdResource()}))
        assert isinstance(found, SensorResult)
        [add] = found.dynamic_partitions_requests or []
        assert list(add.partition_keys) == [TOPIC.partition_key]
        instance.add_dynamic_partitions(TOPICS_PARTITIONS_NAME, list(add.partition_keys))

        # the sealed-segment sensor asks for a tiering run keyed by the last sealed offset
        sensor_resources = {"etcd": EtcdResource(), "broker": BrokerResource()}
        wanted = sealed_segments_sensor(build_sensor_context(instance=instance, resources=sensor_resources))
        assert isinstance(wanted, SensorResult)
        [request] = wanted.run_requests or []
        assert isinstance(request, RunRequest)
        assert request.partition_key == TOPIC.partition_key
        assert request.run_key == f"{TOPIC.partition_key}:2999"

        # That run fails for real (the object store root lies under a regular file): nothing is
        # tiered, and the sensor asks again under a new run key, since Dagster never launches
        # one run key twice.
        blocker = tmp_path / "not-a-directory"
        blocker.write_text("")
        broken = {**resources, "object_store": ObjectStoreResource(root_url=(blocker / "objects").as_uri())}
        failed = materialize(
            [segment_objects, iceberg_table],
            partition_key=TOPIC.partition_key,
            resources=broken,
            instance=instance,
            tags=request.tags,
            raise_on_error=False,
        )
        assert not failed.success
        assert not any(d.completed for d in asyncio.run(_descriptors(etcd_endpoints))[0])
        retry = sealed_segments_sensor(build_sensor_context(instance=instance, resources=sensor_resources))
        assert isinstance(retry, SensorResult)
        [again] = retry.run_requests or []
        assert again.run_key == f"{TOPIC.partition_key}:2999:retry-1"
        assert again.tags[SEALED_END_TAG] == "2999"

        first = materialize(
            [segment_objects, iceberg_table], partition_key=TOPIC.partition_key, resources=resources, instance=instance
        )
        assert first.success
        objects_meta = _meta(first, "segment_objects")
        assert objects_meta["objects_written"] >= 3
        assert objects_meta["first_offset"] == 0 and objects_meta["last_offset"] == 2999
        table_meta = _meta(first, "iceberg_table")
        assert table_meta["rows_appended"] == 3000
        assert table_meta["committed_end_offset"] == 2999
        assert table_meta["data_files"] == objects_meta["objects_written"]

        catalog = iceberg.load_catalog()
        table = catalog.load_table(("default", "flights"))
        snapshots = len(table.snapshots())
        assert snapshots == objects_meta["objects_written"]

        # a second run changes nothing
        second = materialize(
            [segment_objects, iceberg_table], partition_key=TOPIC.partition_key, resources=resources, instance=instance
        )
        assert second.success
        assert _meta(second, "segment_objects")["objects_written"] == 0
        assert _meta(second, "iceberg_table")["rows_appended"] == 0
        table = catalog.load_table(("default", "flights"))
        assert iceberg.row_count(table) == 3000
        assert len(table.snapshots()) == snapshots
        assert isinstance(
            sealed_segments_sensor(build_sensor_context(instance=instance, resources=sensor_resources)), SkipReason
        )

        # the typed columns hold the decoded flights
        rows = table.scan(selected_fields=("_offset", "carrier", "origin", "dep_delay", "_schema_id")).to_arrow()
        by_offset = {r["_offset"]: r for r in rows.to_pylist()}
        expected = list(flights.iter_flights(3))
        for i, flight in enumerate(expected):
            assert by_offset[i]["carrier"] == flight["carrier"]
            assert by_offset[i]["origin"] == flight["origin"]
            assert by_offset[i]["dep_delay"] == flight["dep_delay"]
            assert by_offset[i]["_schema_id"] > 0

        # more messages: only the new segments are tiered and appended
        assert asyncio.run(_produce(broker.address, 3000, 500)) == 3499
        third = materialize(
            [segment_objects, iceberg_table], partition_key=TOPIC.partition_key, resources=resources, instance=instance
        )
        assert third.success
        assert _meta(third, "segment_objects")["objects_written"] >= 1
        assert _meta(third, "iceberg_table")["rows_appended"] == 500
        table = catalog.load_table(("default", "flights"))
        assert iceberg.read_offsets(table) == list(range(3500))
        assert iceberg.committed_end_offset(table) == 3499

    descriptors, cur = asyncio.run(_descriptors(etcd_endpoints))
    store = ObjectStore(env["DANUBE_OBJECT_STORE_URL"])
    expected_start = 0
    for d in descriptors:
        assert d.completed
        assert d.start_offset == expected_start
        assert d.object_id == f"data-{d.start_offset}-{d.end_offset}.dnb1"
        info = store.info(segment_object_path(TOPIC, d.object_id), compute_etag=True)
        assert info is not None and info.size == d.size and info.etag == d.etag
        assert d.offset_index[0] == [d.start_offset, 32]
        expected_start = d.end_offset + 1
    assert expected_start == 3500
    assert cur == keys.pad_offset(descriptors[-1].start_offset)


@pytest.mark.unit
def test_assets_do_not_import_the_broker() -> None:
    import assets

    root = Path(assets.__file__).parent
    for path in root.glob("*.py"):
        text = path.read_text()
        assert "import broker" not in text and "from broker" not in text, path


_ = compacted_table  # imported so a broken module fails collection here too


@pytest.mark.integration
@pytest.mark.asyncio
async def test_field_removed_by_a_later_schema_keeps_its_old_values(etcd_endpoints: Any, tmp_path: Path) -> None:
    """Tiering that runs after a field was removed (v2) still writes the v1 records' values."""
    import io
    import json

    import fastavro

    from danube_pipeline.tiering import _schemas_for
    from danube_pipeline.records import Record
    from danube_pipeline.schema_registry import SchemaRegistry

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
