"""The leader's load rebalancing (``broker/cluster/rebalance.py``): load reports carry msg/s and
bytes/s (``docs/etcd-layout.md`` §1.6), the leader writes its decision to
``/cluster/load_balance`` (§1.8) under its epoch and moves topics by unloading them; clients
follow the moved topics without losing or duplicating a message. Real etcd, real brokers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName

from broker.cluster.leader import LeaderDuties
from broker.cluster.load_manager import (
    BYTE_RATE_RESOURCE,
    MSG_RATE_RESOURCE,
    BrokerLoad,
    LoadBalanceDecision,
    RebalanceAggressiveness,
    coefficient_of_variation,
)
from broker.cluster.membership import TrafficMeter
from broker.cluster.rebalance import Rebalancer

from helpers import eventually

AGGRESSIVE = RebalanceAggressiveness.AGGRESSIVE.threshold


# --- in-process ------------------------------------------------------------------------------


@pytest.mark.unit
def test_traffic_meter_gives_rates_since_the_previous_sample() -> None:
    now = [100.0]
    counters: dict[str, tuple[int, int]] = {"/a/x": (10, 1000)}
    meter = TrafficMeter(lambda: counters, clock=lambda: now[0])
    assert meter.sample() == (0.0, 0.0)  # no interval yet
    now[0] += 2.0
    counters = {"/a/x": (30, 3000), "/a/y": (4, 400)}  # /a/y opened meanwhile: all of it counts
    assert meter.sample() == (12.0, 1200.0)
    now[0] += 0.5  # too soon: the same rates, the window goes on
    counters = {"/a/x": (40, 4000)}
    assert meter.sample() == (12.0, 1200.0)
    now[0] += 0.5
    counters = {"/a/x": (5, 500), "/a/y": (4, 400)}  # /a/x was released and loaded again
    assert meter.sample() == (5.0, 500.0)


@pytest.mark.unit
def test_broker_load_reads_the_rates_of_a_load_report() -> None:
    report = values.LoadReport(
        resources_usage=[
            values.ResourceUsage("CPU", 40),
            values.ResourceUsage("Memory", 20),
            values.ResourceUsage(MSG_RATE_RESOURCE, 1500),
            values.ResourceUsage(BYTE_RATE_RESOURCE, 150_000),
        ],
        topic_list=["/default/a"],
        topics_len=1,
    )
    load = BrokerLoad.from_report(7, report, topics=["/default/a", "/default/b"])
    assert (load.cpu_percent, load.memory_percent, load.msg_per_s, load.bytes_per_s) == (40.0, 20.0, 1500.0, 150_000.0)
    assert load.topics == ["/default/a", "/default/b"]
    assert BrokerLoad.from_report(7, report, msg_per_s=3.0).msg_per_s == 3.0
    old = values.LoadReport([values.ResourceUsage("CPU", 1)], [], 0)  # an older broker's report
    assert (BrokerLoad.from_report(8, old).msg_per_s, BrokerLoad.from_report(8, old).bytes_per_s) == (0.0, 0.0)


# --- the rebalancer on a real etcd, brokers simulated by their keys --------------------------


async def _seed_cluster(meta: MetadataStore, topics_per_broker: dict[int, int]) -> int:
    """Register, activate and load-report each broker, assign it that many topics, and make
    the first one the leader. Returns the leader's epoch."""
    puts: list[tuple[str, values.JsonValue | values.JsonRecord]] = []
    for broker_id, count in topics_per_broker.items():
        names = [TopicName.parse(f"/default/b{broker_id}-t{i}") for i in range(count)]
        puts += [
            (keys.broker_register(broker_id), values.BrokerRegistration(
                admin_addr="http://127.0.0.1:1", advertised_addr="127.0.0.1:1",
                broker_addr="http://127.0.0.1:1", prom_exporter=None,
            )),
            (keys.broker_state(broker_id), values.BrokerState(mode="active", reason="boot")),
            (keys.load_report(broker_id), values.LoadReport(
                [values.ResourceUsage("CPU", 10), values.ResourceUsage("Memory", 10)],
                [n.path for n in names], len(names),
            )),
        ]
        puts += [(keys.topic_assignment(broker_id, n), None) for n in names]
    await meta.put_many(puts)
    epoch = await meta.transaction(created={keys.CLUSTER_LEADER: 0}, puts=[(keys.CLUSTER_LEADER, next(iter(topics_per_broker)))])
    assert epoch is not None
    return epoch


