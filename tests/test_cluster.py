"""Several brokers on one etcd: one owner per topic, assigned by the leader, whose writes are
fenced by its epoch (``docs/etcd-layout.md`` §1.4, §1.5, §1.7). Real etcd, real brokers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.errors import UnavailableRangeNotFoundError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import BrokerState, OffsetReservation, UnavailableRange
from danube_pipeline.names import TopicName

from broker.cluster.leader import assign_topic

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
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """Unload a topic while a producer sends and a consumer acks: the leader assigns it to the
    other broker, which continues the offsets; the earlier owner's untiered segments are
    tiered from it; the log holds every acked message exactly once."""
    from danube_pipeline.storage.objectstore import ObjectStore
    from danube_pipeline.lake.tiering import tier_sealed_segments

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
                            await asyncio.sleep(0.5)  # pacing: the sensor's interval between passes

                reader = asyncio.create_task(consume())
                futures = []
                next_offset = None
                tierer = None
                for i in range(total):
                    futures.append(producer.send_nowait(payload(i)))
                    if i % 100 == 0:
                        await asyncio.sleep(0.01)  # pacing: traffic spread over the unload
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
            assert state is not None and BrokerState.from_json(state.value).mode == "drained"
            for topic in topics:
                assert await owners(meta, TopicName.parse(topic)) != [victim.broker_id]
        for topic in topics:
            async with client.producer(topic, producer_name="d2") as producer:
                assert await producer.send(b"after") == 1  # continues after offset 0
        await client.admin.create_topic("/default/drain-new")
        assert (await client.lookup_topic("/default/drain-new")).broker_id != victim.broker_id


async def test_unload_and_drain_refuse_bad_input(start_broker: Callable[..., BrokerProcess]) -> None:
    """Three RPCs left out of the fuzzing (they take topics or offsets away) answer bad input
    with a typed error and change nothing."""
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
            for bad in ("/default/bad name", ""):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await admin.AbandonUnavailableRange(pb.AbandonUnavailableRangeRequest(topic=bad), timeout=5)
                assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, bad
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await admin.AbandonUnavailableRange(
                    pb.AbandonUnavailableRangeRequest(topic="/default/missing", start_offset=0), timeout=5
                )
            assert caught.value.code() is grpc.StatusCode.NOT_FOUND
            with pytest.raises(UnavailableRangeNotFoundError) as no_range:
                await client.admin.abandon_unavailable_range("/default/stays", 5)
            assert (no_range.value.topic, no_range.value.start_offset) == ("/default/stays", 5)
            for method in (
                "/danube.v1.Admin/UnloadTopic", "/danube.v1.Admin/DrainBroker", "/danube.v1.Admin/AbandonUnavailableRange"
            ):
                call = channel.unary_unary(method, request_serializer=lambda b: b)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call(b"\xff\xff\xff", timeout=5)
                assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert (await client.lookup_topic("/default/stays")).broker_id == broker.broker_id
        async with await MetadataStore.connect(broker.etcd_endpoints) as meta:
            state = await meta.get(keys.broker_state(broker.broker_id))
            assert state is not None and BrokerState.from_json(state.value).mode == "active"


async def test_a_killed_owner_is_failed_over_fenced_and_its_acked_messages_come_back(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """SIGKILL a topic's owner: once its lease expires the leader gives the topic to the other
    broker, which starts past the dead owner's reserved offset block and records the block as
    an unavailable range. Consumers wait there. The dead broker's disk returns: it finds the
    topic gone (fenced), keeps its WAL as released segments and records the last offset it
    wrote; tiering fills the range and every acked message reads back exactly once, at the
    offset it was acked with (``docs/etcd-layout.md`` §5.4, §5.5)."""
    from danube_pipeline.errors import DanubeError
    from danube_pipeline.storage.objectstore import ObjectStore
    from danube_pipeline.lake.tiering import tier_sealed_segments

    url = (tmp_path / "objects").as_uri()
    args = ["--object-store-url", url, "--lease-ttl-s", "2", "--offset-block", "1000"]
    brokers = [start_broker(extra_args=args), start_broker(extra_args=args)]
    topic = "/default/failover"
    name = TopicName.parse(topic)
    async with DanubeClient([b.address for b in brokers], metadata_retries=40, retry_backoff_ms=250) as client:
        await client.admin.create_topic(topic)
        owner_id = (await client.lookup_topic(topic)).broker_id
        owner = next(b for b in brokers if b.broker_id == owner_id)
        survivor = next(b for b in brokers if b.broker_id != owner_id)
        async with client.producer(topic, producer_name="before", max_batch_messages=10) as producer:
            acked = {await producer.send(payload(i)): payload(i) for i in range(300)}
        owner.kill()
        async with client.producer(topic, producer_name="after", max_batch_messages=10) as producer:
            for i in range(300, 400):
                acked[await producer.send(payload(i))] = payload(i)
        assert (await client.lookup_topic(topic)).broker_id == survivor.broker_id
        assert min(o for o in acked if o >= 300) == 1000  # past the dead owner's block 0..999
        async with await MetadataStore.connect(etcd_endpoints) as meta:
            ranges, _ = await meta.get_prefix(keys.unavailable_prefix(name))
            unavailable = [UnavailableRange.from_json(r.value) for r in ranges]
            assert [(u.start_offset, u.end_offset, u.broker_id) for u in unavailable] == [(0, 999, owner_id)]
            described = await client.admin.describe_topic(topic)
            assert [(u.start_offset, u.end_offset, u.last_written) for u in described.unavailable_ranges] == [
                (0, 999, None)
            ]
            # A consumer from the earliest offset waits at the range: nothing is skipped.
            async with client.consumer(topic, subscription="waits", initial_position=InitialPosition.EARLIEST) as c:
                with pytest.raises((TimeoutError, DanubeError)):
                    await c.receive(timeout_ms=1500)
            # The dead broker's disk returns. It no longer owns the topic: its WAL becomes
            # released segments and the range learns where its writes ended.
            returned = start_broker(data_dir=owner.data_dir, extra_args=args)

            async def last_written_recorded() -> bool:
                kvs, _ = await meta.get_prefix(keys.unavailable_prefix(name))
                return [UnavailableRange.from_json(kv.value).last_written for kv in kvs] == [299]

            await eventually(last_written_recorded, timeout_s=20, what="the returned broker records its last offset")
            assert (await client.lookup_topic(topic)).broker_id == survivor.broker_id
            assert await owners(meta, name) == [survivor.broker_id]
            reservation = await meta.get(keys.offset_reservation(name))
            assert reservation is not None and OffsetReservation.from_json(reservation.value).broker_id == survivor.broker_id
            # Tiering reads the returned broker's segments under their own offsets, then the
            # survivor's; the range's offsets never handed out (300..999) are passed over.
            await client.admin.seal_active_segment(topic)
            report = await tier_sealed_segments(name, store=meta, admin=client.admin, objects=ObjectStore(url))
            assert (report.first_offset, report.last_offset) == (0, 1099)
        log = await read_log(client, topic, "replay", 400)
        assert dict(log) == acked
        assert returned.broker_id == owner_id


async def test_a_resent_batch_is_written_once_across_a_restart_and_a_move(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """Idempotent produce (``broker/topics/producer_sequences.py``): a batch sent again with the same
    producer name and sequence numbers gets the offsets it was written at, on the same owner,
    after the owner restarts (rebuilt from its WAL) and after the topic moved (handed over,
    ``docs/etcd-layout.md`` §5.6); sequences written already in another batch are refused."""
    import grpc

    from danube_pipeline.format.batches import BatchBuilder
    from danube_pipeline.proto import danube_pb2 as pb
    from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

    first = start_broker()
    topic = "/default/idempotent"

    def batch(producer_id: int, base_sequence: int, count: int) -> bytes:
        builder = BatchBuilder(1)
        for i in range(count):
            builder.append(f"seq-{base_sequence + i}".encode(), timestamp_us=1)
        return builder.build(producer_id=producer_id, producer_name="once", base_sequence=base_sequence)

    async def send(address: str, base_sequence: int, count: int) -> tuple[int, int]:
        async with grpc.aio.insecure_channel(address) as channel:
            producer = pb_grpc.ProducerServiceStub(channel)
            created = await producer.CreateProducer(pb.CreateProducerRequest(topic=topic, producer_name="once"), timeout=10)
            answer = await producer.SendBatch(
                pb.SendBatchRequest(producer_id=created.producer_id, batch=batch(created.producer_id, base_sequence, count)),
                timeout=10,
            )
            await producer.CloseProducer(pb.CloseProducerRequest(producer_id=created.producer_id), timeout=10)
            return answer.first_offset, answer.last_offset

    assert await send(first.address, 100, 5) == (0, 4)
    assert await send(first.address, 100, 5) == (0, 4)  # resent: not written again
    assert await send(first.address, 105, 3) == (5, 7)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await send(first.address, 102, 2)  # sequences written already, in another batch
    assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "DuplicateSequenceError" in str(caught.value.trailing_metadata())
    first.stop()
    first = start_broker(data_dir=first.data_dir)
    assert await send(first.address, 105, 3) == (5, 7)  # rebuilt from the WAL after the restart
    second = start_broker()
    async with DanubeClient([first.address, second.address]) as client:
        assert await client.admin.unload_topic(topic) == 8
        owner = (await client.lookup_topic(topic)).broker_id
        assert owner == second.broker_id
        assert await send(second.address, 105, 3) == (5, 7)  # handed over with the topic
        assert await send(second.address, 108, 2) == (8, 9)
        assert (await client.admin.describe_topic(topic)).next_offset == 10
