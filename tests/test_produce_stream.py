"""``ProduceStream`` against a real broker: the batches of many producers on lanes of one stream.

* Per lane, ``SendStream``'s rules: appended in order, answered in order, nothing appended after
  a failed batch of the lane; other lanes go on (``broker/rpc/produce_stream.py``).
* A lane whose topic is throttled (``max_publish_rate``, ``docs/etcd-layout.md`` §2.1) does not
  hold back the other lanes' answers.
* A lane the client closed is forgotten; a new lane of the same producer starts clean.
* The client library puts every producer on one broker onto one stream, and the messages of
  each land in its own topic, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import grpc
import pytest

from danube_pipeline.client import DanubeClient, InitialPosition, SubscriptionType
from danube_pipeline.client._connection import Stubs
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.format.batches import BatchBuilder
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb

from helpers import broker_stubs

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

T = 30.0  # request timeout, s


def _stubs(broker: BrokerProcess) -> contextlib.AbstractAsyncContextManager[Stubs]:
    return broker_stubs(broker.address)


async def _producer(stubs: Stubs, topic: str, name: str = "p") -> int:
    created = await stubs.producer.CreateProducer(
        pb.CreateProducerRequest(topic=topic, producer_name=name), timeout=T)
    return int(created.producer_id)


def _batch(producer_id: int, *payloads: bytes) -> bytes:
    builder = BatchBuilder(1)
    for payload in payloads:
        builder.append(payload, timestamp_us=1)
    return builder.build(producer_id=producer_id, producer_name="p")


def _item(producer_id: int, lane: int, sequence_id: int, batch: bytes) -> pb.SendBatchRequest:
    return pb.SendBatchRequest(producer_id=producer_id, stream_id=lane, sequence_id=sequence_id, batch=batch)


class _Answers:
    """Reads a ``ProduceStream`` call's answers into one list per lane."""

    def __init__(self, call: Any) -> None:
        self.by_lane: dict[int, list[Any]] = {}
        self.arrived: list[tuple[float, int, int]] = []  # (monotonic s, lane, sequence id)
        self._call = call
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            response = await self._call.read()
            if response is grpc.aio.EOF:
                return
            for result in response.results:
                self.by_lane.setdefault(result.stream_id, []).append(result)
                self.arrived.append((time.monotonic(), result.stream_id, result.sequence_id))

    async def wait(self, lane: int, count: int, timeout_s: float = 20.0) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        while len(self.by_lane.get(lane, [])) < count:
            assert not self._task.done() or self._task.exception() is None, self._task.exception()
            assert time.monotonic() < deadline, f"lane {lane}: {self.by_lane.get(lane)}"
            await asyncio.sleep(0.01)
        return self.by_lane[lane]

    async def close(self) -> None:
        self._call.cancel()
        with contextlib.suppress(BaseException):
            await self._task


async def test_a_failed_batch_stops_its_lane_only(start_broker: Any) -> None:
    broker = start_broker()
    async with _stubs(broker) as stubs:
        a = await _producer(stubs, "/default/ps-a")
        b = await _producer(stubs, "/default/ps-b")
        call = stubs.producer.ProduceStream()
        answers = _Answers(call)
        try:
            await call.write(pb.ProduceRequest(batches=[
                _item(a, 1, 1, _batch(a, b"a0", b"a1")),
                _item(b, 2, 1, b"not a record batch"),  # refused: lane 2 fails here
                _item(b, 2, 2, _batch(b, b"b0")),        # not appended after the failure
                _item(a, 1, 2, _batch(a, b"a2")),        # lane 1 goes on
            ]))
            lane_a = await answers.wait(1, 2)
            lane_b = await answers.wait(2, 2)
            assert [(r.sequence_id, r.first_offset, r.last_offset) for r in lane_a] == [(1, 0, 1), (2, 2, 2)]
            assert not any(r.HasField("error") for r in lane_a)
            assert lane_b[0].sequence_id == 1 and lane_b[0].error.error_class == "MalformedRequestError"
            assert lane_b[1].sequence_id == 2 and lane_b[1].error.error_class == "BatchNotAppendedError"

            # The client leaves lane 2 and resends on lane 3: a new lane starts with no failure.
            await call.write(pb.ProduceRequest(closed_streams=[2], batches=[_item(b, 3, 2, _batch(b, b"b0"))]))
            lane_c = await answers.wait(3, 1)
            assert not lane_c[0].HasField("error") and (lane_c[0].first_offset, lane_c[0].last_offset) == (0, 0)
        finally:
            await answers.close()


async def test_a_throttled_lane_does_not_hold_back_the_others(
    start_broker: Any, etcd_endpoints: list[str]
) -> None:
    slow = "/default/ps-throttled"
    async with await MetadataStore.connect(etcd_endpoints) as store:
        await store.put(keys.topic_policy(TopicName.parse(slow)), {"max_publish_rate": 2})
    broker = start_broker()
    async with _stubs(broker) as stubs:
        a = await _producer(stubs, slow)
        b = await _producer(stubs, "/default/ps-free")
        call = stubs.producer.ProduceStream()
        answers = _Answers(call)
        try:
            started = time.monotonic()
            # 2 msg/s with one second in the bucket: batches 3 and 4 of lane 1 wait ~0.5 s each.
            await call.write(pb.ProduceRequest(batches=[
                *(_item(a, 1, i, _batch(a, b"s%d" % i)) for i in range(1, 5)),
                _item(b, 2, 1, _batch(b, b"free")),
            ]))
            free = await answers.wait(2, 1)
            throttled = await answers.wait(1, 4)
            assert not free[0].HasField("error")
            assert [r.first_offset for r in throttled] == [0, 1, 2, 3]  # in order
            assert sum(r.throttled_ms for r in throttled) > 0
            assert time.monotonic() - started >= 0.9
            free_at = next(t for t, lane, _ in answers.arrived if lane == 2)
            last_throttled_at = max(t for t, lane, _ in answers.arrived if lane == 1)
            assert last_throttled_at - free_at >= 0.5  # answered while lane 1 still waited
        finally:
            await answers.close()


async def test_the_client_puts_its_producers_on_one_stream_per_broker(start_broker: Any) -> None:
    broker = start_broker()
    topics = [f"/default/ps-client-{i}" for i in range(5)]
    async with DanubeClient([broker.address]) as client:
        producers = [client.producer(topic, producer_name="p") for topic in topics]
        for producer in producers:
            await producer.open()
        sends = [producers[i % 5].send_nowait(b"%d:%d" % (i % 5, i)) for i in range(200)]
        offsets = await asyncio.gather(*sends)
        streams = client._ctx.produce_streams._streams  # noqa: SLF001 - what this test checks
        assert list(streams) == [broker.address]
        for i in range(5):
            assert [o for j, o in enumerate(offsets) if j % 5 == i] == list(range(40))
        for producer in producers:
            await producer.close()
        for i, topic in enumerate(topics):
            consumer = client.consumer(topic, subscription="s", subscription_type=SubscriptionType.EXCLUSIVE,
                                       initial_position=InitialPosition.EARLIEST)
            await consumer.open()
            got: list[bytes] = []
            while len(got) < 40:
                message = await consumer.receive(timeout_ms=int(T * 1000))
                got.append(message.payload)
                await consumer.ack(message)
            assert got == [b"%d:%d" % (i, j) for j in range(i, 200, 5)]
            await consumer.close()
