"""Issue 21 #13: a subscription that passes over the never-written tail of an owner's offset
block (an unavailable range whose ``last_written`` is known) must only move its read position:
the batches it handed out before (queued for the consumer, sent and not acknowledged) stay
pending until their consumer acknowledges them. Real etcd, a real broker process, real
clients."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.client.consumer import Consumer
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.lake.tiering import tier_sealed_segments
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore

from helpers import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

PASSED_OVER = "were never handed out"
"""What the broker logs when a subscription passes over a never-written tail."""


async def _produce(client: DanubeClient, topic: str, first: int, count: int, acked: dict[int, bytes]) -> None:
    async with client.producer(topic, producer_name=f"tail-{first}", max_batch_messages=10) as producer:
        sent = [(f"tail-{first + i:06d}".encode(), producer.send_nowait(f"tail-{first + i:06d}".encode()))
                for i in range(count)]
        for payload, future in sent:
            acked[int(await future)] = payload


async def _receive_all(consumer: Consumer, wanted: int, acked: dict[int, bytes]) -> list[tuple[int, bytes]]:
    """``wanted`` messages from ``consumer``, none acknowledged; fails on a 5 s silence."""
    read: list[tuple[int, bytes]] = []
    while len(read) < wanted:
        try:
            message = await consumer.receive(timeout_ms=5_000)
        except TimeoutError:
            missing = sorted(set(acked) - {o for o, _ in read})
            raise AssertionError(f"{len(missing)} acked offsets never read: {missing[:5]}..{missing[-5:]}") from None
        read.append((message.offset, message.payload))
    return read


async def test_passing_over_a_never_written_tail_keeps_queued_and_unacked_messages(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """The topic's assignment is deleted and queued for the leader in one transaction (what
    ``etcdctl txn`` does) after 150 acked messages of a 400-offset block: the broker gets the
    topic back with a new block and records the old block's never-written tail. 150 more
    messages; everything is tiered. A fresh subscription reading from the earliest offset with
    the default window receives every acked message exactly once, passing over the tail; a
    second consumer, after the first closed without acknowledging, receives them all again
    (nothing was acknowledged in its place); once acknowledged, a third gets nothing."""
    url = (tmp_path / "objects").as_uri()
    broker = start_broker(extra_args=["--object-store-url", url, "--offset-block", "400"])
    topic = "/default/unwritten-tail"
    name = TopicName.parse(topic)
    assignment = keys.topic_assignment(broker.broker_id, name)
    acked: dict[int, bytes] = {}
    async with (
        DanubeClient([broker.address], metadata_retries=60, retry_backoff_ms=100) as client,
        await MetadataStore.connect(etcd_endpoints) as meta,
    ):
        await client.admin.create_topic(topic)
        await _produce(client, topic, 0, 150, acked)
        before = await meta.get(assignment)
        assert before is not None
        revision = await meta.transaction(
            created={assignment: before.create_revision},
            deletes=[assignment],
            puts=[(keys.unassigned_topic(name), values.UnassignedReason(reason="operator", from_broker=-1))],
        )
        assert revision is not None

        async def given_back() -> bool:
            kv = await meta.get(assignment)
            return kv is not None and kv.create_revision > revision

        await eventually(given_back, timeout_s=10, what="the leader gives the topic back")
        await _produce(client, topic, 150, 150, acked)
        assert len(acked) == 300
        await client.admin.seal_active_segment(topic)
        report = await tier_sealed_segments(name, store=meta, admin=client.admin, objects=ObjectStore(url))
        assert report.last_offset == max(acked)
        holes = [o for o in range(min(acked), max(acked)) if o not in acked]
        assert holes, "the test needs a never-written tail between the two blocks"

        async with client.consumer(topic, subscription="replay", initial_position=InitialPosition.EARLIEST) as first:
            read = await _receive_all(first, len(acked), acked)
        assert len(read) == len(set(read)) == len(acked) and dict(read) == acked
        assert PASSED_OVER in broker.log_path.read_text(errors="replace"), "the tail was not passed over"

        async with client.consumer(topic, subscription="replay") as second:
            again = await _receive_all(second, len(acked), acked)
            assert len(again) == len(set(again)) and dict(again) == acked, (
                "messages sent and not acknowledged must be redelivered"
            )
            for offset, _payload in again:
                await second.ack(offset)
        async with client.consumer(topic, subscription="replay") as third:
            with pytest.raises(TimeoutError):
                extra = await third.receive(timeout_ms=1_000)
                raise AssertionError(f"offset {extra.offset} delivered again after it was acknowledged")
