"""Rate policies and ``max_message_size`` of the topic policy, against a real broker.

* ``max_publish_rate`` (``docs/etcd-layout.md`` §2.1, overridden per topic by §3.8): a token
  bucket per topic holding one second of messages. At the limit nothing waits; one message past
  it is slowed (``throttled_ms`` in the answer, ``publish_throttled_ms`` in ``DescribeTopic``),
  never failed; N messages at R msg/s take at least N/R - 1 s (a lower bound only).
* ``max_subscription_dispatch_rate``: the same per subscription, on dispatch
  (``dispatch_throttled_ms`` per subscription).
* Both are read live: a rate written to etcd applies to running producers and consumers within
  about a second (waiting callers re-read it every 0.2 s).
* ``max_message_size`` of the per-topic override: a payload at the limit is taken, one byte
  more is refused with :class:`MessageTooLargeError` and nothing is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from danube_pipeline.format.batches import BatchBuilder, parse_header
from danube_pipeline.client import DanubeClient
from danube_pipeline.client._connection import Stubs
from danube_pipeline.client.status import rpc_errors
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.errors import MessageTooLargeError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb

from helpers import broker_stubs, eventually

T = 30.0  # request timeout, s


async def _call(stubs: Stubs, call: Callable[[Stubs], Awaitable[Any]]) -> Any:
    with rpc_errors(stubs.address):
        return await call(stubs)


async def _put(etcd_endpoints: list[str], key: str, value: Any) -> None:
    async with await MetadataStore.connect(etcd_endpoints) as store:
        await store.put(key, value)


def _stubs(broker: BrokerProcess) -> contextlib.AbstractAsyncContextManager[Stubs]:
    return broker_stubs(broker.address)


class RawProducer:
    """A producer on raw stubs: one ``SendBatch`` per call, the answers kept."""

    def __init__(self, stubs: Stubs, producer_id: int) -> None:
        self.stubs = stubs
        self.id = producer_id
        self.answers: list[Any] = []

    @classmethod
    async def create(cls, stubs: Stubs, topic: str) -> RawProducer:
        created = await _call(stubs, lambda s: s.producer.CreateProducer(
            pb.CreateProducerRequest(topic=topic, producer_name="p"), timeout=T))
        return cls(stubs, created.producer_id)

    async def send(self, *payloads: bytes) -> Any:
        builder = BatchBuilder(1)
        for payload in payloads:
            builder.append(payload, timestamp_us=1)
        batch = builder.build(producer_id=self.id, producer_name="p")
        answer = await _call(self.stubs, lambda s: s.producer.SendBatch(
            pb.SendBatchRequest(producer_id=self.id, batch=batch), timeout=T))
        self.answers.append(answer)
        return answer

    async def send_messages(self, count: int, *, per_batch: int = 1) -> None:
        for start in range(0, count, per_batch):
            await self.send(*(b"m%d" % i for i in range(start, min(count, start + per_batch))))


class RawConsumer:
    """A consumer on raw stubs reading its stream into a list (it never needs to ack: the
    window is larger than every test's message count)."""

    def __init__(self, stubs: Stubs, consumer_id: int) -> None:
        self.offsets: list[int] = []
        self.first_at: float | None = None
        self._call = stubs.consumer.Receive(pb.ReceiveRequest(consumer_id=consumer_id))
        self._task = asyncio.create_task(self._run())

    @classmethod
    async def subscribe(cls, stubs: Stubs, topic: str, subscription: str) -> RawConsumer:
        response = await _call(stubs, lambda s: s.consumer.Subscribe(pb.SubscribeRequest(
            topic=topic, subscription=subscription, consumer_name=subscription, subscription_type=pb.EXCLUSIVE,
            initial_position=pb.EARLIEST, receiver_queue_size=10_000,
        ), timeout=T))
        return cls(stubs, response.consumer_id)

    async def _run(self) -> None:
        with contextlib.suppress(Exception):
            async for deliveries in self._call:
                for d in deliveries.batches:
                    if self.first_at is None:
                        self.first_at = time.monotonic()
                    skip = set(d.acked_offsets)
                    last = parse_header(d.batch).last_offset
                    self.offsets.extend(o for o in range(d.first_offset, last + 1) if o not in skip)

    async def close(self) -> None:
        self._call.cancel()
        with contextlib.suppress(BaseException):
            await self._task


async def _describe(stubs: Stubs, topic: str) -> Any:
    return await _call(stubs, lambda s: s.admin.DescribeTopic(pb.DescribeTopicRequest(topic=topic), timeout=T))


async def _dispatch_throttled_ms(stubs: Stubs, topic: str, subscription: str) -> int:
    for state in (await _describe(stubs, topic)).subscriptions:
        if state.name == subscription:
            return int(state.dispatch_throttled_ms)
    raise AssertionError(f"no subscription {subscription}")


# ------------------------------------------------------------------ max_publish_rate


@pytest.mark.integration
@pytest.mark.asyncio
async def test_publish_rate_at_the_limit_waits_not_and_one_past_is_slowed_not_failed(
    start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str]
) -> None:
    await _put(etcd_endpoints, keys.namespace_policy("rates"), {"max_publish_rate": 10})
    broker = start_broker()
    async with _stubs(broker) as stubs:
        producer = await RawProducer.create(stubs, "/rates/at-limit")
        at_limit = await producer.send(*(b"x" for _ in range(10)))  # one second's worth: a full bucket
        assert at_limit.throttled_ms == 0 and (at_limit.first_offset, at_limit.last_offset) == (0, 9)
        assert (await _describe(stubs, "/rates/at-limit")).publish_throttled_ms == 0

        past = await producer.send(b"one more")  # the bucket is empty: it waits ~1/10 s
        assert not past.HasField("error") and past.first_offset == 10
        assert past.throttled_ms >= 50
        assert (await _describe(stubs, "/rates/at-limit")).publish_throttled_ms >= 50