@pytest.mark.integration
@pytest.mark.asyncio
async def test_a_round_writes_the_decision_under_the_epoch_then_unloads(etcd_endpoints: list[str]) -> None:
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        epoch = await _seed_cluster(meta, {1: 6, 2: 0, 3: 0})
        async with LocalCache(meta) as cache:
            await cache.wait_for_revision(epoch)
            unloaded: list[str] = []
            refuse: set[str] = set()

            async def unload(topic: str) -> None:
                unloaded.append(topic)
                if topic in refuse:
                    raise RuntimeError("owner unreachable")

            duties = LeaderDuties(meta, cache, lambda: epoch)  # not started: only its preferred map
            current: list[int | None] = [epoch]
            rebalancer = Rebalancer(
                meta, cache, lambda: current[0], duties=duties, unload=unload, strategy="fair",
                threshold=AGGRESSIVE, interval_s=1.0, cooldown_s=0.0, max_moves=3, topic_cooldown_s=60.0,
            )
            first = await rebalancer.run_round(epoch)
            assert first.plan is not None and first.decision is not None
            assert [m.from_broker for m in first.decision.moves] == [1, 1, 1]
            assert sorted(m.to_broker for m in first.decision.moves) == [2, 2, 3]
            assert unloaded == [m.topic for m in first.decision.moves] == list(first.moved)
            assert duties.preferred == {m.topic: m.to_broker for m in first.decision.moves}
            stored = await meta.get(keys.CLUSTER_LOAD_BALANCE)
            assert stored is not None and LoadBalanceDecision.from_json(stored.value) == first.decision
            assert first.decision.epoch == epoch and first.decision.strategy == "fair"
            assert first.decision.cv_after < first.decision.cv_before

            # A deposed leader (the epoch no longer matches the leader key) writes and moves nothing.
            unloaded.clear()
            deposed = await rebalancer.run_round(epoch + 1000)
            assert deposed.decision is None and unloaded == []
            assert LoadBalanceDecision.from_json((await meta.get(keys.CLUSTER_LOAD_BALANCE)).value) == first.decision  # type: ignore[union-attr]

            # The unloads above changed nothing in etcd (a fake owner): the next round plans
            # other topics (the moved ones are in their cool-down); a failed move is counted,
            # its preference dropped, and it is not tried again in the following round.
            refuse.update(f"/default/b1-t{i}" for i in range(6))
            second = await rebalancer.run_round(epoch)
            assert second.decision is not None and set(second.failed) == {m.topic for m in second.decision.moves}
            assert not set(second.failed) & set(first.moved)
            assert rebalancer.moves_failed == len(second.failed) and rebalancer.moves_made == 3
            assert all(t not in duties.preferred for t in second.failed)
            unloaded.clear()
            await rebalancer.run_round(epoch)
            assert not set(unloaded) & (set(first.moved) | set(second.failed))

            # While a topic waits in the unassigned queue, a move is under way: no plan.
            revision = await meta.put(keys.unassigned_topic(TopicName.parse("/default/b1-t0")), None)
            await cache.wait_for_revision(revision)
            assert (await rebalancer.run_round(epoch)).plan is None


# --- real brokers ------------------------------------------------------------------------------


async def _load_report(meta: MetadataStore, broker_id: int) -> dict[str, int]:
    kv = await meta.get(keys.load_report(broker_id))
    assert kv is not None
    report = values.LoadReport.from_json(kv.value)
    return {u.resource: u.usage for u in report.resources_usage}


