"""Several brokers on one etcd: one owner per topic, assigned by the leader, whose writes are
fenced by its epoch (``docs/etcd-layout.md`` §1.4, §1.5, §1.7). Real etcd, real brokers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName

from broker.leader import assign_topic

from helpers import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


async def owners(meta: MetadataStore, topic: TopicName) -> list[int]:
    kvs, _ = await meta.get_prefix(keys.BROKERS_PREFIX)
    suffix = f"/{topic.namespace}/{topic.topic}"
    return sorted(int(kv.key[len(keys.BROKERS_PREFIX) :].split("/")[0]) for kv in kvs if kv.key.endswith(suffix))


async def test_brokers_racing_for_new_topics_give_each_exactly_one_owner(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    brokers = [start_broker(), start_broker(), start_broker()]
    topics = [f"/default/race-{i}" for i in range(6)]
    clients = [DanubeClient([b.address]) for b in brokers]
    try:
        for client in clients:
            await client.__aenter__()

        async def publish(client: DanubeClient, topic: str, tag: str) -> list[int]:
            async with client.producer(topic, producer_name=f"{tag}-{topic.rsplit('/', 1)[1]}") as producer:
                return [await producer.send(f"{tag}:{i}".encode()) for i in range(20)]

        # Every client creates every topic at once, each through its own broker.
        results = await asyncio.gather(
            *(publish(client, topic, f"c{n}") for topic in topics for n, client in enumerate(clients))
        )
        async with await MetadataStore.connect(etcd_endpoints) as meta:
            for topic in topics:
                name = TopicName.parse(topic)
                assert len(await owners(meta, name)) == 1, topic
                assert (await meta.get(keys.unassigned_topic(name))) is None
        per_topic = [sorted(sum(results[i * 3 : i * 3 + 3], [])) for i in range(len(topics))]
        assert all(offsets == list(range(60)) for offsets in per_topic)  # one log per topic
        async with clients[0].consumer(topics[0], subscription="check", initial_position=InitialPosition.EARLIEST) as consumer:
            payloads = sorted([(await consumer.receive(timeout_ms=10_000)).payload for _ in range(60)])
        assert payloads == sorted(f"c{n}:{i}".encode() for n in range(3) for i in range(20))
    finally:
        for client in clients:
            await client.__aexit__(None, None, None)


async def test_a_deposed_leaders_assignment_is_refused(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    first, second = start_broker(), start_broker()
    topic = TopicName.parse("/default/fenced")
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        leader = await meta.get(keys.CLUSTER_LEADER)
        assert leader is not None and leader.value in (first.broker_id, second.broker_id)
        old_epoch = leader.create_revision
        await meta.delete(keys.CLUSTER_LEADER)  # the leader is deposed; a new election follows

        async def new_leader() -> bool:
            kv = await meta.get(keys.CLUSTER_LEADER)
            return kv is not None and kv.create_revision != old_epoch

        await eventually(new_leader, timeout_s=10, what="a new election")
        new_epoch = (await meta.get(keys.CLUSTER_LEADER)).create_revision  # type: ignore[union-attr]
        # A topic waits in the queue; the old epoch's write is refused, whatever the broker.
        await meta.put_many([(keys.topic_root(topic), 0), (keys.unassigned_topic(topic), None)])
        brokers = [first.broker_id, second.broker_id]
        assert await assign_topic(meta, topic, first.broker_id, epoch=old_epoch, brokers=brokers) is None
        # The current leader assigns it, once.
        async def assigned() -> bool:
            return len(await owners(meta, topic)) == 1

        await eventually(assigned, timeout_s=10, what="the new leader assigns the topic")
        assert await meta.get(keys.unassigned_topic(topic)) is None
        # Even the current epoch cannot assign it a second time.
        await meta.put(keys.unassigned_topic(topic), None)
        owner = (await owners(meta, topic))[0]
        other = next(b for b in brokers if b != owner)
        assert await assign_topic(meta, topic, other, epoch=new_epoch, brokers=brokers) is None
        assert await owners(meta, topic) == [owner]
