"""Spark compaction on the catalog pyiceberg writes to, for real.

The run's one local Spark session (``conftest.py``: slow to start), on a SQLite catalog and a
``file://`` warehouse in a temporary directory. The configuration tests start no Spark and are
unit tests.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import time
from pathlib import Path
from typing import Any

import fastavro
import pytest
from dagster import DagsterInstance, MultiPartitionKey, materialize
from helpers import RegisterCatalog

from assets.assets import compacted_table
from assets.resources import EtcdResource, IcebergCatalogResource, SparkResource
from danube_pipeline.lake import iceberg
from danube_pipeline.names import TopicName
from danube_pipeline.format.records import Record
from danube_pipeline.lake.spark.procedures import compact_table
from danube_pipeline.lake.spark.session import jdbc_uri, spark_conf

CATALOG = "danube"
SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Reading",
    "fields": [
        {"name": "sensor", "type": "string"},
        {"name": "value", "type": ["null", "double"]},
        {"name": "at", "type": {"type": "long", "logicalType": "timestamp-micros"}},
    ],
}


def result_snapshot_id(spark_catalog: dict[str, Any], ident: tuple[str, str]) -> int:
    snapshot = spark_catalog["catalog"].load_table(ident).current_snapshot()
    assert snapshot is not None
    return int(snapshot.snapshot_id)


def _records(start: int, end: int, *, published_us: int = 1_700_000_000_000_000) -> list[Record]:
    """Records ``start`` .. ``end`` published from ``published_us`` on (µs since the epoch)."""
    parsed = fastavro.parse_schema(SCHEMA)
    out = []
    for i in range(start, end + 1):
        buf = io.BytesIO()
        fastavro.schemaless_writer(
            buf, parsed, {"sensor": f"s{i % 3}", "value": None if i % 4 == 0 else i / 2, "at": 1_700_000_000_000_000 + i}
        )
        out.append(Record(i, published_us + i, 7, "p", 1, 1, buf.getvalue(), {"k": str(i)}))
    return out


@pytest.fixture(scope="session")
def iceberg_catalog(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The module's SQLite catalog, shared by its tests: ``name``, ``uri``, ``warehouse``,
    ``catalog`` (pyiceberg) and ``root``."""
    root = tmp_path_factory.mktemp("spark-iceberg")
    env = {
        "name": CATALOG,
        "uri": f"sqlite:///{root / 'catalog.db'}",
        "warehouse": (root / "warehouse").as_uri(),
    }
    return {**env, "catalog": iceberg.load_catalog(**env), "root": root}


@pytest.fixture
def spark_catalog(iceberg_catalog: dict[str, Any], spark_on_catalog: RegisterCatalog) -> dict[str, Any]:
    """:func:`iceberg_catalog` with ``spark``: the run's Spark session on that catalog."""
    spark = spark_on_catalog(name=CATALOG, uri=iceberg_catalog["uri"], warehouse=iceberg_catalog["warehouse"])
    return {**iceberg_catalog, "spark": spark}


@pytest.mark.unit
def test_jdbc_uri() -> None:
    assert jdbc_uri("sqlite:////tmp/x/catalog.db") == "jdbc:sqlite:/tmp/x/catalog.db"
    assert jdbc_uri("postgresql+psycopg2://u:p@db:5432/iceberg") == "jdbc:postgresql://db:5432/iceberg"


@pytest.mark.unit
def test_spark_conf_points_at_the_shared_catalog(tmp_path: Path) -> None:
    conf = spark_conf(catalog_name="c1", catalog_uri=f"sqlite:///{tmp_path}/c.db", warehouse="file:///w")
    assert conf["spark.sql.catalog.c1"] == "org.apache.iceberg.spark.SparkCatalog"
    assert conf["spark.sql.catalog.c1.type"] == "jdbc"
    assert conf["spark.sql.catalog.c1.uri"] == f"jdbc:sqlite:{tmp_path}/c.db"
    assert conf["spark.sql.catalog.c1.warehouse"] == "file:///w"
    assert "iceberg-spark-runtime-3.5_2.12" in conf["spark.jars"]
    assert "sqlite-jdbc" in conf["spark.jars"]
    assert conf["spark.ui.enabled"] == "false"


