"""The continuous writer against a real etcd, broker, object store and Iceberg SQL catalog: a
produced message becomes queryable without any Dagster run, each commit is recorded as a
materialization in a Dagster instance, and the writer and the sensor path's steps committing
at the same time leave every offset in the table exactly once."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from dagster import AssetKey, DagsterInstance, EventLogRecord
from helpers import eventually_sync

from assets.continuous_writer import ContinuousWriter, WriterConfig, WriterConfigError
from danube_pipeline import settings
from danube_pipeline.lake import iceberg
from danube_pipeline.client import DanubeClient
from danube_pipeline.dev.stack import DevStack
from danube_pipeline.dev.localcluster import BrokerProcess, ContinuousWriterProcess
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore
from danube_pipeline.schemas.registry import SchemaRegistry
from danube_pipeline.lake.tiering import commit_objects_to_table, tier_sealed_segments

REPO = Path(__file__).resolve().parents[1]
TOPIC = TopicName("default", "fresh")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _table_offsets(home: Path, topic: TopicName = TOPIC) -> list[int]:
    """The ``_offset`` column of the topic's table, sorted; empty before the table exists."""
    catalog = iceberg.load_catalog(uri=f"sqlite:///{home / 'catalog.db'}", warehouse=(home / "warehouse").as_uri())
    ident = iceberg.table_identifier(topic)
    if not catalog.table_exists(ident):
        return []
    rows = catalog.load_table(ident).scan(selected_fields=("_offset",)).to_arrow()
    return sorted(rows.column("_offset").to_pylist())


async def _produce(addresses: list[str], payloads: list[bytes], topic: TopicName = TOPIC) -> list[int]:
    async with DanubeClient(addresses) as client, client.producer(topic.path, producer_name="fresh-test") as producer:
        return [int(o) for o in await asyncio.gather(*(producer.send_nowait(p) for p in payloads))]


@pytest.mark.unit
def test_config_rejects_values_out_of_range() -> None:
    with pytest.raises(WriterConfigError, match="commit_interval_s=0"):
        WriterConfig(commit_interval_s=0)
    with pytest.raises(WriterConfigError, match="commit_max_records"):
        WriterConfig(commit_max_records=0)
    with pytest.raises(WriterConfigError, match="max_backoff_s"):
        WriterConfig(poll_interval_s=5, max_backoff_s=1)
    assert WriterConfig().commit_interval_s == 5.0


@pytest.mark.integration
def test_message_queryable_without_a_run_and_recorded_in_dagster(tmp_path: Path) -> None:
    """``make dev``'s stack without the UI: brokers that would keep a segment open for 10
    minutes, the writer sealing after 1 s. Five messages reach the table with no Dagster run,
    and the instance holds runless materializations of both assets for the topic's partition
    with their offsets, rows and snapshot id. Stopping the stack ends every process by pid."""
    home = tmp_path / "dev"
    instance_dir = tmp_path / "dagster_home"
    instance_dir.mkdir()
    shutil.copy(REPO / "dagster_home" / "dagster.yaml", instance_dir / "dagster.yaml")
    stack = DevStack(
        home, dagster_home=instance_dir, ui=False, segment_max_age_s=600.0, commit_interval_s=1.0
    )
    stack.start()
    try:
        assert stack.writer is not None
        pids = [stack.etcd.pid, stack.brokers[0].pid, stack.writer.pid]
        offsets = asyncio.run(_produce(stack.addresses, [f"m{i}".encode() for i in range(5)]))
        assert offsets == [0, 1, 2, 3, 4]
        eventually_sync(lambda: _table_offsets(home) == offsets, timeout_s=90, interval_s=0.5,
                        what="the five messages queryable in the table")
        os.environ["DANUBE_DAGSTER_STORAGE"] = str(home / "dagster")
        try:
            with DagsterInstance.from_config(str(instance_dir)) as instance:
                assert instance.get_runs() == []

                def materializations(key: str) -> list[EventLogRecord]:
                    return list(instance.fetch_materializations(AssetKey(key), limit=10).records)

                eventually_sync(lambda: bool(materializations("iceberg_table")), timeout_s=30, interval_s=0.5,
                                what="an iceberg_table materialization")
                [table_event] = materializations("iceberg_table")
                mat = table_event.asset_materialization
                assert mat is not None and mat.partition == TOPIC.partition_key
                meta: dict[str, Any] = {k: v.value for k, v in mat.metadata.items()}
                assert meta["committed_end_offset"] == 4 and meta["rows_appended"] == 5
                assert meta["first_offset"] == 0 and meta["last_offset"] == 4
                assert meta["bytes_read"] > 0 and int(meta["snapshot_id"]) > 0
                assert mat.tags == {"danube/writer": "continuous"}
                [segment_event] = materializations("segment_objects")
                seg = segment_event.asset_materialization
                assert seg is not None and seg.partition == TOPIC.partition_key
                assert seg.metadata["records_written"].value == 5
                assert TOPIC.partition_key in instance.get_dynamic_partitions("topics")
        finally:
            del os.environ["DANUBE_DAGSTER_STORAGE"]
    finally:
        stack.stop()
    eventually_sync(lambda: not any(_alive(p) for p in pids), timeout_s=30, what="every process of the stack stopped")


