"""Negative acks and ack timeouts, against a real broker.

* ``consumer.nack(msg)``: only that message comes back (not the rest of its batch), after the
  subscription's ``nack_redelivery_delay_ms``, doubled for each earlier redelivery, with its
  ``redelivery_count`` one higher each time.
* ``ack_timeout_ms``: a message left unacknowledged comes back with ``redelivery_count`` 1.
* A nack of a message that is not the consumer's (acknowledged, or nacked already) is refused
  with :class:`InvalidAckError` and changes nothing.
* The settings are stored in the subscription's etcd value (``docs/etcd-layout.md`` §3.4).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from danube_pipeline.client import DanubeClient, InitialPosition, SubscriptionType
from danube_pipeline.errors import InvalidAckError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName

TOPIC = "/default/redelivery"


async def _produce(client: DanubeClient, count: int) -> None:
    async with client.producer(TOPIC, producer_name="p", max_batch_messages=count) as producer:
        for i in range(count):
            producer.send_nowait(f"m{i}".encode())
        await producer.flush()


@pytest.mark.integration
@pytest.mark.asyncio
async def test_nack_redelivers_one_message_with_backoff_and_counts(start_broker: Any, etcd_endpoints: list[str]) -> None:
    broker = start_broker()
    async with DanubeClient([broker.address]) as client:
        await _produce(client, 5)  # one batch
        async with client.consumer(
            TOPIC, subscription="s", subscription_type=SubscriptionType.SHARED,
            initial_position=InitialPosition.EARLIEST, nack_redelivery_delay_ms=300,
            nack_redelivery_max_delay_ms=5_000,
        ) as consumer:
            first = [await consumer.receive(timeout_ms=10_000) for _ in range(5)]
            assert [m.offset for m in first] == [0, 1, 2, 3, 4]
            assert [m.redelivery_count for m in first] == [0] * 5
            for m in first:
                if m.offset != 2:
                    await consumer.ack(m)
            nacked_at = time.monotonic()
            await consumer.nack(first[2], reason="cannot parse")
            with pytest.raises(InvalidAckError):  # nacked already: not this consumer's now
                await consumer.nack(first[2])
            again = await consumer.receive(timeout_ms=10_000)
            waited = time.monotonic() - nacked_at
            assert (again.offset, again.redelivery_count, again.payload) == (2, 1, b"m2")
            assert waited >= 0.3, f"redelivered after {waited:.3f} s, before the nack delay"
            nacked_at = time.monotonic()
            await consumer.nack(again)
            third = await consumer.receive(timeout_ms=10_000)
            waited = time.monotonic() - nacked_at
            assert (third.offset, third.redelivery_count) == (2, 2)
            assert waited >= 0.6, f"second redelivery after {waited:.3f} s: the backoff doubles it"
            await consumer.ack(third)
            with pytest.raises(TimeoutError):  # the other four were acknowledged: never back
                await consumer.receive(timeout_ms=1_000)
            with pytest.raises(InvalidAckError):  # acknowledged: refused
                await consumer.nack(first[0])
        description = await client.admin.describe_topic(TOPIC)
        assert description.subscriptions[0].cursor == 4
    async with await MetadataStore.connect(etcd_endpoints) as store:
        kv = await store.get(keys.topic_subscription(TopicName.parse(TOPIC), "s"))
    assert kv is not None
    stored = kv.value
    assert isinstance(stored, dict)
    assert stored["nack_redelivery_delay_ms"] == 300 and stored["nack_redelivery_max_delay_ms"] == 5_000
    assert "ack_timeout_ms" not in stored  # default settings are not written (Danube's value)


@pytest.mark.integration
@pytest.mark.asyncio
async def test_ack_timeout_redelivers_unacked_messages(start_broker: Any) -> None:
    broker = start_broker()
    async with DanubeClient([broker.address]) as client:
        await _produce(client, 3)
        async with client.consumer(
            TOPIC, subscription="t", initial_position=InitialPosition.EARLIEST, ack_timeout_ms=500,
        ) as consumer:
            got = [await consumer.receive(timeout_ms=10_000) for _ in range(3)]
            sent_at = time.monotonic()
            await consumer.ack(got[0])
            await consumer.ack(got[2])
            back = await consumer.receive(timeout_ms=10_000)
            waited = time.monotonic() - sent_at
            assert (back.offset, back.redelivery_count) == (1, 1)
            assert waited >= 0.4, f"redelivered after {waited:.3f} s, before the ack timeout"
            await consumer.ack(back)
            with pytest.raises(TimeoutError):
                await consumer.receive(timeout_ms=1_500)
        description = await client.admin.describe_topic(TOPIC)
        assert description.subscriptions[0].cursor == 2
