"""Checked acks and the count limits of the topic policy, against a real broker.

* A consumer acknowledges only offsets sent to it and not acknowledged yet; any other ack is
  refused whole with :class:`InvalidAckError` (unknown consumer ids: ``ConsumerNotFoundError``)
  and changes nothing: the cursor stays, the message is still redelivered.
* ``max_producers_per_topic``, ``max_subscriptions_per_topic``, ``max_consumers_per_topic`` and
  ``max_consumers_per_subscription`` (``docs/etcd-layout.md`` §2.1) and the topic's override
  ``/topics/{ns}/{topic}/policy`` (§3.8): at the limit, one more is refused with
  :class:`PolicyLimitError`; a policy written live applies through the broker's etcd watch.
* The subscription cursor is stored every 1,000 acks, every 5 s, and when a consumer closes
  (§3.5).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pytest
import pytest_asyncio
from helpers import eventually

from danube_pipeline.format.batches import BatchBuilder, parse_header
from danube_pipeline.client import DanubeClient, InitialPosition, SubscriptionType
from danube_pipeline.client._connection import ConnectionPool, Stubs
from danube_pipeline.client.status import rpc_errors
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.error_codec import RemoteError
from danube_pipeline.errors import (
    ConsumerNotFoundError,
    DanubeError,
    InvalidAckError,
    PolicyLimitError,
)
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb

E = TypeVar("E", bound=DanubeError)
T = 30.0  # request timeout, s


async def _call(stubs: Stubs, call: Callable[[Stubs], Awaitable[Any]]) -> Any:
    with rpc_errors(stubs.address):
        return await call(stubs)


async def _raises(cls: type[E], action: Awaitable[object]) -> E:
    with pytest.raises(cls) as info:
        await action
    assert isinstance(info.value, RemoteError), type(info.value)
    return info.value


@pytest_asyncio.fixture
async def stubs(start_broker: Callable[..., BrokerProcess]) -> AsyncIterator[Stubs]:
    broker = start_broker()
    pool = ConnectionPool()
    try:
        yield pool.stubs(broker.address)
    finally:
        await pool.close()


async def _produce(stubs: Stubs, topic: str, count: int, *, per_batch: int = 1) -> None:
    """``count`` messages in batches of ``per_batch`` records (one producer, closed after)."""
    created = await _call(stubs, lambda s: s.producer.CreateProducer(
        pb.CreateProducerRequest(topic=topic, producer_name="p"), timeout=T))
    sent = 0
    while sent < count:
        n = min(per_batch, count - sent)
        builder = BatchBuilder(1)
        for i in range(n):
            builder.append(f"m{sent + i}".encode(), timestamp_us=1)
        batch = builder.build(producer_id=created.producer_id, producer_name="p")
        request = pb.SendBatchRequest(producer_id=created.producer_id, batch=batch)
        await _call(stubs, lambda s: s.producer.SendBatch(request, timeout=T))
        sent += n
    await _call(stubs, lambda s: s.producer.CloseProducer(
        pb.CloseProducerRequest(producer_id=created.producer_id), timeout=T))


class RawConsumer:
    """A consumer on raw stubs: its Receive stream collects the offsets delivered to it."""

    def __init__(self, stubs: Stubs, consumer_id: int) -> None:
        self.stubs = stubs
        self.id = consumer_id
        self.offsets: list[int] = []
        self.redelivered: list[int] = []
        self._call = stubs.consumer.Receive(pb.ReceiveRequest(consumer_id=consumer_id))
        self._task = asyncio.create_task(self._run())

    @classmethod
    async def subscribe(
        cls, stubs: Stubs, topic: str, subscription: str, *, shared: bool = True, window: int = 1000
    ) -> RawConsumer:
        response = await _call(stubs, lambda s: s.consumer.Subscribe(pb.SubscribeRequest(
            topic=topic, subscription=subscription, consumer_name=f"{subscription}-c",
            subscription_type=pb.SHARED if shared else pb.EXCLUSIVE, initial_position=pb.EARLIEST,
            receiver_queue_size=window,
        ), timeout=T))
        return cls(stubs, response.consumer_id)

    async def _run(self) -> None:
        with contextlib.suppress(Exception):
            async for deliveries in self._call:
                for d in deliveries.batches:
                    header = parse_header(d.batch)
                    acked = set(d.acked_offsets)
                    got = [o for o in range(d.first_offset, header.last_offset + 1) if o not in acked]
                    self.offsets.extend(got)
                    if d.redelivery_count:
                        self.redelivered.extend(got)

    async def wait_for(self, count: int, timeout_s: float = 10.0) -> list[int]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(self.offsets) < count:
            assert loop.time() < deadline, f"consumer {self.id} got {self.offsets}, wanted {count}"
            await asyncio.sleep(0.02)
        return list(self.offsets)

    async def ack(self, *ranges: tuple[int, int], consumer_id: int | None = None) -> None:
        await _call(self.stubs, lambda s: s.consumer.Ack(pb.AckRequest(
            consumer_id=self.id if consumer_id is None else consumer_id,
            ranges=[pb.OffsetRange(first=f, last=la) for f, la in ranges],
        ), timeout=T))

    async def close(self) -> None:
        await _call(self.stubs, lambda s: s.consumer.CloseConsumer(
            pb.CloseConsumerRequest(consumer_id=self.id), timeout=T))
        self._call.cancel()
        with contextlib.suppress(BaseException):
            await self._task


async def _cursor(stubs: Stubs, topic: str, subscription: str) -> int | None:
    """The subscription's in-memory cursor (``Admin.DescribeTopic``)."""
    described = await _call(stubs, lambda s: s.admin.DescribeTopic(pb.DescribeTopicRequest(topic=topic), timeout=T))
    for sub in described.subscriptions:
        if sub.name == subscription:
            return sub.cursor if sub.HasField("cursor") else None
    raise AssertionError(f"no subscription {subscription}")