@pytest.mark.integration
@pytest.mark.asyncio
async def test_publish_rate_paces_producers_on_send_batch_and_send_stream(
    start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str]
) -> None:
    rate, count = 20, 60  # one second in the bucket, then 40 messages at 20/s: >= 2 s
    await _put(etcd_endpoints, keys.namespace_policy("rates"), {"max_publish_rate": rate})
    broker = start_broker()
    async with _stubs(broker) as stubs:
        producer = await RawProducer.create(stubs, "/rates/batches")
        started = time.monotonic()
        await producer.send_messages(count)
        assert time.monotonic() - started >= (count - rate) / rate * 0.95
        assert [a.first_offset for a in producer.answers] == list(range(count))
        assert sum(a.throttled_ms for a in producer.answers) > 0

    async with DanubeClient([broker.address]) as client:  # the client library streams (SendStream)
        async with client.producer("/rates/stream", producer_name="p") as streamed:
            started = time.monotonic()
            offsets = await asyncio.gather(*(streamed.send_nowait(b"s%d" % i) for i in range(count)))
            assert time.monotonic() - started >= (count - rate) / rate * 0.95
        assert sorted(offsets) == list(range(count))
        assert (await client.admin.describe_topic("/rates/stream")).publish_throttled_ms > 0


@pytest.mark.integration
@pytest.mark.asyncio
async def test_publish_rate_changed_live_applies_within_a_second(
    start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str]
) -> None:
    topic = "/default/live-publish"
    policy_key = keys.topic_policy(TopicName.parse(topic))
    await _put(etcd_endpoints, policy_key, {"max_publish_rate": 2})  # the topic's override
    broker = start_broker()
    async with _stubs(broker) as stubs:
        producer = await RawProducer.create(stubs, topic)
        sending = asyncio.create_task(producer.send_messages(40))  # ~19 s at 2 msg/s
        try:
            await eventually(lambda: any(a.throttled_ms for a in producer.answers), what="throttled at 2 msg/s")
            await _put(etcd_endpoints, policy_key, {"max_publish_rate": 0})  # 0 lifts the limit
            lifted = time.monotonic()
            await asyncio.wait_for(sending, timeout=5.0)
            assert time.monotonic() - lifted < 5.0 and len(producer.answers) == 40
        finally:
            sending.cancel()

        # limited again, live: a burst of single messages gets slowed within about a second
        await _put(etcd_endpoints, policy_key, {"max_publish_rate": 5})
        before = len(producer.answers)

        async def slowed() -> bool:
            await producer.send(b"probe")
            return any(a.throttled_ms for a in producer.answers[before:])

        await eventually(slowed, timeout_s=10.0, interval_s=0.0, what="throttled again at 5 msg/s")


# ------------------------------------------------------------------ max_subscription_dispatch_rate


