"""Retention (``danube_pipeline.lake.retention`` and the ``retention`` asset) against a real etcd, a
real broker, real segment objects, the real SQL catalog and a real local Spark session.

Records carry the publish time the client gave them, so expiry is steered with ``now_ms``:
a batch is produced, the time is noted, the next batch follows, and retention runs with
``now_ms`` one retention period after the noted time, so everything before it has expired and
everything after it has not.

The run's one Spark session (``conftest.py``) serves the module, on its own catalog; the crash
tests run retention in child processes that die for real (``os._exit(137)``) right after a given
step, so those start their own short-lived JVM.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from dagster import AssetSelection, DagsterInstance, MultiPartitionKey, materialize
from helpers import RegisterCatalog
from pyiceberg.catalog.sql import SqlCatalog

from assets.assets import iceberg_table, segment_objects
from assets.assets import retention as retention_asset
from assets.checks import tiering_checks
from assets.resources import (
    BrokerResource,
    EtcdResource,
    IcebergCatalogResource,
    ObjectStoreResource,
    SparkResource,
)
from danube_pipeline.lake import iceberg
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.descriptors import read_descriptors
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import NamespacePolicy, ObjectDescriptor
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore
from danube_pipeline.lake.retention import (
    STEPS,
    RetentionReport,
    apply_retention,
    expired_descriptors,
    size_start_offset,
)
from danube_pipeline.schemas.registry import SchemaRegistry
from danube_pipeline.lake.spark.procedures import compact_table
from danube_pipeline.lake.tiering import (
    TableReport,
    TieringReport,
    commit_objects_to_table,
    completed_descriptors,
    descriptor_gaps,
    descriptor_record_count,
    object_mismatches,
    segments_needing_tiering,
    tier_sealed_segments,
    untiered_segments,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

CATALOG = "retention"
MINUTE_MS = 60_000
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Env:
    uri: str
    warehouse: str
    catalog: SqlCatalog
    spark: SparkSession


@pytest.fixture(scope="session")
def retention_catalog(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, SqlCatalog]:
    """The module's SQLite catalog, shared by its tests: ``(uri, warehouse, catalog)``."""
    root = tmp_path_factory.mktemp("retention-iceberg")
    uri, warehouse = f"sqlite:///{root / 'catalog.db'}", (root / "warehouse").as_uri()
    return uri, warehouse, iceberg.load_catalog(name=CATALOG, uri=uri, warehouse=warehouse)


@pytest.fixture
def retention_spark(retention_catalog: tuple[str, str, SqlCatalog], spark_on_catalog: RegisterCatalog) -> Env:
    """The module's catalog with the run's Spark session on it."""
    uri, warehouse, catalog = retention_catalog
    return Env(uri, warehouse, catalog, spark_on_catalog(name=CATALOG, uri=uri, warehouse=warehouse))


# --------------------------------------------------------------------------- helpers


def _now_ms() -> int:
    return int(time.time() * 1000)


async def _produce(address: str, topic: str, count: int, *, size: int = 64, seal: bool = True) -> list[int]:
    """Send ``count`` schemaless messages of ``size`` bytes one after another (one record per
    batch), then seal the active segment unless ``seal`` is false; their offsets."""
    from danube_pipeline.client import DanubeClient

    async with DanubeClient([address]) as client:
        async with client.producer(topic, producer_name="retention-test") as producer:
            offsets = [int(await producer.send(os.urandom(size))) for _ in range(count)]
        if seal:
            await client.admin.seal_active_segment(topic)
    return offsets


async def _tier(
    address: str, endpoints: list[str], topic: TopicName, objects: ObjectStore, catalog: Any, *, commit: bool = True
) -> tuple[TieringReport, TableReport | None]:
    from danube_pipeline.client import DanubeClient

    async with await MetadataStore.connect(endpoints) as store, DanubeClient([address]) as client:
        tiered = await tier_sealed_segments(topic, store=store, admin=client.admin, objects=objects)
        if not commit:
            return tiered, None
        table = await commit_objects_to_table(
            topic, store=store, objects=objects, catalog=catalog, registry=SchemaRegistry(store)
        )
        return tiered, table