# ------------------------------------------------------------------ checked acks


@pytest.mark.integration
@pytest.mark.asyncio
async def test_stray_acks_are_refused_and_change_nothing(stubs: Stubs) -> None:
    topic = "/default/acks"
    await _produce(stubs, topic, 4)  # offsets 0..3, one batch each
    a = await RawConsumer.subscribe(stubs, topic, "s", window=2)
    await a.wait_for(2)
    b = await RawConsumer.subscribe(stubs, topic, "s", window=2)
    await b.wait_for(2)
    assert sorted(a.offsets + b.offsets) == [0, 1, 2, 3]
    mine, theirs = a.offsets[0], b.offsets[0]

    never = await _raises(InvalidAckError, a.ack((100, 101)))
    assert (never.consumer_id, never.first_offset, never.last_offset) == (a.id, 100, 101)
    assert "never delivered" in never.reason

    other = await _raises(InvalidAckError, a.ack((theirs, theirs)))
    assert (other.first_offset, other.last_offset) == (theirs, theirs)
    assert "another consumer" in other.reason

    # one bad offset refuses the whole request: the good one is not acknowledged either
    mixed = await _raises(InvalidAckError, a.ack((mine, mine), (theirs, theirs)))
    assert mixed.first_offset == theirs
    assert await _cursor(stubs, topic, "s") is None
    await a.ack((mine, mine))  # still a's to acknowledge

    again = await _raises(InvalidAckError, a.ack((mine, mine)))
    assert "already acknowledged" in again.reason

    twice = await _raises(InvalidAckError, a.ack((a.offsets[1], a.offsets[1]), (a.offsets[1], a.offsets[1])))
    assert "twice" in twice.reason

    unknown = await _raises(ConsumerNotFoundError, a.ack((mine, mine), consumer_id=987654321))
    assert unknown.consumer_id == 987654321

    # b leaves: its offsets go back for redelivery, and its late acks are refused
    await b.close()
    closed = await _raises(InvalidAckError, b.ack((theirs, theirs)))
    assert closed.consumer_id == b.id and "closed" in closed.reason
    await a.ack((a.offsets[1], a.offsets[1]))  # room in a's window: b's offsets come to a
    got = await a.wait_for(4)
    assert sorted(got) == [0, 1, 2, 3] and sorted(a.redelivered) == sorted(b.offsets)
    # a late ack by b of an offset now redelivered to a is still refused
    await _raises(InvalidAckError, b.ack((theirs, theirs)))
    for offset in b.offsets:
        await a.ack((offset, offset))
    assert await _cursor(stubs, topic, "s") == 3
    await a.close()


