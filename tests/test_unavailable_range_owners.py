"""Issue 21 #14: unavailable ranges (``docs/etcd-layout.md`` §5.5) recorded by different owners
must never overwrite each other.

A release records the offsets only the releasing owner holds as a range keyed by its start.
That start used to be "tiered end + 1" whatever the owner held, so after a failover (the
failed owner's block recorded as a range from the tiered end) or a release by an earlier
owner, the next owner's release wrote a range at the same key and replaced the earlier
owner's: tiering then waited for ever for offsets the new owner never had.

The first test runs the issue's sequence on real etcd and real broker processes: SIGKILL an
owner (failover: its block becomes its range), its disk returns, then the topic moves (the
survivor's release records a range). The others use real etcd and the real ownership and
release code in in-process brokers run one after the other on separate data directories; there
the first owner's "failure" is the broker closed without a release and its assignment moved
to the second broker, the etcd writes a failover makes (no process needs to die for the key
collision).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.format.batches import BatchBuilder
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.schemas.registry import SchemaRegistry
from danube_pipeline.storage.objectstore import ObjectStore
from danube_pipeline.lake.tiering import tier_sealed_segments

from broker.cluster.ownership import commit_takeover, plan_takeover, uncovered_pieces
from broker.config import BrokerConfig
from broker.core import Broker

from helpers import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

BLOCK = 10
FIRST, SECOND = 1401, 1402


def _batch(producer_id: int, producer_name: str, count: int) -> bytes:
    builder = BatchBuilder(1)
    for i in range(count):
        builder.append(f"m{i}".encode(), timestamp_us=1)
    return builder.build(producer_id=producer_id, producer_name=producer_name, base_sequence=0)


async def _broker(tmp_path: Path, endpoints: list[str], broker_id: int) -> tuple[Broker, LocalCache]:
    store = await MetadataStore.connect(endpoints)
    cache = LocalCache(store, prefixes=("/",))
    await cache.start()
    config = BrokerConfig(
        data_dir=tmp_path / f"broker-{broker_id}", etcd_endpoints=endpoints,
        object_store_url=(tmp_path / "objects").as_uri(), offset_block=BLOCK,
    )
    broker = Broker(config, broker_id, store=store, cache=cache, registry=SchemaRegistry(store, cache=cache))
    return broker, cache


async def _owns_and_writes(tmp_path: Path, endpoints: list[str], broker_id: int, name: TopicName,
                           count: int, *, release: bool) -> tuple[int, int]:
    """Start ``broker_id`` on ``name`` (already assigned to it), publish ``count`` messages,
    then release the topic (``release``) or stop without releasing (a failure)."""
    broker, cache = await _broker(tmp_path, endpoints, broker_id)
    store = broker.store
    try:
        await broker.start()
        await eventually(lambda: name.path in broker.topics, timeout_s=10, what=f"broker {broker_id} loads the topic")
        producer = await broker.create_producer(name.path, f"p{broker_id}", access_mode=0)
        offsets = await broker.publish(producer.id, _batch(producer.id, f"p{broker_id}", count))
        if release:
            await broker.release_topic(name)
        return offsets
    finally:
        await broker.close()
        await cache.stop()
        await store.close()


async def _ranges(store: MetadataStore, name: TopicName) -> list[tuple[int, int, int]]:
    kvs, _ = await store.get_prefix(keys.unavailable_prefix(name))
    out = []
    for kv in kvs:
        rng = values.UnavailableRange.from_json(kv.value)
        assert kv.key == keys.unavailable_range(name, rng.start_offset)
        out.append((rng.start_offset, rng.end_offset, rng.broker_id))
    return sorted(out)


async def test_a_move_after_a_failover_keeps_the_failed_owners_range_and_tiers_everything(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """Real brokers. The owner acks 0..299 and is killed; the survivor takes over past its
    block (range 0..999 of the dead owner) and acks 1000..1099; the dead broker's disk returns
    and records its last offset (299). Then the topic is moved: the survivor's release records
    its own untiered offsets. It must not replace the dead owner's range: tiering reaches
    1099 and every acked message reads back at its offset."""
    url = (tmp_path / "objects").as_uri()
    args = ["--object-store-url", url, "--lease-ttl-s", "2", "--offset-block", "1000"]
    brokers = [start_broker(extra_args=args), start_broker(extra_args=args)]
    topic = "/default/range-after-failover"
    name = TopicName.parse(topic)
    async with (
        DanubeClient([b.address for b in brokers], metadata_retries=40, retry_backoff_ms=250) as client,
        await MetadataStore.connect(etcd_endpoints) as meta,
    ):
        await client.admin.create_topic(topic)
        owner_id = (await client.lookup_topic(topic)).broker_id
        owner = next(b for b in brokers if b.broker_id == owner_id)
        survivor = next(b for b in brokers if b.broker_id != owner_id)
        acked: dict[int, bytes] = {}
        async with client.producer(topic, producer_name="before", max_batch_messages=10) as producer:
            for i in range(300):
                acked[await producer.send(f"m{i}".encode())] = f"m{i}".encode()
        owner.kill()
        async with client.producer(topic, producer_name="after", max_batch_messages=10) as producer:
            for i in range(300, 400):
                acked[await producer.send(f"m{i}".encode())] = f"m{i}".encode()
        assert min(o for o in acked if o >= 300) == 1000
        returned = start_broker(data_dir=owner.data_dir, extra_args=args)

        async def last_written_recorded() -> bool:
            kvs, _ = await meta.get_prefix(keys.unavailable_prefix(name))
            return [values.UnavailableRange.from_json(kv.value).last_written for kv in kvs] == [299]

        await eventually(last_written_recorded, timeout_s=20, what="the returned broker records its last offset")
        assert await client.admin.unload_topic(topic) == 1100  # the survivor releases 1000..1099
        assert await _ranges(meta, name) == [(0, 999, owner_id), (1000, 1099, survivor.broker_id)]
        await eventually(
            lambda: _owned_by(meta, name, returned.broker_id), timeout_s=20, what="the topic moves to the returned broker"
        )
        report = await asyncio.wait_for(
            tier_sealed_segments(name, store=meta, admin=client.admin, objects=ObjectStore(url)), timeout=30
        )
        assert (report.first_offset, report.last_offset) == (0, 1099)
        read = {}
        async with client.consumer(topic, subscription="all", initial_position=InitialPosition.EARLIEST) as consumer:
            for _ in range(len(acked)):
                message = await consumer.receive(timeout_ms=15_000)
                read[message.offset] = message.payload
                await consumer.ack(message)
        assert read == acked


async def _owned_by(meta: MetadataStore, name: TopicName, broker_id: int) -> bool:
    return await meta.get(keys.topic_assignment(broker_id, name)) is not None


@pytest.mark.parametrize("first_leaves", ["failover", "release"])
async def test_a_release_after_an_earlier_owner_left_a_range_keeps_that_range(
    tmp_path: Path, etcd_endpoints: list[str], first_leaves: str
) -> None:
    """The first owner writes offsets 0..4 and leaves: it fails (its block 0..9 becomes its
    range, recorded by the next owner) or it releases (its range 0..4). The second owner
    writes its own offsets and releases the topic, nothing tiered yet. The first owner's range
    must survive, and the second owner's range must cover only its own offsets."""
    name = TopicName.parse(f"/default/ranges-{first_leaves}")
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        await meta.put_many([
            (keys.topic_root(name), 0), (keys.namespace_topic(name), None), (keys.topic_assignment(FIRST, name), None),
        ])
        assert await _owns_and_writes(tmp_path, etcd_endpoints, FIRST, name, 5, release=first_leaves == "release") == (0, 4)
        # The leader's move: the first owner's assignment goes (failover) or the queue entry is
        # taken (release), and the topic is assigned to the second broker.
        await meta.transaction(
            deletes=[keys.topic_assignment(FIRST, name), keys.unassigned_topic(name)],
            puts=[(keys.topic_assignment(SECOND, name), None)],
        )
        first_range = (0, BLOCK - 1, FIRST) if first_leaves == "failover" else (0, 4, FIRST)
        second_from = BLOCK if first_leaves == "failover" else 5
        assert await _owns_and_writes(tmp_path, etcd_endpoints, SECOND, name, 3, release=True) == (
            second_from, second_from + 2
        )
        assert await _ranges(meta, name) == [first_range, (second_from, second_from + 2, SECOND)]


