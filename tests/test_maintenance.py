"""Time-partitioned tables (``danube_pipeline.lake.iceberg.layout``), the maintenance schedules that
find the (topic, day) partitions needing work, the ``fresh`` check, and the schedules and
sensors as the Dagster daemon loads them: real etcd, real segment objects, a real catalog."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from dagster import (
    AssetSelection,
    DagsterInstance,
    MultiPartitionKey,
    SensorResult,
    materialize,
    build_schedule_context,
    build_sensor_context,
    instance_for_test,
)
from pyiceberg.transforms import DayTransform, HourTransform, IdentityTransform
from helpers import RegisterCatalog
from tiering_helpers import avro, avro_payload, make_env

from assets.assets import iceberg_table, segment_objects
from assets.checks import fresh, tiering_checks
from assets.partitions import DAYS_PARTITIONS_NAME, TOPICS_PARTITIONS_NAME
from assets.resources import BrokerResource, EtcdResource, IcebergCatalogResource, ObjectStoreResource
from assets.schedules import compaction_schedule, retention_schedule
from assets.sensors import freshness_sensor
from danube_pipeline.lake import iceberg
from danube_pipeline.lake.iceberg.layout import apply_layout, data_files_by_day, describe_spec, layout_of
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import NamespacePolicy, TableLayout
from danube_pipeline.names import TopicName
from danube_pipeline.format.records import Record

SCHEMA = avro({"name": "n", "type": "long"}, {"name": "s", "type": "string"})


def _requests(evaluated: Any) -> list[Any]:
    """The run requests and skip reasons a schedule function yielded."""
    return list(evaluated)


def _evaluate(schedule: Any, instance: DagsterInstance, env: _Env) -> list[Any]:
    """The run requests and skip reasons of one tick of ``schedule``, its context closed here.

    A schedule context opens an instance of its own from the test instance's ref. Left to the
    garbage collector, its close came after the test instance's and put that instance's state
    storage back as Dagster's current one, dead: the next test of the worker to load the
    definitions failed with "Attempted to resolve undefined DagsterInstance weakref"."""
    with build_schedule_context(
        instance=instance, resources=env.resources(), scheduled_execution_time=_now()
    ) as context:
        return _requests(schedule(context))


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _today() -> dt.date:
    return dt.datetime.now(dt.UTC).date()


def _start_us(day: dt.date) -> int:
    return int(dt.datetime.combine(day, dt.time(), tzinfo=dt.UTC).timestamp() * 1_000_000)


def _records(first: int, count: int, day: dt.date, *, hour: int = 1) -> list[Record]:
    """``count`` Avro records from offset ``first``, published ``hour`` o'clock on ``day`` (UTC)."""
    base = _start_us(day) + hour * 3_600_000_000
    return [
        Record(
            offset=o,
            publish_time_us=base + o,
            producer_id=1,
            producer_name="maintenance-test",
            schema_id=1,
            schema_version=1,
            payload=avro_payload(SCHEMA, {"n": o, "s": f"row {o}"}),
            attributes={},
        )
        for o in range(first, first + count)
    ]


class _Env:
    """Segment objects in an object store with their descriptors in etcd, and the catalog the
    tiering commits them to (``tiering_helpers.make_env``)."""

    def __init__(self, endpoints: list[str], root: Path, topic: TopicName) -> None:
        self.inner = make_env(endpoints, root)
        self.inner.registry.add_avro(1, 1, SCHEMA)
        self.topic = topic
        self.next_offset = 0
        self.root = root

    def put(self, count: int, day: dt.date, *, hour: int = 1) -> None:
        asyncio.run(self.inner.put(_records(self.next_offset, count, day, hour=hour), self.topic))
        self.next_offset += count

    def tier(self) -> Any:
        return asyncio.run(self.inner.tier(self.topic))

    def table(self) -> Any:
        return self.inner.table(self.topic)

    async def put_key(self, key: str, value: Any) -> None:
        async with await MetadataStore.connect(self.inner.endpoints) as store:
            await store.put(key, value)

    def resources(self, **extra: Any) -> dict[str, Any]:
        return {
            "etcd": EtcdResource(endpoints=",".join(self.inner.endpoints)),
            "object_store": ObjectStoreResource(root_url=self.inner.objects.root_url),
            "iceberg_catalog": IcebergCatalogResource(
                name="danube", uri=f"sqlite:///{self.root / 'catalog.db'}", warehouse=(self.root / "warehouse").as_uri()
            ),
            **extra,
        }


