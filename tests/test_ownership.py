"""Owner epochs and reserved offset blocks (``broker/cluster/ownership.py``, ``docs/etcd-layout.md``
§1.4, §5.4, §5.5) against a real etcd and a real WAL: an owner whose assignment changed hands
cannot reserve offsets, store cursors or write batches past its block."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from danube_pipeline.format.batches import BatchBuilder
from danube_pipeline.errors import MetadataStoreError, NotServedHereError
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.etcd import KeyValue
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName

from broker.cluster.ownership import Ownership, TakeoverPlan, commit_takeover, plan_takeover, record_last_written
from broker.cluster.takeover_reads import TOPICS_PER_READ, TakeoverReader, TakeoverReads
from broker.storage.wal import WriteAheadLog

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

TOPIC = TopicName.parse("/default/fenced")
OLD, NEW = 11, 22


def batch(count: int) -> bytes:
    builder = BatchBuilder(1)
    for i in range(count):
        builder.append(f"m{i}".encode(), timestamp_us=1)
    return builder.build(producer_id=1, producer_name="p")


async def take(
    meta: MetadataStore, broker_id: int, next_offset: int | None = None, *, block: int = 10
) -> tuple[Ownership, TakeoverPlan]:
    plan = await plan_takeover(meta, TOPIC, broker_id, wal_holds_data=False, tiered_end=None)
    ownership, plan = await commit_takeover(
        meta, TOPIC, broker_id, plan, plan.floor if next_offset is None else next_offset, block=block,
        wal_holds_data=False, tiered_end=None,
    )
    return ownership, plan


async def test_an_owner_whose_assignment_changed_hands_is_fenced(etcd_endpoints: list[str], tmp_path: Path) -> None:
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        await meta.put(keys.topic_assignment(OLD, TOPIC), None)
        old, plan = await take(meta, OLD)
        assert (plan.floor, plan.unavailable, old.reserved_end) == (0, None, 9)
        wal = await WriteAheadLog.open(tmp_path / "wal")
        wal.offset_guard = old
        try:
            assert await wal.append(batch(8), 8) == (0, 7)  # inside the block: no etcd write
            assert old.reservations == 0
            assert await wal.append(batch(5), 5) == (8, 12)  # past it: the block is extended first
            assert old.reservations == 1 and old.reserved_end == 12 + 10 - 1
            await old.put(keys.subscription_cursor(TOPIC, "s"), 4)

            # The leader fails OLD over and NEW takes the topic: it starts past OLD's block, and
            # OLD's block becomes an unavailable range.
            await meta.transaction(deletes=[keys.topic_assignment(OLD, TOPIC)])
            await meta.put(keys.topic_assignment(NEW, TOPIC), None)
            new, plan = await take(meta, NEW)
            assert plan.floor == 22 and new.first_offset == 22
            assert plan.unavailable is not None
            assert (plan.unavailable.start_offset, plan.unavailable.end_offset, plan.unavailable.broker_id) == (0, 21, OLD)

            # OLD, still running, can fill its block but not go past it, nor store a cursor.
            assert await wal.append(batch(9), 9) == (13, 21)
            with pytest.raises(NotServedHereError):
                await wal.append(batch(1), 1)
            assert wal.next_offset == 22  # the refused offsets were handed back, nothing written
            with pytest.raises(NotServedHereError):
                await old.put(keys.subscription_cursor(TOPIC, "s"), 20)
            cursor = await meta.get(keys.subscription_cursor(TOPIC, "s"))
            assert cursor is not None and cursor.value == 4
            assert old.fenced
        finally:
            await wal.close()

        # OLD records where its writes ended: offsets 22.. of its block were never handed out.
        assert await record_last_written(meta, TOPIC, OLD, 21)
        kvs, _ = await meta.get_prefix(keys.unavailable_prefix(TOPIC))
        (rng,) = [values.UnavailableRange.from_json(kv.value) for kv in kvs]
        assert (rng.last_written, rng.unused_from()) == (21, 22)
        reservation = await meta.get(keys.offset_reservation(TOPIC))
        assert reservation is not None
        reserved = values.OffsetReservation.from_json(reservation.value)
        assert reserved.broker_id == NEW
        assert reserved.owner_epoch == new.epoch != old.epoch


async def test_a_released_topic_continues_right_after_the_last_offset(etcd_endpoints: list[str]) -> None:
    """A release shrinks the block to the last offset handed out and writes the sealed state:
    the next owner continues there, with no unavailable range (§5.3, §5.4)."""
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        await meta.put(keys.topic_assignment(OLD, TOPIC), None)
        old, _ = await take(meta, OLD, block=100)
        await meta.transaction(
            created=old.guard,
            puts=[
                (keys.offset_reservation(TOPIC), old.reservation(41)),
                (keys.sealed_state(TOPIC), values.SealedState(sealed=True, last_committed_offset=41, broker_id=OLD, timestamp=1)),
            ],
            deletes=[keys.topic_assignment(OLD, TOPIC)],
        )
        await meta.put(keys.topic_assignment(NEW, TOPIC), None)
        _, plan = await take(meta, NEW)
        assert (plan.floor, plan.unavailable) == (42, None)


async def test_the_same_owner_restarting_goes_on_in_its_block(etcd_endpoints: list[str], tmp_path: Path) -> None:
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        await meta.put(keys.topic_assignment(OLD, TOPIC), None)
        await take(meta, OLD, block=100)
        wal_dir = tmp_path / "wal"
        wal = await WriteAheadLog.open(wal_dir)
        await wal.append(batch(30), 30)
        await wal.close()
        plan = await plan_takeover(meta, TOPIC, OLD, wal_holds_data=True, tiered_end=None)
        assert plan.continuing and plan.unavailable is None
        ownership, _ = await commit_takeover(
            meta, TOPIC, OLD, plan, 30, block=100, wal_holds_data=True, tiered_end=None
        )
        assert (ownership.first_offset, ownership.reserved_end) == (0, 99)


async def test_the_takeover_reader_shares_transactions_between_topics_loading_at_once(
    etcd_endpoints: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    names = [TopicName.parse(f"/default/load{i}") for i in range(TOPICS_PER_READ + 8)]
    async with await MetadataStore.connect(etcd_endpoints) as meta:
        for i, name in enumerate(names):
            if i % 2 == 0:
                await meta.put(keys.topic_assignment(NEW, name), None)
        await meta.put(keys.sealed_state(names[3]), {"last_committed_offset": 41})
        calls: list[int] = []
        real_get_many = meta.get_many

        async def counted(keys_read: list[str]) -> list[KeyValue | None]:
            calls.append(len(keys_read))
            return await real_get_many(keys_read)

        monkeypatch.setattr(meta, "get_many", counted)
        reader = TakeoverReader(meta, NEW)
        reads = await asyncio.gather(*(reader.read(name) for name in names))
        # one read in flight, then the rest in one more: 2 transactions for 40 topics
        assert calls == [4 * TOPICS_PER_READ, 4 * 8]
        for i, (name, got) in enumerate(zip(names, reads)):
            assert got == await TakeoverReads.read(meta, name, NEW)  # the same as one topic's own read
            assert (got.assignment is not None) == (i % 2 == 0)
        assert reads[3].sealed is not None and reads[3].sealed.value == {"last_committed_offset": 41}

        async def failing(keys_read: list[str]) -> list[KeyValue | None]:
            raise MetadataStoreError("get_many", "etcd cut off (FAKE: a failure injected into the read)")

        monkeypatch.setattr(meta, "get_many", failing)
        results = await asyncio.gather(*(reader.read(name) for name in names[:3]), return_exceptions=True)
        assert [type(r) for r in results] == [MetadataStoreError] * 3
