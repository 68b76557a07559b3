"""Several brokers on one etcd: one owner per topic, assigned by the leader, whose writes are
fenced by its epoch (``docs/etcd-layout.md`` §1.4, §1.5, §1.7). Real etcd, real brokers."""

from __future__ import annotations

import asyncio
import contextlib
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


def payload(i: int) -> bytes:
    return f"move-{i:06d}".encode()


async def read_log(client: DanubeClient, topic: str, subscription: str, count: int) -> list[tuple[int, bytes]]:
    out = []
    async with client.consumer(topic, subscription=subscription, initial_position=InitialPosition.EARLIEST) as consumer:
        for _ in range(count):
            message = await consumer.receive(timeout_ms=15_000)
            out.append((message.offset, message.payload))
            await consumer.ack(message)
    return out


async def test_a_move_under_load_loses_and_duplicates_nothing(
    tmp_path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]  # type: ignore[no-untyped-def]
) -> None:
    """Unload a topic while a producer sends and a consumer acks: the leader assigns it to the
    other broker, which continues the offsets; the earlier owner's untiered segments are
    tiered from it; the log holds every acked message exactly once."""
    from danube_pipeline.objectstore import ObjectStore
    from danube_pipeline.tiering import tier_sealed_segments

    url = (tmp_path / "objects").as_uri()
    args = ["--object-store-url", url, "--local-retention-check-s", "0.5"]
    brokers = [start_broker(extra_args=args), start_broker(extra_args=args)]
    topic = "/default/moving"
    total = 2000
    async with DanubeClient([b.address for b in brokers]) as client:
        await client.admin.create_topic(topic)
        before = (await client.lookup_topic(topic)).broker_id
        received: list[bytes] = []
        async with client.producer(topic, producer_name="mover", max_batch_messages=20) as producer:
            async with client.consumer(topic, subscription="live", initial_position=InitialPosition.EARLIEST) as consumer:

                async def consume() -> None:
                    while len(set(received)) < total:
                        message = await consumer.receive(timeout_ms=20_000)
                        received.append(message.payload)
                        await consumer.ack(message)

                async def tier_continuously() -> None:
                    # What the sealed-segments sensor does: the consumer waits at the earlier
                    # owner's untiered offsets until they are tiered.
                    async with await MetadataStore.connect(etcd_endpoints) as meta:
                        while True:
                            await tier_sealed_segments(
                                TopicName.parse(topic), store=meta, admin=client.admin, objects=ObjectStore(url)
                            )
                            await asyncio.sleep(0.5)

                reader = asyncio.create_task(consume())
                futures = []
                next_offset = None
                tierer = None
                for i in range(total):
                    futures.append(producer.send_nowait(payload(i)))
                    if i % 100 == 0:
                        await asyncio.sleep(0.01)
                    if i == total // 2:
                        next_offset = await client.admin.unload_topic(topic)
                        tierer = asyncio.create_task(tier_continuously())
                offsets = await asyncio.gather(*futures)
                try:
                    await asyncio.wait_for(reader, 60)
                finally:
                    assert tierer is not None
                    tierer.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await tierer
        after = (await client.lookup_topic(topic)).broker_id
        assert after != before and next_offset is not None and next_offset > 0
        assert sorted(offsets) == list(range(total))  # every ack a distinct offset, none reused
        assert set(received) == {payload(i) for i in range(total)}
        # The earlier owner's segments are tiered from it; then the whole log reads back.
        await client.admin.seal_active_segment(topic)
        async with await MetadataStore.connect(etcd_endpoints) as meta:
            report = await tier_sealed_segments(
                TopicName.parse(topic), store=meta, admin=client.admin, objects=ObjectStore(url)
            )
        assert report.last_offset == total - 1 and report.first_offset == 0
        log = await read_log(client, topic, "replay", total)
        assert [o for o, _ in log] == list(range(total))
        assert sorted(p for _, p in log) == sorted(payload(i) for i in range(total))
        assert dict(log) == {o: p for o, p in zip(offsets, (payload(i) for i in range(total)))}
        # The earlier owner drops its copies once they are verified in object storage.
        released = brokers[0] if brokers[0].broker_id == before else brokers[1]
        await eventually(
            lambda: not any((released.data_dir / "released").rglob("*.dnb1")), timeout_s=15,
            what="the released segments are deleted once tiered",
        )


async def test_draining_moves_every_topic_away(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    first, second = start_broker(), start_broker()
    topics = [f"/default/drain-{i}" for i in range(4)]
    async with DanubeClient([first.address, second.address]) as client:
        for topic in topics:
            await client.admin.create_topic(topic)
            async with client.producer(topic, producer_name="d") as producer:
                await producer.send(b"before")
        owners_before = {t: (await client.lookup_topic(t)).broker_id for t in topics}
        victim = first if list(owners_before.values()).count(first.broker_id) else second
        released = await client.admin.drain_broker(victim.address)
        assert sorted(released) == sorted(t for t, b in owners_before.items() if b == victim.broker_id)
        async with await MetadataStore.connect(etcd_endpoints) as meta:
            state = await meta.get(keys.broker_state(victim.broker_id))
            assert state is not None and state.value["mode"] == "drained"
            for topic in topics:
                assert await owners(meta, TopicName.parse(topic)) != [victim.broker_id]
        for topic in topics:
            async with client.producer(topic, producer_name="d2") as producer:
                assert await producer.send(b"after") == 1  # continues after offset 0
        await client.admin.create_topic("/default/drain-new")
        assert (await client.lookup_topic("/default/drain-new")).broker_id != victim.broker_id


async def test_unload_and_drain_refuse_bad_input(start_broker: Callable[..., BrokerProcess]) -> None:
    """The two RPCs left out of the fuzzing (they take topics away) answer bad input with a
    typed error and change nothing."""
    import grpc

    from danube_pipeline.proto import danube_pb2 as pb
    from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

    broker = start_broker()
    async with DanubeClient([broker.address]) as client:
        await client.admin.create_topic("/default/stays")
        async with grpc.aio.insecure_channel(broker.address) as channel:
            admin = pb_grpc.AdminStub(channel)
            for bad in ("/default/bad name", "/default/abc\n", "", "x" * 10_000):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await admin.UnloadTopic(pb.UnloadTopicRequest(topic=bad), timeout=5)
                assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, bad
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await admin.UnloadTopic(pb.UnloadTopicRequest(topic="/default/missing"), timeout=5)
            assert caught.value.code() is grpc.StatusCode.NOT_FOUND
            for method in ("/danube.v1.Admin/UnloadTopic", "/danube.v1.Admin/DrainBroker"):
                call = channel.unary_unary(method, request_serializer=lambda b: b)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call(b"\xff\xff\xff", timeout=5)
                assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert (await client.lookup_topic("/default/stays")).broker_id == broker.broker_id
        async with await MetadataStore.connect(broker.etcd_endpoints) as meta:
            state = await meta.get(keys.broker_state(broker.broker_id))
            assert state is not None and state.value["mode"] == "active"
