"""The Iceberg table as a cold read path (``docs/etcd-layout.md`` §3.10, §3.5.1).

A real broker runs with ``--cold-read-path iceberg`` on a SQLite catalog; a topic with an Avro
schema is tiered into segment objects and, for its first part, into its table: offsets 0..149
before the table layout's ``raw_payload`` was on (their rows have no exact bytes), 150..299
after; local retention then leaves only the newest offsets in the WAL. A subscription from
EARLIEST reads 0..149 from the objects, 150..299 from the table, 300..499 from the objects and
the rest from the WAL, and gets every message exactly as a subscription on the ``objects`` path
does. The objects of 150..299 are deleted before that read, so only the table can serve them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from helpers import run_admin
from tiering_helpers import TableStorage

from broker.storage.table_batches import BATCH_RECORDS
from danube_pipeline.client import AvroSchema, DanubeClient, InitialPosition, Message
from danube_pipeline.dev.flights import FLIGHT_AVRO_SCHEMA_JSON, encode_flight, iter_flights
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.lake.tiering import commit_objects_to_table, tier_sealed_segments
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import ObjectDescriptor, TableLayout, TableSnapshot
from danube_pipeline.names import TopicName
from danube_pipeline.schemas.registry import SchemaRegistry
from danube_pipeline.storage.objectstore import ObjectStore, segment_object_path
from danube_pipeline.storage.table_properties import committed_end_offset

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

TOPIC = "/default/cold-read"
COMPACTED = "/default/coldcompacted"
CATALOG = "coldread"
# phases: (first offset, count, producer name); a pause between phases separates publish times
PHASES = [(0, 150, "p-a"), (150, 150, "p-b"), (300, 100, "p-a"), (400, 100, "p-c"), (500, 50, "p-b"), (550, 50, "p-c")]
RAW_FROM = 150  # rows from here on keep their exact bytes (``_raw_payload``)
TABLE_END = 300  # offsets below it are committed to the table
OBJECTS_END = 500  # offsets below it are in segment objects (and no longer in the WAL)
TOTAL = 600


def fields(m: Message) -> tuple[Any, ...]:
    """Everything a consumer sees of a message but its redelivery count."""
    return (
        m.offset, m.payload, dict(m.attributes), m.publish_time_us, m.producer_id, m.producer_name,
        m.schema_id, m.schema_version,
    )


async def admin(etcd: list[str], *args: str) -> str:
    run = await run_admin(*args, etcd=etcd)
    assert run.code == 0, run.err
    return run.out


async def read_all(
    client: DanubeClient, subscription: str, count: int, *, topic: str = TOPIC, **options: Any
) -> list[Message]:
    got: list[Message] = []
    async with client.consumer(topic, subscription=subscription, receiver_queue_size=64, **options) as consumer:
        for _ in range(count):
            message = await consumer.receive(timeout_ms=20_000)
            got.append(message)
            await consumer.ack(message)
        with pytest.raises(TimeoutError):
            await consumer.receive(timeout_ms=300)
    return got


async def test_a_subscription_reads_the_table_then_the_objects_then_the_wal(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    storage = TableStorage(tmp_path, CATALOG)
    objects = storage.objects
    broker = start_broker(
        segment_max_bytes=4096,
        extra_args=storage.broker_args("--cold-read-path", "iceberg", "--object-cache-bytes", "1"),
        env=storage.broker_env(),
    )
    topic = TopicName.parse(TOPIC)
    flights = list(iter_flights(TOTAL))
    catalog = storage.catalog()
    schema = AvroSchema(subject="cold-read", raw_schema=FLIGHT_AVRO_SCHEMA_JSON)
    async with DanubeClient([broker.address]) as client, await MetadataStore.connect(etcd_endpoints) as meta:

        async def tier(*, table: bool) -> None:
            await client.admin.seal_active_segment(TOPIC)
            await tier_sealed_segments(topic, store=meta, admin=client.admin, objects=objects)
            if table:
                await commit_objects_to_table(topic, store=meta, objects=objects, catalog=catalog, registry=SchemaRegistry(meta))

        for first, count, name in PHASES:
            if first == RAW_FROM:
                await tier(table=True)
                await meta.put(keys.topic_table(topic), TableLayout(raw_payload=True))
            elif first == TABLE_END:
                await tier(table=True)
            elif first == OBJECTS_END:
                await tier(table=False)
                retention = await client.admin.apply_local_retention(TOPIC, retention_bytes=0)
                assert retention.first_local_offset == OBJECTS_END
            await asyncio.sleep(0.01)  # publish times of two phases never meet
            async with client.producer(TOPIC, producer_name=name, schema=schema, max_batch_messages=20) as producer:
                for i in range(first, first + count):
                    attributes = {"i": str(i), "phase": name} if i % 3 else None
                    producer.send_nowait(encode_flight(flights[i]), attributes=attributes)
                await producer.flush()
        table = catalog.load_table(("default", "cold-read"))
        assert committed_end_offset(table) == TABLE_END - 1
        raw = table.scan(selected_fields=("_offset", "_raw_payload")).to_arrow().sort_by("_offset")
        assert raw.column("_offset").to_pylist() == list(range(TABLE_END))
        assert [b is not None for b in raw.column("_raw_payload").to_pylist()] == [i >= RAW_FROM for i in range(TABLE_END)]

        # the objects path, through the topic's override: the reference
        await admin(etcd_endpoints, "topics", "set-read-path", TOPIC, "objects")
        by_objects = await read_all(client, "by-objects", TOTAL, initial_position=InitialPosition.EARLIEST)
        assert [m.offset for m in by_objects] == list(range(TOTAL))
        assert [m.payload for m in by_objects] == [encode_flight(f) for f in flights]

        # now only the table holds offsets 150..299 (their objects are deleted; descriptors stay)
        await admin(etcd_endpoints, "topics", "set-read-path", TOPIC, "iceberg")
        for kv in (await meta.get_prefix(keys.objects_prefix(topic)))[0]:
            if kv.key != keys.objects_cur(topic):
                descriptor = ObjectDescriptor.from_json(kv.value)
                if descriptor.start_offset >= RAW_FROM and descriptor.end_offset < TABLE_END:
                    objects.delete(segment_object_path(topic, descriptor.object_id))
        by_table = await read_all(client, "by-table", TOTAL, initial_position=InitialPosition.EARLIEST)
        assert [m.offset for m in by_table] == list(range(TOTAL))  # each offset once, in order
        assert [fields(m) for m in by_table] == [fields(m) for m in by_objects]  # byte for byte
        served = {s.name: s for s in (await client.admin.describe_topic(TOPIC)).subscriptions}
        assert served["by-table"].records_from_table == TABLE_END - RAW_FROM  # only the raw rows
        assert served["by-table"].records_from_object_storage == OBJECTS_END  # everything below the WAL
        assert served["by-objects"].records_from_table == 0

        # the table snapshot beside the cursor (§3.5.1): the table's last snapshot, and an offset
        # at or past its end (the table was asked again at each object past its end)
        stored = await meta.get(keys.subscription_table_snapshot(topic, "by-table"))
        assert stored is not None
        snapshot = TableSnapshot.from_json(stored.value)
        assert TABLE_END <= snapshot.offset < OBJECTS_END
        current = catalog.load_table(("default", "cold-read")).current_snapshot()
        assert current is not None and snapshot.snapshot_id == current.snapshot_id
        assert await meta.get(keys.subscription_table_snapshot(topic, "by-objects")) is None

        # seek by time: in the table, in the objects, in the WAL
        for start in (150, 400, 550):
            at = by_objects[start].publish_time_us
            assert by_objects[start - 1].publish_time_us < at
            got = await read_all(client, f"from-{start}", TOTAL - start, start_publish_time_us=at)
            assert [m.offset for m in got] == list(range(start, TOTAL))
            assert [fields(m) for m in got] == [fields(m) for m in by_objects[start:]]


async def test_batches_read_from_the_table_are_redelivered_from_the_table(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """A raw topic (its table keeps the bytes in ``_payload``, and with ``raw_payload`` on the
    routing keys) whose objects are all deleted: messages a consumer left unacknowledged are
    redelivered as the very batches the table gave."""
    storage = TableStorage(tmp_path, CATALOG)
    objects = storage.objects
    broker = start_broker(
        segment_max_bytes=4096, extra_args=storage.broker_args("--cold-read-path", "auto"), env=storage.broker_env()
    )
    topic = TopicName.parse(TOPIC)
    catalog = storage.catalog()
    count = BATCH_RECORDS + 200  # the table's first batch is handed out whole, the last is not
    async with DanubeClient([broker.address]) as client, await MetadataStore.connect(etcd_endpoints) as meta:
        async with client.producer(TOPIC, producer_name="raw", max_batch_messages=7) as producer:
            for i in range(count):
                producer.send_nowait(f"raw {i}".encode() * (1 + i % 5), attributes={"i": str(i)}, key=f"k{i % 4}")
            await producer.flush()
        await meta.put(keys.topic_table(topic), TableLayout(raw_payload=True))
        await client.admin.seal_active_segment(TOPIC)
        await tier_sealed_segments(topic, store=meta, admin=client.admin, objects=objects)
        await commit_objects_to_table(topic, store=meta, objects=objects, catalog=catalog, registry=SchemaRegistry(meta))
        assert (await client.admin.apply_local_retention(TOPIC, retention_bytes=0)).first_local_offset == count
        for path in objects.list(segment_object_path(topic, "")):
            objects.delete(path)

        async with client.consumer(
            TOPIC, subscription="redo", initial_position=InitialPosition.EARLIEST, receiver_queue_size=50
        ) as first:
            held = [await first.receive(timeout_ms=20_000) for _ in range(40)]
            for message in held[:10]:
                await first.ack(message)
        assert [m.offset for m in held] == list(range(40))
        got = await read_all(client, "redo", count - 10, initial_position=InitialPosition.EARLIEST)
    assert [m.offset for m in got] == list(range(10, count))
    assert [m.payload for m in got] == [f"raw {i}".encode() * (1 + i % 5) for i in range(10, count)]
    assert [dict(m.attributes) for m in got] == [{"i": str(i)} for i in range(10, count)]
    assert [m.key for m in got] == [f"k{i % 4}" for i in range(10, count)]
    assert all(m.redelivery_count == 1 for m in got[:30])  # handed out again, not read afresh
    assert got[-1].redelivery_count == 0


@pytest.mark.parametrize("path", ["auto", "iceberg"])
async def test_a_catalog_that_cannot_be_opened_sends_reads_to_the_objects(
    path: str, tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """A catalog URL that can never work (configuration, not an outage) sends cold reads to the
    segment objects, in ``auto`` as on any trouble and in ``iceberg`` too; the read path key of
    the topic follows ``danube-admin topics set-read-path``."""
    objects_url = (tmp_path / "objects").as_uri()
    objects = ObjectStore(objects_url)
    broker = start_broker(
        segment_max_bytes=4096,
        extra_args=["--object-store-url", objects_url, "--local-retention-check-s", "3600"],
        env={"DANUBE_CATALOG_URI": "mysql://nowhere/catalog", "DANUBE_WAREHOUSE": (tmp_path / "w").as_uri()},
    )
    topic = TopicName.parse(TOPIC)
    async with DanubeClient([broker.address]) as client, await MetadataStore.connect(etcd_endpoints) as meta:
        async with client.producer(TOPIC, producer_name="raw", max_batch_messages=10) as producer:
            for i in range(100):
                producer.send_nowait(f"m{i}".encode())
            await producer.flush()
        await client.admin.seal_active_segment(TOPIC)
        await tier_sealed_segments(topic, store=meta, admin=client.admin, objects=objects)
        assert (await client.admin.apply_local_retention(TOPIC, retention_bytes=0)).first_local_offset == 100
        assert f'"cold_read_path": "{path}"' in await admin(etcd_endpoints, "topics", "set-read-path", TOPIC, path)
        stored = await meta.get(keys.topic_read_path(topic))
        assert stored is not None and stored.value == {"cold_read_path": path}
        got = await read_all(client, "fallback", 100, initial_position=InitialPosition.EARLIEST)
        assert [m.payload for m in got] == [f"m{i}".encode() for i in range(100)]
        assert await meta.get(keys.subscription_table_snapshot(topic, "fallback")) is None


async def test_a_subscription_resumes_in_the_table_after_a_move_from_its_snapshot(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """The stored snapshot (§3.5.1) survives an unload: the reloaded subscription reads what the
    table gained since with ``after_snapshot_id``, then the WAL, every offset once."""
    storage = TableStorage(tmp_path, CATALOG)
    objects = storage.objects
    broker = start_broker(
        segment_max_bytes=4096, extra_args=storage.broker_args("--cold-read-path", "iceberg"), env=storage.broker_env()
    )
    topic = TopicName.parse(TOPIC)
    catalog = storage.catalog()

    def payload(i: int) -> bytes:
        return f"moved {i}".encode()

    async with DanubeClient([broker.address]) as client, await MetadataStore.connect(etcd_endpoints) as meta:

        async def publish_and_tier(first: int, count: int) -> int:
            async with client.producer(TOPIC, producer_name="mover", max_batch_messages=9) as producer:
                for i in range(first, first + count):
                    producer.send_nowait(payload(i), key=f"k{i % 3}")
                await producer.flush()
            await client.admin.seal_active_segment(TOPIC)
            await tier_sealed_segments(topic, store=meta, admin=client.admin, objects=objects)
            await commit_objects_to_table(topic, store=meta, objects=objects, catalog=catalog, registry=SchemaRegistry(meta))
            retention = await client.admin.apply_local_retention(TOPIC, retention_bytes=0)
            assert retention.first_local_offset == first + count
            current = catalog.load_table(("default", "cold-read")).current_snapshot()
            assert current is not None
            return current.snapshot_id

        await meta.put(keys.topic_table(topic), TableLayout(raw_payload=True))
        first_snapshot = await publish_and_tier(0, 200)
        got = await read_all(client, "mover", 200, initial_position=InitialPosition.EARLIEST)
        stored = await meta.get(keys.subscription_table_snapshot(topic, "mover"))
        assert stored is not None and TableSnapshot.from_json(stored.value) == TableSnapshot(snapshot_id=first_snapshot, offset=200)

        second_snapshot = await publish_and_tier(200, 100)
        assert second_snapshot != first_snapshot
        await client.admin.unload_topic(TOPIC)
        async with client.producer(TOPIC, producer_name="mover", max_batch_messages=9) as producer:
            for i in range(300, 350):
                producer.send_nowait(payload(i), key=f"k{i % 3}")
            await producer.flush()
        got += await read_all(client, "mover", 150, initial_position=InitialPosition.EARLIEST)
        stored = await meta.get(keys.subscription_table_snapshot(topic, "mover"))
    assert [m.offset for m in got] == list(range(350))
    assert [(m.payload, m.key) for m in got] == [(payload(i), f"k{i % 3}") for i in range(350)]
    assert stored is not None and TableSnapshot.from_json(stored.value) == TableSnapshot(snapshot_id=second_snapshot, offset=300)


@pytest.mark.spark
async def test_compaction_between_reads_neither_skips_nor_repeats(
    tmp_path: Path,
    etcd_endpoints: list[str],
    start_broker: Callable[..., BrokerProcess],
    spark_on_catalog: Callable[..., SparkSession],
) -> None:
    """A subscription whose snapshot (§3.5.1) predates new appends and a compaction (a
    ``replace`` snapshot) reads the new offsets once after the topic moves: the incremental
    read from its snapshot sees the appends, never the rewritten files twice."""
    from danube_pipeline.lake.spark.procedures import compact_table

    storage = TableStorage(tmp_path, CATALOG)
    objects = storage.objects
    broker = start_broker(
        segment_max_bytes=1024, extra_args=storage.broker_args("--cold-read-path", "iceberg"), env=storage.broker_env()
    )
    topic = TopicName.parse(COMPACTED)  # Spark's procedures take no "-" in a name
    catalog = storage.catalog()
    spark = spark_on_catalog(name=CATALOG, uri=storage.catalog_uri, warehouse=storage.warehouse)
    async with DanubeClient([broker.address]) as client, await MetadataStore.connect(etcd_endpoints) as meta:

        async def publish_and_tier(first: int, count: int) -> None:
            async with client.producer(COMPACTED, producer_name="compacted", max_batch_messages=5) as producer:
                for i in range(first, first + count):
                    producer.send_nowait(f"c{i}".encode() * 4, key=str(i % 2))
                await producer.flush()
            await client.admin.seal_active_segment(COMPACTED)
            await tier_sealed_segments(topic, store=meta, admin=client.admin, objects=objects)
            await commit_objects_to_table(topic, store=meta, objects=objects, catalog=catalog, registry=SchemaRegistry(meta))
            assert (await client.admin.apply_local_retention(COMPACTED, retention_bytes=0)).first_local_offset == first + count

        await meta.put(keys.topic_table(topic), TableLayout(raw_payload=True))
        await publish_and_tier(0, 100)
        got = await read_all(client, "compaction", 100, topic=COMPACTED, initial_position=InitialPosition.EARLIEST)
        await publish_and_tier(100, 100)  # several objects: several append snapshots
        result = compact_table(spark, topic, catalog_name=CATALOG, rewrite_all=True)
        table = catalog.load_table(("default", "coldcompacted"))
        current = table.current_snapshot()
        assert current is not None and current.summary is not None and current.summary.operation.value == "replace"
        assert result is not None
        for path in objects.list(segment_object_path(topic, "")):
            objects.delete(path)  # only the table holds the history now
        await client.admin.unload_topic(COMPACTED)
        got += await read_all(client, "compaction", 100, topic=COMPACTED, initial_position=InitialPosition.EARLIEST)
    assert [m.offset for m in got] == list(range(200))
    assert [m.payload for m in got] == [f"c{i}".encode() * 4 for i in range(200)]