@pytest.mark.spark
def test_compaction_rewrites_pyiceberg_snapshots(spark_catalog: dict[str, Any]) -> None:
    topic = TopicName("default", "readings")
    catalog = spark_catalog["catalog"]
    table = iceberg.ensure_table(catalog, topic, SCHEMA)
    for start in (0, 100, 200):
        iceberg.append_records(table, _records(start, start + 99), SCHEMA, f"data-{start}-{start + 99}.dnb1")
    assert iceberg.data_file_count(table) == 3
    before_rows = sorted(table.scan().to_arrow().to_pylist(), key=lambda r: r["_offset"])

    result = compact_table(spark_catalog["spark"], topic, catalog_name=CATALOG)
    assert result.data_files_before == 3
    assert result.data_files_after < 3
    assert result.rewritten_data_files == 3

    reloaded = catalog.load_table(("default", "readings"))
    snapshot = reloaded.current_snapshot()
    assert snapshot is not None and snapshot.snapshot_id == result.snapshot_id
    assert snapshot.summary is not None and snapshot.summary[iceberg.SUMMARY_END_OFFSET] is None
    assert iceberg.data_file_count(reloaded) == result.data_files_after
    assert iceberg.snapshot_row_count(reloaded) == 300  # Spark's replace snapshot keeps the total
    after_rows = sorted(reloaded.scan().to_arrow().to_pylist(), key=lambda r: r["_offset"])
    assert after_rows == before_rows

    # exactly-once survives compaction: the committed offset is found past the replace snapshot
    assert iceberg.committed_end_offset(reloaded) == 299
    again = iceberg.append_records(reloaded, _records(200, 299), SCHEMA, "data-200-299.dnb1")
    assert again.rows_appended == 0
    more = iceberg.append_records(reloaded, _records(300, 349), SCHEMA, "data-300-349.dnb1")
    assert more.rows_appended == 50

    count = spark_catalog["spark"].sql(f"SELECT count(*) AS n, max(_offset) AS hi FROM {CATALOG}.default.readings").collect()[0]
    assert (count["n"], count["hi"]) == (350, 349)


@pytest.mark.spark
def test_compacted_table_asset(spark_catalog: dict[str, Any], etcd_endpoints: list[str]) -> None:
    """The asset compacts one (topic, day) partition: that day's two files become one, sorted
    by _offset; the other day's files are not touched; a day with one file starts no Spark."""
    topic = TopicName("default", "asset_readings")
    today = dt.datetime.now(dt.UTC).date()
    yesterday = today - dt.timedelta(days=1)
    table = iceberg.ensure_table(spark_catalog["catalog"], topic, SCHEMA)
    for start, day in ((0, yesterday), (10, yesterday), (20, today), (30, today)):
        published = int(dt.datetime.combine(day, dt.time(1), tzinfo=dt.UTC).timestamp() * 1_000_000)
        iceberg.append_records(table, _records(start, start + 9, published_us=published), SCHEMA, f"data-{start}-{start + 9}.dnb1")
    files_by_partition = {f["file_path"]: f["partition"]["_publish_time_day"] for f in table.inspect.files().to_pylist()}
    today_files = {p for p, d in files_by_partition.items() if d == today}

    resources = {
        "etcd": EtcdResource(endpoints=",".join(etcd_endpoints)),  # a plain topic: no partitioned root
        "iceberg_catalog": IcebergCatalogResource(
            name=CATALOG, uri=spark_catalog["uri"], warehouse=spark_catalog["warehouse"]
        ),
        "spark": SparkResource(
            catalog_name=CATALOG,
            catalog_uri=spark_catalog["uri"],
            warehouse=spark_catalog["warehouse"],
            stop_after_use=False,  # the session belongs to the fixture
        ),
    }
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("topics", [topic.partition_key])
        instance.add_dynamic_partitions("days", [yesterday.isoformat()])
        result = materialize(
            [compacted_table],
            partition_key=MultiPartitionKey({"topic": topic.partition_key, "day": yesterday.isoformat()}),
            resources=resources,
            instance=instance,
        )
        assert result.success
        compacted = spark_catalog["catalog"].load_table(("default", "asset_readings"))
        again = materialize(
            [compacted_table],
            partition_key=MultiPartitionKey({"topic": topic.partition_key, "day": yesterday.isoformat()}),
            resources=resources,
            instance=instance,
        )
    [mat] = result.asset_materializations_for_node("compacted_table")
    meta = {k: v.value for k, v in mat.metadata.items()}
    assert meta["day"] == yesterday.isoformat() and meta["partition_spec"] == "day(_publish_time)"
    assert (meta["day_data_files_before"], meta["day_data_files_after"]) == (2, 1)
    assert (meta["data_files_before"], meta["data_files_after"]) == (4, 3)
    assert meta["rewritten_data_files"] == 2 and meta["day_rows"] == 20
    assert meta["committed_end_offset"] == 39
    assert meta["row_count"] == 40
    assert meta["snapshot_id"] == str(result_snapshot_id(spark_catalog, ("default", "asset_readings")))
    after = {f["file_path"]: f["partition"]["_publish_time_day"] for f in compacted.inspect.files().to_pylist()}
    assert {p for p, d in after.items() if d == today} == today_files  # the other day: untouched
    [merged] = [p for p, d in after.items() if d == yesterday]
    offsets = spark_catalog["spark"].read.parquet(merged).select("_offset").collect()
    assert [r["_offset"] for r in offsets] == list(range(20))  # sorted by _offset
    assert iceberg.row_count(compacted) == 40
    [skipped] = again.asset_materializations_for_node("compacted_table")
    assert skipped.metadata["skipped"].value == "fewer than 2 data files"


