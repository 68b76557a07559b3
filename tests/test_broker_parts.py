"""In-process tests of broker parts (topic, subscription, SendStream servicer) on real WAL
files, with typed in-memory stand-ins for etcd."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from helpers import eventually

from danube_pipeline.format.batches import BatchBuilder, batch_records
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.values import JsonRecord, JsonValue
from danube_pipeline.modes import SubscriptionType
from danube_pipeline.names import TopicName
from danube_pipeline.outages import OutageLog
from danube_pipeline.proto import danube_pb2 as pb

from broker.tasks import BackgroundWrites

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]


class _DictCache:
    """An in-memory :class:`~danube_pipeline.metadata.protocols.MetadataReader`."""

    def __init__(self, values: dict[str, JsonValue] | None = None) -> None:
        self.values = values or {}

    def get(self, key: str) -> JsonValue | None:
        return self.values.get(key)

    def get_prefix(self, prefix: str) -> dict[str, JsonValue]:
        return {key: self.values[key] for key in sorted(self.values) if key.startswith(prefix)}


class _RecordingStore:
    """A :class:`~danube_pipeline.metadata.protocols.MetadataWriter` that records every put."""

    def __init__(self) -> None:
        self.puts: list[tuple[str, JsonValue | JsonRecord]] = []

    async def put(self, key: str, value: JsonValue | JsonRecord) -> int:
        self.puts.append((key, value))
        return len(self.puts)

    async def delete(self, key: str) -> bool:
        self.puts.append((key, None))
        return True


def _background() -> BackgroundWrites:
    return BackgroundWrites(OutageLog(logging.getLogger("test"), "test writes"))


def _batch(*payloads: bytes, producer_id: int = 1, producer_name: str = "p") -> tuple[bytes, int]:
    """One record batch of ``payloads``, as a producer frames it, and its record count."""
    builder = BatchBuilder(1)
    for payload in payloads:
        builder.append(payload, timestamp_us=1)
    return builder.build(producer_id=producer_id, producer_name=producer_name), len(payloads)


async def test_send_stream_stops_after_a_failed_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wal_syscalls_from_python: None
) -> None:
    """After the WAL write of batch N fails, SendStream must not publish later batches: they
    would persist after the gap and a client resending from N would duplicate and reorder. Every
    batch is answered, errors as data, and the broker does not end the stream first.

    FAKE fault injection: ``os.fdatasync`` (as used by broker.storage.wal) raises ENOSPC on its second
    call, i.e. for the write of sequence 1; a failing disk cannot be produced for real here.
    """
    from broker.topics.producer import Producer
    from broker.rpc.producer_service import ProducerBroker, ProducerServicer
    from broker.topics.topic import Topic
    from broker.storage.wal import WriteAheadLog

    wal = await WriteAheadLog.open(tmp_path, segment_max_age_s=3600.0)
    topic = Topic(TopicName.parse("/ns/t"), wal, store=_RecordingStore(), cache=_DictCache(), background=_background())
    producer = Producer(id=1, name="p", access_mode=0, topic=topic)

    class OneTopicBroker:
        """A :class:`broker.rpc.producer_service.ProducerBroker` with one producer on one topic."""

        broker_id = 1

        async def create_producer(self, topic_path: str, producer_name: str, **options: Any) -> Producer:
            return producer

        async def throttle_publish(self, producer_id: int, batch: bytes) -> float:
            return 0.0  # no max_publish_rate here: never waits

        def publish(self, producer_id: int, batch: bytes) -> asyncio.Future[tuple[int, int]]:
            return topic.publish(producer, batch)

        async def close_producer(self, producer_id: int) -> None:
            pass

    real = os.fdatasync
    calls = {"n": 0}

    def flaky(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fdatasync", flaky)

    def request(seq: int) -> pb.SendBatchRequest:
        batch, _ = _batch(f"s{seq}".encode())
        return pb.SendBatchRequest(producer_id=1, sequence_id=seq, batch=batch)

    first_answered = asyncio.Event()
    third_sent = asyncio.Event()

    async def requests() -> Any:
        yield request(0)
        await first_answered.wait()
        yield request(1)  # its write fails
        # the WAL failed the append and handed offset 1 back
        await eventually(lambda: calls["n"] >= 2 and wal.next_offset == 1, what="write of request 1 failed")
        # Set before the yield: the servicer's reader handles request 2 in the same task step,
        # before the test task (woken by this event) runs again.
        third_sent.set()
        yield request(2)  # arrives after the failure

    # a fake broker core: SendStream needs only the producer calls OneTopicBroker has
    servicer = ProducerServicer(cast("ProducerBroker", OneTopicBroker()))
    gen = inspect.unwrap(ProducerServicer.SendStream)(servicer, requests(), None)
    answers = [await gen.__anext__()]
    first_answered.set()
    await asyncio.wait_for(third_sent.wait(), 5)  # the transport is slow to take the next answer
    answers += [answer async for answer in gen]  # the broker answers everything, then ends
    try:
        assert [a.sequence_id for a in answers] == [0, 1, 2]
        assert not answers[0].HasField("error") and (answers[0].first_offset, answers[0].last_offset) == (0, 0)
        # The failed batch gets its typed error as data; the next one is not appended.
        assert answers[1].error.error_class == "StorageFullError"
        assert answers[1].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert answers[2].error.error_class == "BatchNotAppendedError"
        assert json.loads(answers[2].error.fields) == {"sequence_id": 2, "failed_sequence_id": 1}
        assert [r.payload for b in wal.read(0, 100) for r in batch_records(b.data)] == [b"s0"]
        assert wal.next_offset == 1  # request 2 was never enqueued (it would hold offset 1)
    finally:
        await wal.close()


async def test_cursor_advances_when_start_is_below_the_wal_start(tmp_path: Path) -> None:
    """A stored cursor older than the WAL start (e.g. after a topic move the WAL starts at
    last_committed_offset + 1): the ack floor must follow the read position, so the cursor
    advances and acked offsets are not kept forever."""
    from broker.dispatch.subscription import Subscription
    from broker.storage.wal import WriteAheadLog

    wal = await WriteAheadLog.open(tmp_path, segment_max_age_s=3600.0, initial_offset=100)
    stored: list[int] = []

    async def persist(cursor: int) -> None:
        stored.append(cursor)

    sub = Subscription(
        topic="/ns/t", name="s", subscription_type=SubscriptionType.EXCLUSIVE, wal=wal,
        start_offset=50, persisted_cursor=49, persist_cursor=persist, cursor_flush_acks=10,
    )
    consumer = sub.add_consumer(1, "c", SubscriptionType.EXCLUSIVE, 1000)
    try:
        for i in range(10):  # offsets 100..199 in ten batches
            await wal.append(*_batch(*[f"m{i}-{j}".encode() for j in range(10)]))
        got: list[int] = []

        async def receive() -> None:
            async for group in consumer.deliveries():
                for d in group:
                    got.extend(range(d.handout.first, d.handout.last + 1))
                    sub.ack_ranges([(d.handout.first, d.handout.last)])
                if len(got) >= 100:
                    return

        await asyncio.wait_for(receive(), 5)
        await sub.flush_cursor()
        assert got == list(range(100, 200))
        assert sub.cursor == 199
        assert sub.handouts == {}
        assert stored[-1] == 199
    finally:
        await sub.close()
        await wal.close()


async def test_acks_counted_during_a_cursor_write_start_the_next_one(tmp_path: Path) -> None:
    """``cursor_flush_acks`` acknowledgements made while the previous cursor write is under way
    are stored once it ends, not only at the next acknowledgement."""
    from broker.dispatch.subscription import Subscription
    from broker.storage.wal import WriteAheadLog

    wal = await WriteAheadLog.open(tmp_path, segment_max_age_s=3600.0)
    stored: list[int] = []
    writing = asyncio.Event()
    release = asyncio.Event()

    async def persist(cursor: int) -> None:
        writing.set()
        await release.wait()
        stored.append(cursor)

    sub = Subscription(
        topic="/ns/t", name="s", subscription_type=SubscriptionType.EXCLUSIVE, wal=wal,
        start_offset=0, persisted_cursor=None, persist_cursor=persist, cursor_flush_acks=10,
    )
    consumer = sub.add_consumer(1, "c", SubscriptionType.EXCLUSIVE, 1000)
    try:
        for i in range(20):
            await wal.append(*_batch(f"m{i}".encode()))
        deliveries = consumer.deliveries()
        got: list[tuple[int, int]] = []
        while len(got) < 20:
            got.extend((d.handout.first, d.handout.last) for d in await anext(deliveries))
        sub.ack_ranges(got[:10])  # 10 acks: a write of cursor 9 starts and blocks
        await asyncio.wait_for(writing.wait(), 5)
        sub.ack_ranges(got[10:])  # 10 more while it writes
        release.set()
        for _ in range(200):
            if stored[-1:] == [19]:
                break
            await asyncio.sleep(0.01)
        assert stored == [9, 19]
    finally:
        release.set()
        await sub.close()
        await wal.close()


async def test_subscribe_with_cursor_below_the_wal_start_starts_at_the_wal_start(tmp_path: Path) -> None:
    from broker.topics.topic import Topic
    from broker.storage.wal import WriteAheadLog

    name = TopicName.parse("/ns/t")
    wal = await WriteAheadLog.open(tmp_path, segment_max_age_s=3600.0, initial_offset=100)
    store = _RecordingStore()
    cache = _DictCache({keys.subscription_cursor(name, "s"): 49})
    topic = Topic(name, wal, store=store, cache=cache, background=_background())
    try:
        await topic.subscriptions.subscribe(
            subscription="s", subscription_type=SubscriptionType.EXCLUSIVE, consumer_id=1,
            consumer_name="c", earliest=False, receiver_queue_size=10,
        )
        sub = topic.subscriptions["s"]
        assert sub.read_position == 100 and sub.ack_floor == 100
        assert (keys.subscription_cursor(name, "s"), 99) in store.puts
    finally:
        await topic.close()
