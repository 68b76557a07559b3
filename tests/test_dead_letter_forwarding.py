"""A dead-letter topic owned by another broker than its source topic, against real etcd and
two real broker processes.

The source topic's owner forwards the dead-letter batch to the dead-letter topic's owner over
``ProducerService`` (``broker/dispatch/dead_letter_forwarding.py``): the message lands there once, with
its origin attributes, and is acknowledged on its topic. The same batch forwarded again is
recognised by the owner's idempotent-produce check (producer name plus sequence) and answered
with the offsets it was written at.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from danube_pipeline.client import DanubeClient, InitialPosition, SubscriptionType
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName

from broker.dispatch.dead_letter_forwarding import forward_dead_letter
from broker.dispatch.dead_letter_topic import (
    ATTR_OFFSET,
    ATTR_REASON,
    ATTR_REDELIVERY_COUNT,
    ATTR_SUBSCRIPTION,
    ATTR_TOPIC,
    dead_letter_batch,
    dead_letter_producer_name,
)
from helpers import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

TOPIC = "/default/orders"
DLQ = "/default/orders-billing-DLQ"


async def _owners(meta: MetadataStore, topic: str) -> list[int]:
    """Broker ids with an assignment key ``/cluster/brokers/{id}/{ns}/{topic}`` (§1.5)."""
    name = TopicName.parse(topic)
    kvs, _ = await meta.get_prefix(keys.BROKERS_PREFIX)
    suffix = f"/{name.namespace}/{name.topic}"
    return sorted(int(kv.key[len(keys.BROKERS_PREFIX) :].split("/")[0]) for kv in kvs if kv.key.endswith(suffix))


async def _separate_owners(client: DanubeClient, meta: MetadataStore) -> tuple[int, int]:
    """Unload the dead-letter topic until the leader assigns it to the other broker than the
    source topic's. Returns ``(source owner, dead-letter owner)``."""
    for _attempt in range(8):
        source: list[int] = []
        dlq: list[int] = []

        async def both_assigned() -> bool:
            nonlocal source, dlq
            source, dlq = await _owners(meta, TOPIC), await _owners(meta, DLQ)
            return len(source) == 1 and len(dlq) == 1

        await eventually(both_assigned, timeout_s=15, what="both topics have one owner")
        if source != dlq:
            return source[0], dlq[0]
        await client.admin.unload_topic(DLQ)
        await client.lookup_topic(DLQ)  # an unassigned topic is queued for the leader (§1.5)
    raise AssertionError("the leader kept assigning both topics to one broker")


async def test_a_dead_letter_goes_to_a_topic_owned_by_another_broker_once(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    first = start_broker()
    async with DanubeClient([first.address]) as alone:  # both topics start on the first broker
        await alone.admin.create_topic(TOPIC)
        await alone.admin.create_topic(DLQ)
    brokers = [first, start_broker()]
    async with DanubeClient([b.address for b in brokers]) as client, await MetadataStore.connect(
        etcd_endpoints
    ) as meta:
        assert await _owners(meta, TOPIC) == await _owners(meta, DLQ) == [first.broker_id]
        source_owner, dlq_owner = await _separate_owners(client, meta)
        assert source_owner != dlq_owner

        async with client.producer(TOPIC, producer_name="p", max_batch_messages=2) as producer:
            for i in range(2):
                producer.send_nowait(f"order-{i}".encode(), key=f"k{i}", attributes={"i": str(i)})
            await producer.flush()
        async with client.consumer(
            TOPIC, subscription="billing", subscription_type=SubscriptionType.SHARED,
            initial_position=InitialPosition.EARLIEST, nack_redelivery_delay_ms=50, max_redeliveries=1,
        ) as consumer:
            counts = []
            for _ in range(3):  # offset 0 once, offset 1 twice
                message = await consumer.receive(timeout_ms=10_000)
                if message.offset == 1:
                    counts.append(message.redelivery_count)
                    await consumer.nack(message, reason="bad order")
                else:
                    await consumer.ack(message)
            assert counts == [0, 1]

            async def acknowledged() -> bool:
                description = await client.admin.describe_topic(TOPIC)
                return description.subscriptions[0].cursor == 1

            await eventually(acknowledged, timeout_s=20, what="the dead-lettered offset is acknowledged")
            with pytest.raises(TimeoutError):  # past max_redeliveries: never delivered again
                await consumer.receive(timeout_ms=1_500)

        async with client.consumer(DLQ, subscription="inspect", initial_position=InitialPosition.EARLIEST) as inspect:
            dead = await inspect.receive(timeout_ms=20_000)
            with pytest.raises(TimeoutError):  # exactly once
                await inspect.receive(timeout_ms=1_500)
        assert dead.offset == 0 and dead.payload == b"order-1" and dead.key == "k1"
        assert dead.producer_name == dead_letter_producer_name(TOPIC, "billing", 1)
        assert dict(dead.attributes) == {
            "i": "1",
            ATTR_TOPIC: TOPIC,
            ATTR_OFFSET: "1",
            ATTR_SUBSCRIPTION: "billing",
            ATTR_REASON: "nack: bad order",
            ATTR_REDELIVERY_COUNT: "2",
        }
        # Nothing moved meanwhile: the batch really went from one broker to the other.
        assert (await _owners(meta, TOPIC), await _owners(meta, DLQ)) == ([source_owner], [dlq_owner])

        # A repeat (what a restarted source owner sends) is deduplicated by the DLQ's owner.
        dlq_address = next(b.address for b in brokers if b.broker_id == dlq_owner)
        name = dead_letter_producer_name(TOPIC, "billing", 1)
        again = dead_letter_batch(
            producer_name=name, key="k1", payload=b"order-1", attributes={"i": "1"},
            publish_time_us=dead.publish_time_us, topic=TOPIC, subscription="billing", offset=1,
            reason="nack: bad order", redelivery_count=2,
        )
        assert await forward_dead_letter(dlq_address, DLQ, name, again) == (0, 0)
        assert (await client.admin.describe_topic(DLQ)).next_offset == 1