async def _produce_raw(address: str, topic: str, count: int, *, start: int = 0) -> int:
    """Send ``count`` schemaless messages one after another, then seal; the last offset."""
    from danube_pipeline.client import DanubeClient

    async with DanubeClient([address]) as client:
        async with client.producer(topic, producer_name="spark-test") as producer:
            last = -1
            for i in range(start, start + count):
                last = await producer.send(f"message {i:05d} ".encode() * 4)
        await client.admin.seal_active_segment(topic)
    return int(last)


async def _tier_and_commit(address: str, endpoints: list[str], topic: TopicName, objects: Any, catalog: Any) -> Any:
    """Tier and commit with the table's own upkeep off (no small-file merge or expiry by the
    writer), so that what the test's Spark procedures leave is theirs alone."""
    from danube_pipeline.client import DanubeClient
    from danube_pipeline.metadata.store import MetadataStore
    from danube_pipeline.schemas.registry import SchemaRegistry
    from danube_pipeline.lake.iceberg.upkeep import UpkeepPolicy
    from danube_pipeline.lake.tiering import commit_objects_to_table, tier_sealed_segments

    async with await MetadataStore.connect(endpoints) as store, DanubeClient([address]) as client:
        await tier_sealed_segments(topic, store=store, admin=client.admin, objects=objects)
        return await commit_objects_to_table(
            topic, store=store, objects=objects, catalog=catalog, registry=SchemaRegistry(store),
            upkeep=UpkeepPolicy.disabled(),
        )


@pytest.mark.spark
def test_exactly_once_survives_compaction_and_snapshot_expiry(
    spark_catalog: dict[str, Any], etcd_endpoints: list[str], start_broker: Any, tmp_path: Path
) -> None:
    """Objects tiered from a real broker into the table; Spark compacts it and expires every
    snapshot but the compaction's, so no snapshot carrying ``danube.end-offset`` is left.
    Tiering the same objects again appends nothing: the committed end offset is a table
    property, which both procedures keep."""
    from danube_pipeline.metadata.descriptors import read_descriptors
    from danube_pipeline.metadata.store import MetadataStore
    from danube_pipeline.storage.objectstore import ObjectStore
    from danube_pipeline.lake.spark.procedures import expire_snapshots
    from danube_pipeline.lake.tiering import completed_descriptors

    broker = start_broker(segment_max_bytes=4096, segment_max_age_s=600.0)
    topic = TopicName("default", "exactly_once")
    objects = ObjectStore((tmp_path / "objects").as_uri())
    catalog, spark = spark_catalog["catalog"], spark_catalog["spark"]
    assert asyncio.run(_produce_raw(broker.address, topic.path, 300)) == 299
    first = asyncio.run(_tier_and_commit(broker.address, etcd_endpoints, topic, objects, catalog))
    assert first.objects_appended >= 3 and first.rows_appended == 300 and first.committed_end_offset == 299

    compact_table(spark, topic, catalog_name=CATALOG)
    expire_snapshots(spark, topic, older_than_ms=int(time.time() * 1000) + 1000, retain_last=1, catalog_name=CATALOG)
    table = catalog.load_table(iceberg.table_identifier(topic))
    [snapshot] = table.snapshots()
    assert snapshot.summary is not None and snapshot.summary[iceberg.SUMMARY_END_OFFSET] is None
    assert snapshot.summary.operation.value == "replace"
    assert table.properties[iceberg.COMMITTED_END_OFFSET_PROPERTY] == "299"

    again = asyncio.run(_tier_and_commit(broker.address, etcd_endpoints, topic, objects, catalog))
    assert again.rows_appended == 0 and again.objects_appended == 0
    assert again.objects_skipped == first.objects_appended
    assert again.committed_end_offset == 299

    async def descriptors() -> list[Any]:
        async with await MetadataStore.connect(etcd_endpoints) as store:
            return completed_descriptors((await read_descriptors(store, topic))[0])

    covered = [o for d in asyncio.run(descriptors()) for o in range(d.start_offset, d.end_offset + 1)]
    assert iceberg.read_offsets(catalog.load_table(iceberg.table_identifier(topic))) == covered == list(range(300))
    count = spark.sql(f"SELECT count(*) AS n FROM {CATALOG}.default.exactly_once").collect()[0]["n"]
    assert count == 300
