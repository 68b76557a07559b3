"""Issue 21 #9: two tiering writers at once (the continuous writer and the Dagster asset both
run ``tier_sealed_segments``) never un-complete a descriptor, never move ``objects/cur``
backwards, and register each segment exactly once (``docs/etcd-layout.md`` §5.1, §5.2).

Everything is real: the session etcd, a broker process with small segments, and the tiering
step writing to a ``file://`` object store. A watch on the topic's ``objects/`` prefix records
every descriptor and cursor write, so a transient bad write shows even when the end state is
right.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers import eventually

from danube_pipeline.client import DanubeClient
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.lake.tiering import TieringReport, tier_sealed_segments
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.descriptors import complete_descriptor, create_descriptor, read_descriptors
from danube_pipeline.metadata.store import MetadataStore, WatchEvent, WatchEventType
from danube_pipeline.metadata.values import ObjectDescriptor, ObjectsCursor
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

SEGMENT_BYTES = 4 * 1024
MESSAGES = 3000


class ObjectWrites:
    """Every write under a topic's ``objects/`` prefix, in revision order, checked as it comes."""

    def __init__(self, topic: TopicName) -> None:
        self.cur_key = keys.objects_cur(topic)
        self.completed: set[str] = set()
        self.uncompleted: list[str] = []
        self.cursor_moves_back: list[tuple[int, int]] = []
        self.cursor = -1
        self.deletes: list[str] = []

    def apply(self, event: WatchEvent) -> None:
        if event.type is WatchEventType.DELETE:
            self.deletes.append(event.key)
            return
        if event.key == self.cur_key:
            start = int(ObjectsCursor.from_json(event.value).start)
            if start < self.cursor:
                self.cursor_moves_back.append((self.cursor, start))
            self.cursor = max(self.cursor, start)
            return
        descriptor = ObjectDescriptor.from_json(event.value)
        if descriptor.completed:
            self.completed.add(event.key)
        elif event.key in self.completed:
            self.uncompleted.append(event.key)


async def test_two_concurrent_writers_never_uncomplete_or_move_the_cursor_back(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="danube_pipeline.lake.tiering.segments")
    objects_url = (tmp_path / "objects").as_uri()
    broker = start_broker(
        segment_max_bytes=SEGMENT_BYTES,
        extra_args=["--object-store-url", objects_url, "--local-retention-check-s", "3600"],
    )
    topic = "/default/two-writers"
    name = TopicName.parse(topic)
    objects = ObjectStore(objects_url)
    async with DanubeClient([broker.address]) as client, await MetadataStore.connect(
        etcd_endpoints
    ) as watcher, await MetadataStore.connect(etcd_endpoints) as meta_a, await MetadataStore.connect(
        etcd_endpoints
    ) as meta_b:
        async with client.producer(topic, producer_name="p", max_batch_messages=20) as producer:
            for i in range(MESSAGES):
                producer.send_nowait(f"message {i:06d} ".encode() * 3)
            await producer.flush()
        await client.admin.seal_active_segment(topic)
        sealed = [s for s in await client.admin.list_sealed_segments(topic) if s.end_offset >= s.start_offset]
        assert len(sealed) >= 20, len(sealed)

        _, revision = await watcher.get_prefix(keys.objects_prefix(name))
        writes = ObjectWrites(name)

        async def follow() -> None:
            async for event in watcher.watch_prefix(keys.objects_prefix(name), start_revision=revision + 1):
                writes.apply(event)

        follower = asyncio.get_running_loop().create_task(follow())
        try:
            # A second writer that starts while the first is under way (it read the
            # descriptors before the first completed the ones it then reaches), then two
            # writers that start together.
            first = asyncio.create_task(tier_sealed_segments(name, store=meta_a, admin=client.admin, objects=objects))
            await eventually(lambda: len(writes.completed) >= 2, timeout_s=20, what="the first writer got going")
            second = asyncio.create_task(tier_sealed_segments(name, store=meta_b, admin=client.admin, objects=objects))
            reports: list[TieringReport] = list(await asyncio.gather(first, second))

            more = MESSAGES // 2
            async with client.producer(topic, producer_name="q", max_batch_messages=20) as producer:
                for i in range(more):
                    producer.send_nowait(f"message {MESSAGES + i:06d} ".encode() * 3)
                await producer.flush()
            await client.admin.seal_active_segment(topic)
            reports += await asyncio.gather(
                tier_sealed_segments(name, store=meta_a, admin=client.admin, objects=objects),
                tier_sealed_segments(name, store=meta_b, admin=client.admin, objects=objects),
            )
            sealed = [s for s in await client.admin.list_sealed_segments(topic) if s.end_offset >= s.start_offset]
            final = await watcher.get(keys.objects_cur(name))
            assert final is not None
            await eventually(lambda: writes.cursor == int(ObjectsCursor.from_json(final.value).start),
                             what="the watch saw the last cursor write")
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower

        assert (writes.uncompleted, writes.cursor_moves_back) == ([], []), (
            f"{len(writes.uncompleted)} completed descriptors rewritten as completed=false, "
            f"objects/cur moved backwards {len(writes.cursor_moves_back)} times: {writes.cursor_moves_back}"
        )
        assert writes.deletes == []
        assert "another tiering writer got there first" in caplog.text, "the writers never raced"
        # Each segment registered exactly once: the loser of a race counts nothing.
        assert sum(r.objects_written for r in reports) == len(sealed)
        kvs, _ = await watcher.get_prefix(keys.objects_prefix(name))
        descriptors = [ObjectDescriptor.from_json(kv.value) for kv in kvs if kv.key != keys.objects_cur(name)]
        assert all(d.completed for d in descriptors)
        assert [(d.start_offset, d.end_offset) for d in descriptors] == [(s.start_offset, s.end_offset) for s in sealed]
        assert ObjectsCursor.from_json(final.value).start == keys.pad_offset(sealed[-1].start_offset)
        for d in descriptors:
            info = objects.info(f"topics/default/two-writers/{d.object_id}", compute_etag=True)
            assert info is not None and info.size_bytes == d.size and info.etag == d.etag