@pytest.mark.integration
@pytest.mark.asyncio
async def test_dispatch_rate_at_the_limit_waits_not_and_one_past_is_slowed(
    start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str]
) -> None:
    await _put(etcd_endpoints, keys.namespace_policy("rates"), {"max_subscription_dispatch_rate": 10})
    broker = start_broker()
    async with _stubs(broker) as stubs:
        at_limit = await RawProducer.create(stubs, "/rates/ten")
        await at_limit.send(*(b"x" for _ in range(10)))
        past = await RawProducer.create(stubs, "/rates/eleven")
        await past.send(*(b"x" for _ in range(10)))
        await past.send(b"one more")

        a = await RawConsumer.subscribe(stubs, "/rates/ten", "s")
        b = await RawConsumer.subscribe(stubs, "/rates/eleven", "s")
        try:
            await eventually(lambda: len(a.offsets) == 10 and len(b.offsets) == 11, what="everything delivered")
            assert a.offsets == list(range(10)) and b.offsets == list(range(11))
            assert await _dispatch_throttled_ms(stubs, "/rates/ten", "s") == 0
            assert await _dispatch_throttled_ms(stubs, "/rates/eleven", "s") >= 50
        finally:
            await a.close()
            await b.close()


@pytest.mark.integration
@pytest.mark.asyncio
async def test_dispatch_rate_paces_a_subscription(
    start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str]
) -> None:
    rate, count = 20, 60
    await _put(etcd_endpoints, keys.namespace_policy("rates"), {"max_subscription_dispatch_rate": rate})
    broker = start_broker()
    async with _stubs(broker) as stubs:
        producer = await RawProducer.create(stubs, "/rates/paced")
        await producer.send_messages(count)  # publishing is not limited
        consumer = await RawConsumer.subscribe(stubs, "/rates/paced", "s")
        try:
            await eventually(lambda: len(consumer.offsets) == count, timeout_s=30.0, what="all delivered")
            assert consumer.first_at is not None
            assert time.monotonic() - consumer.first_at >= (count - rate) / rate * 0.95
            assert consumer.offsets == list(range(count))
            assert await _dispatch_throttled_ms(stubs, "/rates/paced", "s") > 0
        finally:
            await consumer.close()


@pytest.mark.integration
@pytest.mark.asyncio
async def test_dispatch_rate_changed_live_applies_within_a_second(
    start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str]
) -> None:
    topic = "/default/live-dispatch"
    policy_key = keys.topic_policy(TopicName.parse(topic))
    # the first override is in etcd before the broker starts: its cache holds it from the start
    await _put(etcd_endpoints, policy_key, {"max_subscription_dispatch_rate": 1})
    broker = start_broker()
    async with _stubs(broker) as stubs:
        producer = await RawProducer.create(stubs, topic)
        await producer.send_messages(30)
        consumer = await RawConsumer.subscribe(stubs, topic, "s")
        try:
            await eventually(lambda: len(consumer.offsets) >= 1, what="the first message")
            await asyncio.sleep(1.0)  # time passes at the limited rate (not a propagation wait)
            assert len(consumer.offsets) < 10  # ~1 msg/s, the bucket holds one
            await _put(etcd_endpoints, policy_key, {"max_subscription_dispatch_rate": 0})
            # at 1 msg/s the rest would take ~25 s
            await eventually(lambda: len(consumer.offsets) == 30, timeout_s=5.0, what="the rest, unlimited")
            assert consumer.offsets == list(range(30))
        finally:
            await consumer.close()


# ------------------------------------------------------------------ max_message_size


@pytest.mark.integration
@pytest.mark.asyncio
async def test_max_message_size_of_the_topic_override_at_the_limit_and_one_past(
    start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str]
) -> None:
    topic = "/default/sized"
    policy_key = keys.topic_policy(TopicName.parse(topic))
    await _put(etcd_endpoints, policy_key, {"max_message_size": 100})  # the namespace allows 10 MiB
    broker = start_broker()
    async with _stubs(broker) as stubs:
        producer = await RawProducer.create(stubs, topic)
        taken = await producer.send(b"a" * 100)
        assert taken.first_offset == 0
        with pytest.raises(MessageTooLargeError) as refused:
            await producer.send(b"b" * 101)
        assert (refused.value.size_bytes, refused.value.max_message_size_bytes) == (101, 100)
        with pytest.raises(MessageTooLargeError):  # a batch holding one is refused whole
            await producer.send(b"c", b"d" * 101)
        assert (await _describe(stubs, topic)).next_offset == 1  # nothing of the refused was written

        await _put(etcd_endpoints, policy_key, {"max_message_size": 101})  # raised live

        async def accepted() -> bool:
            try:
                await producer.send(b"e" * 101)
            except MessageTooLargeError:
                return False
            return True

        await eventually(accepted, timeout_s=5.0, what="the raised limit applies")
        assert (await _describe(stubs, topic)).next_offset == 2
