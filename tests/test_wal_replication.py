"""Unit tests of the WAL's replication side (broker/storage/wal/epochs.py, replica_log.py):
leader epochs (KIP-101, KIP-279), replica appends, reads for followers, the high watermark and
truncation. Real files in tmp_path, no etcd."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import eventually, stays

from broker.storage.wal import WriteAheadLog
from broker.storage.wal.epochs import EPOCHS_FILE, LeaderEpochCache
from broker.storage.wal.segment import decode_write_record
from danube_pipeline.errors import CorruptRecordError, LogTruncationError, OffsetRangeError
from danube_pipeline.format.batches import BatchBuilder, batch_records, set_base_offset
from danube_pipeline.format.records import SEGMENT_HEADER_SIZE, SegmentHeader
from danube_pipeline.format.segments import StoredBatch

pytestmark = pytest.mark.unit


def batch(first: int, count: int = 3, size: int = 20) -> bytes:
    """A producer-framed batch of ``count`` records tagged ``first``, ``first + 1``, ..."""
    builder = BatchBuilder(1_700_000_000_000_000)
    for i in range(first, first + count):
        builder.append(f"r{i}:".encode() + b"x" * size, timestamp_us=1_700_000_000_000_000 + i)
    return builder.build(producer_id=3, producer_name="p")


def stored(base_offset: int, count: int = 3) -> bytes:
    """The batch of ``count`` records as a WAL stores it at ``base_offset``."""
    head, rest = set_base_offset(batch(base_offset, count), base_offset)
    return head + bytes(rest)


async def open_wal(path: Path, **kw: Any) -> WriteAheadLog:
    kw.setdefault("segment_max_bytes", 1 << 20)
    kw.setdefault("segment_max_age_s", 3600.0)
    return await WriteAheadLog.open(path, **kw)


async def append_batches(wal: WriteAheadLog, count: int, records: int = 3) -> None:
    for _ in range(count):
        first = wal.next_offset
        await wal.append(batch(first, records), records)


def read_all(wal: WriteAheadLog, from_offset: int = 0) -> list[StoredBatch]:
    return wal.read(from_offset, 1 << 30, max_bytes=1 << 30)


def payload_tags(batches: list[StoredBatch]) -> list[bytes]:
    return [r.payload.split(b":")[0] for b in batches for r in batch_records(b.data)]


# ---------------------------------------------------------------------------- epoch cache


def test_epoch_cache_assign_persist_and_refuse(tmp_path: Path) -> None:
    cache = LeaderEpochCache.load(tmp_path)
    assert list(cache.entries) == [] and cache.latest_epoch is None
    assert not (tmp_path / EPOCHS_FILE).exists()  # a missing file is an empty cache, never written by a load

    cache.assign(1, 0)
    cache.assign(1, 5)  # same epoch: no-op
    cache.assign(3, 10)
    assert cache.entries == ((1, 0), (3, 10)) and cache.latest_epoch == 3
    assert json.loads((tmp_path / EPOCHS_FILE).read_text()) == [
        {"epoch": 1, "start_offset": 0}, {"epoch": 3, "start_offset": 10},
    ]
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError, match="below the latest epoch"):
        cache.assign(2, 20)
    with pytest.raises(ValueError, match="below the start"):
        cache.assign(4, 9)
    assert LeaderEpochCache.load(tmp_path).entries == ((1, 0), (3, 10))

    cache.assign(4, 10)  # epoch 3 held no batch: replaced (as Kafka's assign does)
    assert cache.entries == ((1, 0), (4, 10))
    cache.truncate_from(10)
    assert list(cache.entries) == [(1, 0)]
    assert LeaderEpochCache.load(tmp_path).entries == ((1, 0),)


def test_epoch_cache_refuses_a_bad_file(tmp_path: Path) -> None:
    (tmp_path / EPOCHS_FILE).write_text('[{"epoch": 2, "start_offset": 5}, {"epoch": 1, "start_offset": 9}]')
    with pytest.raises(ValueError, match="out of order"):
        LeaderEpochCache.load(tmp_path)
    (tmp_path / EPOCHS_FILE).write_text('{"epoch": 2}')
    with pytest.raises(ValueError, match="list of entries"):
        LeaderEpochCache.load(tmp_path)


def test_end_offset_for_follows_kip_279(tmp_path: Path) -> None:
    assert LeaderEpochCache.load(tmp_path).end_offset_for(3, 50) == (-1, -1)
    cache = LeaderEpochCache.load(tmp_path)
    for epoch, start in [(1, 0), (3, 10), (5, 20)]:
        cache.assign(epoch, start)
    log_end = 30
    assert cache.end_offset_for(5, log_end) == (5, 30)  # the latest epoch ends at the log end
    assert cache.end_offset_for(3, log_end) == (3, 20)  # the next epoch's start
    assert cache.end_offset_for(1, log_end) == (1, 10)
    assert cache.end_offset_for(4, log_end) == (3, 20)  # unknown epoch: the largest below it
    assert cache.end_offset_for(2, log_end) == (1, 10)
    assert cache.end_offset_for(9, log_end) == (5, 30)  # above every epoch: the latest
    assert cache.end_offset_for(0, log_end) == (-1, -1)  # none at or below: UNDEFINED
    assert [cache.epoch_at(o) for o in (0, 9, 10, 19, 20, 99)] == [1, 1, 3, 3, 5, 5]

    later = LeaderEpochCache(tmp_path / "other", ((4, 100),))
    assert later.epoch_at(99) is None and later.epoch_at(100) == 4


# ---------------------------------------------------------------------------- epochs in the WAL


@pytest.mark.asyncio
async def test_a_wal_without_replication_writes_no_epoch_file(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path, segment_max_bytes=300)
    await append_batches(wal, 5)
    await wal.close()
    wal = await open_wal(tmp_path, segment_max_bytes=300)
    assert wal.latest_epoch is None and wal.high_watermark is None
    assert [epoch for epoch, _ in wal.read_for_replication(0, 1 << 20)] == [0] * 5
    await wal.close()
    assert not (tmp_path / EPOCHS_FILE).exists()


@pytest.mark.asyncio
async def test_begin_epoch_then_appends_survive_reopen(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    await wal.begin_epoch(1)
    await append_batches(wal, 2)
    await wal.begin_epoch(2)
    await wal.begin_epoch(2)  # already the latest: no-op
    await append_batches(wal, 1)
    with pytest.raises(ValueError, match="below the latest"):
        await wal.begin_epoch(1)
    assert wal.epochs.entries == ((1, 0), (2, 6))
    await wal.close()

    wal = await open_wal(tmp_path)
    assert wal.epochs.entries == ((1, 0), (2, 6)) and wal.latest_epoch == 2
    got = wal.read_for_replication(0, 1 << 20)
    assert [(epoch, b.base_offset) for epoch, b in got] == [(1, 0), (1, 3), (2, 6)]
    await wal.begin_epoch(3)  # before any append: kept at the log end across a reopen
    await wal.close()
    wal = await open_wal(tmp_path)
    assert wal.epochs.entries == ((1, 0), (2, 6), (3, 9))
    await wal.close()


@pytest.mark.asyncio
async def test_begin_epoch_lands_between_appends_queued_before_and_after(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    before = wal.enqueue(batch(0), 3)
    begun = asyncio.ensure_future(wal.begin_epoch(4))
    await asyncio.sleep(0)  # begin_epoch queued its entry
    after = wal.enqueue(batch(3), 3)
    assert await before == (0, 2) and await after == (3, 5)
    await begun
    assert wal.epochs.entries == ((4, 3),)
    assert [(e, b.base_offset) for e, b in wal.read_for_replication(0, 1 << 20)] == [(0, 0), (4, 3)]
    await wal.close()


class RefuseOnce:
    """An offset guard (broker.storage.wal.commit_failures.OffsetGuard) whose first reservation fails."""

    def __init__(self) -> None:
        self.reserved_end = 0
        self.refused = False

    def covers(self, offset: int) -> bool:
        return offset < self.reserved_end

    async def reserve_through(self, offset: int) -> None:
        await asyncio.sleep(0.05)  # etcd round trip: the writer waits with the batch taken
        if not self.refused:
            self.refused = True
            raise RuntimeError("etcd is down")
        self.reserved_end = offset + 1000

    def refuse_ack(self, offset: int) -> Exception | None:
        return None


@pytest.mark.asyncio
async def test_an_epoch_begun_behind_failed_appends_moves_down_with_the_offsets(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    wal.offset_guard = RefuseOnce()
    lost = wal.enqueue(batch(0), 3)
    await asyncio.sleep(0.01)  # the writer took it and waits for the reservation
    begun = asyncio.ensure_future(wal.begin_epoch(2))
    await asyncio.sleep(0)
    assert wal.next_offset == 3  # the entry was queued at 3
    with pytest.raises(RuntimeError, match="etcd is down"):
        await lost
    await begun
    assert wal.epochs.entries == ((2, 0),)  # offsets 0..2 were handed back: the epoch starts there
    assert await wal.append(batch(0), 3) == (0, 2)
    await wal.close()


@pytest.mark.asyncio
async def test_epochs_above_the_log_end_are_dropped_at_open(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    await append_batches(wal, 2)  # offsets 0..5
    await wal.close()
    # A crash between recording epoch 3 and writing its first batch (then torn off).
    (tmp_path / EPOCHS_FILE).write_text(json.dumps([
        {"epoch": 1, "start_offset": 0}, {"epoch": 2, "start_offset": 6}, {"epoch": 3, "start_offset": 9},
    ]))
    wal = await open_wal(tmp_path)
    assert wal.epochs.entries == ((1, 0), (2, 6))  # the entry at the log end is kept
    assert LeaderEpochCache.load(tmp_path).entries == ((1, 0), (2, 6))
    await wal.close()


# ---------------------------------------------------------------------------- replica appends


@pytest.mark.asyncio
async def test_append_replica_writes_at_the_owners_offsets(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path, initial_offset=100)
    syncs = wal.sync_count
    assert await wal.append_replica([(1, stored(100)), (1, stored(103, 2))]) == 105 == wal.durable_end
    assert wal.sync_count == syncs + 1  # one group commit for both batches
    end = await wal.append_replica([(4, stored(105))])  # a new epoch, recorded before the batch
    assert end == 108 == wal.durable_end == wal.next_offset
    assert wal.epochs.entries == ((1, 100), (4, 105))
    assert [b.data for b in read_all(wal)] == [stored(100), stored(103, 2), stored(105)]
    await wal.close()
    wal = await open_wal(tmp_path)
    assert wal.next_offset == 108 and wal.epochs.entries == ((1, 100), (4, 105))
    await wal.close()


@pytest.mark.asyncio
async def test_append_replica_refuses_bad_batches_before_writing_anything(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    await wal.append_replica([(1, stored(0))])
    size = wal.active_path.stat().st_size

    with pytest.raises(OffsetRangeError, match="expected offset 3, found 4"):
        wal.append_replica([(1, stored(4))])
    with pytest.raises(OffsetRangeError, match="expected offset 6, found 7"):
        wal.append_replica([(1, stored(3)), (1, stored(7))])  # a gap after a good batch
    corrupt = bytearray(stored(3))
    corrupt[-1] ^= 0xFF
    with pytest.raises(CorruptRecordError, match="CRC32C"):
        wal.append_replica([(1, stored(3)), (1, bytes(corrupt))])
    with pytest.raises(CorruptRecordError, match="not one batch"):
        wal.append_replica([(1, stored(3) + stored(6))])
    with pytest.raises(ValueError, match="below epoch 1"):
        wal.append_replica([(0, stored(3))])

    assert wal.next_offset == 3 and wal.durable_end == 3 and wal.epochs.entries == ((1, 0),)
    await stays(lambda: wal.active_path.stat().st_size == size, for_s=0.2)
    assert await wal.append_replica([(2, stored(3))]) == 6
    await wal.close()


@pytest.mark.asyncio
async def test_a_replica_copied_through_read_for_replication_is_byte_identical(tmp_path: Path) -> None:
    leader = await open_wal(tmp_path / "leader", segment_max_bytes=400)
    await leader.begin_epoch(1)
    await append_batches(leader, 7)
    await leader.begin_epoch(3)
    await append_batches(leader, 5, records=2)
    await leader.seal_active()
    await append_batches(leader, 2)
    assert len(leader.sealed_segments()) >= 3  # the copy reads sealed and active segments

    follower = await open_wal(tmp_path / "follower", segment_max_bytes=400)
    while follower.next_offset < leader.durable_end:
        fetched = leader.read_for_replication(follower.next_offset, max_bytes=250)
        assert fetched[0][1].base_offset == follower.next_offset
        await follower.append_replica([(epoch, b.data) for epoch, b in fetched])
    assert [b.data for b in read_all(follower)] == [b.data for b in read_all(leader)]
    assert follower.epochs.entries == leader.epochs.entries == ((1, 0), (3, 21))
    assert follower.read_for_replication(0, 1 << 20) == leader.read_for_replication(0, 1 << 20)
    await leader.close()
    await follower.close()


# ---------------------------------------------------------------------------- truncation


@pytest.mark.asyncio
async def test_truncate_at_a_batch_boundary_then_reopen_and_append(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    await wal.begin_epoch(1)
    await append_batches(wal, 2)  # 0..5
    await wal.begin_epoch(2)
    await append_batches(wal, 2)  # 6..11
    wal.set_high_watermark(12)
    await wal.truncate_to(6)
    assert wal.next_offset == wal.durable_end == 6
    assert wal.epochs.entries == ((1, 0),) and wal.high_watermark == 6
    assert payload_tags(read_all(wal)) == [f"r{i}".encode() for i in range(6)]
    assert wal.active_path.stat().st_size == SEGMENT_HEADER_SIZE + 2 * (8 + len(stored(0)))  # epoch + batch entries
    assert decode_write_record(wal.active_path.read_bytes()) is None  # it described a write cut off
    await wal.truncate_to(50)  # nothing at or above: no-op
    await wal.begin_epoch(5)  # begun here as owner, never written to: at the log end
    assert wal.next_offset == 6 and list(wal.epochs.entries) == [(1, 0), (5, 6)]
    await wal.truncate_to(6)  # removes no batch, but the owner of this log end has no epoch 5
    assert wal.next_offset == 6 and wal.epochs.entries == ((1, 0),)
    await wal.close()

    wal = await open_wal(tmp_path)
    assert wal.next_offset == 6 and wal.epochs.entries == ((1, 0),)
    await wal.begin_epoch(3)
    await append_batches(wal, 1)
    assert payload_tags(read_all(wal)) == [f"r{i}".encode() for i in range(9)]
    assert [e for e, _ in wal.read_for_replication(0, 1 << 20)] == [1, 1, 3]
    await wal.close()


@pytest.mark.asyncio
async def test_truncate_inside_a_batch_removes_the_whole_batch(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    await append_batches(wal, 3)  # 0..2, 3..5, 6..8
    await wal.truncate_to(4)  # inside 3..5: the batch goes, the log ends at its base
    assert wal.next_offset == wal.durable_end == 3
    assert await wal.append(batch(3), 3) == (3, 5)
    assert decode_write_record(wal.active_path.read_bytes()) is not None
    created = SegmentHeader.decode(wal.active_path.read_bytes()).created_at_ms
    await asyncio.sleep(0.01)
    await wal.truncate_to(1)  # inside the first batch: the segment is cut back to its header
    assert wal.next_offset == 0 and read_all(wal) == []
    data = wal.active_path.read_bytes()
    assert len(data) == SEGMENT_HEADER_SIZE and decode_write_record(data) is None  # its writes are gone
    assert SegmentHeader.decode(data).created_at_ms > created  # a fresh header: its age starts again
    await wal.close()
    wal = await open_wal(tmp_path)
    assert wal.next_offset == 0
    assert await wal.append(batch(0), 3) == (0, 2)
    await wal.close()


@pytest.mark.asyncio
async def test_truncate_refuses_a_sealed_segment_and_queued_appends(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    await append_batches(wal, 2)
    sealed = await wal.seal_active()
    assert sealed is not None and sealed.end_offset == 5
    await append_batches(wal, 1)
    names = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(LogTruncationError, match="sealed segment") as info:
        await wal.truncate_to(5)
    assert not info.value.retriable
    assert wal.next_offset == 9 and sorted(p.name for p in tmp_path.iterdir()) == names
    assert len(read_all(wal)) == 3

    pending = wal.enqueue(batch(9), 3)
    with pytest.raises(LogTruncationError, match="appends are queued"):
        await wal.truncate_to(6)
    assert await pending == (9, 11)
    await wal.truncate_to(6)  # the active segment only
    assert wal.next_offset == 6 and len(read_all(wal)) == 2
    await wal.close()


@pytest.mark.asyncio
async def test_truncate_refuses_an_active_segment_that_does_not_scan(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    await append_batches(wal, 3)  # 0..2, 3..5, 6..8
    data = bytearray(wal.active_path.read_bytes())
    data[SEGMENT_HEADER_SIZE + len(stored(0)) + 40] ^= 0xFF  # inside the batch 3..5
    wal.active_path.write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError):
        await wal.truncate_to(6)  # never cuts at a guess
    assert wal.next_offset == 9 and wal.active_path.read_bytes() == bytes(data)
    await wal.close()


# ---------------------------------------------------------------------------- high watermark


@pytest.mark.asyncio
async def test_high_watermark_caps_read_and_wakes_listeners(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    await append_batches(wal, 4)  # 0..2, 3..5, 6..8, 9..11
    ends: list[int] = []
    wal.add_listener(ends.append)

    wal.set_high_watermark(7)  # inside 6..8: only whole batches below it
    assert [b.base_offset for b in read_all(wal)] == [0, 3]
    assert read_all(wal, 6) == [] and read_all(wal, 7) == []
    assert wal.readable_end == 7 and wal.durable_end == 12
    assert ends == []  # introducing a cap makes nothing newly readable

    wal.set_high_watermark(9)
    assert ends == [12] and [b.base_offset for b in read_all(wal, 6)] == [6]
    wal.set_high_watermark(4)  # lowering wakes nobody
    assert ends == [12] and [b.base_offset for b in read_all(wal)] == [0]
    wal.set_high_watermark(None)  # lifting the cap wakes them too
    assert ends == [12, 12] and len(read_all(wal)) == 4
    await wal.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("limit", [{"segment_max_bytes": 300}, {"segment_max_age_s": 0.05}], ids=["size", "age"])
async def test_roll_waits_for_the_high_watermark(tmp_path: Path, limit: dict[str, Any]) -> None:
    wal = await open_wal(tmp_path, **limit)
    wal.set_high_watermark(0)
    await append_batches(wal, 6)  # 0..17, past 300 bytes
    await stays(lambda: wal.sealed_segments() == [], for_s=0.3)  # past its limit, not below the watermark
    wal.set_high_watermark(9)  # the segment still holds 9..17
    await stays(lambda: wal.sealed_segments() == [], for_s=0.2)
    wal.set_high_watermark(18)
    await eventually(lambda: len(wal.sealed_segments()) == 1)
    assert wal.sealed_segments()[0].end_offset == 17
    await wal.close()


@pytest.mark.asyncio
async def test_seal_active_waits_for_the_high_watermark(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    await append_batches(wal, 2)
    wal.set_high_watermark(3)
    with pytest.raises(TimeoutError, match="high watermark 3 stayed below the end 6"):
        await wal.seal_active(timeout_s=0.1)
    assert wal.sealed_segments() == []
    sealing = asyncio.ensure_future(wal.seal_active(timeout_s=5))
    await stays(lambda: not sealing.done(), for_s=0.1)
    wal.set_high_watermark(6)
    sealed = await sealing
    assert sealed is not None and sealed.end_offset == 5
    await wal.close()


@pytest.mark.asyncio
async def test_group_commit_keeps_its_groups_while_the_roll_waits(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path, segment_max_bytes=1000)
    wal.set_high_watermark(0)
    await append_batches(wal, 7)
    assert os.path.getsize(wal.active_path) > 1000 > 5 * len(stored(0))
    syncs = wal.sync_count
    await asyncio.gather(*(wal.enqueue(batch(i), 3) for i in range(20)))
    assert wal.sync_count - syncs <= 5  # up to segment_max_bytes per write, not one write per batch
    await wal.close()