@pytest.fixture
def env(etcd_endpoints: list[str], tmp_path: Path, request: pytest.FixtureRequest) -> _Env:
    return _Env(etcd_endpoints, tmp_path, TopicName("default", request.node.name.replace("[", "_").rstrip("]")[:40]))


# --------------------------------------------------------------------------- layout


@pytest.mark.integration
def test_new_table_is_partitioned_by_day_and_sorted_by_offset(env: _Env) -> None:
    """Tiering creates the table partitioned by day(_publish_time), sorted by _offset; one
    object whose records span two days becomes one data file per day."""
    yesterday = _today() - dt.timedelta(days=1)
    records = _records(0, 5, yesterday, hour=23) + _records(5, 5, _today())
    asyncio.run(env.inner.put(records, env.topic))
    report = env.tier()
    table = env.table()
    [field] = table.spec().fields
    assert isinstance(field.transform, DayTransform) and field.name == "_publish_time_day"
    assert table.schema().find_column_name(field.source_id) == "_publish_time"
    [sort_field] = table.sort_order().fields
    assert table.schema().find_column_name(sort_field.source_id) == "_offset"
    assert isinstance(sort_field.transform, IdentityTransform)
    by_day = data_files_by_day(table)
    assert sorted(by_day) == [yesterday, _today()]
    assert [(f.data_files, f.rows, f.min_offset) for f in by_day.values()] == [(1, 5, 0), (1, 5, 5)]
    assert report.partition_spec == "day(_publish_time)" and report.layout_changes == []
    assert report.rows_appended == 10 and (report.first_offset, report.last_offset) == (0, 9)
    assert report.data_files == 2 and report.bytes_read > 0
    # a reader prunes by day: only that day's file is planned
    scan = table.scan(row_filter=f"_publish_time >= '{dt.datetime.combine(_today(), dt.time(), tzinfo=dt.UTC).isoformat()}'")
    assert len(list(scan.plan_files())) == 1
    assert sorted(scan.to_arrow()["_offset"].to_pylist()) == list(range(5, 10))


@pytest.mark.integration
def test_existing_unpartitioned_table_is_evolved_not_rebuilt(env: _Env) -> None:
    """A table created as earlier releases did (unpartitioned, unsorted) keeps its data files
    and history; the next tiering evolves its spec to day(_publish_time) and its sort order
    to _offset, and new files are written under the new spec."""
    catalog = env.inner.catalog
    catalog.create_namespace_if_not_exists(env.topic.namespace)
    ident = iceberg.table_identifier(env.topic)
    old = catalog.create_table(
        ident, schema=iceberg.iceberg_schema_for_avro(SCHEMA), properties={"danube.topic": env.topic.path}
    )
    assert not old.spec().fields and not old.sort_order().fields
    iceberg.append_records(old, _records(0, 3, _today()), SCHEMA, "data-0-2.dnb1")
    env.put(3, _today())  # the object of those 3 rows: already committed, skipped
    old_files = set(old.inspect.files()["file_path"].to_pylist())
    old_snapshots = [s.snapshot_id for s in old.snapshots()]
    env.put(3, _today())
    report = env.tier()
    evolved = env.table()
    assert report.layout_changes == ["partition spec: day(_publish_time)", "sort order: _offset"]
    assert report.rows_appended == 3 and report.objects_skipped == 1
    assert (report.data_files_before, report.data_files) == (1, 2)
    assert layout_of(evolved) == TableLayout("day") and evolved.spec().spec_id == 1
    assert old_files <= set(evolved.inspect.files()["file_path"].to_pylist())  # not rewritten
    assert [s.snapshot_id for s in evolved.snapshots()][: len(old_snapshots)] == old_snapshots
    assert sorted(f["spec_id"] for f in evolved.inspect.files().to_pylist()) == [0, 1]
    assert sorted(evolved.scan().to_arrow()["_offset"].to_pylist()) == list(range(6))
    assert data_files_by_day(evolved)[_today()].older_spec_files == 1
    env.put(2, _today())
    assert env.tier().layout_changes == []  # tiering again changes nothing


