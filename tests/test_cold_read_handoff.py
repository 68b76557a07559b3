"""Handoff without gaps: one subscription from the table to the objects to the WAL, across a move.

Two real brokers run with ``--cold-read-path iceberg`` on one SQLite catalog; the topic's table
keeps exact bytes (``raw_payload``, ``docs/etcd-layout.md`` §3.9) and every segment object is
deleted once its rows are committed, so the table is the only cold copy of what it holds. One
subscription reads from EARLIEST in small windows while table maintenance runs beside each read
(a Spark thread): a compaction, a ``schema_rewrite`` that turns ``flight`` from int into
string, and a retention delete of one day's rows below the subscription's position. Between
windows tiering commits more rows, so each window crosses the table's end and reads on from
the subscription's table snapshot (§3.5.1) over those ``replace`` and ``overwrite`` snapshots.
It reads on from the table into the objects and into the WAL. Then the topic moves to the
other broker, the offsets the subscription has not reached yet are committed to the table, and
a snapshot expiry removes every snapshot but the current one (the stored one among them) and
deletes the replaced files while the subscription reads on from its stored cursor: the table,
then the new owner's WAL. Every offset arrives exactly once, with the bytes, attributes, key
and producer that were published.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from tiering_helpers import TableStorage

from danube_pipeline.client import AvroSchema, Consumer, DanubeClient, InitialPosition, Message
from danube_pipeline.dev.flights import FLIGHT_AVRO_SCHEMA_JSON, encode_flight, iter_flights
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.lake.tiering import commit_objects_to_table, tier_sealed_segments
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import ObjectDescriptor, TableLayout, TableSnapshot
from danube_pipeline.names import TopicName
from danube_pipeline.schemas.registry import SchemaRegistry
from danube_pipeline.storage.objectstore import segment_object_path
from danube_pipeline.storage.table_properties import committed_end_offset

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = [pytest.mark.spark, pytest.mark.asyncio]

TOPIC = "/default/handoff"  # Spark's procedures take no "-" in a name
CATALOG = "handoff"
CHUNK = 60  # messages per publish (one segment object)
TOTAL = 8 * CHUNK


def source(i: int, flights: list[dict[str, Any]]) -> tuple[bytes, dict[str, str], str | None, str]:
    """What was published at offset ``i``: payload, attributes, key, producer name."""
    attributes = {"i": str(i)} if i % 3 else {}
    return encode_flight(flights[i]), attributes, (f"k{i % 4}" if i % 5 else None), f"p{i // CHUNK % 2}"


def seen(m: Message) -> tuple[bytes, dict[str, str], str | None, str]:
    return m.payload, dict(m.attributes), m.key, m.producer_name


async def window(consumer: Consumer, count: int) -> list[Message]:
    """The next ``count`` messages, each acknowledged."""
    got: list[Message] = []
    for _ in range(count):
        message = await consumer.receive(timeout_ms=30_000)
        got.append(message)
        await consumer.ack(message)
    return got


async def test_a_subscription_hands_off_without_gaps_through_maintenance_and_a_move(
    tmp_path: Path,
    etcd_endpoints: list[str],
    start_broker: Callable[..., BrokerProcess],
    spark_on_catalog: Callable[..., SparkSession],
) -> None:
    from danube_pipeline.lake import rewrite
    from danube_pipeline.lake.spark.procedures import compact_table, delete_rows_below, expire_snapshots

    storage = TableStorage(tmp_path, CATALOG)
    objects = storage.objects
    options: dict[str, Any] = {
        "segment_max_bytes": 1 << 20,
        "extra_args": storage.broker_args("--cold-read-path", "iceberg", "--object-cache-bytes", "1"),
        "env": storage.broker_env(),
    }
    brokers = [start_broker(**options), start_broker(**options)]
    topic = TopicName.parse(TOPIC)
    ident = (topic.namespace, topic.topic)
    flights = list(iter_flights(TOTAL))
    catalog = storage.catalog()
    spark = spark_on_catalog(name=CATALOG, uri=storage.catalog_uri, warehouse=storage.warehouse)
    schema = AvroSchema(subject="handoff", raw_schema=FLIGHT_AVRO_SCHEMA_JSON)
    got: list[Message] = []
    async with DanubeClient([b.address for b in brokers]) as client, await MetadataStore.connect(etcd_endpoints) as meta:

        async def publish(chunk: int) -> None:
            first = chunk * CHUNK
            async with client.producer(TOPIC, producer_name=f"p{chunk % 2}", schema=schema, max_batch_messages=7) as producer:
                for i in range(first, first + CHUNK):
                    payload, attributes, key, _ = source(i, flights)
                    producer.send_nowait(payload, attributes=attributes or None, key=key)
                await producer.flush()

        async def tier(*, commit: bool, first_local: int | None = None) -> None:
            """Seal and tier to objects, and with ``first_local`` drop the WAL below it; with
            ``commit``, commit the objects to the table and delete them (the table is then
            their only cold copy)."""
            await client.admin.seal_active_segment(TOPIC)
            await tier_sealed_segments(topic, store=meta, admin=client.admin, objects=objects)
            if first_local is not None:
                retention = await client.admin.apply_local_retention(TOPIC, retention_bytes=0)
                assert retention.first_local_offset == first_local
            if not commit:
                return
            await commit_objects_to_table(topic, store=meta, objects=objects, catalog=catalog, registry=SchemaRegistry(meta))
            end = committed_end_offset(catalog.load_table(ident))
            assert end is not None
            for kv in (await meta.get_prefix(keys.objects_prefix(topic)))[0]:
                if kv.key != keys.objects_cur(topic):
                    descriptor = ObjectDescriptor.from_json(kv.value)
                    if descriptor.end_offset <= end:
                        objects.delete(segment_object_path(topic, descriptor.object_id))

        async def beside(maintenance: Callable[[], object], consumer: Consumer, count: int) -> None:
            """Read ``count`` messages while ``maintenance`` runs in a thread."""
            _, read = await asyncio.gather(asyncio.to_thread(maintenance), window(consumer, count))
            got.extend(read)

        await meta.put(keys.topic_table(topic), TableLayout(raw_payload=True))
        for chunk in (0, 1):
            await publish(chunk)
        await tier(commit=True, first_local=2 * CHUNK)
        owner = (await client.lookup_topic(TOPIC)).broker_id
        async with client.consumer(
            TOPIC, subscription="handoff", initial_position=InitialPosition.EARLIEST, receiver_queue_size=16
        ) as consumer:
            # 0..39 while compaction rewrites the table's files (a replace snapshot)
            await beside(lambda: compact_table(spark, topic, catalog_name=CATALOG, rewrite_all=True), consumer, 40)
            await publish(2)
            await tier(commit=True, first_local=3 * CHUNK)

            # 40..149, over the table's former end, while a schema_rewrite turns flight into a string
            def schema_rewrite() -> None:
                rewrite.set_rewrite_spec(catalog.load_table(ident), {"version": 2, "columns": {"flight": {"type": "string"}}})
                assert rewrite.rewrite_table(spark, catalog, topic, catalog_name=CATALOG).finalized

            await beside(schema_rewrite, consumer, 110)
            assert str(catalog.load_table(ident).schema().find_field("flight").field_type) == "string"
            await publish(3)  # written with flight an int, into a table where it is a string
            await tier(commit=True, first_local=4 * CHUNK)

            # 150..209 while retention deletes the rows below 150 of their day (all read already)
            passed = got[-1].offset + 1
            day = dt.datetime.fromtimestamp(got[0].publish_time_us / 1e6, dt.UTC).date()
            await beside(lambda: delete_rows_below(spark, topic, passed, catalog_name=CATALOG, day=day), consumer, 60)
            await publish(4)
            await tier(commit=True, first_local=5 * CHUNK)

            # 210..389: the table (on over the deletes' snapshot), the objects of 300..359,
            # the WAL from 360
            await publish(5)
            await tier(commit=False, first_local=6 * CHUNK)
            await publish(6)
            got += await window(consumer, 180)
        table = catalog.load_table(ident)
        assert committed_end_offset(table) == 5 * CHUNK - 1
        assert table.scan(row_filter=f"_offset < {passed}").to_arrow().num_rows == 0  # retention's rows are gone
        stored = await meta.get(keys.subscription_table_snapshot(topic, "handoff"))
        assert stored is not None
        # the table's snapshot, at an offset at or past its end (asked again at each object)
        before_move = TableSnapshot.from_json(stored.value)
        current = table.current_snapshot()
        assert current is not None and before_move.snapshot_id == current.snapshot_id
        assert 5 * CHUNK <= before_move.offset < 6 * CHUNK

        # the move: the subscription's next offsets (390..419) are committed to the table
        # meanwhile, in two appends (their objects deleted), and the new owner reads them from
        # there, then its own WAL, while the expiry of every snapshot but the current one
        # deletes the files that compaction, the rewrite and the deletes replaced: the stored
        # snapshot is gone then, and no parent of a snapshot left (the offset scan reads)
        await tier(commit=True)
        await client.admin.unload_topic(TOPIC)
        assert (await client.lookup_topic(TOPIC)).broker_id != owner
        await publish(7)
        now_ms = int(time.time() * 1000)
        expiry = asyncio.create_task(
            asyncio.to_thread(expire_snapshots, spark, topic, older_than_ms=now_ms, catalog_name=CATALOG)
        )
        for _ in range(600):  # until the expiry commits; it deletes the files after
            if before_move.snapshot_id not in {s.snapshot_id for s in catalog.load_table(ident).snapshots()}:
                break
            await asyncio.sleep(0.1)
        table = catalog.load_table(ident)
        current = table.current_snapshot()
        assert current is not None and current.parent_snapshot_id != before_move.snapshot_id
        async with client.consumer(
            TOPIC, subscription="handoff", initial_position=InitialPosition.EARLIEST, receiver_queue_size=16
        ) as consumer:
            got += await window(consumer, TOTAL - 390)
            with pytest.raises(TimeoutError):
                await consumer.receive(timeout_ms=300)
        assert await expiry > 0
        assert [s.snapshot_id for s in catalog.load_table(ident).snapshots()] == [current.snapshot_id]
        stored = await meta.get(keys.subscription_table_snapshot(topic, "handoff"))
    assert [m.offset for m in got] == list(range(TOTAL))  # every offset once, in order
    assert [seen(m) for m in got] == [source(i, flights) for i in range(TOTAL)]  # byte for byte
    times = [m.publish_time_us for m in got]
    assert times == sorted(times) and len({(m.schema_id, m.schema_version) for m in got}) == 1
    assert stored is not None and current is not None
    assert TableSnapshot.from_json(stored.value) == TableSnapshot(snapshot_id=current.snapshot_id, offset=7 * CHUNK)