async def _set_policy(endpoints: list[str], namespace: str, value: dict[str, Any]) -> None:
    async with await MetadataStore.connect(endpoints) as store:
        await store.put(keys.namespace_policy(namespace), value)


async def _descriptors(endpoints: list[str], topic: TopicName) -> list[ObjectDescriptor]:
    async with await MetadataStore.connect(endpoints) as store:
        return (await read_descriptors(store, topic))[0]


async def _retain(
    address: str,
    endpoints: list[str],
    topic: TopicName,
    objects: ObjectStore,
    env: Env,
    now_ms: int,
    *,
    between_steps: Callable[[str], None] | None = None,
) -> tuple[RetentionReport, list[str]]:
    """``apply_retention`` in this process; the report and the steps it went through.
    ``between_steps(step)`` runs after each step, before the next."""
    from danube_pipeline.client import DanubeClient

    steps: list[str] = []

    def after_step(step: str) -> None:
        steps.append(step)
        if between_steps is not None:
            between_steps(step)

    async with await MetadataStore.connect(endpoints) as store, DanubeClient([address]) as client:
        report = await apply_retention(
            topic,
            store=store,
            objects=objects,
            catalog=env.catalog,
            spark=env.spark,
            admin=client.admin,
            now_ms=now_ms,
            after_step=after_step,
        )
    return report, steps


def _in_thread(coroutine: Any) -> Any:
    """Run ``coroutine`` to its end on an event loop of its own (from inside a running one)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result(timeout=120)


def _table(env: Env, topic: TopicName) -> Any:
    return env.catalog.load_table(iceberg.table_identifier(topic))


def _rows(env: Env, topic: TopicName) -> list[tuple[int, dt.datetime]]:
    arrow = _table(env, topic).scan(selected_fields=("_offset", "_publish_time")).to_arrow()
    return sorted(zip(arrow.column("_offset").to_pylist(), arrow.column("_publish_time").to_pylist(), strict=True))


def _object_names(objects: ObjectStore, topic: TopicName) -> list[str]:
    """The topic's objects in offset order."""
    prefix = f"topics/{topic.namespace}/{topic.topic}/"
    names = [p[len(prefix) :] for p in objects.list(prefix)]
    return sorted(names, key=lambda name: int(name.split("-")[1]))


def _assert_consistent(
    env: Env, endpoints: list[str], topic: TopicName, objects: ObjectStore, *, cutoff_ms: int | None = None
) -> list[ObjectDescriptor]:
    """The invariants that hold between any two retention steps: descriptors contiguous, each
    with its object of the recorded size, the table's offsets unique and within the
    descriptors' range; with ``cutoff_ms``, also no row published before it."""
    done = completed_descriptors(asyncio.run(_descriptors(endpoints, topic)))
    assert done, "the newest descriptor is always kept"
    assert descriptor_gaps(done) == []
    assert object_mismatches(topic, done, objects) == []
    rows = _rows(env, topic)
    offsets = [o for o, _ in rows]
    assert len(set(offsets)) == len(offsets)
    assert all(done[0].start_offset <= o <= done[-1].end_offset for o in offsets)
    if cutoff_ms is not None:
        cutoff = dt.datetime.fromtimestamp(cutoff_ms / 1000, tz=dt.UTC)
        assert [o for o, t in rows if t < cutoff] == []
    return done


# --------------------------------------------------------------------------- unit


def _descriptor(start: int, end: int, size: int) -> ObjectDescriptor:
    return ObjectDescriptor(True, 0, end, "e", f"data-{start}-{end}.dnb1", [[start, 32]], size, start)


@pytest.mark.unit
def test_size_limit_keeps_the_newest_objects_that_fit() -> None:
    done = [_descriptor(0, 9, 400), _descriptor(10, 19, 300), _descriptor(20, 29, 300), _descriptor(30, 39, 300)]
    assert size_start_offset(done, 900) == 10  # 300 + 300 + 300 fit, 400 more does not
    assert size_start_offset(done, 899) == 20
    assert size_start_offset(done, 1300) == 0
    assert size_start_offset(done, 1) == 30  # the newest is kept even when it alone is too big
    assert expired_descriptors(done, 20) == done[:2]
    assert expired_descriptors(done, 25) == done[:2]  # 20-29 still holds retained records
    assert expired_descriptors(done, 40) == done[:3]  # everything expired: the newest stays
    assert expired_descriptors(done, None) == []