@pytest.mark.integration
def test_thresholds_decide_when_a_segment_is_sealed(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    """With a clock the test moves: records wait until ``commit_interval_s`` has passed since
    the writer first saw them, unless ``commit_max_records`` are waiting; each seal is tiered
    and committed in the same pass."""
    broker = start_broker(segment_max_age_s=600.0)
    objects = ObjectStore((tmp_path / "objects").as_uri())
    catalog = iceberg.load_catalog(uri=f"sqlite:///{tmp_path / 'catalog.db'}", warehouse=(tmp_path / "warehouse").as_uri())
    now = [100.0]

    async def scenario() -> None:
        async with await MetadataStore.connect(etcd_endpoints) as store, DanubeClient([broker.address]) as client:
            writer = ContinuousWriter(
                store=store, admin=client.admin, objects=objects, catalog=catalog,
                config=WriterConfig(commit_interval_s=5.0, commit_max_records=10), clock=lambda: now[0],
            )
            await _produce([broker.address], [b"a", b"b", b"c"])
            [first] = await writer.run_once()
            assert first.sealed_end_offset is None  # just seen: the 5 s start now
            now[0] += 4.9
            [second] = await writer.run_once()
            assert second.sealed_end_offset is None and second.table is None
            now[0] += 0.2
            [third] = await writer.run_once()
            assert third.sealed_end_offset == 2
            assert third.table is not None and third.table.committed_end_offset == 2 and third.table.rows_appended == 3
            assert third.tiering is not None and third.tiering.objects_written == 1

            await _produce([broker.address], [b"x"] * 10)  # the size threshold: no waiting
            [fourth] = await writer.run_once()
            assert fourth.sealed_end_offset == 12
            assert fourth.table is not None and fourth.table.committed_end_offset == 12

            [idle] = await writer.run_once()
            assert idle.sealed_end_offset is None and idle.table is None

    asyncio.run(scenario())
    assert _table_offsets(tmp_path) == list(range(13))


@pytest.mark.integration
def test_writer_and_sensor_path_together_commit_each_offset_once(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    """The writer process seals every 0.3 s while the test runs the tiering assets' two steps
    (what a ``tiering_job`` run does) in a loop on the same topic: whoever loses a descriptor
    or an Iceberg commit skips what the other did, so the table holds offsets 0..N-1 once."""
    home = tmp_path / "danube"
    # the broker on the writer's and the assets' object store (all check its identity)
    broker = start_broker(segment_max_age_s=600.0, extra_args=["--object-store-url", (home / "objects").as_uri()])
    env = {**os.environ, **settings.environment(home, etcd_endpoints=etcd_endpoints, broker_addresses=[broker.address])}
    writer = ContinuousWriterProcess(state_dir=tmp_path / "writer", env=env, commit_interval_s=0.3,
                                     poll_interval_s=0.1, dagster=False,
                                     extra_args=["--topic-refresh-interval-s", "0.2"])
    writer.start()
    done = threading.Event()
    errors: list[BaseException] = []
    passes = [0]

    def sensor_path() -> None:
        objects = ObjectStore((home / "objects").as_uri())
        catalog = iceberg.load_catalog(uri=env["DANUBE_CATALOG_URI"], warehouse=env["DANUBE_WAREHOUSE"])

        async def loop() -> None:
            async with await MetadataStore.connect(etcd_endpoints) as store, DanubeClient([broker.address]) as client:
                while not done.is_set():
                    try:
                        await tier_sealed_segments(TOPIC, store=store, admin=client.admin, objects=objects)
                        await commit_objects_to_table(TOPIC, store=store, objects=objects, catalog=catalog,
                                                      registry=SchemaRegistry(store))
                        passes[0] += 1
                    except Exception as exc:  # noqa: BLE001 - recorded for the assertion below
                        if "not found" not in str(exc).lower():
                            errors.append(exc)
                    await asyncio.sleep(0.05)  # pacing: the sensor's interval between passes

        asyncio.run(loop())

    thread = threading.Thread(target=sensor_path)
    thread.start()
    try:
        async def produce_in_bursts() -> int:
            sent = 0
            for burst in range(12):
                sent += len(await _produce([broker.address], [f"{burst}-{i}".encode() for i in range(50)]))
                await asyncio.sleep(0.4)  # pacing: bursts spread over the writer's passes
            return sent

        total = asyncio.run(produce_in_bursts())
        eventually_sync(lambda: _table_offsets(home) == list(range(total)), timeout_s=120, interval_s=0.5,
                        what=f"offsets 0..{total - 1} in the table exactly once")
    finally:
        done.set()
        thread.join(timeout=120)
        writer.stop()
    assert passes[0] > 0 and errors == [], errors
    assert _table_offsets(home) == list(range(total))

    async def check_descriptors() -> None:
        from danube_pipeline.metadata.descriptors import read_descriptors
        from danube_pipeline.lake.tiering import descriptor_gaps

        async with await MetadataStore.connect(etcd_endpoints) as store:
            descriptors, _ = await read_descriptors(store, TOPIC)
        assert all(d.completed for d in descriptors) and descriptor_gaps(descriptors) == []
        assert len(descriptors) >= 5  # the writer sealed and committed during the bursts, not once at the end

    asyncio.run(check_descriptors())

