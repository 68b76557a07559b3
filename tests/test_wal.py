"""Unit tests of the broker's write-ahead log (broker/wal.py): real files, no etcd."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from broker.wal import PendingMessage, WriteAheadLog, active_name
from danube_pipeline.records import SEGMENT_HEADER_SIZE, decode_segment, encode_record, scan_records

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]


def msg(i: int, size: int = 16) -> PendingMessage:
    return PendingMessage(
        payload=(f"m{i}:".encode() + b"x" * size)[: max(size, 4)],
        publish_time_us=1_700_000_000_000_000 + i,
        producer_id=7,
        producer_name="p",
        attributes={"i": str(i)},
    )


def payloads(records) -> list[bytes]:
    return [r.payload for r in records]


async def open_wal(path: Path, **kw) -> WriteAheadLog:
    kw.setdefault("segment_max_bytes", 8 * 1024 * 1024)
    kw.setdefault("segment_max_age_s", 3600.0)
    return await WriteAheadLog.open(path, **kw)


async def test_append_read_round_trip(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    try:
        assert await wal.append([msg(0), msg(1), msg(2)]) == (0, 2)
        assert await wal.append([msg(3)]) == (3, 3)
        records = wal.read(0, 100)
        assert [r.offset for r in records] == [0, 1, 2, 3]
        assert payloads(records) == [msg(i).payload for i in range(4)]
        assert records[1].attributes == {"i": "1"}
        assert records[1].producer_id == 7 and records[1].producer_name == "p"
        assert [r.offset for r in wal.read(2, 1)] == [2]
        assert wal.read(4, 10) == []
        assert wal.next_offset == 4 and wal.durable_end == 4
    finally:
        await wal.close()
    # reopen: same content, appends continue
    wal = await open_wal(tmp_path)
    try:
        assert wal.next_offset == 4
        assert await wal.append([msg(4)]) == (4, 4)
        assert [r.offset for r in wal.read(0, 100)] == [0, 1, 2, 3, 4]
    finally:
        await wal.close()


async def test_group_commit_uses_far_fewer_syncs(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    try:
        n = 2000
        results = await asyncio.gather(*(wal.append([msg(i)]) for i in range(n)))
        # every append resolved with its own contiguous offset
        assert sorted(first for first, _ in results) == list(range(n))
        assert all(first == last for first, last in results)
        assert wal.record_count == n
        assert wal.sync_count < n / 10, wal.sync_count
        assert len(wal.read(0, n)) == n
    finally:
        await wal.close()


async def test_offsets_are_assigned_in_enqueue_order(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    try:
        futures = [wal.enqueue([msg(i), msg(i)]) for i in range(50)]
        results = await asyncio.gather(*futures)
        assert results == [(2 * i, 2 * i + 1) for i in range(50)]
    finally:
        await wal.close()


async def test_roll_by_size_creates_decodable_sealed_segments(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path, segment_max_bytes=4096)
    try:
        for i in range(100):
            await wal.append([msg(i, size=200)])
        sealed = wal.sealed_segments()
        assert len(sealed) >= 3
        expected_start = 0
        for seg in sealed:
            assert seg.path.name == f"{seg.start_offset:020d}-{seg.end_offset:020d}.dnb1"
            decoded = decode_segment(seg.path.read_bytes(), where=str(seg.path))
            assert decoded.start_offset == seg.start_offset == expected_start
            assert decoded.end_offset == seg.end_offset
            assert seg.size_bytes == seg.path.stat().st_size
            expected_start = seg.end_offset + 1
        assert wal.active_path.name == active_name(expected_start)
        assert [r.offset for r in wal.read(0, 1000)] == list(range(100))
    finally:
        await wal.close()


async def test_concurrent_appends_keep_segments_near_max_size(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path, segment_max_bytes=4096)
    try:
        await asyncio.gather(*(wal.append([msg(i, size=200)]) for i in range(300)))
        sealed = wal.sealed_segments()
        assert len(sealed) >= 10
        record_bytes = len(encode_record(msg(0, size=200).to_record(0)))
        for seg in sealed:
            assert seg.size_bytes < 4096 + 2 * record_bytes, seg
        assert [r.offset for r in wal.read(0, 1000)] == list(range(300))
    finally:
        await wal.close()


async def test_roll_by_age(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path, segment_max_age_s=0.2)
    try:
        await wal.append([msg(0), msg(1)])
        for _ in range(100):
            if wal.sealed_segments():
                break
            await asyncio.sleep(0.05)
        sealed = wal.sealed_segments()
        assert [(s.start_offset, s.end_offset) for s in sealed] == [(0, 1)]
        await asyncio.sleep(0.5)  # the empty active segment is never sealed
        assert len(wal.sealed_segments()) == 1
    finally:
        await wal.close()


async def test_seal_active_and_empty_noop(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    try:
        assert await wal.seal_active() is None
        assert wal.sealed_segments() == []
        wal.enqueue([msg(0), msg(1), msg(2)])  # not awaited: seal must still include them
        seg = await wal.seal_active()
        assert seg is not None and (seg.start_offset, seg.end_offset) == (0, 2)
        assert await wal.seal_active() is None
        assert len(wal.sealed_segments()) == 1
    finally:
        await wal.close()


async def test_reads_across_sealed_and_active(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path, index_interval_bytes=256)
    try:
        offset = 0
        for size in (10, 20, 5):
            await wal.append([msg(offset + i, size=100) for i in range(size)])
            offset += size
            await wal.seal_active()
        await wal.append([msg(offset + i, size=100) for i in range(7)])
        total = offset + 7
        assert [s.start_offset for s in wal.sealed_segments()] == [0, 10, 30]
        for start in (0, 5, 9, 10, 29, 30, 34, 35, 40):
            got = wal.read(start, 12)
            assert [r.offset for r in got] == list(range(start, min(start + 12, total)))
            assert payloads(got) == [msg(o, size=100).payload for o in range(start, min(start + 12, total))]
    finally:
        await wal.close()
    # after reopen, sealed segments are discovered by name and read with a lazily built index
    wal = await open_wal(tmp_path, index_interval_bytes=256)
    try:
        assert [s.start_offset for s in wal.sealed_segments()] == [0, 10, 30]
        assert [r.offset for r in wal.read(8, 30)] == list(range(8, 38))
    finally:
        await wal.close()


async def test_torn_tail_is_truncated(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    await wal.append([msg(i) for i in range(5)])
    path = wal.active_path
    await wal.close()
    good_size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(encode_record(msg(5).to_record(5))[:-7])  # a torn last record
    wal = await open_wal(tmp_path)
    try:
        assert path.stat().st_size == good_size
        assert wal.next_offset == 5
        assert await wal.append([msg(50)]) == (5, 5)
        got = wal.read(0, 100)
        assert [r.offset for r in got] == [0, 1, 2, 3, 4, 5]
        assert got[-1].payload == msg(50).payload
    finally:
        await wal.close()


async def test_garbage_tail_is_truncated(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    await wal.append([msg(i) for i in range(3)])
    path = wal.active_path
    await wal.close()
    good_size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(os.urandom(100))
    wal = await open_wal(tmp_path)
    try:
        assert path.stat().st_size == good_size
        assert await wal.append([msg(3)]) == (3, 3)
        assert [r.offset for r in wal.read(0, 10)] == [0, 1, 2, 3]
    finally:
        await wal.close()


async def test_corrupt_crc_in_the_middle_truncates_from_there(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    await wal.append([msg(i) for i in range(10)])
    path = wal.active_path
    await wal.close()
    data = bytearray(path.read_bytes())
    positions = scan_records(bytes(data), keep_positions=True).positions
    pos4 = dict(positions)[4]
    data[pos4 + 8 + 20] ^= 0xFF  # flip a byte inside record 4's body
    path.write_bytes(bytes(data))
    wal = await open_wal(tmp_path)
    try:
        assert path.stat().st_size == pos4
        assert wal.next_offset == 4
        assert [r.offset for r in wal.read(0, 100)] == [0, 1, 2, 3]
        assert await wal.append([msg(99)]) == (4, 4)
        assert wal.read(4, 1)[0].payload == msg(99).payload
        assert scan_records(path.read_bytes()).error is None
    finally:
        await wal.close()


async def test_short_active_file_gets_a_fresh_header(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    await wal.append([msg(0), msg(1)])
    await wal.seal_active()
    active = wal.active_path
    await wal.close()
    active.write_bytes(b"DNB")  # shorter than the header
    wal = await open_wal(tmp_path)
    try:
        assert wal.next_offset == 2
        assert wal.active_path.stat().st_size >= SEGMENT_HEADER_SIZE
        assert await wal.append([msg(2)]) == (2, 2)
        assert [r.offset for r in wal.read(0, 10)] == [0, 1, 2]
    finally:
        await wal.close()


async def test_initial_offset_for_empty_wal(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path, initial_offset=22)
    try:
        assert wal.next_offset == 22 and wal.first_offset == 22
        assert await wal.append([msg(0)]) == (22, 22)
        seg = await wal.seal_active()
        assert seg is not None
        assert decode_segment(seg.path.read_bytes()).start_offset == 22
    finally:
        await wal.close()
    wal = await open_wal(tmp_path, initial_offset=0)  # ignored: the WAL is not empty
    try:
        assert wal.next_offset == 23
    finally:
        await wal.close()


async def test_wait_for_offset_wakes_on_append(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    try:
        waiter = asyncio.create_task(wal.wait_for_offset(0, timeout_s=5))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await wal.append([msg(0)])
        assert await waiter is True
        assert await wal.wait_for_offset(5, timeout_s=0.05) is False
    finally:
        await wal.close()