async def test_a_takeover_does_not_overwrite_a_recorded_range(tmp_path: Path, etcd_endpoints: list[str]) -> None:
    """A failed owner's block whose head is already covered by a recorded range (here an
    earlier owner's, as a stale or repeated record would be): the takeover records only the
    uncovered rest, created, and leaves the recorded range as it was."""
    name = TopicName.parse("/default/ranges-takeover")
    earlier = values.UnavailableRange(start_offset=0, end_offset=3, broker_id=7, since=1, last_written=3)
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        await meta.put_many([
            (keys.topic_root(name), 0), (keys.namespace_topic(name), None),
            (keys.topic_assignment(SECOND, name), None),
            (keys.offset_reservation(name), values.OffsetReservation(
                broker_id=FIRST, owner_epoch=1, first_offset=0, end_offset=BLOCK - 1)),
            (keys.unavailable_range(name, 0), earlier),
        ])
        plan = await plan_takeover(meta, name, SECOND, wal_holds_data=False, tiered_end=None)
        await commit_takeover(meta, name, SECOND, plan, plan.floor, block=BLOCK, wal_holds_data=False, tiered_end=None)
        assert await _ranges(meta, name) == [(0, 3, 7), (4, BLOCK - 1, FIRST)]
        kv = await meta.get(keys.unavailable_range(name, 0))
        assert kv is not None and values.UnavailableRange.from_json(kv.value) == earlier


async def test_uncovered_pieces_start_past_and_split_around_recorded_ranges() -> None:
    def rng(start: int, end: int) -> values.UnavailableRange:
        return values.UnavailableRange(start_offset=start, end_offset=end, broker_id=1, since=0)

    assert uncovered_pieces(0, 9, []) == [(0, 9)]
    assert uncovered_pieces(411, 2509, [rng(411, 615)]) == [(616, 2509)]
    assert uncovered_pieces(0, 20, [rng(5, 7), rng(12, 14)]) == [(0, 4), (8, 11), (15, 20)]
    assert uncovered_pieces(3, 9, [rng(0, 20)]) == []
    assert uncovered_pieces(0, 9, [rng(10, 20)]) == [(0, 9)]
