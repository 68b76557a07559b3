"""Offsets lost on a broker's disk are abandoned, never handed out again: real etcd, a real
broker process, the operator's ``python -m broker.storage.wal.repair --truncate``.

The broker acks offsets 0..9 (one batch each) and is killed; a batch in the middle of its WAL
is damaged by hand (disk corruption, done to the file). The restarted broker quarantines the
segment; after the repair it must continue at 10 (the repair used to hand 4..9 out again, to
new messages), publish 4..9 as an abandoned unavailable range in etcd, and a fresh subscription
must read 0..3 and then the new messages, passing over the lost offsets instead of waiting, and
tiering must pass over them too.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.format.segments import scan_segment
from danube_pipeline.lake.tiering import tier_sealed_segments
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore

from helpers import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


def _damage_batch(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    pos = dict(scan_segment(bytes(data), keep_positions=True).positions)[offset]
    data[pos + 70] ^= 0xFF  # inside the batch: CRC mismatch, valid batches after it
    path.write_bytes(bytes(data))


async def test_a_repaired_wal_abandons_the_lost_offsets_and_never_reuses_them(
    tmp_path: Path, etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess]
) -> None:
    topic = "/default/abandoned"
    name = TopicName.parse(topic)
    url = (tmp_path / "objects").as_uri()
    args = ["--lease-ttl-s", "2", "--object-store-url", url]
    broker = start_broker(extra_args=args)
    async with DanubeClient([broker.address], metadata_retries=40, retry_backoff_ms=250) as client:
        await client.admin.create_topic(topic)
        async with client.producer(topic, producer_name="before", max_batch_messages=1) as producer:
            acked = [await producer.send(f"m{i}".encode()) for i in range(10)]
    assert acked == list(range(10))
    broker.kill()
    wal_dir = broker.data_dir / "wal" / "default" / "abandoned"
    (active,) = [p for p in wal_dir.iterdir() if p.suffix == ".log"]
    _damage_batch(active, 4)

    broker = start_broker(data_dir=broker.data_dir, extra_args=args)  # quarantines, writes the marker
    async with DanubeClient([broker.address], metadata_retries=40, retry_backoff_ms=250) as client:
        await client.lookup_topic(topic)
        await eventually(lambda: any(p.name.endswith(".quarantine") for p in wal_dir.iterdir()),
                         timeout_s=20, what="the broker quarantines the segment")
    broker.kill()
    done = subprocess.run(
        [sys.executable, "-m", "broker.storage.wal.repair", str(wal_dir), "--truncate"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr

    broker = start_broker(data_dir=broker.data_dir, extra_args=args, segment_max_age_s=1.0)
    async with (
        DanubeClient([broker.address], metadata_retries=40, retry_backoff_ms=250) as client,
        await MetadataStore.connect(etcd_endpoints) as meta,
    ):
        async with client.producer(topic, producer_name="after", max_batch_messages=1) as producer:
            later = [await producer.send(f"n{i}".encode()) for i in range(3)]
        assert later[0] >= 10 and later == list(range(later[0], later[0] + 3))
        kvs, _ = await meta.get_prefix(keys.unavailable_prefix(name))
        ranges = [values.UnavailableRange.from_json(kv.value) for kv in kvs]
        assert [(r.start_offset, r.end_offset, r.abandoned, r.broker_id) for r in ranges] == [
            (4, 9, True, broker.broker_id)
        ]
        read: dict[int, bytes] = {}
        async with client.consumer(topic, subscription="all", initial_position=InitialPosition.EARLIEST) as consumer:
            for _ in range(4 + len(later)):
                message = await consumer.receive(timeout_ms=15_000)
                read[message.offset] = message.payload
                await consumer.ack(message)
        expected: dict[int, bytes] = {i: f"m{i}".encode() for i in range(4)}
        expected.update({int(o): f"n{i}".encode() for i, o in enumerate(later)})
        assert read == expected

        async def tiered_past_the_gap() -> bool:
            report = await tier_sealed_segments(name, store=meta, admin=client.admin, objects=ObjectStore(url))
            return report.last_offset == later[-1]

        await eventually(tiered_past_the_gap, timeout_s=20, what="tiering passes over the abandoned offsets")
