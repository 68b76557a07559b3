"""Tiered storage end to end: subscriptions read offsets below the local WAL from the segment
objects, local retention deletes only verified segments, and offsets are never reused.

Everything is real: an etcd, broker processes, the tiering steps of the assets, and object
storage on the local file system or on moto's S3 server.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypedDict

import boto3
import pytest
from moto.server import ThreadedMotoServer

from danube_pipeline.client import DanubeClient, InitialPosition, SubscriptionType
from danube_pipeline.client.consumer import Consumer
from danube_pipeline.dev.localcluster import BrokerProcess, free_port
from danube_pipeline.errors import PositionBelowRetentionError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore
from danube_pipeline.lake.tiering import tier_sealed_segments

from broker.storage.wal.epochs import EPOCHS_FILE

from helpers import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

BUCKET = "danube-tiered"
SEGMENT_BYTES = 8 * 1024


class SubscriptionOptions(TypedDict):
    """Keyword arguments of ``DanubeClient.consumer`` shared by a test's consumers."""

    subscription: str
    subscription_type: SubscriptionType
    initial_position: InitialPosition


def payload(i: int) -> bytes:
    return f"message {i:06d} ".encode() * 3


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test", aws_secret_access_key="test"
    ).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


class Store:
    """An object store as the broker (command line) and the tiering steps (``ObjectStore``) see it."""

    def __init__(self, url: str, options: dict[str, object], broker_args: list[str], env: dict[str, str]) -> None:
        self.url = url
        self.objects = ObjectStore(url, storage_options=options or None)
        self.broker_args = ["--object-store-url", url, *broker_args]
        self.env = env


def file_store(tmp_path: Path) -> Store:
    return Store((tmp_path / "objects").as_uri(), {}, [], {})


