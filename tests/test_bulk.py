"""Bulk loads on Spark (:mod:`danube_pipeline.lake.bulk`), against real etcd descriptors, real
segment objects, a real SQLite Iceberg catalog and a real Spark: ``local[*]`` and, in the last
test, a standalone master and worker started from pyspark's ``spark-class``.

The bulk path must write what tiering writes: the same rows, offsets, dead letters and
committed end offset, and keep the exactly-once rule with it in both directions.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from dagster import DagsterInstance, materialize
from helpers import RegisterCatalog
from spark_cluster import SparkStandaloneCluster
from tiering_helpers import Env, avro, avro_payload, make_env, record

from assets.bulk import bulk_table
from assets.resources import (
    EtcdResource,
    IcebergCatalogResource,
    ObjectStoreResource,
    SparkResource,
)
from danube_pipeline.lake import iceberg
from danube_pipeline.lake.bulk import (
    SUMMARY_ENGINE,
    BulkLoadError,
    BulkLoadReport,
    bulk_load,
    plan_objects,
)
from danube_pipeline.errors import OffsetRangeError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import (
    ObjectDescriptor,
    TableLayout,
    UnavailableRange,
)
from danube_pipeline.names import TopicName
from danube_pipeline.format.records import Record
from danube_pipeline.lake.spark.session import build_spark_session, spark_conf, spark_master

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

CATALOG = "danube"
V1 = avro({"name": "sensor", "type": "string"}, {"name": "value", "type": ["null", "double"]})
V2 = avro(
    {"name": "sensor", "type": "string"},
    {"name": "value", "type": ["null", "double"]},
    {"name": "unit", "type": ["null", "string"], "default": None},
)
DAY_US = 86_400_000_000


def _descriptor(start: int, end: int) -> ObjectDescriptor:
    return ObjectDescriptor(
        completed=True, created_at=1, end_offset=end, etag=None, object_id=f"data-{start}-{end}.dnb1",
        offset_index=[], size=1, start_offset=start,
    )


# --------------------------------------------------------------------------- plan (unit)


@pytest.mark.unit
def test_plan_resumes_after_the_committed_end_offset() -> None:
    topic = TopicName("default", "t")
    descs = [_descriptor(0, 9), _descriptor(10, 19), _descriptor(20, 29)]
    assert plan_objects(topic, descs, [], committed=None) == (0, plan_objects(topic, descs, [], committed=None)[1])
    start, chosen = plan_objects(topic, descs, [], committed=14)
    assert start == 15 and [o.object_id for o in chosen] == ["data-10-19.dnb1", "data-20-29.dnb1"]
    assert plan_objects(topic, descs, [], committed=29) == (None, [])
    start, chosen = plan_objects(topic, descs, [], committed=None, from_offset=12)
    assert start == 12 and chosen[0].path == "topics/default/t/data-10-19.dnb1"


@pytest.mark.unit
def test_plan_refuses_gaps() -> None:
    topic = TopicName("default", "t")
    with pytest.raises(OffsetRangeError):
        plan_objects(topic, [_descriptor(0, 9), _descriptor(15, 19)], [], committed=None)
    with pytest.raises(OffsetRangeError):  # from_offset would skip offsets 10..11
        plan_objects(topic, [_descriptor(0, 9), _descriptor(10, 19)], [], committed=9, from_offset=12)
    with pytest.raises(BulkLoadError):
        plan_objects(topic, [_descriptor(0, 9)], [], committed=None, from_offset=-1)
    # offsets 10..14 abandoned (§5.5): passed over, as tiering does
    abandoned = UnavailableRange(start_offset=10, end_offset=14, broker_id=1, since=1, abandoned=True)
    start, chosen = plan_objects(topic, [_descriptor(0, 9), _descriptor(15, 19)], [abandoned], committed=9)
    assert start == 15 and len(chosen) == 1


@pytest.mark.unit
def test_plan_refuses_objects_deleted_after_commit() -> None:
    """Under ``after-commit`` (§5.1 ``object_deleted_at``) only the table holds those offsets:
    a load that needs them says so and where it could start instead."""
    topic = TopicName("default", "t")
    descs = [dataclasses.replace(_descriptor(0, 9), object_deleted_at=5), _descriptor(10, 19)]
    with pytest.raises(BulkLoadError, match=r"data-0-9\.dnb1.*from_offset 10"):
        plan_objects(topic, descs, [], committed=None)
    assert plan_objects(topic, descs, [], committed=None, from_offset=10)[0] == 10
    assert plan_objects(topic, descs, [], committed=9)[0] == 10  # the topic's own table goes on


@pytest.mark.unit
def test_spark_master_is_configurable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    uri, warehouse = f"sqlite:///{tmp_path}/c.db", tmp_path.as_uri()
    monkeypatch.delenv("DANUBE_SPARK_MASTER", raising=False)
    assert spark_master() == "local[*]"
    assert spark_conf(catalog_uri=uri, warehouse=warehouse)["spark.master"] == "local[*]"
    monkeypatch.setenv("DANUBE_SPARK_MASTER", "spark://127.0.0.1:7077")
    assert spark_conf(catalog_uri=uri, warehouse=warehouse)["spark.master"] == "spark://127.0.0.1:7077"
    resource = SparkResource(catalog_uri=uri, warehouse=warehouse)
    assert resource.conf()["spark.master"] == "spark://127.0.0.1:7077"
    pinned = SparkResource(catalog_uri=uri, warehouse=warehouse, master="local[1]")
    assert pinned.conf()["spark.master"] == "local[1]"


# --------------------------------------------------------------------------- Spark


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bulk")


@pytest.fixture
def spark(root: Path, spark_on_catalog: RegisterCatalog) -> SparkSession:
    """The run's Spark session on the module's catalog."""
    return spark_on_catalog(name=CATALOG, uri=f"sqlite:///{root / 'catalog.db'}", warehouse=(root / "warehouse").as_uri())


@pytest.fixture
def env(etcd_endpoints: list[str], root: Path) -> Env:
    return make_env(etcd_endpoints, root)


async def _put_history(env: Env, topic: TopicName, *, layout: str = "day") -> int:
    """Four objects over three days: Avro v1 then v2, a raw record, an unknown schema id and a
    corrupt payload (three dead letters). Returns the last offset."""
    env.registry.add_avro(1, 1, V1, subject="readings-value")
    env.registry.add_avro(1, 2, V2, subject="readings-value")
    async with await MetadataStore.connect(env.endpoints) as store:
        await store.put(keys.topic_table(topic), TableLayout(partition_transform=layout))

    def rec(offset: int, payload: bytes, sid: int = 1, version: int = 1) -> Record:
        r = record(offset, payload, sid, version)
        # spread over four UTC days, so a day-partitioned table gets four partitions
        return dataclasses.replace(r, publish_time_us=r.publish_time_us + (offset // 10) * DAY_US)

    objects = [
        [rec(i, avro_payload(V1, {"sensor": f"s{i % 3}", "value": None if i % 4 == 0 else i / 2})) for i in range(10)],
        [rec(10, b"\x07", 0, 0)] + [rec(i, avro_payload(V1, {"sensor": "s", "value": float(i)})) for i in range(11, 20)],
        [rec(i, avro_payload(V2, {"sensor": "t", "value": 1.5, "unit": f"u{i}"}), 1, 2) for i in range(20, 28)]
        + [rec(28, b"\x01", 9, 1), rec(29, b"\xff\xff\xff", 1, 2)],
        [rec(i, avro_payload(V2, {"sensor": "z", "value": None, "unit": None}), 1, 2) for i in range(30, 35)],
    ]
    for records in objects:
        await env.put(records, topic)
    return 34


async def _bulk(env: Env, spark: SparkSession, topic: TopicName, **kwargs: Any) -> BulkLoadReport:
    async with await MetadataStore.connect(env.endpoints) as store:
        return await bulk_load(
            spark, env.catalog, topic, store=store, objects=env.objects, registry=env.registry, catalog_name=CATALOG,
            **kwargs,
        )


def _rows(env: Env, ident: tuple[str, str]) -> list[dict[str, Any]]:
    return sorted(env.catalog.load_table(ident).scan().to_arrow().to_pylist(), key=lambda r: r["_offset"])


def _dlq(env: Env, ident: tuple[str, str]) -> list[dict[str, Any]]:
    table = env.catalog.load_table((ident[0], ident[1] + "__dlq"))
    return sorted(table.scan().to_arrow().to_pylist(), key=lambda r: r["_offset"])


@pytest.mark.spark
@pytest.mark.asyncio
@pytest.mark.parametrize("layout", ["day", "none"])
async def test_bulk_path_writes_the_table_tiering_writes(env: Env, spark: SparkSession, layout: str) -> None:
    topic = TopicName("default", f"readings_{layout}")
    last = await _put_history(env, topic, layout=layout)
    tiered = await env.tier(topic)
    assert tiered.committed_end_offset == last

    report = await _bulk(env, spark, topic, target=f"{topic.topic}_bulk", replay=True)
    bulk_ident = ("default", f"{topic.topic}_bulk")
    assert report.table == "default." + bulk_ident[1]
    assert report.created and report.objects_read == 4 and report.attempts == 1
    assert (report.first_offset, report.last_offset, report.committed_end_offset) == (0, last, last)
    assert report.rows_appended == last + 1 - 3 and report.dead_letter_records == 3
    infos = [env.objects.info(p) for p in env.objects.list(f"topics/default/{topic.topic}")]
    assert report.bytes_read == sum(info.size_bytes for info in infos if info is not None) and None not in infos

    # same rows (every column), same dead letters, same committed end offsets
    assert _rows(env, bulk_ident) == _rows(env, iceberg.table_identifier(topic))
    tiered_dlq = _dlq(env, iceberg.table_identifier(topic))
    assert _dlq(env, bulk_ident) == tiered_dlq
    assert [r["_offset"] for r in tiered_dlq] == [10, 28, 29]
    bulk_table = env.catalog.load_table(bulk_ident)
    assert iceberg.committed_end_offset(bulk_table) == iceberg.committed_end_offset(env.table(topic)) == last
    assert bulk_table.schema() == env.table(topic).schema()
    assert bulk_table.spec() == env.table(topic).spec()
    assert len(bulk_table.spec().fields) == (1 if layout == "day" else 0)

    # one published snapshot, carrying the offsets in its summary
    snapshot = bulk_table.current_snapshot()
    assert snapshot is not None and snapshot.snapshot_id == report.snapshot_id
    summary = snapshot.summary
    assert summary is not None
    assert summary[iceberg.SUMMARY_START_OFFSET] == "0" and summary[iceberg.SUMMARY_END_OFFSET] == str(last)
    assert summary[iceberg.SUMMARY_DEAD_LETTER_RECORDS] == "3" and summary[SUMMARY_ENGINE] == "spark"
    assert summary[iceberg.SUMMARY_TOPIC] == topic.path


@pytest.mark.spark
@pytest.mark.asyncio
async def test_rerun_appends_nothing_and_tiering_continues(env: Env, spark: SparkSession) -> None:
    topic = TopicName("default", "continued")
    last = await _put_history(env, topic)
    first = await _bulk(env, spark, topic)
    assert first.committed_end_offset == last and first.committed_end_offset_before is None
    table = env.table(topic)
    snapshots = len(table.snapshots())

    again = await _bulk(env, spark, topic)
    assert again.rows_appended == 0 and again.objects_read == 0 and again.snapshot_id is None
    assert again.committed_end_offset == last
    assert len(env.table(topic).snapshots()) == snapshots

    # tiering sees the bulk load: it skips those objects and appends only the new one
    skipped = await env.tier(topic)
    assert skipped.objects_appended == 0 and skipped.rows_appended == 0
    await env.put([record(i, avro_payload(V2, {"sensor": "n", "value": 2.0, "unit": "k"}), 1, 2) for i in range(35, 40)], topic)
    tiered = await env.tier(topic)
    assert tiered.objects_appended == 1 and tiered.rows_appended == 5 and tiered.committed_end_offset == 39
    table = env.table(topic)
    assert iceberg.duplicate_offsets(table, dead_letters=iceberg.dead_letter_table_of(table)) == {}
    main = iceberg.read_offsets(table)
    dead = iceberg.dead_letter_offsets(iceberg.dead_letter_table_of(table))  # type: ignore[arg-type]
    assert sorted(main + dead) == list(range(40))

    # and a bulk load after tiering starts after tiering's commits
    await env.put([record(i, avro_payload(V2, {"sensor": "m", "value": 3.0, "unit": "k"}), 1, 2) for i in range(40, 44)], topic)
    more = await _bulk(env, spark, topic)
    assert (more.first_offset, more.last_offset, more.rows_appended) == (40, 43, 4)
    assert sorted(iceberg.read_offsets(env.table(topic))) == sorted(main + list(range(40, 44)))


@pytest.mark.spark
@pytest.mark.asyncio
async def test_bulk_load_from_an_offset_and_bad_requests(env: Env, spark: SparkSession) -> None:
    topic = TopicName("default", "partial")
    last = await _put_history(env, topic)
    report = await _bulk(env, spark, topic, target="partial_tail", from_offset=25)
    assert (report.first_offset, report.last_offset) == (25, last)
    assert iceberg.read_offsets(env.catalog.load_table(("default", "partial_tail"))) == [25, 26, 27, *range(30, 35)]

    with pytest.raises(BulkLoadError, match="replay needs a target"):
        await _bulk(env, spark, topic, replay=True)
    with pytest.raises(OffsetRangeError):  # would skip offsets 35..39 after the committed 34
        await _bulk(env, spark, topic, target="partial_tail", from_offset=40)
    assert iceberg.committed_end_offset(env.catalog.load_table(("default", "partial_tail"))) == last


@pytest.mark.spark
def test_bulk_table_asset(env: Env, spark: SparkSession, root: Path) -> None:
    """The Dagster asset loads a topic's schemaless history with its Config, reports rows,
    bytes, offsets, snapshot id and files; a second run appends nothing."""
    topic = TopicName("default", "asset_raw")
    for start in (0, 10, 20):
        asyncio.run(env.put([record(i, f"message {i}".encode()) for i in range(start, start + 10)], topic))
    resources = {
        "etcd": EtcdResource(endpoints=",".join(env.endpoints)),
        "object_store": ObjectStoreResource(root_url=env.objects.root_url),
        "iceberg_catalog": IcebergCatalogResource(
            name=CATALOG, uri=f"sqlite:///{root / 'catalog.db'}", warehouse=(root / "warehouse").as_uri()
        ),
        "spark": SparkResource(
            catalog_name=CATALOG, catalog_uri=f"sqlite:///{root / 'catalog.db'}",
            warehouse=(root / "warehouse").as_uri(), stop_after_use=False,  # the run's session
        ),
    }
    run_config = {"ops": {"bulk_table": {"config": {"target": "asset_raw_v2", "replay": True, "from_offset": 5}}}}
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("topics", [topic.partition_key])
        first = materialize(
            [bulk_table], partition_key=topic.partition_key, resources=resources, instance=instance, run_config=run_config
        )
        again = materialize(
            [bulk_table], partition_key=topic.partition_key, resources=resources, instance=instance, run_config=run_config
        )
    assert first.success and again.success
    [mat] = first.asset_materializations_for_node("bulk_table")
    meta: dict[str, Any] = {k: v.value for k, v in mat.metadata.items()}
    table = env.catalog.load_table(("default", "asset_raw_v2"))
    assert meta["table"] == "danube.default.asset_raw_v2" and meta["table_created"] is True
    assert (meta["rows_appended"], meta["row_count"], meta["objects_read"]) == (25, 25, 3)
    assert (meta["first_offset"], meta["last_offset"], meta["committed_end_offset"]) == (5, 29, 29)
    assert "committed_end_offset_before" not in meta  # a new table: nothing committed before
    assert meta["bytes_read"] == sum(len(env.objects.get_bytes(p)) for p in env.objects.list("topics/default/asset_raw"))
    snapshot = table.current_snapshot()
    assert snapshot is not None and meta["snapshot_id"] == str(snapshot.snapshot_id)
    assert meta["data_files_before"] == 0 and meta["data_files_after"] >= 1
    assert iceberg.read_offsets(table) == list(range(5, 30))
    assert table.scan().to_arrow().column("_payload").to_pylist()[0] == b"message 5"
    [mat2] = again.asset_materializations_for_node("bulk_table")
    meta2 = {k: v.value for k, v in mat2.metadata.items()}
    assert meta2["rows_appended"] == 0 and meta2["objects_read"] == 0 and "snapshot_id" not in meta2
    assert meta2["committed_end_offset_before"] == meta2["committed_end_offset"] == 29


@pytest.mark.spark
@pytest.mark.asyncio
async def test_standalone_cluster_writes_the_same_table_as_local(env: Env, spark: SparkSession, root: Path) -> None:
    """Runs last in this module: it stops the run's local session (``conftest.py``) to start
    one on a standalone master and worker. The master is fixed when a SparkContext starts and a
    JVM holds one SparkContext, so this test cannot share the local one; the next Spark test
    gets a new local session on the same JVM."""
    topic = TopicName("default", "engines")
    await _put_history(env, topic)
    local = await _bulk(env, spark, topic, target="engines_local", replay=True)
    spark.stop()
    with SparkStandaloneCluster(root / "standalone") as cluster:
        conf = spark_conf(
            catalog_name=CATALOG, catalog_uri=f"sqlite:///{root / 'catalog.db'}",
            warehouse=(root / "warehouse").as_uri(), master=cluster.master_url,
        )
        conf.update({"spark.executor.memory": "512m", "spark.cores.max": "1", "spark.driver.host": "127.0.0.1"})
        session = build_spark_session(conf)
        try:
            assert session.sparkContext.master == cluster.master_url
            remote = await _bulk(env, session, topic, target="engines_cluster", replay=True)
            # the tasks ran in an executor the worker launched
            assert list((root / "standalone" / "work").glob("app-*/*/stderr"))
        finally:
            session.stop()
    assert remote.committed_end_offset == local.committed_end_offset
    assert remote.rows_appended == local.rows_appended and remote.dead_letter_records == local.dead_letter_records
    assert _rows(env, ("default", "engines_cluster")) == _rows(env, ("default", "engines_local"))
    assert _dlq(env, ("default", "engines_cluster")) == _dlq(env, ("default", "engines_local"))


@pytest.mark.spark
@pytest.mark.asyncio
async def test_bulk_load_into_a_payload_table_takes_records_with_a_schema(env: Env, spark: SparkSession) -> None:
    """A topic tiered raw first has a ``_payload`` table; records that carry a schema id later
    go into the same ``_payload`` column on both paths (the bulk path used to raise ``KeyError``)."""
    env.registry.add_avro(1, 1, V1, subject="readings-value")
    raw = [record(i, f"message {i}".encode()) for i in range(5)]
    typed = [record(i, avro_payload(V1, {"sensor": "s", "value": float(i)}), 1, 1) for i in range(5, 9)]
    tiered_topic, bulk_topic = TopicName("default", "payload_tiered"), TopicName("default", "payload_bulk")
    for topic in (tiered_topic, bulk_topic):
        await env.put(raw, topic)
        assert (await env.tier(topic)).committed_end_offset == 4
        await env.put(typed, topic)
    assert (await env.tier(tiered_topic)).committed_end_offset == 8

    report = await _bulk(env, spark, bulk_topic)
    assert (report.first_offset, report.last_offset, report.rows_appended) == (5, 8, 4)
    assert report.dead_letter_records == 0
    assert _rows(env, iceberg.table_identifier(bulk_topic)) == _rows(env, iceberg.table_identifier(tiered_topic))
    assert [r["_payload"] for r in _rows(env, iceberg.table_identifier(bulk_topic))] == [r.payload for r in raw + typed]
