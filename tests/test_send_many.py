"""``Producer.send_many``: several messages framed in one call, one future per batch, against a
real broker (the accumulator's side: ``tests/test_accumulator_many.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

from danube_pipeline.client import DanubeClient, InitialPosition, Message
from danube_pipeline.errors import MessageTooLargeError

pytestmark = pytest.mark.integration

TOPIC = "/default/send_many"


@pytest.mark.asyncio
async def test_send_many_gives_offsets_in_order_mixed_with_send_nowait(start_broker: Any) -> None:
    broker = start_broker()
    async with DanubeClient([broker.address]) as client:
        async with client.producer(TOPIC, producer_name="many", max_batch_messages=16) as producer:
            first = producer.send_nowait(b"single-0")
            run = producer.send_many_nowait([f"m-{i}".encode() for i in range(100)])
            keyed = producer.send_many_nowait([b"k-0", b"k-1"], key="route", attributes={"a": "1"})
            last = producer.send_nowait(b"single-1")
            assert await first == 0
            assert list(await run) == list(range(1, 101))
            assert list(await keyed) == [101, 102]
            assert await last == 103
            assert list(await producer.send_many([])) == []
            too_big = b"x" * (producer.max_message_size_bytes + 1)
            with pytest.raises(MessageTooLargeError):
                producer.send_many_nowait([b"fine", too_big])  # raised at once: nothing queued
            assert list(await producer.send_many([b"after"])) == [104]
        topics = await client.admin.list_topics("default")
        assert [(t.topic, t.next_offset) for t in topics] == [(TOPIC, 105)]
        async with client.consumer(TOPIC, subscription="s", initial_position=InitialPosition.EARLIEST) as consumer:
            received: list[Message] = []
            while len(received) < 105:
                message = await consumer.receive(timeout_ms=10_000)
                received.append(message)
                await consumer.ack(message)
    expected = [b"single-0", *(f"m-{i}".encode() for i in range(100)), b"k-0", b"k-1", b"single-1", b"after"]
    assert [m.payload for m in received] == expected
    assert [m.offset for m in received] == list(range(105))
    assert [(m.key, dict(m.attributes)) for m in received[101:103]] == [("route", {"a": "1"})] * 2
    assert received[0].key is None and not received[1].attributes


@pytest.mark.asyncio
async def test_send_many_on_a_partitioned_topic_routes_each_message(start_broker: Any) -> None:
    broker = start_broker()
    async with DanubeClient([broker.address]) as client:
        assert await client.admin.create_topic("/default/many-parts", partitions=3)
        async with client.producer("/default/many-parts", producer_name="many") as producer:
            ids = await producer.send_many([f"m-{i}".encode() for i in range(9)])
            keyed = await producer.send_many([b"a", b"b"], key="one-key")
    assert sorted((m.partition, int(m)) for m in ids) == [(p, o) for p in range(3) for o in range(3)]
    assert len({m.partition for m in keyed}) == 1
