"""Issue 21 #7: a release whose etcd transaction failed its compare (the assignment changed
under the releasing broker), or timed out but was applied, must still end right: the WAL kept
as released segments and the last offset written recorded when the topic is no longer ours,
the topic served again when it still is. Real etcd and real broker processes; the timed-out
outcomes use an in-process broker on the real etcd with a FAKE transaction timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.errors import MetadataStoreError
from danube_pipeline.format.batches import BatchBuilder
from danube_pipeline.lake.tiering import tier_sealed_segments
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc
from danube_pipeline.schemas.registry import SchemaRegistry
from danube_pipeline.storage.objectstore import ObjectStore

from broker.config import BrokerConfig
from broker.core import Broker

from helpers import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

IDLE_PRODUCERS = 200


def payload(i: int) -> bytes:
    return f"release-{i:05d}".encode()


async def test_a_release_whose_assignment_changed_under_it_keeps_the_wal_and_records_the_last_offset(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """Unload a topic; while its owner closes the topic's producers (one etcd write each, many
    idle producers make that step last), the topic is taken from it (its assignment deleted and
    queued for the leader, as a failover does). The release transaction fails its compare. The
    other broker takes over; the earlier owner keeps its WAL as released segments and records
    the last offset it wrote, so tiering and a fresh subscription get every acked message."""
    url = (tmp_path / "objects").as_uri()
    args = ["--object-store-url", url]
    brokers = [start_broker(extra_args=args), start_broker(extra_args=args)]
    topic = "/default/taken"
    name = TopicName.parse(topic)
    async with (
        DanubeClient([b.address for b in brokers], metadata_retries=60, retry_backoff_ms=100) as client,
        await MetadataStore.connect(etcd_endpoints) as meta,
    ):
        await client.admin.create_topic(topic)
        owner_id = (await client.lookup_topic(topic)).broker_id
        owner = next(b for b in brokers if b.broker_id == owner_id)
        other = next(b for b in brokers if b.broker_id != owner_id)
        async with client.producer(topic, producer_name="data", max_batch_messages=10) as producer:
            acked = {int(await producer.send_nowait(payload(i))): payload(i) for i in range(300)}
        async with grpc.aio.insecure_channel(owner.address) as channel:
            stub = pb_grpc.ProducerServiceStub(channel)
            for i in range(IDLE_PRODUCERS):
                await stub.CreateProducer(pb.CreateProducerRequest(topic=topic, producer_name=f"idle-{i}"), timeout=10)
        assignment = keys.topic_assignment(owner_id, name)
        epoch = await meta.get(assignment)
        assert epoch is not None

        async def producers_closing() -> bool:
            kvs, _ = await meta.get_prefix(keys.topic_producers_prefix(name))
            return any(
                isinstance(kv.value, dict) and kv.value.get("status") is False
                and str(kv.value.get("producer_name")).startswith("idle-")
                for kv in kvs
            )

        channel = grpc.aio.insecure_channel(owner.address)  # to the owner, no retry elsewhere
        admin = pb_grpc.AdminStub(channel)

        async def unload_once() -> object:
            return await admin.UnloadTopic(pb.UnloadTopicRequest(topic=topic), timeout=30)

        unload = asyncio.create_task(unload_once())
        await eventually(producers_closing, timeout_s=10, interval_s=0.002, what="the release closes the producers")
        taken = await meta.transaction(
            created={assignment: epoch.create_revision},
            deletes=[assignment],
            puts=[(keys.unassigned_topic(name), values.UnassignedReason(reason="failover", from_broker=owner_id))],
        )
        assert taken is not None, "the release ended before the assignment could change under it"
        outcome: Any = await asyncio.gather(unload, return_exceptions=True)
        await channel.close()
        assert isinstance(outcome[0], grpc.aio.AioRpcError), f"the release succeeded: {outcome[0]}"
        assert "NotServedHereError" in str(outcome[0].trailing_metadata())

        async def moved_and_recorded() -> bool:
            ranges, _ = await meta.get_prefix(keys.unavailable_prefix(name))
            recorded = [values.UnavailableRange.from_json(r.value) for r in ranges]
            wal = owner.data_dir / "wal" / name.namespace / name.topic
            return (
                await meta.get(keys.topic_assignment(other.broker_id, name)) is not None
                and not wal.exists()
                and [(r.broker_id, r.last_written) for r in recorded] == [(owner_id, 299)]
            )

        await eventually(moved_and_recorded, timeout_s=15, what="the WAL kept as released and offset 299 recorded")
        async with client.producer(topic, producer_name="after", max_batch_messages=10) as producer:
            for i in range(300, 350):
                acked[int(await producer.send(payload(i)))] = payload(i)
        await client.admin.seal_active_segment(topic)
        report = await tier_sealed_segments(name, store=meta, admin=client.admin, objects=ObjectStore(url))
        assert (report.first_offset, report.last_offset) == (0, max(acked))
        read: dict[int, bytes] = {}
        async with client.consumer(
            topic, subscription="replay", initial_position=InitialPosition.EARLIEST, receiver_queue_size=5,
            ack_batch_size=5, ack_flush_ms=5,
        ) as consumer:
            while len(read) < len(acked):
                message = await consumer.receive(timeout_ms=10_000)
                assert message.offset not in read
                read[message.offset] = message.payload
                await consumer.ack(message)
        assert read == acked


# --------------------------------------------------------------------------- timed out (FAKE)


def _batch(producer_id: int, producer_name: str, count: int, base_sequence: int) -> bytes:
    builder = BatchBuilder(1)
    for i in range(count):
        builder.append(f"m{base_sequence + i}".encode(), timestamp_us=1)
    return builder.build(producer_id=producer_id, producer_name=producer_name, base_sequence=base_sequence)


async def _in_process_broker(tmp_path: Path, endpoints: list[str], broker_id: int) -> tuple[Broker, LocalCache]:
    store = await MetadataStore.connect(endpoints)
    cache = LocalCache(store, prefixes=("/",))
    await cache.start()
    config = BrokerConfig(data_dir=tmp_path / "broker", etcd_endpoints=endpoints, object_store_url=(tmp_path / "objects").as_uri())
    broker = Broker(config, broker_id, store=store, cache=cache, registry=SchemaRegistry(store, cache=cache))
    return broker, cache


@pytest.mark.parametrize("applied", [True, False], ids=["applied", "not-applied"])
async def test_a_release_that_timed_out_settles_from_what_etcd_holds(
    tmp_path: Path, etcd_endpoints: list[str], monkeypatch: pytest.MonkeyPatch, applied: bool
) -> None:
    """FAKE fault: the release transaction raises ``MetadataStoreError`` as a timeout does,
    after it was applied to the real etcd (``applied``) or without sending it. A real etcd
    cannot be made to time out after applying on cue. Applied: the release completes (the WAL
    moves to the released segments). Not applied: the topic stays assigned here and is served
    again, continuing its offsets."""
    broker_id = 4242
    name = TopicName.parse("/default/uncertain")
    broker, cache = await _in_process_broker(tmp_path, etcd_endpoints, broker_id)
    store = broker.store
    try:
        await store.put_many([
            (keys.topic_root(name), 0), (keys.namespace_topic(name), None), (keys.topic_assignment(broker_id, name), None),
        ])
        await broker.start()
        await eventually(lambda: name.path in broker.topics, timeout_s=10, what="the topic is loaded")
        producer = await broker.create_producer(name.path, "p", access_mode=0)
        assert await broker.publish(producer.id, _batch(producer.id, "p", 5, 0)) == (0, 4)
        real = store.transaction

        async def timing_out(**kwargs: Any) -> int | None:
            if keys.topic_assignment(broker_id, name) in kwargs.get("deletes", ()):
                if applied:
                    await real(**kwargs)
                raise MetadataStoreError("transaction", "FAKE: deadline exceeded")
            return await real(**kwargs)

        monkeypatch.setattr(store, "transaction", timing_out)
        wal = broker.config.wal_dir / name.namespace / name.topic
        if applied:
            assert await broker.release_topic(name) == 5
            assert not wal.exists()
            assert [s[1:3] for s in broker.released_segments(name)] == [(0, 4)]
        else:
            with pytest.raises(MetadataStoreError):
                await broker.release_topic(name)
            monkeypatch.setattr(store, "transaction", real)
            assert name.path in broker.topics and wal.exists()
            producer = await broker.create_producer(name.path, "p2", access_mode=0)
            assert await broker.publish(producer.id, _batch(producer.id, "p2", 3, 100)) == (5, 7)
    finally:
        await broker.close()
        await cache.stop()
        await store.close()
