"""Partitioned topics (``docs/etcd-layout.md`` §3.1): the names, the client's partitioner, the
one Iceberg table with ``_partition`` and exactly-once per partition, and end to end on three
real brokers: independent assignment, keyed routing and order, a consumer of every partition,
a partition moved while the others serve, and tiering into one table."""

from __future__ import annotations

import asyncio
import collections
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import eventually

from danube_pipeline.lake import iceberg
from danube_pipeline.client import DanubeClient, InitialPosition, Message, MessageId
from danube_pipeline.client._partitioner import Partitioner, murmur2
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.errors import (
    InvalidNameError,
    MalformedRequestError,
    PartitionedTopicError,
)
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore
from danube_pipeline.partitions import (
    partition_name,
    partition_names,
    partition_of,
    split_partition_name,
)
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc
from danube_pipeline.format.records import Record
from danube_pipeline.schemas.registry import SchemaRegistry
from danube_pipeline.lake.tiering import (
    commit_objects_to_table,
    list_topic_roots,
    tier_sealed_segments,
)

PARENT = TopicName("default", "orders")
ADMIN = Path(sys.executable).parent / "danube-admin"


# --------------------------------------------------------------------------- unit


@pytest.mark.unit
def test_murmur2_is_kafkas() -> None:
    # Kafka's UtilsTest.testMurmur2 vectors: a key lands where a Kafka producer puts it.
    vectors = {
        "21": -973932308,
        "foobar": -790332482,
        "a-little-bit-long-string": -985981536,
        "a-little-bit-longer-string": -1486304829,
        "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
        "abc": 479470107,
    }
    assert {k: murmur2(k.encode()) for k in vectors} == vectors


@pytest.mark.unit
def test_partitioner_keys_stick_and_unkeyed_messages_take_turns() -> None:
    partitioner = Partitioner(3)
    assert all(partitioner.partition("user-7") == (murmur2(b"user-7") & 0x7FFFFFFF) % 3 for _ in range(5))
    turns = [partitioner.partition(None) for _ in range(9)]
    assert sorted(collections.Counter(turns).values()) == [3, 3, 3]
    assert all(turns[i + 1] == (turns[i] + 1) % 3 for i in range(8))
    with pytest.raises(ValueError):
        Partitioner(0)


@pytest.mark.unit
def test_partition_names() -> None:
    assert [p.path for p in partition_names(PARENT, 3)] == [f"/default/orders-part-{i}" for i in range(3)]
    assert split_partition_name(TopicName("default", "orders-part-12")) == (PARENT, 12)
    assert split_partition_name(TopicName("default", "a-part-b-part-0")) == (TopicName("default", "a-part-b"), 0)
    for plain in ("orders", "orders-part-", "orders-part-01", "orders-part-x"):
        assert split_partition_name(TopicName("default", plain)) is None
    with pytest.raises(MalformedRequestError):
        partition_names(PARENT, 0)
    with pytest.raises(MalformedRequestError):
        partition_names(PARENT, 101)
    with pytest.raises(InvalidNameError):  # "{topic}-part-{i}" must fit the 128-character grammar
        partition_name(TopicName("default", "x" * 125), 10)


def _records(first: int, last: int) -> list[Record]:
    return [
        Record(offset=o, publish_time_us=1_700_000_000_000_000 + o, producer_id=7, producer_name="p",
               schema_id=0, schema_version=0, payload=f"m{o}".encode())
        for o in range(first, last + 1)
    ]