@pytest.mark.integration
@pytest.mark.asyncio
async def test_the_load_report_carries_msg_and_byte_rates(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    broker = start_broker(extra_args=["--load-report-interval-s", "1"])
    payload = b"x" * 100
    async with DanubeClient([broker.address]) as client, await MetadataStore.connect(etcd_endpoints) as meta:
        async with client.producer("/default/rates", producer_name="rates", max_batch_messages=50) as producer:
            usage = await _load_report(meta, broker.broker_id)
            assert list(usage) == ["CPU", "Memory", MSG_RATE_RESOURCE, BYTE_RATE_RESOURCE]
            await asyncio.gather(*(producer.send_nowait(payload) for _ in range(2000)))

        async def rates_reported() -> bool:
            usage = await _load_report(meta, broker.broker_id)
            return usage[MSG_RATE_RESOURCE] > 0 and usage[BYTE_RATE_RESOURCE] >= 100 * usage[MSG_RATE_RESOURCE]

        await eventually(rates_reported, timeout_s=10, interval_s=0.2, what="MsgRate and ByteRate in the load report")


def _payload(topic: str, i: int) -> bytes:
    return f"{topic}:{i:05d}".encode()


async def _topic_counts(meta: MetadataStore, broker_ids: list[int]) -> tuple[list[int], int]:
    """Topics assigned to each broker (§1.4), and how many wait in the unassigned queue (§1.5)."""
    assigned, _ = await meta.get_prefix(keys.BROKERS_PREFIX)
    counts = {b: 0 for b in broker_ids}
    for kv in assigned:
        parts = kv.key[len(keys.BROKERS_PREFIX):].split("/")
        if len(parts) == 3 and int(parts[0]) in counts:
            counts[int(parts[0])] += 1
    waiting, _ = await meta.get_prefix(f"{keys.CLUSTER}/unassigned/")
    return [counts[b] for b in broker_ids], len(waiting)


@pytest.mark.integration
@pytest.mark.asyncio
async def test_the_leader_moves_topics_until_the_load_is_even(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """Nine topics on one broker; two more brokers join. The leader moves topics (one second
    rounds and cool-down, aggressive threshold) until each broker holds three, records its
    decisions in ``/cluster/load_balance``, and producers and consumers on every topic go on
    through the moves: every message sent is acknowledged at its own offset and received, none
    lost and none written twice."""
    from danube_pipeline.storage.objectstore import ObjectStore
    from danube_pipeline.lake.tiering import tier_sealed_segments

    url = (tmp_path / "objects").as_uri()
    args = [
        "--rebalance-interval-s", "1", "--rebalance-cooldown-s", "1", "--rebalance-threshold", "aggressive",
        "--load-report-interval-s", "1", "--object-store-url", url, "--local-retention-check-s", "0.5",
    ]  # fmt: skip
    first = start_broker(extra_args=args)
    topics = [f"/default/spread-{i}" for i in range(9)]
    total = 300
    async with DanubeClient([first.address]) as client, await MetadataStore.connect(etcd_endpoints) as meta:
        for topic in topics:
            await client.admin.create_topic(topic)
        assert (await _topic_counts(meta, [first.broker_id])) == ([9], 0)

        async def produce(topic: str) -> list[int]:
            async with client.producer(topic, producer_name="spread", max_batch_messages=10) as producer:
                futures = []
                for i in range(total):
                    futures.append(producer.send_nowait(_payload(topic, i)))
                    if i % 10 == 9:
                        await asyncio.sleep(0.2)  # about 6 s of traffic
                return list(await asyncio.gather(*futures))

        received: dict[str, list[tuple[int, bytes]]] = {t: [] for t in topics}

        async def consume(topic: str) -> None:
            # One client per consumer: a consumer whose stream ends discards its client's
            # channel to that broker, which fails the other consumers sharing it (see the report).
            async with DanubeClient([first.address]) as own, own.consumer(
                topic, subscription="live", initial_position=InitialPosition.EARLIEST
            ) as consumer:
                while len(set(received[topic])) < total:
                    message = await consumer.receive(timeout_ms=20_000)
                    received[topic].append((message.offset, message.payload))
                    await consumer.ack(message)

        async def tier_continuously() -> None:
            # What the sealed-segments sensor does: a consumer behind a move waits at the earlier
            # owner's offsets until they are tiered.
            objects = ObjectStore(url)
            while True:
                for topic in topics:
                    with contextlib.suppress(Exception):  # a topic in mid-move: the next pass
                        await tier_sealed_segments(TopicName.parse(topic), store=meta, admin=client.admin, objects=objects)
                await asyncio.sleep(0.5)  # pacing: the sensor's interval between passes

        consumers = [asyncio.create_task(consume(t)) for t in topics]
        producers = [asyncio.create_task(produce(t)) for t in topics]
        tierer = asyncio.create_task(tier_continuously())
        try:
            second = await asyncio.to_thread(start_broker, extra_args=args)
            third = await asyncio.to_thread(start_broker, extra_args=args)
            ids = [first.broker_id, second.broker_id, third.broker_id]

            async def balanced() -> bool:
                counts, waiting = await _topic_counts(meta, ids)
                return waiting == 0 and sum(counts) == 9 and coefficient_of_variation(counts) <= AGGRESSIVE

            await eventually(balanced, timeout_s=30, interval_s=0.2, what="topic counts even across the brokers")
            assert (await _topic_counts(meta, ids))[0] == [3, 3, 3]

            leader = await meta.get(keys.CLUSTER_LEADER)
            assert leader is not None and leader.value == first.broker_id
            stored = await meta.get(keys.CLUSTER_LOAD_BALANCE)
            assert stored is not None
            decision = LoadBalanceDecision.from_json(stored.value)
            assert decision.epoch == leader.create_revision and decision.strategy == "fair"
            assert decision.moves and decision.cv_after < decision.cv_before
            assert all(m.from_broker in ids and m.to_broker in ids and m.from_broker != m.to_broker for m in decision.moves)

            offsets = await asyncio.wait_for(asyncio.gather(*producers), 60)
            await asyncio.wait_for(asyncio.gather(*consumers), 60)
        finally:
            for task in (*producers, *consumers, tierer):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*producers, *consumers, tierer, return_exceptions=True)

        # A new client: this one's lookups are cached, and a topic whose producer finished
        # before its move was never redirected.
        async with DanubeClient([first.address]) as fresh:
            moved = [t for t in topics if (await fresh.lookup_topic(t)).broker_id != first.broker_id]
        assert len(moved) == 6
        for topic, acked in zip(topics, offsets):
            assert sorted(acked) == list(range(total)), topic  # every ack a distinct offset
            # Received: every message sent, each at one offset (nothing lost, nothing written
            # twice). A message delivered but not yet acked when its topic moved is delivered
            # again at the same offset by the next owner (at-least-once delivery).
            log = dict(received[topic])
            assert len(set(received[topic])) == len(log) == total, topic
            assert log == {offset: _payload(topic, i) for i, offset in enumerate(acked)}, topic


@pytest.mark.integration
@pytest.mark.asyncio
async def test_a_replicated_topic_moves_only_to_an_in_sync_replica(etcd_endpoints: list[str]) -> None:
    """A move of a replicated topic to a broker outside its replica set (§1.9) first makes that
    broker one more replica and waits until the owner counts it in the ISR (§5.9); one that does
    not catch up in time is taken out of the set again, and the topic is not released."""
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        epoch = await _seed_cluster(meta, {1: 2, 2: 0})
        names = [TopicName.parse(f"/default/b1-t{i}") for i in range(2)]
        await meta.put(keys.namespace_policy("default"), values.NamespacePolicy(replication_factor=2))
        revision = 0
        for name in names:
            await meta.put(keys.replica_assignment(name), values.ReplicaAssignment(replicas=[1, 3], since=1))
            revision = await meta.put(keys.in_sync_replicas(name), values.InSyncReplicas(
                owner=1, owner_epoch=1, isr=[1, 3], high_watermark=0))
        async with LocalCache(meta) as cache:
            await cache.wait_for_revision(revision)
            unloaded: list[str] = []

            async def unload(topic: str) -> None:
                unloaded.append(topic)

            async def owner_counts_the_new_replica() -> TopicName:
                """What the owner of the first topic broker 2 joins does once it caught up: its
                ISR record names broker 2."""
                while True:
                    for name in names:
                        raw = cache.get(keys.replica_assignment(name))
                        if raw is not None and 2 in values.ReplicaAssignment.from_json(raw).replicas:
                            await meta.put(keys.in_sync_replicas(name), values.InSyncReplicas(
                                owner=1, owner_epoch=1, isr=[1, 2, 3], high_watermark=0))
                            return name
                    await asyncio.sleep(0.05)

            duties = LeaderDuties(meta, cache, lambda: epoch)
            rebalancer = Rebalancer(
                meta, cache, lambda: epoch, duties=duties, unload=unload, strategy="fair", threshold=AGGRESSIVE,
                interval_s=1.0, cooldown_s=0.0, max_moves=1, topic_cooldown_s=60.0, replica_catch_up_s=1.0,
            )
            catching_up = asyncio.create_task(owner_counts_the_new_replica())
            moved = await rebalancer.run_round(epoch)
            first = await catching_up
            other = next(n for n in names if n != first)
            assert moved.moved == (first.path,) and unloaded == [first.path]
            replicas = values.ReplicaAssignment.from_json((await meta.get(keys.replica_assignment(first))).value)  # type: ignore[union-attr]
            assert sorted(replicas.replicas) == [1, 2, 3]
            assert duties.preferred == {first.path: 2}
            unloaded.clear()
            refused = await rebalancer.run_round(epoch)  # nobody counts broker 2 in the other's ISR
            assert refused.failed == (other.path,) and unloaded == []
            replicas = values.ReplicaAssignment.from_json((await meta.get(keys.replica_assignment(other))).value)  # type: ignore[union-attr]
            assert sorted(replicas.replicas) == [1, 3]
            assert other.path not in duties.preferred

            # What the source's release writes (§1.4, §1.5); the assignment drops its copy.
            released = await meta.transaction(
                puts=[(keys.topic_root(first), None),
                      (keys.unassigned_topic(first), values.UnassignedReason(reason="unload", from_broker=1))],
                deletes=[keys.topic_assignment(1, first)],
            )
            assert released is not None
            await cache.wait_for_revision(released)
            assert await duties.assign_pass(epoch) == 1
            assert await meta.get(keys.topic_assignment(2, first)) is not None
            replicas = values.ReplicaAssignment.from_json((await meta.get(keys.replica_assignment(first))).value)  # type: ignore[union-attr]
            assert sorted(replicas.replicas) == [2, 3]