def _descriptor(start: int, end: int, *, completed: bool) -> ObjectDescriptor:
    return ObjectDescriptor(
        completed=completed, created_at=1, end_offset=end, etag="0" * 32 if completed else None,
        object_id=f"data-{start}-{end}.dnb1", offset_index=[[start, 32]] if completed else [], size=100,
        start_offset=start,
    )


async def test_descriptor_writes_compare_and_the_cursor_only_moves_forward(etcd_endpoints: list[str]) -> None:
    name = TopicName.parse("/default/cas")
    async with await MetadataStore.connect(etcd_endpoints) as store:
        created = await create_descriptor(store, name, _descriptor(10, 19, completed=False))
        assert created is not None
        assert await create_descriptor(store, name, _descriptor(10, 19, completed=False)) is None
        created_first = await create_descriptor(store, name, _descriptor(0, 9, completed=False))
        assert created_first is not None

        # The newer object completes first; completing the older one leaves the cursor alone.
        assert await complete_descriptor(store, name, _descriptor(10, 19, completed=True), expected_mod_revision=created)
        assert await complete_descriptor(store, name, _descriptor(0, 9, completed=True), expected_mod_revision=created_first)
        descriptors, cur = await read_descriptors(store, name)
        assert [d.completed for d in descriptors] == [True, True]
        assert cur == keys.pad_offset(10)

        # A second completion from the same stale read loses: nothing changes.
        before = await store.get(keys.object_descriptor(name, 10))
        assert not await complete_descriptor(store, name, _descriptor(10, 19, completed=True), expected_mod_revision=created)
        assert await store.get(keys.object_descriptor(name, 10)) == before

        # A cursor another writer moved past the descriptor stays where it is.
        third = await create_descriptor(store, name, _descriptor(20, 29, completed=False))
        assert third is not None
        await store.put(keys.objects_cur(name), ObjectsCursor(start=keys.pad_offset(30)))
        assert await complete_descriptor(store, name, _descriptor(20, 29, completed=True), expected_mod_revision=third)
        _, cur = await read_descriptors(store, name)
        assert cur == keys.pad_offset(30)
