"""Handoff without gaps across a failover: a subscription reading the table when its owner dies.

Two real brokers run with ``--cold-read-path iceberg`` on one SQLite catalog, a 2 s lease and
offset blocks of 1000 (``docs/etcd-layout.md`` §1.2, §5.4), and store a subscription's cursor
after every 150 acks (never on a timer here). The topic's table keeps exact bytes
(``raw_payload``, §3.9) and its object lifecycle is ``after-commit`` (§2.1, set by the topic's
override, §3.8): an object is deleted once its offsets are committed, and the table is then
their only cold copy.

At the start 0..119 are in the table only, 120..239 in a segment object only and 240..299 in
the owner's WAL only. One consumer reads from EARLIEST: the table, then the object. Once its
cursor is stored at 149 (with the table snapshot of 0..119, offset 120: §3.5.1), 120..239 are
committed to the table and their object deleted, and the consumer reads on from the table;
150..189 are acknowledged (taken by the broker, not stored) and 190..209 received and held
when the owner is SIGKILLed. The client subscribes again by itself on the other broker, which
took the topic once the dead owner's lease expired. It reads the table from the stored cursor
with an incremental append scan after the stored snapshot; at the dead owner's unavailable
range (§5.5) it waits until that broker's disk returns and its WAL's tail is tiered, reads that
object, passes over the offsets the dead owner never handed out, and reads its own WAL
(1000..1059, published after the kill).

The check is Jepsen-style, over every delivery recorded: no published offset is missing,
nothing unpublished arrives, every delivery carries the payload, attributes, key and producer
that were published, and an offset delivered twice is one the subscription had not durably
acknowledged when the broker died: above the cursor stored in etcd then. That is the
documented at-least-once window of cursor persistence (§3.5: acks since the last write are
lost if the broker crashes, and those messages are redelivered); every offset of it that was
delivered before the kill is delivered again, and the new owner's stream delivers each offset
from the stored cursor on once, in order.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import broker_config_args, eventually
from tiering_helpers import TableStorage

from danube_pipeline.client import Consumer, DanubeClient, InitialPosition, Message
from danube_pipeline.client.types import SubscriptionInfo
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.lake.tiering import commit_objects_to_table, tier_sealed_segments
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import ObjectDescriptor, TableLayout, TableSnapshot, UnavailableRange
from danube_pipeline.names import TopicName
from danube_pipeline.schemas.registry import SchemaRegistry
from danube_pipeline.storage.objectstore import segment_object_path
from danube_pipeline.storage.table_properties import committed_end_offset

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

TOPIC = "/default/coldfailover"
TABLE = ("default", "coldfailover")
CATALOG = "coldfailover"
SUBSCRIPTION = "survives"
CHUNK = 60  # messages per publish
FIRST_COMMIT = 2 * CHUNK  # 0..119: in the table from the start
SECOND_COMMIT = 4 * CHUNK  # 120..239: an object, committed to the table (and deleted) mid-read
WAL_END = 5 * CHUNK  # 240..299: only in the WAL of the owner that dies
BLOCK = 1000  # --offset-block: the new owner starts at 1000
FLUSH_ACKS = 150  # the cursor is stored after every 150 acks: once here, at 149
DURABLE = FLUSH_ACKS - 1  # the cursor stored when the owner dies
ACKED, HELD = 190, 20  # before the kill: 0..189 acknowledged, 190..209 received and held


def producer(i: int) -> str:
    """The producer of offset ``i``: two take turns by chunk before the kill, a third after."""
    return "after" if i >= BLOCK else f"p{i // CHUNK % 2}"


def published(i: int) -> tuple[bytes, dict[str, str], str | None, str]:
    """What was published at offset ``i``: payload, attributes, key, producer name."""
    payload = bytes([i % 256, 0, 255]) + f"message {i}".encode() * (1 + i % 4)
    return payload, ({"i": str(i)} if i % 3 else {}), (f"k{i % 4}" if i % 5 else None), producer(i)


def seen(m: Message) -> tuple[bytes, dict[str, str], str | None, str]:
    return m.payload, dict(m.attributes), m.key, m.producer_name


async def test_a_table_reader_survives_its_owners_sigkill_every_offset_delivered(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    storage = TableStorage(tmp_path, CATALOG)
    objects = storage.objects
    config = {"cursor_flush_acks": FLUSH_ACKS, "cursor_flush_interval_s": 3600}
    args = storage.broker_args(
        "--cold-read-path", "iceberg", "--lease-ttl-s", "2", "--offset-block", str(BLOCK), "--object-cache-bytes", "1",
        *broker_config_args(tmp_path / "broker.yml", config),
    )  # fmt: skip
    options: dict[str, Any] = {"segment_max_bytes": 1 << 20, "extra_args": args, "env": storage.broker_env()}
    brokers = [start_broker(**options), start_broker(**options)]
    topic = TopicName.parse(TOPIC)
    catalog = storage.catalog()
    expected = [*range(WAL_END), *range(BLOCK, BLOCK + CHUNK)]
    deliveries: list[Message] = []  # every delivery, in arrival order
    async with (
        DanubeClient([b.address for b in brokers], metadata_retries=40, retry_backoff_ms=250) as client,
        await MetadataStore.connect(etcd_endpoints) as meta,
    ):

        async def publish(first: int, end: int) -> None:
            """Publish the messages of offsets ``first..end - 1``, a producer per chunk."""
            for chunk in range(first, end, CHUNK):
                async with client.producer(TOPIC, producer_name=producer(chunk), max_batch_messages=7) as sender:
                    futures = []
                    for i in range(chunk, chunk + CHUNK):
                        payload, attributes, key, _ = published(i)
                        futures.append(sender.send_nowait(payload, attributes=attributes or None, key=key))
                    assert list(await asyncio.gather(*futures)) == list(range(chunk, chunk + CHUNK))

        async def commit() -> None:
            """Commit the objects to the table (after-commit: then they are deleted)."""
            await commit_objects_to_table(topic, store=meta, objects=objects, catalog=catalog, registry=SchemaRegistry(meta))

        async def tier() -> None:
            await client.admin.seal_active_segment(TOPIC)
            await tier_sealed_segments(topic, store=meta, admin=client.admin, objects=objects)

        async def objects_held() -> list[int]:
            """The first offsets of the segment objects that exist."""
            kvs, _ = await meta.get_prefix(keys.objects_prefix(topic))
            held = [ObjectDescriptor.from_json(kv.value) for kv in kvs if kv.key != keys.objects_cur(topic)]
            return [d.start_offset for d in held if objects.exists(segment_object_path(topic, d.object_id))]

        async def stored_cursor() -> int | None:
            kv = await meta.get(keys.subscription_cursor(topic, SUBSCRIPTION))
            if kv is None:
                return None
            value = kv.value
            assert isinstance(value, int)
            return value

        async def subscription() -> SubscriptionInfo:
            described = await client.admin.describe_topic(TOPIC)
            return next(s for s in described.subscriptions if s.name == SUBSCRIPTION)

        async def take(consumer: Consumer, last: int, *, ack: bool) -> None:
            """Receive (and ``ack``) up to offset ``last``."""
            while not deliveries or deliveries[-1].offset < last:
                message = await consumer.receive(timeout_ms=30_000)
                deliveries.append(message)
                if ack:
                    await consumer.ack(message)

        await meta.put(keys.topic_table(topic), TableLayout(raw_payload=True))
        await meta.put(keys.topic_policy(topic), {"object_lifecycle": "after-commit"})
        await publish(0, FIRST_COMMIT)
        await tier()
        await commit()
        await publish(FIRST_COMMIT, SECOND_COMMIT)
        await tier()
        assert (await client.admin.apply_local_retention(TOPIC, retention_bytes=0)).first_local_offset == SECOND_COMMIT
        await publish(SECOND_COMMIT, WAL_END)  # never tiered by this owner
        first = catalog.load_table(TABLE).current_snapshot()
        assert first is not None and committed_end_offset(catalog.load_table(TABLE)) == FIRST_COMMIT - 1
        assert await objects_held() == [FIRST_COMMIT]

        owner_id = (await client.lookup_topic(TOPIC)).broker_id
        owner = next(b for b in brokers if b.broker_id == owner_id)
        consumer = await client.consumer(
            TOPIC, subscription=SUBSCRIPTION, initial_position=InitialPosition.EARLIEST,
            receiver_queue_size=16,
        ).open()  # fmt: skip
        try:
            await take(consumer, DURABLE, ack=True)

            async def cursor_stored() -> bool:
                return await stored_cursor() == DURABLE

            await eventually(cursor_stored, timeout_s=10, what=f"the cursor stored at {DURABLE}")
            # the table and the object have served; now the object's offsets go to the table
            await commit()
            assert committed_end_offset(catalog.load_table(TABLE)) == SECOND_COMMIT - 1
            assert await objects_held() == []
            await take(consumer, ACKED - 1, ack=True)  # 40 acks: not stored (150 would be)

            async def acked_on_broker() -> bool:
                return (await subscription()).cursor == ACKED - 1

            await eventually(acked_on_broker, timeout_s=10, what=f"the broker took the acks up to {ACKED - 1}")
            await take(consumer, ACKED + HELD - 1, ack=False)
            before = await subscription()
            assert before.records_from_table > FIRST_COMMIT  # some of 120..239 came from the table
            before_kill = len(deliveries)

            owner.kill()
            # what the subscription had stored when the owner died (nobody writes it until
            # the topic is assigned again): the cursor, and the snapshot of the first commit
            durable = await stored_cursor()
            assert durable == DURABLE
            snapshot_at_kill = await meta.get(keys.subscription_table_snapshot(topic, SUBSCRIPTION))
            assert snapshot_at_kill is not None
            assert TableSnapshot.from_json(snapshot_at_kill.value) == TableSnapshot(
                snapshot_id=first.snapshot_id, offset=FIRST_COMMIT
            )  # so the new owner's first table read is an incremental scan after it

            async def read_on() -> None:
                """Receive and ack until every expected offset arrived."""
                missing = set(expected) - {m.offset for m in deliveries}
                while missing:
                    message = await consumer.receive(timeout_ms=30_000)
                    deliveries.append(message)
                    missing.discard(message.offset)
                    await consumer.ack(message)

            reader = asyncio.create_task(read_on())
            try:
                await publish(BLOCK, BLOCK + CHUNK)  # to the new owner, past the dead owner's block
                assert (await client.lookup_topic(TOPIC)).broker_id != owner_id
                # the dead broker's disk returns: fenced, it records where its writes ended,
                # and tiering brings its WAL's tail to object storage
                returned = start_broker(data_dir=owner.data_dir, **options)
                assert returned.broker_id == owner_id

                async def last_written_recorded() -> bool:
                    kvs, _ = await meta.get_prefix(keys.unavailable_prefix(topic))
                    return [UnavailableRange.from_json(kv.value).last_written for kv in kvs] == [WAL_END - 1]

                await eventually(last_written_recorded, timeout_s=20, what="the returned broker records its last offset")
                await tier()
                await asyncio.wait_for(asyncio.shield(reader), timeout=30)
            finally:
                reader.cancel()
            with pytest.raises(TimeoutError):
                deliveries.append(await consumer.receive(timeout_ms=300))
            after = await subscription()
        finally:
            await consumer.close()
        stored = await meta.get(keys.subscription_table_snapshot(topic, SUBSCRIPTION))
        current = catalog.load_table(TABLE).current_snapshot()

    offsets = [m.offset for m in deliveries]
    counts = collections.Counter(offsets)
    assert set(counts) == set(expected)  # none missing, none made up
    wrong = [m.offset for m in deliveries if seen(m) != published(m.offset)]
    assert not wrong  # byte for byte, attributes, key and producer too
    twice = {o for o, n in counts.items() if n > 1}
    assert all(o > durable for o in twice), sorted(o for o in twice if o <= durable)  # only above the durable cursor
    assert set(range(durable + 1, ACKED + HELD)) <= twice  # what was delivered of the window came back
    assert offsets[:before_kill] == list(range(ACKED + HELD))
    resumed = offsets[before_kill:]  # the old stream's queued messages may come first
    resumed = resumed[resumed.index(durable + 1) :]
    assert resumed == expected[durable + 1 :]  # the new owner's stream: in order, each once
    # the new owner read the table from the stored cursor, then the returned broker's object
    assert (after.records_from_table, after.records_from_object_storage) == (
        SECOND_COMMIT - durable - 1, WAL_END - durable - 1,
    )  # fmt: skip
    assert after.skipped_below_retention == after.skipped_unavailable == 0
    assert stored is not None and current is not None
    # the table's last snapshot, at an offset at or past its end (asked again at each object)
    final = TableSnapshot.from_json(stored.value)
    assert final.snapshot_id == current.snapshot_id and SECOND_COMMIT <= final.offset <= WAL_END