@pytest.mark.unit
def test_expired_segments_are_not_tiered_again() -> None:
    """Sealed segments below the first descriptor were tiered and then expired; the WAL may
    still list them, and tiering must not bring them back."""
    from danube_pipeline.client.types import SegmentInfo

    sealed = [SegmentInfo(s, s + 9, 100, 10, 0, 0) for s in (0, 10, 20, 30)]
    assert [s.start_offset for s in untiered_segments(sealed, [])] == [0, 10, 20, 30]
    assert [s.start_offset for s in untiered_segments(sealed, [_descriptor(20, 29, 100)])] == [30]


@pytest.mark.integration
def test_without_limits_or_admin_method_nothing_is_touched(etcd_endpoints: list[str], tmp_path: Path) -> None:
    """No policy limits (none stored, then an unreadable one: the defaults apply, as for the
    broker) and an admin API without ``apply_local_retention`` (a client from before the RPC):
    every step runs, none deletes anything, no Spark starts, and the WAL step reports
    ``skipped``."""
    topic = TopicName("default", "unlimited")
    objects = ObjectStore((tmp_path / "objects").as_uri())
    descriptor = ObjectDescriptor(True, 0, 9, None, "data-0-9.dnb1", [[0, 32]], 5, 0)
    objects.put_bytes(f"topics/{topic.namespace}/{topic.topic}/data-0-9.dnb1", b"bytes")
    catalog = iceberg.load_catalog(name="t", uri=f"sqlite:///{tmp_path / 'c.db'}", warehouse=(tmp_path / "wh").as_uri())
    steps: list[str] = []

    def no_spark() -> Any:
        raise AssertionError("no step needs Spark")

    async def run() -> RetentionReport:
        async with await MetadataStore.connect(etcd_endpoints) as store:
            await store.put(keys.object_descriptor(topic, 0), descriptor)
            return await apply_retention(
                topic,
                store=store,
                objects=objects,
                catalog=catalog,
                spark=no_spark,
                admin=object(),
                after_step=steps.append,
            )

    for policy in (None, {"retention_time_minutes": -5}):
        if policy is not None:
            asyncio.run(_set_policy(etcd_endpoints, "default", policy))
        steps.clear()
        report = asyncio.run(run())
        assert steps == list(STEPS)
        assert (report.policy_error is None) == (policy is None)
        assert report.wal_step == "skipped" and report.wal_deleted_segments is None
        assert (report.retention_ms, report.retention_bytes) == (0, 0)
        assert report.cutoff_ms is None and report.retained_start is None
        assert (report.rows_deleted, report.descriptors_deleted, report.objects_deleted) == (0, 0, 0)
        assert report.earliest_offset == 0 and report.table is None
        assert asyncio.run(_descriptors(etcd_endpoints, topic)) == [descriptor]
        assert _object_names(objects, topic) == ["data-0-9.dnb1"]


# --------------------------------------------------------------------------- time retention