@pytest.mark.integration
def test_topic_layout_key_chooses_the_transform(env: _Env) -> None:
    """``/topics/{ns}/{topic}/table`` (§3.9) picks hour for a new table; changing it to day
    evolves the spec on the next tiering; a bad value fails tiering with the key named."""
    asyncio.run(env.put_key(keys.topic_table(env.topic), {"partition_transform": "hour"}))
    env.put(3, _today(), hour=1)
    env.put(3, _today(), hour=5)
    env.tier()
    table = env.table()
    [field] = table.spec().fields
    assert isinstance(field.transform, HourTransform) and field.name == "_publish_time_hour"
    assert len(table.inspect.files()) == 2  # one per hour
    asyncio.run(env.put_key(keys.topic_table(env.topic), {"partition_transform": "day"}))
    env.put(2, _today())
    report = env.tier()
    assert report.layout_changes == ["partition spec: day(_publish_time)"]
    assert layout_of(env.table()) == TableLayout("day")
    asyncio.run(env.put_key(keys.topic_table(env.topic), {"partition_transform": "week"}))
    env.put(1, _today())
    with pytest.raises(ValueError, match=r"/topics/default/.*/table: TableLayout: partition_transform must be one of"):
        env.tier()


@pytest.mark.unit
def test_apply_layout_to_none_and_back(tmp_path: Path) -> None:
    catalog = iceberg.load_catalog(name="t", uri=f"sqlite:///{tmp_path / 'c.db'}", warehouse=(tmp_path / "w").as_uri())
    table = iceberg.ensure_table(catalog, TopicName("default", "t"), SCHEMA)
    assert apply_layout(table) == []
    assert apply_layout(table, TableLayout("none")) == ["partition spec: unpartitioned"]
    assert describe_spec(table) == "unpartitioned"
    assert apply_layout(table, TableLayout("month")) == ["partition spec: month(_publish_time)"]
    assert apply_layout(table, TableLayout("month")) == []
    with pytest.raises(ValueError, match="partition_transform must be one of hour, day, month, year, none"):
        TableLayout.from_json({"partition_transform": "minute"})


