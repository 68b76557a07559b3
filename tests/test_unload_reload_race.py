"""Issue 21 #6: a topic unloaded (its assignment deleted) and given back to the same broker at
once. The unload (close the topic, keep its WAL as released segments, record the last offset
written) and the reload must not overlap: the new WAL must never start at offsets that sit in
``released/``. Real etcd, a real broker process, a real producer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.format.records import SEGMENT_HEADER_SIZE
from danube_pipeline.lake.tiering import tier_sealed_segments
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore

from broker.storage.wal.segment import SEALED_NAME_RE

from helpers import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]

CYCLES = 6


def payload(i: int) -> bytes:
    return f"reload-{i:06d}".encode()


def segment_ranges(directory: Path) -> list[tuple[int, int, str]]:
    """``(start, end, path)`` of every sealed segment under ``directory`` (recursively)."""
    out = []
    for f in directory.rglob("*.dnb1"):
        m = SEALED_NAME_RE.fullmatch(f.name)
        if m is not None:
            out.append((int(m.group(1)), int(m.group(2)), str(f.relative_to(directory.parent))))
    return sorted(out)


def unsealed_with_records(directory: Path) -> list[str]:
    return [str(f) for f in directory.rglob("*.log") if f.stat().st_size > SEGMENT_HEADER_SIZE]


async def test_an_assignment_deleted_and_given_back_at_once_reuses_no_offset(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    """Delete the topic's assignment and queue it for the leader in one transaction (what
    ``etcdctl txn`` with a ``del`` and a ``put`` of ``/cluster/unassigned/...`` does) while a
    producer sends, several times: the leader gives it back to the only broker at once. Every
    sealed segment, live or released, holds offsets no other one holds; the acks are distinct;
    after tiering, a fresh subscription reads every acked message exactly once, at its offset."""
    url = (tmp_path / "objects").as_uri()
    broker = start_broker(extra_args=["--object-store-url", url, "--offset-block", "400"])
    topic = "/default/reloaded"
    name = TopicName.parse(topic)
    assignment = keys.topic_assignment(broker.broker_id, name)
    acked: dict[int, bytes] = {}
    acked_twice: list[int] = []
    async with (
        DanubeClient([broker.address], metadata_retries=60, retry_backoff_ms=100) as client,
        await MetadataStore.connect(etcd_endpoints) as meta,
    ):
        await client.admin.create_topic(topic)
        stop = asyncio.Event()

        async def produce() -> None:
            async with client.producer(topic, producer_name="steady", max_batch_messages=5) as producer:
                i = 0
                while not stop.is_set():
                    sent = [(payload(i + j), producer.send_nowait(payload(i + j))) for j in range(20)]
                    i += 20
                    for p, future in sent:
                        offset = int(await future)
                        if offset in acked:
                            acked_twice.append(offset)
                        acked[offset] = p

        sender = asyncio.create_task(produce())
        try:
            for cycle in range(CYCLES):
                wanted = len(acked) + 150
                await eventually(lambda: len(acked) >= wanted or sender.done(), timeout_s=20, what="acks")
                assert not sender.done(), sender
                before = await meta.get(assignment)
                assert before is not None
                revision = await meta.transaction(
                    created={assignment: before.create_revision},
                    deletes=[assignment],
                    puts=[(keys.unassigned_topic(name), values.UnassignedReason(reason="operator", from_broker=-1))],
                )
                assert revision is not None, f"cycle {cycle}: the assignment changed under the test"

                async def given_back() -> bool:
                    kv = await meta.get(assignment)
                    return kv is not None and kv.create_revision > revision

                await eventually(given_back, timeout_s=10, what=f"cycle {cycle}: the leader gives the topic back")
            wanted = len(acked) + 150
            await eventually(lambda: len(acked) >= wanted or sender.done(), timeout_s=20, what="acks after the last cycle")
        finally:
            stop.set()
            await asyncio.wait_for(sender, 30)
        assert acked_twice == []
        await client.admin.seal_active_segment(topic)

        data = broker.data_dir
        live = segment_ranges(data / "wal" / name.namespace / name.topic)
        released = segment_ranges(data / "released" / name.namespace / name.topic)
        assert released, "each unload keeps the WAL as released segments"
        everything = sorted(live + released)
        overlaps = [(a, b) for a, b in zip(everything, everything[1:]) if b[0] <= a[1]]
        assert overlaps == [], f"segments hold the same offsets twice: {overlaps}"
        assert unsealed_with_records(data / "wal" / name.namespace / name.topic) == []

        report = await tier_sealed_segments(name, store=meta, admin=client.admin, objects=ObjectStore(url))
        assert report.last_offset == max(acked)
        read: list[tuple[int, bytes]] = []
        async with client.consumer(
            topic, subscription="replay", initial_position=InitialPosition.EARLIEST
        ) as consumer:
            while len(read) < len(acked):
                try:
                    message = await consumer.receive(timeout_ms=10_000)
                except TimeoutError:
                    missing = sorted(set(acked) - {o for o, _ in read})
                    raise AssertionError(f"{len(missing)} acked offsets never read: {missing[:5]}..{missing[-5:]}") from None
                read.append((message.offset, message.payload))
                await consumer.ack(message)
        assert len(read) == len(set(read)) == len(acked)
        assert dict(read) == acked