def s3_store(endpoint: str, prefix: str) -> Store:
    options: dict[str, object] = {
        "endpoint_url": endpoint, "key": "test", "secret": "test", "client_kwargs": {"region_name": "us-east-1"}
    }
    return Store(
        f"s3://{BUCKET}/{prefix}",
        options,
        ["--s3-endpoint-url", endpoint, "--s3-region", "us-east-1"],
        {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"},
    )


def start(start_broker: Callable[..., BrokerProcess], store: Store, *extra: str, data_dir: Path | None = None) -> BrokerProcess:
    return start_broker(
        data_dir=data_dir,
        segment_max_bytes=SEGMENT_BYTES,
        extra_args=[*store.broker_args, "--local-retention-check-s", "3600", *extra],
        env=store.env,
    )


async def produce(client: DanubeClient, topic: str, first: int, count: int) -> None:
    async with client.producer(topic, producer_name=f"p{first}", max_batch_messages=20) as producer:
        for i in range(first, first + count):
            producer.send_nowait(payload(i))
        await producer.flush()


async def tier(client: DanubeClient, etcd_endpoints: list[str], topic: str, store: Store) -> None:
    """Seal the active segment and run the tiering step of ``segment_objects``."""
    await client.admin.seal_active_segment(topic)
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        await tier_sealed_segments(TopicName.parse(topic), store=meta, admin=client.admin, objects=store.objects)


async def remote_end_is(client: DanubeClient, topic: str, expected: int) -> bool:
    """Whether the broker reports ``expected`` as the topic's last tiered offset. It follows
    the descriptors through its etcd cache (a watch), so a read right after tiering from this
    process may still see the earlier end."""
    return (await client.admin.describe_topic(topic)).remote_end_offset == expected


async def receive_all(consumer: Consumer, count: int, *, ack: bool = True, timeout_ms: int = 10_000) -> list[int]:
    got = []
    for _ in range(count):
        message = await consumer.receive(timeout_ms=timeout_ms)
        assert message.payload == payload(message.offset), f"offset {message.offset}"
        got.append(message.offset)
        if ack:
            await consumer.ack(message)
    return got


@pytest.mark.parametrize("backend", ["file", "s3"])
async def test_exclusive_reads_object_storage_then_the_wal(
    backend: str, s3_endpoint: str, tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    store = file_store(tmp_path) if backend == "file" else s3_store(s3_endpoint, "exclusive")
    broker = start(start_broker, store)
    topic = "/default/tiered"
    async with DanubeClient([broker.address]) as client:
        await produce(client, topic, 0, 600)
        await tier(client, etcd_endpoints, topic, store)
        await eventually(lambda: remote_end_is(client, topic, 599), what="the descriptors reached the broker")
        before = await client.admin.describe_topic(topic)
        assert before.remote_first_offset == 0 and before.remote_end_offset == 599
        result = await client.admin.apply_local_retention(topic, retention_bytes=0)
        assert result.deleted_segments == before.sealed_segments >= 3
        assert result.first_local_offset == 600
        await produce(client, topic, 600, 200)  # these stay in the WAL
        async with client.consumer(
            topic, subscription="replay", initial_position=InitialPosition.EARLIEST
        ) as consumer:
            got = await receive_all(consumer, 800)
            assert got == list(range(800))  # no gap, no duplicate across the boundary
            with pytest.raises(TimeoutError):
                await consumer.receive(timeout_ms=300)
        described = await client.admin.describe_topic(topic)
    sub = next(s for s in described.subscriptions if s.name == "replay")
    assert sub.records_from_object_storage == 600
    assert sub.cursor == 799 and sub.skipped_below_retention == 0
    assert described.first_local_offset == 600 and described.earliest_offset == 0


@pytest.mark.parametrize("subscription_type", [SubscriptionType.SHARED, SubscriptionType.FAILOVER])
async def test_shared_and_failover_across_the_boundary(
    subscription_type: SubscriptionType, tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    store = file_store(tmp_path)
    broker = start(start_broker, store)
    topic = "/default/tiered-multi"
    async with DanubeClient([broker.address]) as client:
        await produce(client, topic, 0, 400)
        await tier(client, etcd_endpoints, topic, store)
        await client.admin.apply_local_retention(topic, retention_bytes=0)
        await produce(client, topic, 400, 100)
        seen: list[int] = []
        opts = SubscriptionOptions(
            subscription="multi", subscription_type=subscription_type, initial_position=InitialPosition.EARLIEST
        )
        async with client.consumer(topic, consumer_name="a", **opts) as a, client.consumer(topic, consumer_name="b", **opts) as b:

            async def drain(consumer: Consumer) -> None:
                while True:
                    try:
                        message = await consumer.receive(timeout_ms=1500)
                    except TimeoutError:
                        return
                    assert message.payload == payload(message.offset)
                    seen.append(message.offset)
                    await consumer.ack(message)

            await asyncio.gather(drain(a), drain(b))
    assert sorted(seen) == list(range(500))
    assert len(seen) == len(set(seen))


async def test_unacked_cold_messages_are_redelivered_from_object_storage(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    store = file_store(tmp_path)
    broker = start(start_broker, store)
    topic = "/default/tiered-redeliver"
    async with DanubeClient([broker.address]) as client:
        await produce(client, topic, 0, 300)
        await tier(client, etcd_endpoints, topic, store)
        await client.admin.apply_local_retention(topic, retention_bytes=0)
        opts = SubscriptionOptions(
            subscription="redeliver", initial_position=InitialPosition.EARLIEST, subscription_type=SubscriptionType.FAILOVER
        )
        async with client.consumer(topic, consumer_name="first", **opts) as first:
            acked = await receive_all(first, 100)
            unacked = await receive_all(first, 50, ack=False)
            # the acks reach the broker (the client flushes them every 100 ms)
            await eventually(lambda: _cursor_is(client, topic, "redeliver", 99), what="acks of 0..99 applied")
        assert acked == list(range(100)) and unacked == list(range(100, 150))
        async with client.consumer(topic, consumer_name="second", **opts) as second:
            message = await second.receive(timeout_ms=10_000)
            assert message.offset == 100 and message.redelivery_count >= 1
            await second.ack(message)
            rest = await receive_all(second, 199)
    assert rest == list(range(101, 300))


async def test_restart_in_the_middle_of_a_cold_read(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    store = file_store(tmp_path)
    data_dir = tmp_path / "broker"
    broker = start(start_broker, store, data_dir=data_dir)
    topic = "/default/tiered-restart"
    async with DanubeClient([broker.address]) as client:
        await produce(client, topic, 0, 500)
        await tier(client, etcd_endpoints, topic, store)
        await client.admin.apply_local_retention(topic, retention_bytes=0)
        async with client.consumer(topic, subscription="restart", initial_position=InitialPosition.EARLIEST) as consumer:
            first = await receive_all(consumer, 200)
            await eventually(lambda: _cursor_is(client, topic, "restart", 199), what="acks flushed to the broker")
    broker.kill()  # no graceful close: the cursor in etcd is whatever was flushed
    broker = start(start_broker, store, data_dir=data_dir)
    async with DanubeClient([broker.address]) as client:
        described = await client.admin.describe_topic(topic)
        assert described.first_local_offset == 500  # the deleted segments did not come back
        async with client.consumer(topic, subscription="restart", initial_position=InitialPosition.EARLIEST) as consumer:
            message = await consumer.receive(timeout_ms=10_000)
            assert message.offset <= 200  # resumes at the stored cursor + 1, at-least-once
            rest = [message.offset, *await receive_all(consumer, 499 - message.offset)]
    assert first == list(range(200))
    assert rest == list(range(rest[0], 500))


async def test_wiped_broker_continues_above_every_offset_handed_out(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    store = file_store(tmp_path)
    data_dir = tmp_path / "broker"
    broker = start(start_broker, store, data_dir=data_dir)
    topic = "/default/tiered-wiped"
    async with DanubeClient([broker.address]) as client:
        await produce(client, topic, 0, 300)
        await tier(client, etcd_endpoints, topic, store)
    broker.stop()
    shutil.rmtree(data_dir / "wal")  # the disk is lost; etcd and object storage are not
    broker = start(start_broker, store, data_dir=data_dir)
    async with DanubeClient([broker.address]) as client:
        await produce(client, topic, 300, 50)
        # The broker cannot know which offsets of its reserved block (§5.4) it acked and lost:
        # it starts past the block, and the untiered part is an unavailable range (§5.5).
        described = await client.admin.describe_topic(topic)
        assert described.next_offset == 100_050 and described.first_local_offset == 100_000
        assert [(u.start_offset, u.end_offset, u.broker_id) for u in described.unavailable_ranges] == [
            (300, 99_999, broker.broker_id)
        ]
        async with client.consumer(topic, subscription="all", initial_position=InitialPosition.EARLIEST) as consumer:
            assert await receive_all(consumer, 300) == list(range(300))
            with pytest.raises(TimeoutError):  # it waits at the range: nothing is skipped silently
                await consumer.receive(timeout_ms=1000)
            # The disk is lost for good: the operator abandons the range; the skip is counted.
            assert await client.admin.abandon_unavailable_range(topic, 300) == 99_700
            after = [await consumer.receive(timeout_ms=10_000) for _ in range(50)]
            assert [m.offset for m in after] == list(range(100_000, 100_050))
            assert [m.payload for m in after] == [payload(300 + i) for i in range(50)]
            for message in after:
                await consumer.ack(message)
        described = await client.admin.describe_topic(topic)
        assert [s.skipped_unavailable for s in described.subscriptions] == [99_700]
        await client.admin.seal_active_segment(topic)
        await tier(client, etcd_endpoints, topic, store)  # the new segment passes over the abandoned range
        await eventually(lambda: remote_end_is(client, topic, 100_049), what="the new descriptor reached the broker")


@pytest.mark.parametrize("mode", ["earliest", "error"])
async def test_position_below_retention_jumps_or_fails_never_silently(
    mode: str, tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    store = file_store(tmp_path)
    broker = start(start_broker, store, "--position-below-retention", mode)
    topic = "/default/tiered-expired"
    name = TopicName.parse(topic)
    async with DanubeClient([broker.address]) as client:
        await produce(client, topic, 0, 300)
        await tier(client, etcd_endpoints, topic, store)
        async with client.consumer(topic, subscription="slow", initial_position=InitialPosition.EARLIEST) as consumer:
            assert await receive_all(consumer, 10) == list(range(10))
            await eventually(lambda: _cursor_is(client, topic, "slow", 9), what="acks flushed to the broker")
        # Retention expires the first objects: their descriptors and objects go, then the WAL.
        async with await MetadataStore.connect(etcd_endpoints) as meta:
            kvs, _ = await meta.get_prefix(keys.objects_prefix(name))
            descriptors = sorted((kv for kv in kvs if not kv.key.endswith("/cur")), key=lambda kv: kv.key)
            expired = descriptors[:2]
            for kv in expired:
                await meta.delete(kv.key)
        earliest = int(descriptors[2].key.rsplit("/", 1)[1])
        await eventually(
            lambda: _earliest(client, topic, earliest), timeout_s=10, what="the broker sees the descriptors go"
        )
        result = await client.admin.apply_local_retention(topic)  # expired segments leave the WAL
        assert result.first_local_offset == earliest
        consumer = client.consumer(topic, subscription="slow", initial_position=InitialPosition.EARLIEST)
        if mode == "earliest":
            async with consumer:
                message = await consumer.receive(timeout_ms=10_000)
                assert message.offset == earliest
            described = await client.admin.describe_topic(topic)
            sub = next(s for s in described.subscriptions if s.name == "slow")
            assert sub.skipped_below_retention == earliest - 10
        else:
            with pytest.raises(PositionBelowRetentionError) as caught:
                async with consumer:
                    await consumer.receive(timeout_ms=10_000)
            assert caught.value.position == 10 and caught.value.earliest_offset == earliest


async def _cursor_is(client: DanubeClient, topic: str, subscription: str, expected: int) -> bool:
    """The subscription's cursor on the broker is ``expected`` (every offset up to it acked)."""
    described = await client.admin.describe_topic(topic)
    return any(s.name == subscription and s.cursor == expected for s in described.subscriptions)


async def _earliest(client: DanubeClient, topic: str, expected: int) -> bool:
    return (await client.admin.describe_topic(topic)).remote_first_offset == expected


async def test_local_retention_keeps_the_wal_bounded_under_ingest(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    store = file_store(tmp_path)
    broker = start_broker(
        segment_max_bytes=SEGMENT_BYTES,
        extra_args=[*store.broker_args, "--local-retention-bytes", str(4 * SEGMENT_BYTES), "--local-retention-check-s", "0.2"],
    )
    topic = "/default/tiered-bounded"
    sizes: list[int] = []
    async with DanubeClient([broker.address]) as client:
        for round_ in range(8):
            await produce(client, topic, round_ * 200, 200)
            await tier(client, etcd_endpoints, topic, store)
            # Ingest paced over time, so the 0.2 s retention check runs between rounds; the
            # sizes it leaves are what is asserted, so there is no state to poll for here.
            await asyncio.sleep(0.5)
            sizes.append((await client.admin.describe_topic(topic)).wal_bytes)
        described = await client.admin.describe_topic(topic)
        async with client.consumer(topic, subscription="check", initial_position=InitialPosition.EARLIEST) as consumer:
            assert await receive_all(consumer, 1600) == list(range(1600))
    assert described.first_local_offset > 0  # segments were deleted
    # at most the retention plus one segment (a segment exceeds its size by up to one batch)
    assert max(sizes[2:]) <= 4 * SEGMENT_BYTES + 2 * SEGMENT_BYTES, sizes
    wal_files = [  # the segments; the leader-epoch checkpoint is not log data
        f for f in (broker.data_dir / "wal" / "default" / "tiered-bounded").iterdir() if f.name != EPOCHS_FILE
    ]
    assert sum(f.stat().st_size for f in wal_files) == described.wal_bytes


async def test_tiering_refuses_other_bytes_or_overlaps_for_registered_offsets(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """A completed descriptor already holds these offsets with other content (say, written
    by another owner of the topic): tiering refuses, and changes nothing."""
    from danube_pipeline.errors import CorruptRecordError, OffsetRangeError
    from danube_pipeline.metadata.values import ObjectDescriptor

    store = file_store(tmp_path)
    broker = start(start_broker, store)
    topic = "/default/tiered-conflict"
    name = TopicName.parse(topic)
    async with DanubeClient([broker.address]) as client:
        await produce(client, topic, 0, 100)
        segment = await client.admin.seal_active_segment(topic)
        assert segment is not None and segment.end_offset == 99
        async with await MetadataStore.connect(etcd_endpoints) as meta:
            other = ObjectDescriptor(
                completed=True, created_at=1, end_offset=99, etag="0" * 32, object_id="data-0-99.dnb1",
                offset_index=[[0, 32]], size=segment.size_bytes + 1, start_offset=0,
            )
            await meta.put(keys.object_descriptor(name, 0), other)
            with pytest.raises(CorruptRecordError, match="different content"):
                await tier_sealed_segments(name, store=meta, admin=client.admin, objects=store.objects)
            same_size = ObjectDescriptor(**{**other.to_json(), "size": segment.size_bytes})
            await meta.put(keys.object_descriptor(name, 0), same_size)
            with pytest.raises(CorruptRecordError, match="different content"):
                await tier_sealed_segments(name, store=meta, admin=client.admin, objects=store.objects)
            await meta.delete(keys.object_descriptor(name, 0))
            overlapping = ObjectDescriptor(**{**other.to_json(), "start_offset": 50, "object_id": "data-50-99.dnb1"})
            await meta.put(keys.object_descriptor(name, 50), overlapping)
            with pytest.raises(OffsetRangeError, match="overlaps"):
                await tier_sealed_segments(name, store=meta, admin=client.admin, objects=store.objects)
            assert not store.objects.exists("topics/default/tiered-conflict/data-0-99.dnb1")
