"""NonReliable delivery (``docs/etcd-layout.md`` §3.2) against a real broker.

* Messages are acknowledged and delivered from the broker's memory: nothing is written under
  the broker's WAL directory and no ``fdatasync`` is counted, while a Reliable topic on the same
  broker does both.
* The in-memory buffer is bounded (``--nonreliable-buffer-messages``): with a consumer that does
  not keep up, the oldest unread messages are dropped, counted in ``DescribeTopic`` (and the
  admin CLI) and logged; every offset is either delivered once, in order, or counted as dropped.
* A broker restart loses the buffer (documented): the messages are gone, and offsets go on
  increasing past every offset handed out before.
* Such a topic is not tiered: the tiering listing skips it, and tiering it anyway finds nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from danube_pipeline.format.batches import BatchBuilder, parse_header
from danube_pipeline.client import DanubeClient, InitialPosition, SubscriptionType
from danube_pipeline.client._connection import Stubs
from danube_pipeline.client.status import rpc_errors
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.modes import DeliveryMode
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.lake.tiering import list_topic_roots, segments_needing_tiering, tier_sealed_segments

from helpers import broker_stubs, eventually

T = 30.0  # request timeout, s


async def _call(stubs: Stubs, call: Callable[[Stubs], Awaitable[Any]]) -> Any:
    with rpc_errors(stubs.address):
        return await call(stubs)


def _stubs(broker: BrokerProcess) -> contextlib.AbstractAsyncContextManager[Stubs]:
    return broker_stubs(broker.address)


async def _describe(stubs: Stubs, topic: str) -> Any:
    return await _call(stubs, lambda s: s.admin.DescribeTopic(pb.DescribeTopicRequest(topic=topic), timeout=T))


def _wal_files(broker: BrokerProcess) -> list[Path]:
    wal = broker.data_dir / "wal"
    return sorted(p for p in wal.rglob("*") if p.is_file()) if wal.exists() else []


class SlowConsumer:
    """A consumer on raw stubs that does not read until :meth:`start_reading`, then receives
    into a list (it never acks)."""

    def __init__(self, stubs: Stubs, consumer_id: int) -> None:
        self.stubs = stubs
        self.id = consumer_id
        self.offsets: list[int] = []
        self._call: Any = None
        self._task: asyncio.Task[None] | None = None

    def start_reading(self) -> None:
        self._call = self.stubs.consumer.Receive(pb.ReceiveRequest(consumer_id=self.id))
        self._task = asyncio.create_task(self._run())

    @classmethod
    async def subscribe(cls, stubs: Stubs, topic: str, *, window: int) -> SlowConsumer:
        response = await _call(stubs, lambda s: s.consumer.Subscribe(pb.SubscribeRequest(
            topic=topic, subscription="slow", consumer_name="slow", subscription_type=pb.EXCLUSIVE,
            initial_position=pb.EARLIEST, receiver_queue_size=window,
        ), timeout=T))
        return cls(stubs, response.consumer_id)

    async def _run(self) -> None:
        with contextlib.suppress(Exception):
            async for deliveries in self._call:
                for d in deliveries.batches:
                    header = parse_header(d.batch)
                    skip = set(d.acked_offsets)
                    self.offsets.extend(o for o in range(d.first_offset, header.last_offset + 1) if o not in skip)

    async def close(self) -> None:
        if self._call is not None and self._task is not None:
            self._call.cancel()
            with contextlib.suppress(BaseException):
                await self._task


async def _send_singles(stubs: Stubs, topic: str, count: int) -> list[int]:
    """``count`` one-message batches through one producer; the offsets acknowledged."""
    created = await _call(stubs, lambda s: s.producer.CreateProducer(
        pb.CreateProducerRequest(topic=topic, producer_name="p"), timeout=T))
    offsets = []
    for i in range(count):
        builder = BatchBuilder(1)
        builder.append(f"m{i}".encode(), timestamp_us=1)
        batch = builder.build(producer_id=created.producer_id, producer_name="p")
        request = pb.SendBatchRequest(producer_id=created.producer_id, batch=batch)
        r = await _call(stubs, lambda s: s.producer.SendBatch(request, timeout=T))
        offsets.append(r.first_offset)
    return offsets


@pytest.mark.integration
@pytest.mark.asyncio
async def test_messages_are_delivered_from_memory_and_nothing_reaches_the_wal(
    start_broker: Callable[..., BrokerProcess],
) -> None:
    broker = start_broker()
    memory, durable = "/default/fast", "/default/durable"
    async with DanubeClient([broker.address]) as client:
        await client.admin.create_topic(memory, delivery=DeliveryMode.NON_RELIABLE)
        await client.admin.create_topic(durable)
        for topic in (memory, durable):
            async with client.producer(topic, producer_name="p") as producer:
                for i in range(50):
                    await producer.send(f"{topic}-{i}".encode())
            async with client.consumer(
                topic, subscription="s", subscription_type=SubscriptionType.SHARED,
                initial_position=InitialPosition.EARLIEST,
            ) as consumer:
                got = []
                for _ in range(50):
                    message = await consumer.receive(timeout_ms=10_000)
                    got.append((message.offset, message.payload))
                    await consumer.ack(message)
            assert got == [(i, f"{topic}-{i}".encode()) for i in range(50)]

        described = await client.admin.describe_topic(memory)
        assert described.delivery == DeliveryMode.NON_RELIABLE
        assert (described.next_offset, described.buffered_messages, described.dropped_messages) == (50, 50, 0)
        assert described.wal_bytes == 0 and described.sealed_segments == 0 and described.buffered_bytes > 0
        assert await client.admin.list_sealed_segments(memory) == []
        syncs = {t.topic: t.wal_syncs for t in await client.admin.list_topics()}
        assert syncs[memory] == 0 and syncs[durable] > 0
        assert (await client.admin.describe_topic(durable)).delivery == DeliveryMode.RELIABLE

    files = _wal_files(broker)
    assert files, "the Reliable topic writes its WAL"  # the check below can fail
    assert not [f for f in files if "fast" in f.parts], files


@pytest.mark.integration
@pytest.mark.asyncio
async def test_a_slow_consumer_overflows_the_buffer_and_the_oldest_are_dropped_and_counted(
    start_broker: Callable[..., BrokerProcess],
) -> None:
    broker = start_broker(extra_args=["--nonreliable-buffer-messages", "20"])
    topic = "/default/overflow"
    async with _stubs(broker) as stubs:
        await _call(stubs, lambda s: s.admin.CreateTopic(
            pb.CreateTopicRequest(topic=topic, delivery=pb.NON_RELIABLE), timeout=T))
        # subscribed at offset 0, but not reading: its subscription cannot dispatch
        consumer = await SlowConsumer.subscribe(stubs, topic, window=1000)
        try:
            offsets = await _send_singles(stubs, topic, 100)
            assert offsets == list(range(100))  # every send acknowledged, offsets in order

            d = await _describe(stubs, topic)
            assert (d.buffered_messages, d.first_local_offset, d.next_offset) == (20, 80, 100)
            assert d.dropped_messages == 80  # 0..79: evicted before the subscription read them
            assert d.wal_bytes == 0

            # the consumer starts reading: it gets what is still held, from the oldest on
            consumer.start_reading()
            await eventually(lambda: len(consumer.offsets) >= 20, what="the consumer gets the buffer")
            assert consumer.offsets == list(range(80, 100))
            (state,) = (await _describe(stubs, topic)).subscriptions
            assert state.skipped_below_retention == 80 and state.read_position == 100
        finally:
            await consumer.close()

    text = broker.log_path.read_text()
    assert "unread messages dropped" in text


@pytest.mark.integration
@pytest.mark.asyncio
async def test_the_buffer_is_lost_on_restart_and_offsets_keep_increasing(
    start_broker: Callable[..., BrokerProcess],
) -> None:
    broker = start_broker()
    memory, durable = "/default/volatile", "/default/kept"
    async with DanubeClient([broker.address]) as client:
        await client.admin.create_topic(memory, delivery=DeliveryMode.NON_RELIABLE)
        for topic in (memory, durable):
            async with client.producer(topic, producer_name="p") as producer:
                for i in range(10):
                    await producer.send(b"before-%d" % i)
        assert (await client.admin.describe_topic(memory)).buffered_messages == 10

    broker.stop()
    broker.start()
    async with DanubeClient([broker.address]) as client:
        described = await client.admin.describe_topic(memory)
        assert described.buffered_messages == 0 and described.next_offset >= 10
        async with client.consumer(
            durable, subscription="s", initial_position=InitialPosition.EARLIEST
        ) as consumer:
            first = await consumer.receive(timeout_ms=10_000)
            assert first.payload == b"before-0"  # the Reliable topic kept its messages

        async with client.consumer(memory, subscription="s", initial_position=InitialPosition.EARLIEST) as consumer:
            async with client.producer(memory, producer_name="p") as producer:
                after = await producer.send(b"after")
            assert after >= 10  # never an offset handed out before the restart
            message = await consumer.receive(timeout_ms=10_000)
            assert (message.offset, message.payload) == (after, b"after")  # nothing from before


@pytest.mark.integration
@pytest.mark.asyncio
async def test_a_nonreliable_topic_is_not_tiered(
    start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str], tmp_path: Path
) -> None:
    broker = start_broker()
    memory, durable = "/default/volatile", "/default/kept"
    async with DanubeClient([broker.address]) as client:
        await client.admin.create_topic(memory, delivery=DeliveryMode.NON_RELIABLE)
        for topic in (memory, durable):
            async with client.producer(topic, producer_name="p") as producer:
                for i in range(5):
                    await producer.send(b"%d" % i)
            await client.admin.seal_active_segment(topic)
        async with await MetadataStore.connect(etcd_endpoints) as store:
            assert [t.path for t in await list_topic_roots(store)] == [durable]
            name = TopicName.parse(memory)
            assert await segments_needing_tiering(name, store=store, admin=client.admin) == []
            report = await tier_sealed_segments(
                name, store=store, admin=client.admin, objects=ObjectStore((tmp_path / "objects").as_uri())
            )
            assert report.sealed_segments == 0


def _batch(*payloads: bytes) -> bytes:
    builder = BatchBuilder(1)
    for payload in payloads:
        builder.append(payload, timestamp_us=1)
    return builder.build(producer_id=1, producer_name="p")


@pytest.mark.unit
@pytest.mark.asyncio
async def test_memory_log_keeps_the_newest_within_both_bounds_and_counts_unread_evictions() -> None:
    from broker.storage.memory_log import MemoryLog

    size = len(_batch(b"aa", b"bb"))
    memory = MemoryLog("/t/t", initial_offset=7, max_messages=100, max_bytes=3 * size)
    floor = 9  # a subscription has read 7 and 8
    memory.read_floor = lambda: floor
    for i in range(5):
        assert await memory.append(_batch(b"aa", b"bb"), 2) == (7 + 2 * i, 8 + 2 * i)
    # 3 batches fit in max_bytes: 7..10 were evicted, 9 and 10 unread (dropped), 7 and 8 read
    assert (memory.first_offset, memory.durable_end, memory.next_offset) == (11, 17, 17)
    assert (memory.held_messages, memory.size_bytes) == (6, 3 * size)
    assert (memory.evicted_messages, memory.dropped_messages) == (4, 2)
    assert [b.base_offset for b in memory.read(0, 100)] == [11, 13, 15]  # below the first: from it
    assert [b.base_offset for b in memory.read(12, 1)] == [11]  # a batch is read whole
    assert memory.read(17, 10) == [] and memory.sealed_segments() == [] and memory.sync_count == 0
    (stored,) = memory.read(15, 2)
    assert parse_header(stored.data).base_offset == 15  # the stored bytes carry their offsets

    messages = MemoryLog("/t/m", initial_offset=0, max_messages=3, max_bytes=1 << 20)
    for _ in range(3):
        await messages.append(_batch(b"x", b"y"), 2)
    assert (messages.first_offset, messages.held_messages, messages.dropped_messages) == (4, 2, 0)
    big = MemoryLog("/t/b", initial_offset=0, max_messages=10, max_bytes=1)  # the newest batch always stays
    await big.append(_batch(b"z" * 100), 1)
    assert big.held_messages == 1 and [b.base_offset for b in big.read(0, 10)] == [0]
    await memory.close()
    with pytest.raises(RuntimeError):
        memory.enqueue(_batch(b"late"), 1)