@pytest.mark.integration
@pytest.mark.asyncio
async def test_client_acks_are_never_refused_across_close_and_redelivery(
    start_broker: Callable[..., BrokerProcess],
) -> None:
    """Normal use through the client: acks flushed on close, acks of redelivered messages."""
    broker = start_broker()
    topic = "/default/client-acks"
    async with DanubeClient([broker.address]) as client:
        async with client.producer(topic, producer_name="p") as producer:
            for i in range(20):
                await producer.send(f"m{i}".encode())
        # acks buffered (flushed only on close): the close flushes them before ending the stream
        consumer = client.consumer(
            topic, subscription="s", subscription_type=SubscriptionType.SHARED,
            initial_position=InitialPosition.EARLIEST, ack_batch_size=10_000, ack_flush_ms=60_000,
        )
        await consumer.open()
        for _ in range(10):
            await consumer.ack(await consumer.receive(timeout_ms=10_000))
        await consumer.close()  # raises if the broker refused the buffered acks

        async with client.consumer(
            topic, subscription="s", subscription_type=SubscriptionType.SHARED,
            initial_position=InitialPosition.EARLIEST,
        ) as consumer:
            offsets = []
            for _ in range(10):
                message = await consumer.receive(timeout_ms=10_000)
                offsets.append(message.offset)
                await consumer.ack(message)
        assert sorted(offsets) == list(range(10, 20))


# ------------------------------------------------------------------ policy limits


async def _put(etcd_endpoints: list[str], key: str, value: Any) -> None:
    async with await MetadataStore.connect(etcd_endpoints) as store:
        await store.put(key, value)


