"""Dispatch to three consumers for each subscription type, against a real broker.

* Exclusive refuses the second and third consumer; Failover gives everything to the active one;
  Shared spreads messages; Key_Shared sends each key to one consumer, in order.
* Every message is delivered and acknowledged exactly once (nothing is redelivered while no
  consumer leaves, nacks or times out), and the cursor ends at the last offset.
* Key_Shared rebalancing on join keeps per-key order: a key's new consumer gets its messages
  only after the old consumer acknowledged the ones it had (``broker/dispatch/key_shared.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from typing import Any

import pytest

from danube_pipeline.client import DanubeClient, InitialPosition, Message, SubscriptionType
from danube_pipeline.client.consumer import Consumer
from danube_pipeline.errors import SubscriptionBusyError

from broker.dispatch.key_shared import AutoSplitHashRanges, sticky_key_hash
from helpers import eventually, stays

KEYS = [f"key-{i}" for i in range(12)]


async def _produce(client: DanubeClient, topic: str, count: int, start: int = 0) -> None:
    """``count`` messages with keys cycling over :data:`KEYS` (batches of up to 16 mix keys)."""
    async with client.producer(topic, producer_name=f"p{start}", max_batch_messages=16) as producer:
        for i in range(start, start + count):
            producer.send_nowait(f"m{i}".encode(), key=KEYS[i % len(KEYS)])
        await producer.flush()


class _Receiver:
    """Receives on one consumer into a log shared by all (global receive order)."""

    def __init__(self, consumer: Consumer, log: list[tuple[str, Message]], *, ack: bool = True) -> None:
        self.consumer = consumer
        self.log = log
        self.ack = ack
        self.held: list[Message] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for message in self.consumer:
            self.log.append((self.consumer.consumer_name, message))
            if self.ack:
                await self.consumer.ack(message)
            else:
                self.held.append(message)

    async def ack_held(self) -> None:
        self.ack = True
        held, self.held = self.held, []
        for message in held:
            await self.consumer.ack(message)

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@pytest.mark.unit
def test_auto_split_hash_ranges_split_the_largest_and_merge_on_leave() -> None:
    ranges = AutoSplitHashRanges()
    ranges.add(1)
    assert ranges.ranges == [(0, 65535, 1)]
    ranges.add(2)
    assert ranges.ranges == [(0, 32767, 1), (32768, 65535, 2)]
    ranges.add(3)  # the largest range on a tie is the lowest
    assert ranges.ranges == [(0, 16383, 1), (16384, 32767, 3), (32768, 65535, 2)]
    assert ranges.owner(20000) == 3 and ranges.owner(65535) == 2 and ranges.owner(0) == 1
    ranges.remove(3)  # its range goes to the next one up
    assert ranges.ranges == [(0, 16383, 1), (16384, 65535, 2)]
    ranges.remove(2)  # the topmost range goes to the one below
    assert ranges.ranges == [(0, 65535, 1)]
    ranges.remove(1)
    assert ranges.owner(5) is None
    assert sticky_key_hash(None) == sticky_key_hash("") and 0 <= sticky_key_hash("k") < 65536


@pytest.mark.integration
@pytest.mark.asyncio
@pytest.mark.parametrize("subscription_type", list(SubscriptionType), ids=lambda t: t.name)
async def test_three_consumers_each_message_acked_exactly_once(
    start_broker: Any, subscription_type: SubscriptionType
) -> None:
    broker = start_broker()
    topic = f"/default/three-{subscription_type.name.lower()}"
    count = 240
    async with DanubeClient([broker.address]) as client:
        await client.admin.create_topic(topic)
        log: list[tuple[str, Message]] = []
        receivers: list[_Receiver] = []
        refused = 0
        for i in range(3):
            consumer = client.consumer(
                topic, subscription="sub", subscription_type=subscription_type, consumer_name=f"c{i}",
                initial_position=InitialPosition.EARLIEST, receiver_queue_size=40,
            )
            try:
                await consumer.open()
            except SubscriptionBusyError:
                refused += 1
                continue
            receivers.append(_Receiver(consumer, log))
        try:
            # Published once every consumer is attached, so no key moves between consumers.
            await eventually(lambda: all(r.consumer.consumer_id for r in receivers), what="consumers open")
            # Their Receive streams open on the broker (Key_Shared: each stream takes a hash
            # range). No API shows a stream attached (DescribeTopic counts consumers, attached or
            # not), so this one stays a fixed wait.
            await asyncio.sleep(1.0)
            await _produce(client, topic, count)
            await eventually(lambda: len(log) >= count, timeout_s=60, what="every message received")
            await stays(lambda: len(log) == count, for_s=0.5, what="no message received twice")
        finally:
            for receiver in receivers:
                await receiver.stop()
                await receiver.consumer.close()
        offsets = [m.offset for _, m in log]
        assert sorted(offsets) == list(range(count)), "each offset delivered exactly once"
        assert all(m.redelivery_count == 0 for _, m in log)
        by_consumer: dict[str, list[Message]] = defaultdict(list)
        for name, message in log:
            by_consumer[name].append(message)
        if subscription_type is SubscriptionType.EXCLUSIVE:
            assert refused == 2 and list(by_consumer) == ["c0"]
        elif subscription_type is SubscriptionType.FAILOVER:
            assert refused == 0 and list(by_consumer) == ["c0"]
        else:
            assert refused == 0
        if subscription_type is SubscriptionType.KEY_SHARED:
            owners: dict[str | None, set[str]] = defaultdict(set)
            for name, message in log:
                owners[message.key].add(name)
            assert all(len(names) == 1 for names in owners.values()), owners
            assert len(by_consumer) >= 2, "keys are spread over the consumers"
            for messages in by_consumer.values():
                for key in KEYS:
                    mine = [m.offset for m in messages if m.key == key]
                    assert mine == sorted(mine), f"{key} out of order"
        description = await client.admin.describe_topic(topic)
        (sub,) = description.subscriptions
        assert sub.cursor == count - 1, "every offset acknowledged"


@pytest.mark.integration
@pytest.mark.asyncio
async def test_key_shared_join_waits_for_the_old_consumer_to_ack(start_broker: Any) -> None:
    broker = start_broker()
    topic = "/default/key-shared-join"
    async with DanubeClient([broker.address]) as client:
        await _produce(client, topic, 120)
        log: list[tuple[str, Message]] = []
        options: dict[str, Any] = {
            "subscription": "ks", "subscription_type": SubscriptionType.KEY_SHARED,
            "initial_position": InitialPosition.EARLIEST,
        }
        first = await client.consumer(topic, consumer_name="a", **options).open()
        a = _Receiver(first, log, ack=False)  # holds everything it gets, unacknowledged
        receivers = [a]
        try:
            await eventually(lambda: len(log) == 120, timeout_s=30, what="a received every key")
            for name in ("b", "c"):
                receivers.append(_Receiver(await client.consumer(topic, consumer_name=name, **options).open(), log))
            await _produce(client, topic, 120, start=120)
            # Every key has messages held by a: the newcomers' keys wait for a's acks.
            await stays(lambda: all(name == "a" for name, _ in log), for_s=1.0, what="b and c wait")
            await a.ack_held()
            await eventually(lambda: len(log) == 240, timeout_s=30, what="every message received")
        finally:
            for receiver in receivers:
                await receiver.stop()
                await receiver.consumer.close()
        assert sorted(m.offset for _, m in log) == list(range(240))
        moved = {m.key for name, m in log if name != "a"}
        assert moved, "b and c took over some keys"
        for key in KEYS:
            offsets = [m.offset for _, m in log if m.key == key]
            assert offsets == sorted(offsets), f"{key} received out of order across consumers"