@pytest.mark.unit
def test_partitions_share_one_table_exactly_once_each(tmp_path: Path) -> None:
    catalog = iceberg.load_catalog(
        name="danube", uri=f"sqlite:///{tmp_path / 'catalog.db'}", warehouse=(tmp_path / "warehouse").as_uri()
    )
    table = iceberg.ensure_table(catalog, PARENT, None, partitioned=True)
    assert [f.name for f in table.schema().fields][7:9] == [iceberg.PARTITION_COLUMN, iceberg.PAYLOAD_COLUMN]
    a = iceberg.append_records(table, _records(0, 9), None, "data-0-9.dnb1", topic="/default/orders-part-0", partition=0)
    b = iceberg.append_records(table, _records(0, 4), None, "data-0-4.dnb1", topic="/default/orders-part-1", partition=1)
    assert (a.rows_appended, a.committed_end_offset, b.rows_appended, b.committed_end_offset) == (10, 9, 5, 4)
    # Replays append nothing; an overlap appends only the partition's new offsets.
    assert iceberg.append_records(table, _records(0, 9), None, "data-0-9.dnb1", partition=0).rows_appended == 0
    assert iceberg.append_records(table, _records(0, 9), None, "data-0-9.dnb1", partition=1).rows_appended == 5
    with pytest.raises(Exception, match="expected offset 10"):  # a gap in partition 0 only
        iceberg.append_records(table, _records(12, 14), None, "data-12-14.dnb1", partition=0)

    table = catalog.load_table(iceberg.table_identifier(PARENT))
    properties = table.metadata.properties
    assert properties[iceberg.committed_end_offset_property(0)] == "9"
    assert properties[iceberg.committed_end_offset_property(1)] == "9"
    assert iceberg.COMMITTED_END_OFFSET_PROPERTY not in properties
    assert iceberg.committed_end_offset(table) is None  # no plain topic's offsets here
    snapshot = table.current_snapshot()
    assert snapshot is not None and snapshot.summary is not None
    assert snapshot.summary[iceberg.SUMMARY_PARTITION] == "1"
    rows = table.scan(selected_fields=("_partition", "_offset", "_payload")).to_arrow().to_pylist()
    assert sorted((r["_partition"], r["_offset"]) for r in rows) == [(p, o) for p in (0, 1) for o in range(10)]
    assert all(r["_payload"] == f"m{r['_offset']}".encode() for r in rows)
    assert iceberg.duplicate_offsets(table, partition=0) == {} == iceberg.duplicate_offsets(table, partition=1)
    assert iceberg.offset_stats(table, partition=1) == iceberg.OffsetStats(10, 0, 9)
    # Without a partition, the summaries of partitions do not count as a plain topic's.
    plain = iceberg.ensure_table(catalog, TopicName("default", "plain"), None)
    assert iceberg.PARTITION_COLUMN not in {f.name for f in plain.schema().fields}


# --------------------------------------------------------------------------- cluster


