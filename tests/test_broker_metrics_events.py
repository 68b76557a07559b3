"""The broker's event counters (``--metrics-listen``, :mod:`broker.metrics`) against a real
broker process, each driven by the event it counts and compared with the exact number the test
caused:

* nacks, redeliveries and the dead-letter topic (``max_redeliveries``);
* messages taken back after the ack timeout;
* WAL segments sealed and deleted (local retention), with the bytes freed;
* tiered reads: object fetches, cache hits and misses, bytes fetched from object storage;
* the leader's rebalancing moves, when a second broker joins.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import eventually_sync
from test_broker_metrics import _metrics_broker, _registration, _scrape, _value

from danube_pipeline.client import DanubeClient, InitialPosition, SubscriptionType
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.lake.tiering import completed_descriptors, tier_sealed_segments
from danube_pipeline.metadata.descriptors import read_descriptors
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore, segment_object_path

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

SEGMENT_BYTES = 8 * 1024


async def _produce(client: DanubeClient, topic: str, count: int, *, batch: int) -> None:
    async with client.producer(topic, producer_name="p", max_batch_messages=batch) as producer:
        for i in range(count):
            producer.send_nowait(f"message {i:06d} ".encode() * 3)
        await producer.flush()


async def test_nacks_redeliveries_dead_letters_and_ack_timeouts_are_counted(
    start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str]
) -> None:
    broker, url = _metrics_broker(start_broker, etcd_endpoints)
    topic = "/default/events"
    t = {"broker": str(broker.broker_id), "namespace": "default", "topic": topic}
    billing, audit = {**t, "subscription": "billing"}, {**t, "subscription": "audit"}
    async with DanubeClient([broker.address]) as client:
        await _produce(client, topic, 3, batch=3)
        async with client.consumer(
            topic, subscription="billing", subscription_type=SubscriptionType.SHARED,
            initial_position=InitialPosition.EARLIEST, nack_redelivery_delay_ms=50, max_redeliveries=2,
        ) as consumer:  # fmt: skip
            for _ in range(5):  # offsets 0 and 2 once, offset 1 three times: nacked each time
                message = await consumer.receive(timeout_ms=10_000)
                if message.offset == 1:
                    await consumer.nack(message, reason="boom")
                else:
                    await consumer.ack(message)

            def dead_lettered() -> bool:
                return _value(_scrape(url), "danube_subscription_dlq_total", **billing) == 1

            eventually_sync(dead_lettered, what="offset 1 published to the dead-letter topic")
            m = _scrape(url)
            assert _value(m, "danube_subscription_nack_total", **billing) == 3
            assert _value(m, "danube_subscription_redelivery_total", **billing) == 2  # the third nack dead-letters
            assert _value(m, "danube_subscription_ack_timeout_total", **billing) == 0
            dlq = {"broker": t["broker"], "topic": "/default/events-billing-DLQ"}
            assert _value(m, "danube_topic_messages_in_total", **dlq) == 1

        async with client.consumer(
            topic, subscription="audit", initial_position=InitialPosition.EARLIEST, ack_timeout_ms=500
        ) as consumer:
            first = [await consumer.receive(timeout_ms=10_000) for _ in range(3)]
            await consumer.ack(first[0])  # offsets 1 and 2 stay unacknowledged past the timeout
            again = [await consumer.receive(timeout_ms=10_000) for _ in range(2)]
            assert sorted((x.offset, x.redelivery_count) for x in again) == [(1, 1), (2, 1)]
            for message in again:
                await consumer.ack(message)
            m = _scrape(url)
            assert _value(m, "danube_subscription_ack_timeout_total", **audit) == 2
            assert _value(m, "danube_subscription_redelivery_total", **audit) == 2
            assert _value(m, "danube_subscription_nack_total", **audit) == 0
            assert _value(m, "danube_subscription_dlq_total", **audit) == 0


async def test_wal_seals_and_deletes_and_tiered_reads_are_counted(
    start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str], tmp_path: Path
) -> None:
    objects = ObjectStore((tmp_path / "objects").as_uri())
    broker = start_broker(
        segment_max_bytes=SEGMENT_BYTES,
        extra_args=["--metrics-listen", "127.0.0.1:0", "--object-store-url", objects.root_url,
                    "--local-retention-check-s", "3600"],
    )  # fmt: skip
    url = _registration(etcd_endpoints, broker.broker_id)["prom_exporter"]
    topic = "/default/tiered-events"
    b = str(broker.broker_id)
    async with DanubeClient([broker.address]) as client:
        await _produce(client, topic, 600, batch=20)
        await client.admin.seal_active_segment(topic)
        async with await MetadataStore.connect(etcd_endpoints) as meta:
            await tier_sealed_segments(TopicName.parse(topic), store=meta, admin=client.admin, objects=objects)
            descriptors = completed_descriptors((await read_descriptors(meta, TopicName.parse(topic)))[0])
        sealed = await client.admin.describe_topic(topic)
        assert sealed.sealed_segments == len(descriptors) >= 3
        m = _scrape(url)
        assert _value(m, "danube_wal_file_rotate_total", broker=b) == sealed.sealed_segments
        assert _value(m, "danube_wal_delete_total", broker=b) == 0

        result = await client.admin.apply_local_retention(topic, retention_bytes=0)
        assert result.deleted_segments == sealed.sealed_segments
        after = await client.admin.describe_topic(topic)
        m = _scrape(url)
        assert _value(m, "danube_wal_delete_total", broker=b) == result.deleted_segments
        assert _value(m, "danube_wal_delete_bytes_total", broker=b) == sealed.wal_bytes - after.wal_bytes > 0
        assert _value(m, "danube_tiered_fetched_bytes_total", broker=b) == 0

        async with client.consumer(topic, subscription="replay", initial_position=InitialPosition.EARLIEST) as consumer:
            for offset in range(600):
                message = await consumer.receive(timeout_ms=10_000)
                assert message.offset == offset
                await consumer.ack(message)
        described = await client.admin.describe_topic(topic)
        assert described.subscriptions[0].records_from_object_storage == 600
        first = _scrape(url)
        # every object fetched once, whole (its segment header included); the reader's first
        # read found nothing cached, a later one may have waited for a prefetch under way
        object_bytes = sum(len(objects.get_bytes(segment_object_path(TopicName.parse(topic), d.object_id)))
                           for d in descriptors)  # fmt: skip
        assert _value(first, "danube_tiered_fetched_bytes_total", broker=b) == object_bytes == sum(
            d.size for d in descriptors
        )
        misses = _value(first, "danube_tiered_cache_misses_total", broker=b)
        assert 1 <= misses <= len(descriptors)
        hits = _value(first, "danube_tiered_cache_hits_total", broker=b)
        assert hits >= len(descriptors)

        # a second subscription reads the same offsets from the cache: hits only, nothing fetched
        async with client.consumer(topic, subscription="again", initial_position=InitialPosition.EARLIEST) as consumer:
            for offset in range(600):
                assert (await consumer.receive(timeout_ms=10_000)).offset == offset
        second = _scrape(url)
        assert _value(second, "danube_tiered_fetched_bytes_total", broker=b) == object_bytes
        assert _value(second, "danube_tiered_cache_misses_total", broker=b) == misses
        assert _value(second, "danube_tiered_cache_hits_total", broker=b) >= hits + len(descriptors)



async def test_the_leaders_rebalancing_moves_are_counted(
    start_broker: Callable[..., BrokerProcess], etcd_endpoints: list[str]
) -> None:
    args = [
        "--rebalance-interval-s", "1", "--rebalance-cooldown-s", "1", "--rebalance-threshold", "aggressive",
        "--load-report-interval-s", "1",
    ]  # fmt: skip
    leader = start_broker(extra_args=["--metrics-listen", "127.0.0.1:0", *args])
    url = _registration(etcd_endpoints, leader.broker_id)["prom_exporter"]
    b = str(leader.broker_id)
    topics = [f"/default/moved-{i}" for i in range(4)]
    async with DanubeClient([leader.address]) as client:
        for topic in topics:
            await client.admin.create_topic(topic)
    assert _value(_scrape(url), "danube_rebalancing_moves_total", broker=b) == 0  # one broker: no round
    joined = start_broker(extra_args=args)

    def even() -> bool:
        m = _scrape(url)
        return (
            _value(m, "danube_rebalancing_moves_total", broker=b, result="moved") >= 2
            and m.get(("danube_cluster_imbalance_cv", (("broker", b),))) == 0.0
        )

    eventually_sync(even, timeout_s=30, interval_s=0.3, what="two topics moved, the last round even")
    async with DanubeClient([leader.address]) as fresh:  # no cached lookups from before the moves
        owners = [(await fresh.lookup_topic(t)).broker_id for t in topics]
    m = _scrape(url)
    assert _value(m, "danube_rebalancing_moves_total", broker=b, result="moved") == owners.count(joined.broker_id) == 2
    assert _value(m, "danube_rebalancing_moves_total", broker=b, result="failed") == 0
    assert _value(m, "danube_rebalancing_moves_total", broker=b, result="skipped") == 0