async def _eventually(call: Callable[[], Awaitable[object]], cls: type[E], timeout_s: float = 1.0) -> E:
    """``call`` raises ``cls`` within ``timeout_s`` (a policy reaching the broker's cache)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            await call()
        except cls as exc:
            return exc
        assert loop.time() < deadline, f"no {cls.__name__} within {timeout_s} s"
        await asyncio.sleep(0.05)


async def _until_refused(attempt: Callable[[int], Awaitable[object]], *, what: str) -> None:
    """Call ``attempt(0)``, ``attempt(1)``, ... until one raises :class:`PolicyLimitError`: a
    policy written to etcd has reached the broker's cache (a watch event away).

    Raises:
        AssertionError: still not refused after 10 s.
    """
    attempts = itertools.count()

    async def refused() -> bool:
        try:
            await attempt(next(attempts))
        except PolicyLimitError:
            return True
        return False

    await eventually(refused, timeout_s=10.0, interval_s=0.05, what=what)


async def _producer(stubs: Stubs, topic: str, name: str) -> int:
    created = await _call(stubs, lambda s: s.producer.CreateProducer(
        pb.CreateProducerRequest(topic=topic, producer_name=name), timeout=T))
    return int(created.producer_id)


async def _probe_producer(stubs: Stubs, topic: str, name: str) -> None:
    """Create a producer and close it at once: a probe of a limit that leaves no producer
    behind while the limit has not reached the broker yet."""
    producer_id = await _producer(stubs, topic, name)
    await _call(stubs, lambda s: s.producer.CloseProducer(pb.CloseProducerRequest(producer_id=producer_id), timeout=T))


@pytest.mark.integration
@pytest.mark.asyncio
async def test_count_limits_at_the_limit_and_one_past(stubs: Stubs, etcd_endpoints: list[str]) -> None:
    await _put(etcd_endpoints, keys.namespace_policy("limits"), {
        "max_producers_per_topic": 2, "max_subscriptions_per_topic": 2,
        "max_consumers_per_topic": 3, "max_consumers_per_subscription": 2,
    })
    topic = "/limits/t"
    # the policy reaches the broker's cache: a third producer on another topic is refused
    probe = "/limits/probe"
    for i in range(2):
        await _producer(stubs, probe, f"probe-{i}")

    async def third_producer(attempt: int) -> None:
        producer_id = await _producer(stubs, probe, f"probe-extra-{attempt}")
        await _call(stubs, lambda s: s.producer.CloseProducer(pb.CloseProducerRequest(producer_id=producer_id), timeout=T))

    await _until_refused(third_producer, what="max_producers_per_topic reaches the broker's cache")
    p1 = await _producer(stubs, topic, "p1")
    await _producer(stubs, topic, "p2")  # at the limit
    err = await _raises(PolicyLimitError, _producer(stubs, topic, "p3"))
    assert (err.topic, err.policy, err.limit) == (topic, "max_producers_per_topic", 2)
    await _call(stubs, lambda s: s.producer.CloseProducer(pb.CloseProducerRequest(producer_id=p1), timeout=T))
    await _producer(stubs, topic, "p3")  # a closed producer frees its place

    c1 = await RawConsumer.subscribe(stubs, topic, "s1")
    await RawConsumer.subscribe(stubs, topic, "s1")  # 2 on s1: at the per-subscription limit
    err = await _raises(PolicyLimitError, RawConsumer.subscribe(stubs, topic, "s1"))
    assert (err.policy, err.limit) == ("max_consumers_per_subscription", 2)
    await RawConsumer.subscribe(stubs, topic, "s2")  # 3 consumers, 2 subscriptions: both at the limit
    err = await _raises(PolicyLimitError, RawConsumer.subscribe(stubs, topic, "s3"))
    assert err.policy in ("max_subscriptions_per_topic", "max_consumers_per_topic")
    err = await _raises(PolicyLimitError, RawConsumer.subscribe(stubs, topic, "s2"))
    assert (err.policy, err.limit) == ("max_consumers_per_topic", 3)
    await c1.close()
    await RawConsumer.subscribe(stubs, topic, "s2")  # a closed consumer frees its place
    # a third subscription stays refused even without consumers on the first two
    err = await _raises(PolicyLimitError, RawConsumer.subscribe(stubs, topic, "s3"))
    assert err.policy in ("max_subscriptions_per_topic", "max_consumers_per_topic")


@pytest.mark.integration
@pytest.mark.asyncio
async def test_subscription_limit_alone(stubs: Stubs, etcd_endpoints: list[str]) -> None:
    await _put(etcd_endpoints, keys.namespace_policy("subs"), {"max_subscriptions_per_topic": 1})
    topic = "/subs/t"
    await _call(stubs, lambda s: s.admin.CreateTopic(pb.CreateTopicRequest(topic=topic), timeout=T))
    # the policy reaches the broker's cache: a second subscription on another topic is refused
    probe = "/subs/probe"
    await _call(stubs, lambda s: s.admin.CreateTopic(pb.CreateTopicRequest(topic=probe), timeout=T))
    await (await RawConsumer.subscribe(stubs, probe, "probe-0")).close()

    async def second_subscription(attempt: int) -> None:
        await (await RawConsumer.subscribe(stubs, probe, f"probe-{attempt + 1}")).close()

    await _until_refused(second_subscription, what="max_subscriptions_per_topic reaches the broker's cache")
    c = await RawConsumer.subscribe(stubs, topic, "only")
    err = await _raises(PolicyLimitError, RawConsumer.subscribe(stubs, topic, "second"))
    assert (err.topic, err.policy, err.limit) == (topic, "max_subscriptions_per_topic", 1)
    await c.close()
    # the stored subscription still counts after its consumer left
    await _raises(PolicyLimitError, RawConsumer.subscribe(stubs, topic, "second"))
    await RawConsumer.subscribe(stubs, topic, "only")


LIVE_POLICY_TIMEOUT_S = 10.0
"""How long a policy written while the broker runs may take to apply: its etcd watch usually
delivers it within milliseconds; the margin is for a machine running other tests beside this
one (``make test``'s two workers). A restart is not needed either way."""


@pytest.mark.integration
@pytest.mark.asyncio
async def test_policy_changed_live_and_topic_override(stubs: Stubs, etcd_endpoints: list[str]) -> None:
    topic = "/live/t"
    await _producer(stubs, topic, "p1")
    await _producer(stubs, topic, "p2")
    # a namespace limit written with the broker running applies through the watch
    await _put(etcd_endpoints, keys.namespace_policy("live"), {"max_producers_per_topic": 2})
    # (a probe the policy has not reached yet is closed again: it must not count later)
    err = await _eventually(lambda: _probe_producer(stubs, topic, "p3"), PolicyLimitError,
                            timeout_s=LIVE_POLICY_TIMEOUT_S)
    assert err.limit == 2
    # the topic's override wins over the namespace policy (fields present only)
    await _put(etcd_endpoints, keys.topic_policy(TopicName.parse(topic)), {"max_producers_per_topic": 3})
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LIVE_POLICY_TIMEOUT_S
    while True:
        try:
            await _producer(stubs, topic, "p3")
            break
        except PolicyLimitError:
            assert loop.time() < deadline, f"the topic override did not apply within {LIVE_POLICY_TIMEOUT_S} s"
            await asyncio.sleep(0.05)
    err = await _raises(PolicyLimitError, _producer(stubs, topic, "p4"))
    assert err.limit == 3
    # another topic of the namespace keeps the namespace's limit
    other = "/live/other"
    await _producer(stubs, other, "p1")
    await _producer(stubs, other, "p2")
    await _raises(PolicyLimitError, _producer(stubs, other, "p3"))
    # removing the limit (0 = unlimited) applies live too
    await _put(etcd_endpoints, keys.topic_policy(TopicName.parse(topic)), {"max_producers_per_topic": 0})
    deadline = loop.time() + LIVE_POLICY_TIMEOUT_S
    while True:
        try:
            await _producer(stubs, topic, "p4")
            break
        except PolicyLimitError:
            assert loop.time() < deadline, f"the unlimited override did not apply within {LIVE_POLICY_TIMEOUT_S} s"
            await asyncio.sleep(0.05)


# ------------------------------------------------------------------ cursor triggers


async def _stored_cursor(store: MetadataStore, topic: str, subscription: str) -> int | None:
    kv = await store.get(keys.subscription_cursor(TopicName.parse(topic), subscription))
    return None if kv is None else kv.value  # type: ignore[return-value]


async def _wait_stored(store: MetadataStore, topic: str, sub: str, want: int, timeout_s: float) -> float:
    """Seconds until the stored cursor is ``want``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while await _stored_cursor(store, topic, sub) != want:
        assert loop.time() - start < timeout_s, f"cursor {await _stored_cursor(store, topic, sub)}, wanted {want}"
        await asyncio.sleep(0.02)
    return loop.time() - start


@pytest.mark.integration
@pytest.mark.asyncio
async def test_cursor_stored_every_1000_acks_every_5_s_and_on_close(stubs: Stubs, etcd_endpoints: list[str]) -> None:
    topic = "/default/cursor"
    await _produce(stubs, topic, 2100, per_batch=100)
    c = await RawConsumer.subscribe(stubs, topic, "s", shared=False, window=5000)
    await c.wait_for(2100)
    async with await MetadataStore.connect(etcd_endpoints) as store:
        # every 5 s: a few acks are stored by the periodic flush, not at once. Offset 0 first,
        # to start right after a periodic flush
        await c.ack((0, 0))
        await _wait_stored(store, topic, "s", 0, timeout_s=6.0)
        await c.ack((1, 9))
        assert await _wait_stored(store, topic, "s", 9, timeout_s=6.0) > 3.0
        # every 1,000 acks: stored at once, long before the next periodic flush (~5 s away)
        await c.ack((10, 1009))
        assert await _wait_stored(store, topic, "s", 1009, timeout_s=5.0) < 1.5
        # on close: CloseConsumer stores the cursor before it returns
        await c.ack((1010, 1019))
        await c.close()
        assert await _stored_cursor(store, topic, "s") == 1019


@pytest.mark.unit
def test_topic_override_replaces_only_the_fields_present() -> None:
    from danube_pipeline.metadata.values import JsonValue, NamespacePolicy

    namespace = NamespacePolicy(max_producers_per_topic=2, max_consumers_per_topic=5)
    topic = namespace.overridden({"max_producers_per_topic": 0, "retentionTimeInMinutes": 7, "unknown": 1})
    assert (topic.max_producers_per_topic, topic.max_consumers_per_topic) == (0, 5)
    assert topic.retention_time_minutes == 7 and topic.max_message_size == namespace.max_message_size
    bad_overrides: list[JsonValue] = [
        {"max_producers_per_topic": -1}, {"max_consumers_per_topic": "3"}, {"max_producers_per_topic": True}, []
    ]
    for bad in bad_overrides:
        with pytest.raises(ValueError):
            namespace.overridden(bad)