async def _admin(etcd: list[str], brokers: list[BrokerProcess], *args: str, output: str = "json") -> str:
    proc = await asyncio.create_subprocess_exec(
        str(ADMIN), "--etcd-endpoints", ",".join(etcd), "--brokers", ",".join(b.address for b in brokers),
        "--output", output, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def _owners(meta: MetadataStore) -> dict[str, list[int]]:
    kvs, _ = await meta.get_prefix(keys.BROKERS_PREFIX)
    found: dict[str, list[int]] = collections.defaultdict(list)
    for kv in kvs:
        parts = kv.key[len(keys.BROKERS_PREFIX) :].split("/")
        if len(parts) == 3 and parts[0].isdigit():
            found[f"/{parts[1]}/{parts[2]}"].append(int(parts[0]))
    return found


async def _receive(consumer: Any, count: int, seen: dict[tuple[int, int], Message]) -> list[Message]:
    got = []
    for _ in range(count):
        message = await consumer.receive(timeout_ms=15_000)
        key = (message.partition, message.offset)
        assert key not in seen, f"delivered twice: partition {message.partition} offset {message.offset}"
        seen[key] = message
        got.append(message)
        await consumer.ack(message)
    return got


@pytest.mark.integration
@pytest.mark.asyncio
async def test_partitioned_topic_on_three_brokers(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    store_url = (tmp_path / "objects").as_uri()
    brokers = [start_broker(extra_args=["--object-store-url", store_url]) for _ in range(3)]
    parts = [p.path for p in partition_names(PARENT, 3)]
    async with DanubeClient([b.address for b in brokers]) as client, await MetadataStore.connect(etcd_endpoints) as meta:
        assert await client.admin.create_topic(PARENT.path, partitions=3)
        assert not await client.admin.create_topic(PARENT.path, partitions=3)

        # etcd: the root holds N, the partitions are topics with one owner each, spread out.
        assert (await meta.get(keys.topic_root(PARENT))).value == 3  # type: ignore[union-attr]
        assert await meta.get(keys.namespace_topic(PARENT)) is not None
        owners = await _owners(meta)
        assert PARENT.path not in owners and await meta.get(keys.unassigned_topic(PARENT)) is None
        assert all(len(owners[p]) == 1 for p in parts)
        assert len({owners[p][0] for p in parts}) > 1, owners
        assert [t.path for t in await list_topic_roots(meta)] == parts  # the parent holds no data
        assert await partition_of(meta, TopicName.parse(parts[2])) is not None
        assert await client.admin.topic_partitions(PARENT.path) == 3

        # The partitioned topic itself: lookups answer its count, direct use is refused.
        with pytest.raises(PartitionedTopicError) as info:
            await client.lookup_topic(PARENT.path)
        assert info.value.partitions == 3
        async with grpc.aio.insecure_channel(brokers[0].address) as channel:
            lookup = await pb_grpc.DiscoveryStub(channel).TopicLookup(pb.TopicLookupRequest(topic=PARENT.path))
            assert (lookup.partitions, lookup.broker_id) == (3, 0)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.ProducerServiceStub(channel).CreateProducer(
                    pb.CreateProducerRequest(topic=PARENT.path, producer_name="raw", request_id="r1")
                )
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "orders-part-0" in (refused.value.details() or "")
            for call in (
                pb_grpc.ConsumerServiceStub(channel).Subscribe(
                    pb.SubscribeRequest(topic=PARENT.path, subscription="s", request_id="r2")
                ),
                pb_grpc.AdminStub(channel).DescribeTopic(pb.DescribeTopicRequest(topic=PARENT.path)),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
        assert PARENT.path not in await _owners(meta)  # still nobody's

        # danube-admin: create with --partitions, describe shows the count and each partition.
        made = json.loads(await _admin(etcd_endpoints, brokers, "topics", "create", "/default/cli", "--partitions", "2"))
        assert (made["created"], made["partitions"]) == (True, 2)
        assert [p["topic"] for p in made["partition_topics"]] == ["/default/cli-part-0", "/default/cli-part-1"]
        described = json.loads(await _admin(etcd_endpoints, brokers, "topics", "describe", "/default/cli"))
        assert (described["partitions"], described["delivery"]) == (2, "Reliable")
        assert [(p["topic"], p["next_offset"]) for p in described["partition_topics"]] == [
            ("/default/cli-part-0", 0), ("/default/cli-part-1", 0)
        ]
        text = await _admin(etcd_endpoints, brokers, "topics", "describe", "/default/cli", output="text")
        assert "partitions" in text and "/default/cli-part-1" in text

        seen: dict[tuple[int, int], Message] = {}
        async with client.consumer(PARENT.path, subscription="all", initial_position=InitialPosition.EARLIEST) as consumer, \
                client.producer(PARENT.path, producer_name="orders") as producer:
            assert (consumer.partitions, producer.partitions) == (3, 3)
            sends: list[tuple[str | None, int, asyncio.Future[int]]] = []
            for i in range(20):
                for k in range(8):
                    sends.append((f"k{k}", i, producer.send_nowait(f"k{k}:{i}".encode(), key=f"k{k}")))
                for j in range(3):
                    sends.append((None, i * 3 + j, producer.send_nowait(f"none:{i * 3 + j}".encode())))
            ids: list[tuple[str | None, int, MessageId]] = []
            for sent_key, sent_seq, future in sends:
                sent_id = await future
                assert isinstance(sent_id, MessageId)  # a partitioned producer's answer
                ids.append((sent_key, sent_seq, sent_id))
            by_key: dict[str | None, set[int | None]] = collections.defaultdict(set)
            for key, _, message_id in ids:
                assert isinstance(message_id, MessageId)
                by_key[key].add(message_id.partition)
            for k in range(8):  # one partition per key, the partitioner's
                assert by_key[f"k{k}"] == {(murmur2(f"k{k}".encode()) & 0x7FFFFFFF) % 3}
            unkeyed = collections.Counter(mid.partition for key, _, mid in ids if key is None)
            assert unkeyed == {0: 20, 1: 20, 2: 20}  # round-robin, message by message

            got = await _receive(consumer, len(ids), seen)
            assert {(m.partition, m.offset) for m in got} == {(mid.partition, int(mid)) for _, _, mid in ids}
            assert all(m.topic == parts[m.partition] for m in got)  # type: ignore[index]
            order: dict[str, list[int]] = collections.defaultdict(list)
            for m in got:
                key, seq = m.payload.decode().split(":")
                if key != "none":
                    order[key].append(int(seq))
            assert all(seqs == sorted(seqs) and len(seqs) == 20 for seqs in order.values())  # per-key order

            # Acks reach every partition's cursor before one partition moves.
            async def cursors_at_end() -> bool:
                for p in parts:
                    description = await client.admin.describe_topic(p)
                    subscription = {s.name: s for s in description.subscriptions}["all"]
                    if subscription.cursor != description.next_offset - 1:
                        return False
                return True

            await eventually(cursors_at_end, timeout_s=10, what="every partition's cursor at its end")

            # Move partition 1: the others keep their owners and keep serving meanwhile.
            before = await _owners(meta)
            unload = asyncio.ensure_future(client.admin.unload_topic(parts[1]))
            during = [await producer.send(f"k0:{100 + i}".encode(), key="k0") for i in range(5)]
            await unload

            async def moved_partition_assigned() -> bool:  # the leader assigns it after the release
                return len((await _owners(meta))[parts[1]]) == 1

            await eventually(moved_partition_assigned, timeout_s=10, what="the moved partition has a new owner")
            after = await _owners(meta)
            assert all(after[p] == before[p] for p in (parts[0], parts[2]))
            assert len(after[parts[1]]) == 1
            more = [await producer.send(f"none:{1000 + i}".encode()) for i in range(9)]
            assert collections.Counter(mid.partition for mid in more) == {0: 3, 1: 3, 2: 3}
            late = await _receive(consumer, len(during) + len(more), seen)
            assert {(m.partition, m.offset) for m in late} == {(mid.partition, int(mid)) for mid in during + more}
            with pytest.raises(TimeoutError):  # exactly once: nothing more arrives
                await consumer.receive(timeout_ms=500)

        # Tiering: every partition's objects into the one table, each row once.
        objects = ObjectStore(store_url)
        catalog = iceberg.load_catalog(
            name="danube", uri=f"sqlite:///{tmp_path / 'catalog.db'}", warehouse=(tmp_path / "warehouse").as_uri()
        )
        registry = SchemaRegistry(meta)
        for p in parts:
            await client.admin.seal_active_segment(p)
            await tier_sealed_segments(TopicName.parse(p), store=meta, admin=client.admin, objects=objects)
        reports = await asyncio.gather(*(
            commit_objects_to_table(TopicName.parse(p), store=meta, objects=objects, catalog=catalog, registry=registry)
            for p in parts
        ))
        assert {r.table for r in reports} == {"default.orders"}
        assert [r.partition for r in reports] == [0, 1, 2]
        table = catalog.load_table(("default", "orders"))
        rows = table.scan(selected_fields=("_partition", "_offset", "_payload")).to_arrow().to_pylist()
        assert sorted((r["_partition"], r["_offset"]) for r in rows) == sorted(seen)
        assert all(r["_payload"] == seen[(r["_partition"], r["_offset"])].payload for r in rows)
        for index, report in enumerate(reports):
            end = max(o for p, o in seen if p == index)
            assert report.committed_end_offset == end == iceberg.committed_end_offset(table, partition=index)
        again = await commit_objects_to_table(
            TopicName.parse(parts[0]), store=meta, objects=objects, catalog=catalog, registry=registry
        )
        assert again.rows_appended == 0
