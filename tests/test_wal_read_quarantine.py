"""A local WAL segment found corrupt by a read (after the broker opened it) is quarantined on
the spot: readers get the offsets before the corruption and then the typed
``SegmentUnreadableError``, never the bad bytes, and never a dispatcher retrying for ever.

Real etcd and a real broker process; the corruption is made by hand in a sealed segment file
while the broker runs (disk corruption cannot be made to order).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.errors import SegmentUnreadableError
from danube_pipeline.format.segments import scan_segment

from helpers import eventually

pytestmark = [pytest.mark.integration, pytest.mark.asyncio]


def _sealed(wal_dir: Path) -> list[Path]:
    return sorted(p for p in wal_dir.iterdir() if p.suffix == ".dnb1")


async def test_a_segment_corrupt_on_read_is_quarantined_and_readers_get_a_typed_error(
    tmp_path: Path, start_broker: Callable[..., BrokerProcess]
) -> None:
    topic = "/default/rot"
    broker = start_broker(segment_max_bytes=1024)
    wal_dir = broker.data_dir / "wal" / "default" / "rot"
    async with DanubeClient([broker.address], metadata_retries=40, retry_backoff_ms=250) as client:
        await client.admin.create_topic(topic)
        async with client.producer(topic, producer_name="p", max_batch_messages=1) as producer:
            for i in range(40):
                await producer.send(f"m{i}".encode() * 8)
        await eventually(lambda: len(_sealed(wal_dir)) >= 3, timeout_s=10, what="sealed segments")
        first = _sealed(wal_dir)[0]
        positions = scan_segment(first.read_bytes(), keep_positions=True).positions
        bad_offset, bad_pos = positions[2]
        data = bytearray(first.read_bytes())
        data[bad_pos + 70] ^= 0xFF  # bit rot inside a batch of a sealed segment the broker has open
        first.write_bytes(bytes(data))

        got: list[int] = []
        async with client.consumer(topic, subscription="all", initial_position=InitialPosition.EARLIEST) as consumer:
            with pytest.raises(SegmentUnreadableError) as unreadable:
                for _ in range(40):
                    message = await consumer.receive(timeout_ms=10_000)
                    got.append(message.offset)
                    await consumer.ack(message)
        assert got == list(range(bad_offset))
        err = unreadable.value
        assert (err.first_offset, err.position) == (bad_offset, bad_pos)
        assert not err.retriable
    marker = json.loads(first.with_name(first.name + ".quarantine").read_text())
    assert (marker["position"], marker["last_good_offset"]) == (bad_pos, bad_offset - 1)
    assert first.read_bytes() == bytes(data)  # kept as it is
