"""The ``after-commit`` object lifecycle (``docs/etcd-layout.md`` §2.1, §5.1): tiering deletes a
segment object once the topic's Iceberg table is verified to hold it, and the table is then the
only cold copy.

Against a real etcd, real segment objects, a real SQLite catalog, ``danube-admin`` for the
policy, the run's Spark session for retention's row delete, and a real broker on the default
``objects`` cold read path.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import RegisterCatalog, run_admin
from tiering_helpers import PUBLISH_TIME_US, Env, TableStorage, avro, avro_payload, make_env

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.format.records import Record
from danube_pipeline.lake import iceberg
from danube_pipeline.lake.completeness import table_completeness
from danube_pipeline.lake.object_lifecycle import verify_in_table
from danube_pipeline.lake.retention import apply_retention
from danube_pipeline.lake.tiering import commit_objects_to_table, object_mismatches, tier_sealed_segments
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.descriptors import read_descriptors
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import NamespacePolicy, ObjectDescriptor, TableLayout
from danube_pipeline.names import TopicName
from danube_pipeline.schemas.registry import SchemaRegistry
from danube_pipeline.storage.objectstore import segment_object_path
from danube_pipeline.storage.table_reader import TableReader

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

DAY_US = 86_400_000_000
SCHEMA = avro({"name": "flight", "type": "int"}, {"name": "carrier", "type": "string"})


async def admin(etcd: list[str], *args: str) -> Any:
    return (await run_admin(*args, etcd=etcd)).ok()


def _record(offset: int, *, schema_id: int = 1) -> Record:
    """Offsets 0..4 published on one UTC day, 5.. on the next; offset 4 has a schema id the
    registry lacks (a dead letter)."""
    return Record(
        offset=offset,
        publish_time_us=PUBLISH_TIME_US + (DAY_US if offset >= 5 else 0) + offset,
        producer_id=(1 << 63) + offset,
        producer_name="p",
        schema_id=schema_id,
        schema_version=1,
        payload=avro_payload(SCHEMA, {"flight": offset, "carrier": "UA"}),
        attributes={"i": str(offset)} if offset % 2 else {},
        key=None if offset % 3 == 0 else f"k{offset}",
    )


HISTORY = [[_record(0), _record(1), _record(2), _record(3), _record(4, schema_id=9)], [_record(i) for i in range(5, 10)]]


async def _setup(env: Env, topic: TopicName, *, raw_payload: bool) -> None:
    env.registry.add_avro(1, 1, SCHEMA)
    async with await MetadataStore.connect(env.endpoints) as store:
        await store.put(keys.topic_table(topic), TableLayout(raw_payload=raw_payload))
    for records in HISTORY:
        await env.put(records, topic, batches=True)


async def _descriptors(endpoints: list[str], topic: TopicName) -> list[ObjectDescriptor]:
    async with await MetadataStore.connect(endpoints) as store:
        return (await read_descriptors(store, topic))[0]


def _day(record: Record) -> dt.date:
    return dt.datetime.fromtimestamp(record.publish_time_us / 1e6, tz=dt.UTC).date()


async def test_after_commit_deletes_verified_objects_and_retention_reads_the_table(
    tmp_path: Path, etcd_endpoints: list[str], spark_on_catalog: RegisterCatalog
) -> None:
    env = make_env(etcd_endpoints, tmp_path)
    topic = TopicName("default", "lifecycle")
    await _setup(env, topic, raw_payload=True)
    done = await admin(etcd_endpoints, "namespaces", "set-policy", "default", "--object-lifecycle", "after-commit")
    assert done["policy"]["object_lifecycle"] == "after-commit"

    report = await env.tier(topic)
    assert (report.objects_appended, report.dead_letter_records, report.objects_deleted) == (2, 1, 2)
    assert env.objects.list(segment_object_path(topic, "")) == []
    descriptors = await _descriptors(etcd_endpoints, topic)
    assert [d.in_table_only for d in descriptors] == [True, True]
    assert report.object_bytes_deleted == sum(d.size for d in descriptors)
    assert object_mismatches(topic, descriptors, env.objects) == []  # not counted as missing
    assert table_completeness(env.table(topic), descriptors).passed  # descriptors still cover the offsets
    # the table is the copy: every message byte for byte, the dead letter merged in
    ident = iceberg.table_identifier(topic)
    read = TableReader(env.catalog, ident).read(0, max_records=100)
    assert read.records == [r for records in HISTORY for r in records]
    payloads = [r.payload for r in HISTORY[1]]
    assert verify_in_table(env.catalog, ident, descriptors[1], payloads) is None
    wrong = verify_in_table(env.catalog, ident, descriptors[1], [*payloads[:-1], payloads[-1] + b"!"])
    assert wrong is not None and "checksum" in wrong

    # a re-run reads no object (they are gone) and changes nothing
    snapshot = env.table(topic).current_snapshot().snapshot_id
    again = await env.tier(topic)
    assert (again.objects_appended, again.objects_skipped, again.objects_deleted) == (0, 2, 0)
    assert again.snapshot_id == snapshot

    # retention of the first day: the time limit's retained start comes from the table
    spark = spark_on_catalog(
        name="danube", uri=f"sqlite:///{tmp_path / 'catalog.db'}", warehouse=(tmp_path / "warehouse").as_uri()
    )
    cutoff_ms = (PUBLISH_TIME_US + DAY_US // 2) // 1000
    async with await MetadataStore.connect(etcd_endpoints) as store:
        await admin(etcd_endpoints, "namespaces", "set-policy", "default", "--retention-time-minutes", "60")
        kept = await apply_retention(
            topic, store=store, objects=env.objects, catalog=env.catalog, spark=spark, admin=object(),
            now_ms=cutoff_ms + 3_600_000, day=_day(HISTORY[0][0]),
        )  # fmt: skip
    assert (kept.retained_start, kept.rows_deleted, kept.descriptors_deleted) == (5, 4, 1)
    assert [r["_offset"] for r in env.rows(topic=topic)] == list(range(5, 10))
    assert [d.start_offset for d in await _descriptors(etcd_endpoints, topic)] == [5]


async def test_without_raw_payload_the_objects_are_kept(tmp_path: Path, etcd_endpoints: list[str]) -> None:
    """The topic's override (§3.8) asks for ``after-commit``, but the table cannot serve the
    messages byte for byte: the objects stay, unmarked."""
    env = make_env(etcd_endpoints, tmp_path)
    topic = TopicName("default", "kept")
    await _setup(env, topic, raw_payload=False)
    async with await MetadataStore.connect(etcd_endpoints) as store:
        await store.put(keys.topic_policy(topic), {"object_lifecycle": "after-commit"})
    report = await env.tier(topic)
    assert (report.objects_appended, report.objects_deleted) == (2, 0)
    assert len(env.objects.list(segment_object_path(topic, ""))) == 2
    assert [d.in_table_only for d in await _descriptors(etcd_endpoints, topic)] == [False, False]


async def test_a_broker_on_the_objects_path_reads_deleted_objects_from_the_table(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    storage = TableStorage(tmp_path, "lifecycle")
    objects = storage.objects
    broker = start_broker(segment_max_bytes=2048, extra_args=storage.broker_args(), env=storage.broker_env())
    name = "/default/one-copy"
    topic = TopicName.parse(name)
    catalog = storage.catalog()
    tiered, total = 200, 250

    def message(i: int) -> tuple[bytes, dict[str, str], str | None]:
        return f"one copy {i}".encode() * (1 + i % 4), ({"i": str(i)} if i % 2 else {}), (f"k{i % 5}" if i % 3 else None)

    async with DanubeClient([broker.address]) as client, await MetadataStore.connect(etcd_endpoints) as meta:

        async def publish(first: int, last: int) -> None:
            async with client.producer(name, producer_name="one", max_batch_messages=8) as producer:
                for i in range(first, last):
                    payload, attributes, key = message(i)
                    producer.send_nowait(payload, attributes=attributes or None, key=key)
                await producer.flush()

        await publish(0, tiered)
        await meta.put(keys.topic_table(topic), TableLayout(raw_payload=True))
        await meta.put(keys.namespace_policy("default"), NamespacePolicy(object_lifecycle="after-commit"))
        await client.admin.seal_active_segment(name)
        written = await tier_sealed_segments(topic, store=meta, admin=client.admin, objects=objects)
        assert written.objects_written > 1
        # the broker's local retention checks each object before it drops its segment
        assert (await client.admin.apply_local_retention(name, retention_bytes=0)).first_local_offset == tiered
        report = await commit_objects_to_table(topic, store=meta, objects=objects, catalog=catalog, registry=SchemaRegistry(meta))
        assert report.objects_deleted == written.objects_written
        assert objects.list(segment_object_path(topic, "")) == []
        # objects deleted while the WAL still holds their segments: never uploaded again
        await publish(tiered, total)
        await client.admin.seal_active_segment(name)
        await tier_sealed_segments(topic, store=meta, admin=client.admin, objects=objects)
        await commit_objects_to_table(topic, store=meta, objects=objects, catalog=catalog, registry=SchemaRegistry(meta))
        again = await tier_sealed_segments(topic, store=meta, admin=client.admin, objects=objects)
        assert (again.objects_written, again.last_offset) == (0, total - 1)
        assert objects.list(segment_object_path(topic, "")) == []
        # and local retention drops those segments too: the table verifiably holds them
        assert (await client.admin.apply_local_retention(name, retention_bytes=0)).first_local_offset == total

        got = []
        async with client.consumer(
            name, subscription="from-start", initial_position=InitialPosition.EARLIEST, receiver_queue_size=64
        ) as consumer:
            for _ in range(total):
                m = await consumer.receive(timeout_ms=20_000)
                got.append(m)
                await consumer.ack(m)
    assert [m.offset for m in got] == list(range(total))
    assert [(m.payload, dict(m.attributes), m.key or None) for m in got] == [message(i) for i in range(total)]
    assert all(d.in_table_only for d in await _descriptors(etcd_endpoints, topic))


async def test_the_values_keep_their_json_when_the_lifecycle_is_keep() -> None:
    """``object_lifecycle`` and ``object_deleted_at`` are written only when set (§2.1, §5.1); a
    topic's override (§3.8) sets the lifecycle, and an unknown one makes a policy unreadable."""
    assert "object_lifecycle" not in NamespacePolicy().to_json()
    policy = NamespacePolicy.from_json({"object_lifecycle": "after-commit"})
    assert policy.to_json()["object_lifecycle"] == "after-commit"
    assert NamespacePolicy().overridden({"object_lifecycle": "after-commit", "max_publish_rate": 5}) == dataclasses.replace(
        NamespacePolicy(), object_lifecycle="after-commit", max_publish_rate=5
    )
    for bad in ("delete", 1, None):
        with pytest.raises(ValueError, match="object_lifecycle"):
            NamespacePolicy.from_json({"object_lifecycle": bad})
        with pytest.raises(ValueError, match="object_lifecycle"):
            NamespacePolicy().overridden({"object_lifecycle": bad})
    kept = ObjectDescriptor(
        completed=True, created_at=1, end_offset=9, etag="e", object_id="data-0-9.dnb1", offset_index=[[0, 32]],
        size=100, start_offset=0,
    )  # fmt: skip
    assert "object_deleted_at" not in kept.to_json() and not kept.in_table_only
    marked = dataclasses.replace(kept, object_deleted_at=1_767_225_600)
    assert ObjectDescriptor.from_json(marked.to_json()) == marked and marked.in_table_only