@pytest.mark.integration
def test_admin_cli_sets_the_table_layout(env: _Env) -> None:
    """``danube-admin topics set-table-layout`` writes §3.9; a bad transform exits 2 and an
    unknown topic exits 1, writing nothing."""
    import subprocess
    import sys

    admin = str(Path(sys.executable).parent / "danube-admin")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [admin, "--etcd-endpoints", ",".join(env.inner.endpoints), "--output", "json", "topics", *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    asyncio.run(env.put_key(keys.topic_root(env.topic), 0))
    done = run("set-table-layout", env.topic.path, "--partition-by", "hour")
    bad = run("set-table-layout", env.topic.path, "--partition-by", "week")
    missing = run("set-table-layout", "/default/no_such_topic", "--partition-by", "day")

    async def stored(topic: TopicName) -> Any:
        async with await MetadataStore.connect(env.inner.endpoints) as store:
            kv = await store.get(keys.topic_table(topic))
        return kv.value if kv is not None else None

    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["partition_transform"] == "hour" and doc["key"] == keys.topic_table(env.topic)
    assert asyncio.run(stored(env.topic)) == {"partition_transform": "hour"}
    assert bad.returncode == 2 and "'week' is not one of" in bad.stderr
    assert missing.returncode == 1 and "topic '/default/no_such_topic' not found" in missing.stderr
    assert asyncio.run(stored(TopicName("default", "no_such_topic"))) is None


# --------------------------------------------------------------------------- schedules


@pytest.mark.integration
def test_compaction_schedule_requests_only_days_with_small_files(env: _Env) -> None:
    """Two objects on one day (two files) ask for a compaction run of that (topic, day); a day
    with one file does not; a day long past (rows loaded in bulk) is requested too, its day
    partition added by the tick."""
    busy, quiet = _today() - dt.timedelta(days=2), _today() - dt.timedelta(days=1)
    env.put(3, busy)
    env.put(3, busy)
    env.put(3, quiet)
    env.put(2, dt.date(2020, 1, 1))  # long before any day the topic sensor adds
    env.put(2, dt.date(2020, 1, 1))
    env.tier()
    with instance_for_test() as instance:
        empty = _evaluate(compaction_schedule, instance, env)  # no topic partitions yet
        instance.add_dynamic_partitions(TOPICS_PARTITIONS_NAME, [env.topic.partition_key])
        requests = _evaluate(compaction_schedule, instance, env)
        days = instance.get_dynamic_partitions(DAYS_PARTITIONS_NAME)
    assert [type(r).__name__ for r in empty] == ["SkipReason"]
    assert sorted(str(r.partition_key) for r in requests) == [
        str(MultiPartitionKey({"topic": env.topic.partition_key, "day": "2020-01-01"})),
        str(MultiPartitionKey({"topic": env.topic.partition_key, "day": busy.isoformat()})),
    ]
    assert sorted(days) == ["2020-01-01", busy.isoformat()]


@pytest.mark.integration
def test_retention_schedule_requests_the_expired_days(env: _Env) -> None:
    """With a 1-day time limit, the days of records older than a day are requested, today's
    is not."""
    older, old = _today() - dt.timedelta(days=3), _today() - dt.timedelta(days=2)
    env.put(3, older)
    env.put(3, old)
    env.put(3, _today(), hour=0)
    env.tier()
    with instance_for_test() as instance:
        instance.add_dynamic_partitions(TOPICS_PARTITIONS_NAME, [env.topic.partition_key])
        nothing = _evaluate(retention_schedule, instance, env)
        asyncio.run(
            env.put_key(keys.namespace_policy(env.topic.namespace), NamespacePolicy(retention_time_minutes=24 * 60).to_json())
        )
        try:
            requests = _evaluate(retention_schedule, instance, env)
        finally:
            asyncio.run(env.put_key(keys.namespace_policy(env.topic.namespace), NamespacePolicy().to_json()))
    assert [type(r).__name__ for r in nothing] == ["SkipReason"]
    assert sorted(str(r.partition_key) for r in requests) == [
        f"{older.isoformat()}|{env.topic.partition_key}",
        f"{old.isoformat()}|{env.topic.partition_key}",
    ]


# --------------------------------------------------------------------------- freshness


async def _produce(address: str, topic: str, count: int, *, seal: bool) -> None:
    from danube_pipeline.client import DanubeClient

    async with DanubeClient([address]) as client:
        async with client.producer(topic, producer_name="fresh-test") as producer:
            for i in range(count):
                await producer.send(f"m{i}".encode())
        if seal:
            await client.admin.seal_active_segment(topic)


@pytest.mark.integration
def test_freshness_sensor_runs_the_check_when_a_table_turns_stale_or_fresh(
    env: _Env, start_broker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records sealed but not tiered for longer than the limit: the sensor requests a run of
    the ``fresh`` check, which fails with the backlog in its metadata; an unchanged state
    requests nothing; once tiered, the next run of the check passes."""
    from danube_pipeline.client import DanubeClient
    from danube_pipeline.lake.tiering import tier_sealed_segments

    # the broker on the assets' object store (both check its identity: storage/identity.py)
    broker = start_broker(segment_max_age_s=600.0, extra_args=["--object-store-url", env.inner.objects.root_url])
    asyncio.run(_produce(broker.address, env.topic.path, 5, seal=True))
    monkeypatch.setenv("DANUBE_FRESHNESS_LIMIT_S", "0.5")
    time.sleep(1.0)  # time passes: the sealed records become older than the 0.5 s limit
    resources = env.resources(broker=BrokerResource(bootstrap_addresses=broker.address))

    def run_check(instance: Any, tags: Mapping[str, str]) -> Any:
        result = materialize(
            [segment_objects, iceberg_table, *tiering_checks],
            selection=AssetSelection.checks(fresh),
            tags=dict(tags),
            resources=resources,
            instance=instance,
        )
        [evaluation] = result.get_asset_check_evaluations()
        return evaluation

    with instance_for_test() as instance:
        instance.add_dynamic_partitions(TOPICS_PARTITIONS_NAME, [env.topic.partition_key])
        context = build_sensor_context(instance=instance, resources=resources)
        stale = freshness_sensor(context)
        assert isinstance(stale, SensorResult) and stale.run_requests
        [request] = stale.run_requests
        failed = run_check(instance, request.tags)
        unchanged = freshness_sensor(build_sensor_context(instance=instance, resources=resources, cursor=stale.cursor))

        async def tier() -> None:
            async with await MetadataStore.connect(env.inner.endpoints) as store, DanubeClient([broker.address]) as client:
                await tier_sealed_segments(env.topic, store=store, admin=client.admin, objects=env.inner.objects)

        asyncio.run(tier())
        env.tier()
        recovered = freshness_sensor(build_sensor_context(instance=instance, resources=resources, cursor=stale.cursor))
        assert isinstance(recovered, SensorResult) and recovered.run_requests
        passed = run_check(instance, recovered.run_requests[0].tags)
    assert request.tags["dagster/partition"] == env.topic.partition_key
    assert failed.check_name == "fresh" and not failed.passed
    meta = {k: v.value for k, v in failed.metadata.items()}
    assert meta["pending_records"] == 5 and meta["lag_s"] >= 1.0 and meta["limit"] == "0.5 s"
    # nothing plotted that is an epoch or a constant
    assert "last_commit_ms" not in meta and "limit_s" not in meta
    assert "5 records not queryable yet" in (failed.description or "")
    assert isinstance(unchanged, SensorResult) and not unchanged.run_requests and unchanged.skip_reason is None
    assert passed.passed and {k: v.value for k, v in passed.metadata.items()}["pending_records"] == 0


# --------------------------------------------------------------------------- loaded by the daemon


@pytest.mark.integration
def test_schedules_and_sensors_load_as_running() -> None:
    """The real ``assets.definitions`` loaded as the daemon and the UI load it: every schedule
    and sensor is running without anyone turning it on."""
    from dagster._core.test_utils import create_test_daemon_workspace_context
    from dagster._core.workspace.load_target import ModuleTarget

    repo_root = str(Path(__file__).resolve().parents[1])
    with instance_for_test() as instance:
        target = ModuleTarget(module_name="assets.definitions", attribute=None, working_directory=repo_root, location_name="danube")
        with create_test_daemon_workspace_context(target, instance) as context:
            [location] = context.create_request_context().code_locations
            [repository] = location.get_repositories().values()
            states = {}
            instigators: list[Any] = [*repository.get_schedules(), *repository.get_sensors()]
            for s in instigators:
                stored = instance.get_instigator_state(s.get_remote_origin_id(), s.selector_id)
                states[s.name] = s.get_current_instigator_state(stored).is_running
    assert states == {
        "compaction_schedule": True,
        "retention_schedule": True,
        "topic_partitions_sensor": True,
        "sealed_segments_sensor": True,
        "commit_checks_sensor": True,
        "freshness_sensor": True,
    }


# --------------------------------------------------------------------------- backfill from the CLI

DEFS_FOR_BACKFILL = """
from dagster import Definitions, in_process_executor

from assets.assets import compacted_table
from assets.jobs import compaction_job
from assets.resources import EtcdResource, IcebergCatalogResource, SparkResource

defs = Definitions(
    assets=[compacted_table],
    jobs=[compaction_job],
    executor=in_process_executor,  # steps run in the test's process, on its Spark session
    resources={{
        "etcd": EtcdResource(endpoints={etcd!r}),
        "iceberg_catalog": IcebergCatalogResource(name="danube", uri={uri!r}, warehouse={warehouse!r}),
        "spark": SparkResource(catalog_name="danube", catalog_uri={uri!r}, warehouse={warehouse!r}, stop_after_use=False),
    }},
)
"""


@pytest.mark.spark
# Dagster 1.13's own backfill code calls its deprecated AssetSelection.sources() and tags
# multi-partition runs dagster/partition/{dimension}, which its tag check then calls deprecated
@pytest.mark.filterwarnings("ignore:Function `AssetSelection.sources` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:Non-compliant tag keys:DeprecationWarning")
def test_compaction_backfill_over_days_from_the_cli(
    env: _Env, tmp_path: Path, spark_on_catalog: RegisterCatalog
) -> None:
    """``dagster job backfill`` of compaction_job over two (day, topic) partitions, executed by
    the daemon's backfill and run-queue loops: two runs, each compacting its day only; a third
    day with small files is left as it was."""
    import logging
    import subprocess
    import sys

    from dagster._core.execution.backfill import BulkActionStatus
    from dagster._core.test_utils import create_test_daemon_workspace_context
    from dagster._core.workspace.load_target import PythonFileTarget
    from dagster._daemon.backfill import execute_backfill_iteration
    from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon

    days = [_today() - dt.timedelta(days=d) for d in (2, 1, 0)]
    for day in days:
        env.put(3, day)
        env.put(3, day)
    env.tier()
    before = {f["file_path"] for f in env.table().inspect.files().to_pylist()}
    uri, warehouse = f"sqlite:///{env.root / 'catalog.db'}", (env.root / "warehouse").as_uri()
    # the runs' SparkResource gets this session back from build_spark_session (getOrCreate)
    spark_on_catalog(name="danube", uri=uri, warehouse=warehouse)
    defs_file = tmp_path / "compaction_defs.py"
    defs_file.write_text(DEFS_FOR_BACKFILL.format(etcd=",".join(env.inner.endpoints), uri=uri, warehouse=warehouse))
    keys_ = [f"{d.isoformat()}|{env.topic.partition_key}" for d in days[:2]]
    repo_root = str(Path(__file__).resolve().parents[1])
    overrides = {
        "run_launcher": {"module": "dagster._core.launcher.sync_in_memory_run_launcher", "class": "SyncInMemoryRunLauncher"},
    }
    with instance_for_test(overrides=overrides) as instance:
        instance.add_dynamic_partitions(TOPICS_PARTITIONS_NAME, [env.topic.partition_key])
        instance.add_dynamic_partitions(DAYS_PARTITIONS_NAME, [d.isoformat() for d in days])
        cli = subprocess.run(
            [
                sys.executable, "-m", "dagster", "job", "backfill", "-f", str(defs_file), "-a", "defs",
                "-j", "compaction_job", "--partitions", ",".join(keys_), "--noprompt",
            ],
            cwd=repo_root, capture_output=True, text=True, timeout=300,
        )
        assert cli.returncode == 0, cli.stdout + cli.stderr
        [backfill] = instance.get_backfills()
        target = PythonFileTarget(str(defs_file), "defs", repo_root, "compaction_test")
        with create_test_daemon_workspace_context(target, instance) as context:
            with QueuedRunCoordinatorDaemon(interval_seconds=1) as queue:
                for _ in range(8):
                    list(execute_backfill_iteration(context, logging.getLogger("backfill")))
                    list(queue.run_iteration(context))
                    done = instance.get_backfill(backfill.backfill_id)
                    if done is not None and done.status != BulkActionStatus.REQUESTED:
                        break
        runs = instance.get_runs()
        done = instance.get_backfill(backfill.backfill_id)
    # a job backfill is COMPLETED once every run is submitted; the runs themselves succeeded
    assert done is not None and done.status in (BulkActionStatus.COMPLETED, BulkActionStatus.COMPLETED_SUCCESS), done
    assert sorted(r.tags["dagster/partition"] for r in runs) == sorted(keys_)
    assert all(r.is_success for r in runs)
    by_day = data_files_by_day(env.table())
    assert [by_day[d].data_files for d in days] == [1, 1, 2]
    untouched = {f["file_path"] for f in env.table().inspect.files().to_pylist() if f["partition"]["_publish_time_day"] == days[2]}
    assert untouched <= before
    assert sorted(env.table().scan().to_arrow()["_offset"].to_pylist()) == list(range(18))


@pytest.mark.spark
def test_retention_of_one_day_touches_only_that_days_files(env: _Env, spark_on_catalog: RegisterCatalog) -> None:
    """``apply_retention(day=d)`` deletes the expired rows of day d only: the other expired
    day keeps its rows and its very data files until its own run."""
    from danube_pipeline.lake.retention import apply_retention

    older, old = _today() - dt.timedelta(days=3), _today() - dt.timedelta(days=2)
    for day in (older, old, _today()):
        env.put(4, day)
    env.tier()
    asyncio.run(
        env.put_key(keys.namespace_policy(env.topic.namespace), NamespacePolicy(retention_time_minutes=24 * 60).to_json())
    )

    def files_of(day: dt.date) -> set[str]:
        return {f["file_path"] for f in env.table().inspect.files().to_pylist() if f["partition"]["_publish_time_day"] == day}

    old_files = files_of(old)
    uri, warehouse = f"sqlite:///{env.root / 'catalog.db'}", (env.root / "warehouse").as_uri()
    spark = spark_on_catalog(name="danube", uri=uri, warehouse=warehouse)

    async def retain(day: dt.date) -> Any:
        async with await MetadataStore.connect(env.inner.endpoints) as store:
            return await apply_retention(
                env.topic, store=store, objects=env.inner.objects, catalog=env.inner.catalog, spark=spark,
                admin=object(), catalog_name="danube", day=day,
            )  # fmt: skip

    try:
        first = asyncio.run(retain(older))
        after_first = sorted(env.table().scan().to_arrow()["_offset"].to_pylist())
        kept_old_files = files_of(old)
        second = asyncio.run(retain(old))
    finally:
        asyncio.run(env.put_key(keys.namespace_policy(env.topic.namespace), NamespacePolicy().to_json()))
    assert (first.day, first.retained_start, first.rows_deleted) == (older, 8, 4)
    assert after_first == list(range(4, 12))
    assert kept_old_files == old_files  # the other expired day: not read, not rewritten
    assert (second.day, second.rows_deleted) == (old, 4)
    assert sorted(env.table().scan().to_arrow()["_offset"].to_pylist()) == list(range(8, 12))
    assert second.data_files_after is not None and second.data_files_before is not None
