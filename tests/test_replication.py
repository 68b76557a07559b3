"""Replication (``docs/etcd-layout.md`` §1.9, §5.9; ``docs/architecture.md`` "Replication") on
real etcd and three real broker processes, replication factor 3 and ``min_insync_replicas`` 2,
a 2 s lease and a 2 s ``--replica-lag-max-s``.

* An owner's SIGKILL: the leader gives the topic to a member of its ISR, which goes on from its
  own log: no unavailable range, every acknowledged message read back once, by a consumer that
  never waits for the dead broker. The dead owner, back on its disk, truncates by epoch,
  rejoins the ISR, and every replica's log is the same, batch for batch.
* Two failovers in a row with divergent unacknowledged tails (KIP-101, KIP-279): followers
  stopped (SIGSTOP, shorter than the lease) while the owner writes a batch nobody else has, the
  owner SIGKILLed, the next owner does the same to the third broker. Every broker ends with the
  same log, and no acknowledged message is lost or written twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from helpers import eventually
from prometheus_client.parser import text_string_to_metric_families

from danube_pipeline.admin.namespaces import update_namespace_policy
from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.format.records import SEGMENT_HEADER_SIZE, SegmentHeader
from danube_pipeline.format.segments import iter_stored_batches
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.lake.tiering import tier_sealed_segments
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

TOPIC = "/default/replicated"
ARGS = ["--lease-ttl-s", "2", "--replica-lag-max-s", "2", "--replica-replace-after-s", "600"]


def log_batches(broker: BrokerProcess, name: TopicName) -> list[tuple[int, bytes]]:
    """Every stored batch of the topic's WAL on ``broker``'s disk, ``(base_offset, bytes)``."""
    directory = broker.data_dir / "wal" / name.namespace / name.topic
    out: list[tuple[int, bytes]] = []
    for path in sorted(directory.glob("*.dnb1")) + sorted(directory.glob("*.log")):
        data = path.read_bytes()
        if len(data) <= SEGMENT_HEADER_SIZE:
            continue
        header = SegmentHeader.decode(data)
        out.extend((b.base_offset, b.data) for _, b in iter_stored_batches(data, format_version=header.format_version))
    return sorted(out)


async def isr_record(meta: MetadataStore, name: TopicName) -> values.InSyncReplicas | None:
    kv = await meta.get(keys.in_sync_replicas(name))
    return None if kv is None else values.InSyncReplicas.from_json(kv.value)


async def owner_of(meta: MetadataStore, name: TopicName) -> int | None:
    kvs, _ = await meta.get_prefix(keys.BROKERS_PREFIX)
    for key in (kv.key for kv in kvs):
        if key.endswith(f"/{name.namespace}/{name.topic}"):
            return int(key[len(keys.BROKERS_PREFIX):].split("/")[0])
    return None


async def full_isr(meta: MetadataStore, name: TopicName, size: int = 3) -> bool:
    record = await isr_record(meta, name)
    return record is not None and len(record.isr) == size


@contextlib.asynccontextmanager
async def replicated_topic(
    etcd_endpoints: list[str], brokers: list[BrokerProcess]
) -> AsyncIterator[tuple[MetadataStore, DanubeClient]]:
    """etcd and a client of ``brokers``, with namespace ``default`` at replication factor 3 and
    ``min_insync_replicas`` 2, and :data:`TOPIC` created."""
    async with (
        await MetadataStore.connect(etcd_endpoints) as meta,
        DanubeClient([b.address for b in brokers], metadata_retries=60, retry_backoff_ms=100) as client,
    ):
        await update_namespace_policy(meta, "default", {"replication_factor": 3, "min_insync_replicas": 2})
        await client.admin.create_topic(TOPIC)
        yield meta, client


def by_id(brokers: list[BrokerProcess], broker_id: int) -> BrokerProcess:
    return next(b for b in brokers if b.broker_id == broker_id)


async def metric(meta: MetadataStore, broker_id: int, name: str) -> float:
    """The sum of ``name``'s samples on ``broker_id``'s ``/metrics`` (0 when none)."""
    kv = await meta.get(keys.broker_register(broker_id))
    assert kv is not None
    url = values.BrokerRegistration.from_json(kv.value).prom_exporter
    assert url is not None

    def scrape() -> float:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - a loopback test URL
            text = response.read().decode()
        return sum(
            s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name
        )

    return await asyncio.to_thread(scrape)


async def test_an_owners_sigkill_loses_no_acked_message_and_blocks_no_reader(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    brokers = [start_broker(extra_args=[*ARGS, "--metrics-listen", "127.0.0.1:0"]) for _ in range(3)]
    name = TopicName.parse(TOPIC)
    async with replicated_topic(etcd_endpoints, brokers) as (meta, client):
        acked: dict[int, bytes] = {}
        async with client.producer(TOPIC, producer_name="p", max_batch_messages=10) as producer:
            for i in range(200):
                payload = f"before {i}".encode()
                acked[int(await producer.send(payload))] = payload
        await eventually(lambda: full_isr(meta, name), timeout_s=20, what="three in-sync replicas")
        described = await client.admin.describe_topic(TOPIC)
        assert sorted(described.replicas) == sorted(b.broker_id for b in brokers)
        assert described.high_watermark == described.next_offset == 200
        assert all(f.in_sync and f.lag == 0 for f in described.followers)

        owner_id = await owner_of(meta, name)
        assert owner_id is not None
        owner = by_id(brokers, owner_id)
        for family in ("danube_topic_under_replicated", "danube_topic_under_min_isr"):  # steady state
            assert await metric(meta, owner_id, family) == 0, family
        followers = [b for b in brokers if b is not owner]
        await eventually(
            lambda: all(log_batches(b, name) == log_batches(owner, name) for b in followers), what="identical logs"
        )

        consumer = client.consumer(TOPIC, subscription="reader", initial_position=InitialPosition.EARLIEST)
        received: dict[int, bytes] = {}
        async with consumer:
            async for message in consumer:
                received[message.offset] = message.payload
                await consumer.ack(message)
                if len(received) == 100:
                    break
            owner.kill()
            killed_at = time.monotonic()
            first_ack_s: float | None = None
            async with client.producer(TOPIC, producer_name="p2", max_batch_messages=10) as producer:
                for i in range(100):
                    payload = f"after {i}".encode()
                    acked[int(await producer.send(payload))] = payload
                    if first_ack_s is None:
                        first_ack_s = time.monotonic() - killed_at
            assert first_ack_s is not None and first_ack_s < 2 + 8, f"failover took {first_ack_s:.1f} s"
            new_owner = await owner_of(meta, name)
            assert new_owner in {b.broker_id for b in followers}
            assert (await meta.get_prefix(keys.unavailable_prefix(name)))[0] == [], "no unavailable range"
            async for message in consumer:
                received[message.offset] = message.payload
                await consumer.ack(message)
                if set(acked) <= set(received):
                    break
        assert {o: received[o] for o in acked} == acked

        assert new_owner is not None
        assert await metric(meta, new_owner, "danube_topic_under_replicated") == 1  # two of three in sync
        assert await metric(meta, new_owner, "danube_topic_under_min_isr") == 0
        owner.start()  # back on its disk: it truncates by epoch and rejoins
        await eventually(lambda: full_isr(meta, name), timeout_s=30, what="the old owner back in the ISR")
        assert await metric(meta, new_owner, "danube_topic_under_replicated") == 0
        assert await metric(meta, new_owner, "danube_topic_isr_expands_total") >= 1
        await eventually(
            lambda: all(log_batches(b, name) == log_batches(followers[0], name) for b in brokers),
            timeout_s=20, what="identical logs on all three",
        )


async def test_double_failover_with_divergent_tails_ends_with_identical_logs(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    brokers = [start_broker(extra_args=ARGS) for _ in range(3)]
    name = TopicName.parse(TOPIC)
    async with replicated_topic(etcd_endpoints, brokers) as (meta, client):
        acked: dict[int, bytes] = {}
        sent = 0

        async def publish(count: int) -> None:
            nonlocal sent
            async with client.producer(TOPIC, producer_name=f"p{sent}", max_batch_messages=5) as producer:
                for _ in range(count):
                    payload = f"m{sent}".encode()
                    sent += 1
                    acked[int(await producer.send(payload))] = payload

        async def diverge_and_kill() -> BrokerProcess:
            """Stop the followers (their last fetch answered), have the owner write a batch only
            it holds, kill the owner, start the followers again before their leases expire."""
            await eventually(lambda: full_isr(meta, name), timeout_s=30, what="a full ISR")
            owner = by_id(brokers, await owner_of(meta, name) or 0)
            stopped = [b for b in brokers if b is not owner]
            for b in stopped:
                os.kill(b.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(0.6)  # a fetch waiting at the owner is answered (empty) meanwhile
                async with client.producer(TOPIC, producer_name=f"lost{sent}", max_batch_messages=50) as producer:
                    tail = [producer.send_nowait(f"unacked {i}".encode()) for i in range(50)]
                    await asyncio.sleep(0.3)  # the owner writes them; nobody else can fetch them
                    assert not any(f.done() and not f.exception() for f in tail), "acked without followers"
                    owner.kill()
                    for f in tail:
                        f.cancel()
            finally:
                for b in stopped:
                    os.kill(b.pid, signal.SIGCONT)
            return owner

        await publish(100)
        first = await diverge_and_kill()
        await publish(100)  # the second owner, from the ISR
        first.start()  # it truncates its tail by epoch and follows again
        second = await diverge_and_kill()
        await publish(100)  # the third owner
        second.start()
        await eventually(lambda: full_isr(meta, name), timeout_s=40, what="all three in the ISR again")
        await eventually(
            lambda: len({tuple(log_batches(b, name)) for b in brokers}) == 1, timeout_s=20, what="identical logs"
        )
        truncated = [b for b in (first, second) if "replica log truncated" in b.log_path.read_text()]
        assert truncated == [first, second], "each returning owner cut its unacknowledged tail by epoch"
        consumer = client.consumer(TOPIC, subscription="check", initial_position=InitialPosition.EARLIEST)
        received: dict[int, list[bytes]] = {}
        async with consumer:
            async for message in consumer:
                received.setdefault(message.offset, []).append(message.payload)
                await consumer.ack(message)
                if set(acked) <= set(received):
                    break
        assert {o: received[o][0] for o in acked} == acked
        payloads = [p for ps in received.values() for p in ps if not p.startswith(b"unacked")]
        assert len(payloads) == len(set(payloads)), "an acknowledged message written twice"


async def test_replica_logs_follow_the_owners_local_retention_and_go_with_the_topic(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    """Replica logs keep no more than the owner's: once the owner's local retention deleted
    segments that object storage verifiably holds, each follower deletes its sealed segments
    below the owner's first local offset (``broker/replication/follower.py``). A deleted topic's
    replica logs are deleted too (``broker/replication/manager.py``)."""
    url = (tmp_path / "objects").as_uri()
    brokers = [
        start_broker(extra_args=[*ARGS, "--object-store-url", url], segment_max_bytes=2048) for _ in range(3)
    ]
    name = TopicName.parse(TOPIC)
    async with replicated_topic(etcd_endpoints, brokers) as (meta, client):
        async with client.producer(TOPIC, producer_name="p", max_batch_messages=10) as producer:
            for i in range(400):
                await producer.send(f"message {i:04d} ".encode() * 4)
        await eventually(lambda: full_isr(meta, name), timeout_s=20, what="three in-sync replicas")
        await tier_sealed_segments(name, store=meta, admin=client.admin, objects=ObjectStore(url))
        result = await client.admin.apply_local_retention(TOPIC, retention_bytes=0)
        owner_start = result.first_local_offset
        assert owner_start > 0, "the owner deleted tiered segments"
        owner = by_id(brokers, await owner_of(meta, name) or 0)
        followers = [b for b in brokers if b is not owner]
        async with client.producer(TOPIC, producer_name="q") as producer:  # a fetch after the deletion
            await producer.send(b"after retention")

        def oldest(b: BrokerProcess) -> int:
            batches = log_batches(b, name)
            return batches[0][0] if batches else -1

        await eventually(
            lambda: all(0 < oldest(b) <= owner_start for b in followers), timeout_s=20,
            what="replica logs cut below the owner's first local offset",
        )
        for b in followers:  # what they keep is the owner's log from there on
            assert [x for x in log_batches(b, name) if x[0] >= owner_start] == log_batches(owner, name)

        await client.admin.delete_topic(TOPIC, force=True)  # every copy goes with the topic
        await eventually(
            lambda: not any((b.data_dir / "wal" / name.namespace / name.topic).exists() for b in brokers),
            timeout_s=20, what="the replica logs deleted with the topic",
        )


async def test_an_owner_killed_before_it_wrote_rejoins_as_a_follower(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    """An owner that began its leader epoch and died before writing a batch in it: its log's
    latest epoch is one the next owner never saw. Back, it truncates by epoch (dropping the empty
    epoch, KIP-279's "ask again for the epoch below") and follows again; it does not loop."""
    brokers = [start_broker(extra_args=ARGS) for _ in range(3)]
    name = TopicName.parse(TOPIC)
    async with replicated_topic(etcd_endpoints, brokers) as (meta, client):
        async with client.producer(TOPIC, producer_name="p", max_batch_messages=10) as producer:
            for i in range(50):
                await producer.send(f"m{i}".encode())
        await eventually(lambda: full_isr(meta, name), timeout_s=20, what="three in-sync replicas")
        first = by_id(brokers, await owner_of(meta, name) or 0)
        first.kill()

        async def taken_over() -> bool:
            record = await isr_record(meta, name)
            return record is not None and record.owner != first.broker_id

        await eventually(taken_over, timeout_s=20, what="the second owner's ISR record")
        second = by_id(brokers, await owner_of(meta, name) or 0)
        second.kill()  # nothing was produced meanwhile: its epoch holds no batch
        third = next(b for b in brokers if b not in (first, second))
        await eventually(lambda: owner_of_is(meta, name, third.broker_id), timeout_s=20, what="the third owner")
        first.start()
        second.start()
        await eventually(lambda: full_isr(meta, name), timeout_s=30, what="both back in the ISR")
        async with client.producer(TOPIC, producer_name="q") as producer:
            await producer.send(b"after")
        await eventually(
            lambda: len({tuple(log_batches(b, name)) for b in brokers}) == 1, timeout_s=20, what="identical logs"
        )


async def owner_of_is(meta: MetadataStore, name: TopicName, broker_id: int) -> bool:
    return await owner_of(meta, name) == broker_id