@pytest.mark.spark
@pytest.mark.integration
def test_time_retention_deletes_expired_rows_descriptors_and_objects(
    retention_spark: Env, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    """Batch 1 (one object, and the first half of the next) expires, batch 2 does not: the
    table loses batch 1's rows (the compacted file holding both is rewritten), the descriptor
    and object wholly of batch 1 go, the one it shares with batch 2 stays; the table is
    readable by pyiceberg and Spark. Tiering between the object step and the WAL step does not
    upload the expired segment the WAL still holds; the WAL step makes the broker drop it.
    Tiering afterwards adds nothing, and a second run does nothing."""
    env = retention_spark
    # no periodic local retention pass: only the retention run's WAL step trims the WAL
    objects = ObjectStore((tmp_path / "objects").as_uri())
    broker = start_broker(
        segment_max_bytes=64 * 1024,
        segment_max_age_s=600.0,
        extra_args=["--local-retention-check-s", "3600", "--object-store-url", objects.root_url],
    )
    topic = TopicName("default", "time_retention")

    first = asyncio.run(_produce(broker.address, topic.path, 40))
    asyncio.run(_produce(broker.address, topic.path, 20, seal=False))
    # time passes on both sides of the noted time, so it falls strictly between two batches
    time.sleep(0.05)
    split_ms = _now_ms()
    time.sleep(0.05)
    kept = asyncio.run(_produce(broker.address, topic.path, 20))  # same object as the 20 before
    kept += asyncio.run(_produce(broker.address, topic.path, 30))
    assert (first[0], kept[0], kept[-1]) == (0, 60, 109)
    tiered, table_report = asyncio.run(_tier(broker.address, etcd_endpoints, topic, objects, env.catalog))
    assert tiered.objects_written == 3 and table_report is not None and table_report.rows_appended == 110
    compact_table(env.spark, topic, catalog_name=CATALOG)
    assert iceberg.data_file_count(_table(env, topic)) == 1

    # the policy as Danube spells it, in minutes; now is one minute after the split
    asyncio.run(_set_policy(etcd_endpoints, "default", {"retentionTimeInMinutes": 1}))
    now_ms = split_ms + MINUTE_MS

    async def pending() -> list[Any]:
        from danube_pipeline.client import DanubeClient

        async with await MetadataStore.connect(etcd_endpoints) as store, DanubeClient([broker.address]) as client:
            return await segments_needing_tiering(topic, store=store, admin=client.admin)

    before_wal: dict[str, Any] = {}

    def between_steps(step: str) -> None:
        # after the object step, before the WAL step: the broker still lists the expired
        # segment 0-39; tiering and the sensor must leave it alone, not upload it again
        if step == "objects":
            before_wal["tiered"] = _in_thread(_tier(broker.address, etcd_endpoints, topic, objects, env.catalog))
            before_wal["pending"] = _in_thread(pending())
            before_wal["objects"] = _object_names(objects, topic)

    report, steps = asyncio.run(
        _retain(broker.address, etcd_endpoints, topic, objects, env, now_ms, between_steps=between_steps)
    )
    tiered, table_report = before_wal["tiered"]
    assert (tiered.sealed_segments, tiered.segments_expired, tiered.objects_written) == (3, 1, 0)
    assert table_report is not None and table_report.rows_appended == 0
    assert before_wal["pending"] == []
    assert before_wal["objects"] == ["data-40-79.dnb1", "data-80-109.dnb1"]

    assert steps == list(STEPS)
    assert report.cutoff_ms == split_ms and report.retention_ms == MINUTE_MS
    assert report.retained_start == 60 and report.earliest_offset == 60
    assert report.rows_deleted == 60
    assert report.snapshots_expired >= 3 and report.data_files_deleted >= 1
    assert report.descriptors_deleted == 1 and report.objects_deleted == 1
    assert report.deleted_object_ids == ["data-0-39.dnb1"]
    assert report.first_object_offset == 40
    # the broker drops the segment below the first descriptor (its own local retention
    # limits, 1 GiB and 1 hour by default, keep the others)
    assert report.wal_step == "applied"
    assert (report.wal_deleted_segments, report.wal_first_local_offset) == (1, 40)

    done = _assert_consistent(env, etcd_endpoints, topic, objects, cutoff_ms=split_ms)
    assert [(d.start_offset, d.end_offset) for d in done] == [(40, 79), (80, 109)]
    assert _object_names(objects, topic) == ["data-40-79.dnb1", "data-80-109.dnb1"]
    assert [o for o, _ in _rows(env, topic)] == list(range(60, 110))
    table = _table(env, topic)
    assert len(table.snapshots()) == 1
    assert iceberg.committed_end_offset(table) == 109
    assert descriptor_record_count(done, from_offset=60) == iceberg.offset_stats(table).rows == 50
    got = env.spark.sql(f"SELECT count(*) AS n, min(_offset) AS lo FROM {CATALOG}.default.time_retention").collect()[0]
    assert (got["n"], got["lo"]) == (50, 60)

    # the tiering checks still pass: the table starts inside the first descriptor
    checked = materialize(
        [segment_objects, iceberg_table, *tiering_checks],
        selection=AssetSelection.checks(*tiering_checks),
        tags={"dagster/partition": topic.partition_key},
        resources={
            "etcd": EtcdResource(endpoints=",".join(etcd_endpoints)),
            "broker": BrokerResource(bootstrap_addresses=broker.address),
            "object_store": ObjectStoreResource(root_url=objects.root_url),
            "iceberg_catalog": IcebergCatalogResource(name=CATALOG, uri=env.uri, warehouse=env.warehouse),
        },
    )
    evaluations = {e.check_name: e for e in checked.get_asset_check_evaluations()}
    assert len(evaluations) == 7 and all(e.passed for e in evaluations.values()), evaluations
    row_check = {k: v.value for k, v in evaluations["row_count_matches_descriptors"].metadata.items()}
    assert (row_check["table_rows"], row_check["descriptor_records"], row_check["table_first_offset"]) == (50, 50, 60)

    # tiering afterwards: the WAL no longer lists the expired segment, nothing is appended
    tiered, table_report = asyncio.run(_tier(broker.address, etcd_endpoints, topic, objects, env.catalog))
    assert (tiered.sealed_segments, tiered.segments_expired, tiered.objects_written) == (2, 0, 0)
    assert table_report is not None and table_report.rows_appended == 0

    again, _ = asyncio.run(_retain(broker.address, etcd_endpoints, topic, objects, env, now_ms))
    assert (again.rows_deleted, again.snapshots_expired) == (0, 0)
    assert (again.descriptors_deleted, again.objects_deleted) == (0, 0)
    assert (again.retained_start, again.wal_deleted_segments) == (60, 0)


# --------------------------------------------------------------------------- size retention


@pytest.mark.spark
@pytest.mark.integration
def test_size_retention_through_the_asset(
    retention_spark: Env, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    """``retention_size_mb=1``: the ``retention`` asset keeps the newest objects whose sizes
    add up to at most 1 MiB and deletes the older ones with their rows; its materialization
    reports the figures."""
    env = retention_spark
    objects = ObjectStore((tmp_path / "objects").as_uri())
    broker = start_broker(
        segment_max_bytes=200 * 1024,
        segment_max_age_s=600.0,
        extra_args=["--local-retention-check-s", "3600", "--object-store-url", objects.root_url],
    )
    topic = TopicName("sized", "blobs")
    asyncio.run(_produce(broker.address, topic.path, 16, size=100 * 1024))
    asyncio.run(_tier(broker.address, etcd_endpoints, topic, objects, env.catalog))
    before = completed_descriptors(asyncio.run(_descriptors(etcd_endpoints, topic)))
    assert len(before) >= 5 and sum(d.size for d in before) > 1024 * 1024
    asyncio.run(_set_policy(etcd_endpoints, "sized", NamespacePolicy(retention_size_mb=1).to_json()))

    resources = {
        "etcd": EtcdResource(endpoints=",".join(etcd_endpoints)),
        "broker": BrokerResource(bootstrap_addresses=broker.address),
        "object_store": ObjectStoreResource(root_url=objects.root_url),
        "iceberg_catalog": IcebergCatalogResource(name=CATALOG, uri=env.uri, warehouse=env.warehouse),
        "spark": SparkResource(
            catalog_name=CATALOG, catalog_uri=env.uri, warehouse=env.warehouse, stop_after_use=False
        ),
    }
    with DagsterInstance.ephemeral() as instance:
        instance.add_dynamic_partitions("topics", [topic.partition_key])
        # the (topic, day) partition of today, the day every record was published
        day = dt.datetime.now(dt.UTC).date().isoformat()
        instance.add_dynamic_partitions("days", [day])
        result = materialize(
            [retention_asset],
            partition_key=MultiPartitionKey({"topic": topic.partition_key, "day": day}),
            resources=resources,
            instance=instance,
        )
    assert result.success
    [mat] = result.asset_materializations_for_node("retention")
    meta: dict[str, Any] = {k: v.value for k, v in mat.metadata.items()}

    after = _assert_consistent(env, etcd_endpoints, topic, objects)
    kept_bytes = sum(d.size for d in after)
    assert kept_bytes <= 1024 * 1024
    dropped = before[: len(before) - len(after)]
    assert dropped and after == before[len(dropped) :]
    assert kept_bytes + dropped[-1].size > 1024 * 1024  # one more would not fit
    assert meta["retention_bytes"] == 1024 * 1024 and meta["retained_start"] == after[0].start_offset
    assert meta["descriptors_deleted"] == meta["objects_deleted"] == len(dropped)
    assert meta["rows_deleted"] == after[0].start_offset
    assert meta["day"] == day and meta["data_files_after"] <= meta["data_files_before"]
    assert meta["earliest_offset"] == after[0].start_offset
    assert "cutoff_ms" not in meta  # no time limit
    assert meta["wal_step"] == "applied" and meta["wal_deleted_segments"] == len(dropped)
    assert _object_names(objects, topic) == [d.object_id for d in after]
    assert [o for o, _ in _rows(env, topic)] == list(range(after[0].start_offset, after[-1].end_offset + 1))


# --------------------------------------------------------------------------- crashes

# A process of its own, with its own JVM: a crash must kill the process that runs retention,
# which the test's process (and the run's Spark session) must survive.
CHILD = r"""
import asyncio, json, os, sys

args = json.loads(sys.argv[1])

from danube_pipeline.lake import iceberg
from danube_pipeline.client import DanubeClient
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore
from danube_pipeline.lake.retention import apply_retention
from danube_pipeline.lake.spark.session import build_spark_session, spark_conf


def build():
    conf = spark_conf(catalog_name=args["catalog"], catalog_uri=args["uri"], warehouse=args["warehouse"],
                      master="local[1]", shuffle_partitions=1)
    # a short-lived JVM: the C1 compiler alone starts faster
    conf["spark.driver.extraJavaOptions"] = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    return build_spark_session(conf)


# The JVM is launched before any gRPC channel exists, when this run will need it: pyspark forks
# it with a preexec_fn, and a fork while gRPC's threads run can kill the child before it execs
# java. Whether retention asks for a session is still what the test checks ("spark").
prebuilt = build() if args["needs_spark"] else None


def session():
    print("spark", flush=True)
    return prebuilt if prebuilt is not None else build()


def after_step(step):
    print("step", step, flush=True)
    if step == args["crash_at"]:
        os._exit(137)


async def main():
    catalog = iceberg.load_catalog(name=args["catalog"], uri=args["uri"], warehouse=args["warehouse"])
    async with await MetadataStore.connect(args["etcd"]) as store, DanubeClient([args["broker"]]) as client:
        await apply_retention(TopicName.parse(args["topic"]), store=store, objects=ObjectStore(args["objects"]),
                              catalog=catalog, spark=session, admin=client.admin, now_ms=args["now_ms"],
                              after_step=after_step)


asyncio.run(main())
sys.exit(3)
"""


def _crash_after(step: str, **args: Any) -> list[str]:
    """Run ``apply_retention`` in a child process that dies (``os._exit(137)``) right after
    ``step``; the lines it printed."""
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps({**args, "crash_at": step})],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 137, proc.stderr[-3000:]
    return proc.stdout.split("\n")[:-1]


@pytest.mark.spark
@pytest.mark.integration
def test_a_crash_after_any_step_is_completed_by_the_next_run(
    retention_spark: Env, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    """Eight objects, one per batch; the first three are in the table, the others only tiered
    (descriptors and objects). For each step, in order, one more batch expires and a child
    process runs retention and dies right after that step; the state it leaves is consistent,
    and a run in this process completes it. The last three batches expire before reaching the
    table, so the table finally resumes at the first descriptor retention left."""
    env = retention_spark
    broker = start_broker(segment_max_bytes=64 * 1024, segment_max_age_s=600.0)
    topic = TopicName("default", "crashes")
    objects = ObjectStore((tmp_path / "objects").as_uri())
    asyncio.run(_set_policy(etcd_endpoints, "default", NamespacePolicy(retention_time_minutes=1).to_json()))

    boundaries: list[int] = []  # boundaries[k]: a time after batch k, before batch k + 1
    for batch in range(8):
        if batch == 3:  # batches 0-2 go into the table, the later ones stay objects only
            asyncio.run(_tier(broker.address, etcd_endpoints, topic, objects, env.catalog))
        asyncio.run(_produce(broker.address, topic.path, 10))
        # time passes on both sides of the noted time, so it falls strictly between two batches
        time.sleep(0.03)
        boundaries.append(_now_ms())
        time.sleep(0.03)
    asyncio.run(_tier(broker.address, etcd_endpoints, topic, objects, env.catalog, commit=False))
    start = completed_descriptors(asyncio.run(_descriptors(etcd_endpoints, topic)))
    assert [(d.start_offset, d.end_offset) for d in start] == [(10 * b, 10 * b + 9) for b in range(8)]
    assert iceberg.committed_end_offset(_table(env, topic)) == 29
    data_dir = Path(_table(env, topic).location().removeprefix("file://")) / "data"

    child_args = {
        "catalog": CATALOG,
        "uri": env.uri,
        "warehouse": env.warehouse,
        "etcd": etcd_endpoints,
        "broker": broker.address,
        "topic": topic.path,
        "objects": objects.root_url,
    }
    for batch, step in enumerate(STEPS):
        now_ms = boundaries[batch] + MINUTE_MS  # batches 0..batch have expired
        orphan = data_dir / "left-by-a-dead-writer.parquet"
        if step == "orphans":
            orphan.write_bytes(b"not referenced by any snapshot")
            old = time.time() - 4 * 24 * 3600
            os.utime(orphan, (old, old))
        printed = _crash_after(step, now_ms=now_ms, needs_spark=batch <= 2, **child_args)
        assert printed[-1] == f"step {step}"
        # Spark starts only when the table has rows to delete (batches 0-2)
        assert ("spark" in printed) == (batch <= 2), printed

        # what the dead run left is consistent and readable
        mid = _assert_consistent(env, etcd_endpoints, topic, objects)
        rows = [o for o, _ in _rows(env, topic)]
        assert rows == list(range(10 * (batch + 1), 30))  # this batch's rows went first
        assert iceberg.committed_end_offset(_table(env, topic)) == 29
        if step == "orphans":
            assert not orphan.exists()
        descriptors_gone = STEPS.index(step) >= STEPS.index("descriptors")
        assert mid[0].start_offset == 10 * (batch + 1 if descriptors_gone else batch)

        # the next run completes it
        report, steps = asyncio.run(_retain(broker.address, etcd_endpoints, topic, objects, env, now_ms))
        assert steps == list(STEPS)
        assert report.retained_start == 10 * (batch + 1)
        done = _assert_consistent(env, etcd_endpoints, topic, objects, cutoff_ms=boundaries[batch])
        assert [d.start_offset for d in done] == [10 * b for b in range(batch + 1, 8)]
        assert _object_names(objects, topic) == [d.object_id for d in done]
        assert len(_table(env, topic).snapshots()) == 1

    # batches 3-5 expired before reaching the table: it resumes at batch 6
    _, table_report = asyncio.run(_tier(broker.address, etcd_endpoints, topic, objects, env.catalog))
    assert table_report is not None and table_report.rows_appended == 20
    assert table_report.committed_end_offset == 79
    final = _assert_consistent(env, etcd_endpoints, topic, objects, cutoff_ms=boundaries[5])
    assert [o for o, _ in _rows(env, topic)] == list(range(60, 80)) == [
        o for d in final for o in range(d.start_offset, d.end_offset + 1)
    ]
    count = env.spark.sql(f"SELECT count(*) AS n FROM {CATALOG}.default.crashes").collect()[0]["n"]
    assert count == 20
