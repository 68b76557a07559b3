"""The dead-letter topic, against real broker processes.

* After ``max_redeliveries`` redeliveries, the next failed delivery publishes the message to
  ``{topic}-{subscription}-DLQ`` with its key, payload and attributes plus the origin
  attributes (``broker/dispatch/dead_letter_topic.py``), then acknowledges it on its topic.
* Crash safety: a broker SIGKILLed right after the dead-letter publish and before the ack
  (fault point ``dead_letter.after_publish``, :mod:`danube_pipeline.faults`) redelivers the message after its
  restart; when it runs out of redeliveries again, the publish is recognised as written
  (idempotent produce) and only the ack happens: the dead-letter topic holds it once, and it is
  acknowledged once.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

from danube_pipeline import faults
from danube_pipeline.client import DanubeClient, InitialPosition, Message, SubscriptionType
from danube_pipeline.client.consumer import Consumer
from danube_pipeline.errors import BrokerUnavailableError

from broker.dispatch.dead_letter_topic import (
    ATTR_OFFSET,
    ATTR_REASON,
    ATTR_REDELIVERY_COUNT,
    ATTR_SUBSCRIPTION,
    ATTR_TOPIC,
)
from helpers import eventually

TOPIC = "/default/orders"
DLQ = "/default/orders-billing-DLQ"


async def _produce(client: DanubeClient, count: int) -> None:
    async with client.producer(TOPIC, producer_name="p", max_batch_messages=count) as producer:
        for i in range(count):
            producer.send_nowait(f"order-{i}".encode(), key=f"k{i}", attributes={"i": str(i)})
        await producer.flush()


async def _dead_letters(client: DanubeClient, expected: int) -> list[Message]:
    """Every message of the dead-letter topic, checking that no more than ``expected`` arrive."""
    out: list[Message] = []
    async with client.consumer(DLQ, subscription="inspect", initial_position=InitialPosition.EARLIEST) as consumer:
        for _ in range(expected):
            out.append(await consumer.receive(timeout_ms=20_000))
        with pytest.raises(TimeoutError):
            await consumer.receive(timeout_ms=1_500)
    return out


def _check_dead_letter(message: Message, *, offset: int, reason: str, failures: int) -> None:
    assert message.payload == f"order-{offset}".encode() and message.key == f"k{offset}"
    assert dict(message.attributes) == {
        "i": str(offset),
        ATTR_TOPIC: TOPIC,
        ATTR_OFFSET: str(offset),
        ATTR_SUBSCRIPTION: "billing",
        ATTR_REASON: reason,
        ATTR_REDELIVERY_COUNT: str(failures),
    }


@pytest.mark.integration
@pytest.mark.asyncio
async def test_message_goes_to_the_dead_letter_topic_after_max_redeliveries(start_broker: Any) -> None:
    broker = start_broker()
    async with DanubeClient([broker.address]) as client:
        await _produce(client, 3)
        async with client.consumer(
            TOPIC, subscription="billing", subscription_type=SubscriptionType.SHARED,
            initial_position=InitialPosition.EARLIEST, nack_redelivery_delay_ms=50, max_redeliveries=2,
        ) as consumer:
            counts = []
            for _ in range(5):  # offsets 0 and 2 once, offset 1 three times
                message = await consumer.receive(timeout_ms=10_000)
                if message.offset == 1:
                    counts.append(message.redelivery_count)
                    await consumer.nack(message, reason="boom")
                else:
                    await consumer.ack(message)
            assert counts == [0, 1, 2]
            with pytest.raises(TimeoutError):  # past max_redeliveries: never delivered again
                await consumer.receive(timeout_ms=1_500)
        (dead,) = await _dead_letters(client, 1)
        _check_dead_letter(dead, offset=1, reason="nack: boom", failures=3)
        description = await client.admin.describe_topic(TOPIC)
        assert description.subscriptions[0].cursor == 2, "the dead-lettered message is acknowledged"


async def _fail_offset_1(consumer: Consumer, *, until_idle_ms: int) -> list[int]:
    """Ack offset 0, nack offset 1 whenever they come, until nothing comes for ``until_idle_ms``;
    returns the redelivery counts offset 1 arrived with."""
    counts: list[int] = []
    while True:
        try:
            message = await consumer.receive(timeout_ms=until_idle_ms)
        except (TimeoutError, BrokerUnavailableError):  # idle, or the broker is gone
            return counts
        if message.offset == 1:
            counts.append(message.redelivery_count)
            with contextlib.suppress(BrokerUnavailableError):  # the nack that kills the broker
                await consumer.nack(message, reason="bad order")
        else:
            await consumer.ack(message)


@pytest.mark.integration
@pytest.mark.asyncio
async def test_dead_letter_is_published_once_across_a_sigkill_between_its_steps(
    start_broker: Any, tmp_path: Path
) -> None:
    data_dir = tmp_path / "dlq-broker"
    broker = start_broker(data_dir=data_dir, env=faults.environment({faults.DEAD_LETTER_AFTER_PUBLISH: faults.SIGKILL}))
    options: dict[str, Any] = {
        "subscription": "billing", "subscription_type": SubscriptionType.SHARED,
        "initial_position": InitialPosition.EARLIEST,
    }
    client = DanubeClient([broker.address], request_timeout_ms=3_000, metadata_retries=1)
    await client.__aenter__()
    try:
        await _produce(client, 2)
        consumer = await client.consumer(TOPIC, nack_redelivery_delay_ms=50, max_redeliveries=1, **options).open()
        counts = await _fail_offset_1(consumer, until_idle_ms=3_000)
        assert counts == [0, 1]
        await eventually(lambda: broker.exited, timeout_s=20, what="the broker killed itself after the DLQ publish")
        assert broker._proc is not None and broker._proc.returncode == -9  # SIGKILL
    finally:
        with contextlib.suppress(Exception):
            await client.close()

    broker = start_broker(data_dir=data_dir)  # no fault injection this time
    async with DanubeClient([broker.address]) as client:
        # No settings given: the subscription's stored ones apply (docs/etcd-layout.md §3.4).
        async with client.consumer(TOPIC, **options) as consumer:
            counts = await _fail_offset_1(consumer, until_idle_ms=3_000)
        # Redelivery counts start again at 0 after a restart; the second publish was a duplicate.
        assert counts == [0, 1]
        (dead,) = await _dead_letters(client, 1)
        _check_dead_letter(dead, offset=1, reason="nack: bad order", failures=2)
        description = await client.admin.describe_topic(TOPIC)
        assert description.subscriptions[0].cursor == 1, "acknowledged on its topic"
        assert (await client.admin.describe_topic(DLQ)).next_offset == 1, "written once"
