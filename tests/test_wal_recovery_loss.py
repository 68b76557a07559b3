"""WAL recovery never hands an acknowledged offset out twice, and tells a torn write from
corruption: an active segment with a damaged header is rebuilt or quarantined (never deleted),
offsets lost for good are recorded as abandoned and skipped, and a group commit torn by a
power cut is cut back instead of quarantined."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker.storage.wal import WriteAheadLog, active_name
from danube_pipeline.errors import SegmentQuarantinedError, SegmentUnreadableError
from danube_pipeline.format.batches import BatchBuilder, batch_records
from danube_pipeline.format.records import SEGMENT_HEADER_SIZE
from danube_pipeline.format.segments import scan_segment

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]


def frame(i: int) -> tuple[bytes, int]:
    builder = BatchBuilder(1_700_000_000_000_000 + i)
    builder.append(f"m{i}".encode(), timestamp_us=1_700_000_000_000_000 + i)
    return builder.build(producer_id=7, producer_name="p"), 1


async def open_wal(path: Path, **kw: Any) -> WriteAheadLog:
    kw.setdefault("segment_max_bytes", 8 * 1024 * 1024)
    kw.setdefault("segment_max_age_s", 3600.0)
    return await WriteAheadLog.open(path, **kw)


async def ten_batches(directory: Path) -> Path:
    """A WAL holding offsets 0..9, one batch each, closed; returns its active file."""
    wal = await open_wal(directory)
    for i in range(10):
        await wal.append(*frame(i))
    path = wal.active_path
    await wal.close()
    return path


def offsets(wal: WriteAheadLog, start: int = 0) -> list[int]:
    return [r.offset for b in wal.read(start, 1000) for r in batch_records(b.data) if r.offset >= start]


def repair(directory: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "broker.storage.wal.repair", str(directory), *flags],
        capture_output=True, text=True, timeout=120, check=False,
    )


def corrupt(path: Path, start: int, end: int) -> bytes:
    data = bytearray(path.read_bytes())
    for i in range(start, end):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    return bytes(data)


# ---------------------------------------------------------------- damaged header


async def test_a_damaged_header_is_rebuilt_when_the_first_batch_is_intact(tmp_path: Path) -> None:
    """The header is garbage, but the batch at byte 32 is intact and carries the name's start
    offset: the header is rebuilt and nothing is lost (it used to be deleted, with 0..9)."""
    path = await ten_batches(tmp_path)
    corrupt(path, 0, SEGMENT_HEADER_SIZE)
    wal = await open_wal(tmp_path)
    try:
        assert wal.quarantine is None and wal.next_offset == 10
        assert offsets(wal) == list(range(10))
        assert await wal.append(*frame(10)) == (10, 10)
    finally:
        await wal.close()
    assert scan_segment(path.read_bytes()).record_count == 11


async def test_a_header_naming_another_start_is_rebuilt_from_the_file_name(tmp_path: Path) -> None:
    path = await ten_batches(tmp_path)
    data = bytearray(path.read_bytes())
    data[8:16] = (777).to_bytes(8, "little")  # the header's start offset field
    path.write_bytes(bytes(data))
    wal = await open_wal(tmp_path)
    try:
        assert wal.quarantine is None and offsets(wal) == list(range(10))
    finally:
        await wal.close()


async def test_a_damaged_header_and_first_batch_quarantine_the_file_and_the_repair_abandons_its_offsets(
    tmp_path: Path,
) -> None:
    """Header and first batch damaged: the file is kept byte for byte, appends are refused.
    The operator's repair records offsets 0..9 (the valid batches after the damage show them)
    as abandoned before it cuts the file; the WAL then continues at 10, for good."""
    path = await ten_batches(tmp_path)
    damaged = corrupt(path, 0, SEGMENT_HEADER_SIZE + 70)
    wal = await open_wal(tmp_path)
    try:
        q = wal.quarantine
        assert q is not None and (q.position, q.last_good_offset, q.next_valid_offset) == (0, -1, 1)
        assert "header" in q.error
        assert offsets(wal) == []
        with pytest.raises(SegmentQuarantinedError):
            await wal.append(*frame(50))
    finally:
        await wal.close()
    assert path.read_bytes() == damaged  # never deleted
    report = repair(tmp_path)
    assert report.returncode == 1, report.stdout + report.stderr
    assert "0..9" in report.stdout
    done = repair(tmp_path, "--truncate")
    assert done.returncode == 0, done.stdout + done.stderr
    assert path.with_name(path.name + ".quarantined").read_bytes() == damaged
    ranges = json.loads((tmp_path / "abandoned.json").read_text())["ranges"]
    assert [(r["first_offset"], r["last_offset"]) for r in ranges] == [(0, 9)]
    for _ in range(2):
        wal = await open_wal(tmp_path)
        try:
            assert wal.quarantine is None and wal.abandoned_offset_count == 10
            first = wal.next_offset
            assert first >= 10
            assert await wal.append(*frame(60)) == (first, first)
            assert offsets(wal) == list(range(10, first + 1))
        finally:
            await wal.close()
    assert not path.exists() and (tmp_path / active_name(10)).exists()


# ---------------------------------------------------------------- torn group commit
#
# A power cut cannot be produced here. FAKE power cut: the files a real WAL wrote are changed
# the way a cut can leave them: a page of the last group commit lost (zeros) while later pages
# of the same write reached the disk, and the header's write record as it was before the bytes
# written after the last fdatasync (the "synced" bit is written after it returns).


async def grouped(directory: Path, singles: int, group: int) -> tuple[Path, dict[int, int], bytes]:
    """A WAL with ``singles`` batches written one per commit, then ``group`` batches enqueued
    together (one group commit); closed. Returns its active file, every batch's byte position
    and the header's write record bytes as they were right before the group commit."""
    wal = await open_wal(directory)
    for i in range(singles):
        await wal.append(*frame(i))
    before = wal.active_path.read_bytes()[24:32]
    syncs = wal.sync_count
    futures = [wal.enqueue(*frame(singles + i)) for i in range(group)]
    for fut in futures:
        await fut
    assert wal.sync_count == syncs + 1  # one write, one fdatasync
    path = wal.active_path
    await wal.close()
    return path, dict(scan_segment(path.read_bytes(), keep_positions=True).positions), before


def power_cut(path: Path, lose: tuple[int, int], record: bytes | None = None, *, synced: bool | None = None) -> None:
    """FAKE power cut: zero bytes ``lose`` (a page that never reached the disk) and set the
    header's write record to ``record`` (an older one) or clear/set its synced bit."""
    data = bytearray(path.read_bytes())
    data[lose[0] : lose[1]] = bytes(lose[1] - lose[0])
    if record is not None:
        data[24:32] = record
    if synced is not None:
        field = int.from_bytes(data[28:32], "little")
        field = field | (1 << 31) if synced else field & ~(1 << 31)
        data[28:32] = field.to_bytes(4, "little")
    path.write_bytes(bytes(data))


async def test_a_torn_group_commit_is_cut_back_not_quarantined(tmp_path: Path) -> None:
    """Offsets 5..9 went to disk in one write whose fdatasync never returned: batch 6's page was
    lost, 7..9 reached the disk. Nothing after batch 6 was acknowledged: truncated at batch 6
    (it used to quarantine the segment), appends go on at 6."""
    path, pos, _ = await grouped(tmp_path, 5, 5)
    power_cut(path, (pos[6], pos[7]), synced=False)
    wal = await open_wal(tmp_path)
    try:
        assert wal.quarantine is None
        assert path.stat().st_size == pos[6]
        assert offsets(wal) == list(range(6))
        assert await wal.append(*frame(60)) == (6, 6)
    finally:
        await wal.close()
    assert not path.with_name(path.name + ".quarantine").exists()


async def test_a_torn_later_write_whose_record_was_lost_is_cut_back(tmp_path: Path) -> None:
    """The record still describes the synced group 5..9 (the next write's record never reached
    the disk, so that write never synced); that next write, 10..12, lost its first page."""
    wal = await open_wal(tmp_path)
    for i in range(5):
        await wal.append(*frame(i))
    for fut in [wal.enqueue(*frame(5 + i)) for i in range(5)]:
        await fut
    synced_record = wal.active_path.read_bytes()[24:32]
    for fut in [wal.enqueue(*frame(10 + i)) for i in range(3)]:
        await fut
    path = wal.active_path
    await wal.close()
    pos = dict(scan_segment(path.read_bytes(), keep_positions=True).positions)
    power_cut(path, (pos[10], pos[11]), synced_record)
    wal = await open_wal(tmp_path)
    try:
        assert wal.quarantine is None and wal.next_offset == 10
    finally:
        await wal.close()


@pytest.mark.parametrize("case", ["bad_batch_in_an_earlier_write", "synced_group", "no_record"])
async def test_corruption_outside_the_last_unsynced_write_still_quarantines(tmp_path: Path, case: str) -> None:
    """Corruption is not taken for a torn write: a bad batch in a write synced before the last
    one, a bad batch in a group whose record says its fdatasync returned, or a file without
    a write record (written before it) still quarantines the segment."""
    path, pos, _ = await grouped(tmp_path, 5, 5)
    if case == "bad_batch_in_an_earlier_write":
        power_cut(path, (pos[3], pos[4]), synced=False)
        bad = 3
    elif case == "synced_group":
        power_cut(path, (pos[6], pos[7]), synced=True)
        bad = 6
    else:
        power_cut(path, (pos[6], pos[7]), bytes(8))
        bad = 6
    wal = await open_wal(tmp_path)
    try:
        q = wal.quarantine
        assert q is not None and q.position == pos[bad] and q.last_good_offset == bad - 1
    finally:
        await wal.close()


# ---------------------------------------------------------------- quarantine found on read


async def test_a_sealed_segment_found_corrupt_on_read_stays_flagged_across_reopens(tmp_path: Path) -> None:
    """Bit rot in an older sealed segment (recovery checks only the newest whole): the first
    read that meets it serves the good prefix, writes the marker and then refuses the rest with
    the typed error; a reopen finds the marker and the corruption again and keeps refusing."""
    wal = await open_wal(tmp_path)
    for i in range(5):
        await wal.append(*frame(i))
    first = await wal.seal_active()
    for i in range(5, 10):
        await wal.append(*frame(i))
    await wal.seal_active()
    await wal.append(*frame(10))
    assert first is not None
    positions = dict(scan_segment(first.path.read_bytes(), keep_positions=True).positions)
    data = bytearray(first.path.read_bytes())
    data[positions[3] + 70] ^= 0xFF
    first.path.write_bytes(bytes(data))
    marker = first.path.with_name(first.path.name + ".quarantine")
    try:
        assert offsets(wal) == [0, 1, 2]  # the good prefix, never the bad batch
        with pytest.raises(SegmentUnreadableError) as err:
            wal.read(3, 10)
        assert (err.value.first_offset, err.value.end_offset, err.value.position) == (3, 4, positions[3])
        assert offsets(wal, 5) == list(range(5, 11))  # the other segments still serve
        assert marker.exists()
    finally:
        await wal.close()
    wal = await open_wal(tmp_path)
    try:
        assert wal.quarantine is None  # appends go on: the corruption holds no offset to come
        assert offsets(wal) == [0, 1, 2]
        with pytest.raises(SegmentUnreadableError):
            wal.read(4, 10)
        assert await wal.append(*frame(11)) == (11, 11)
    finally:
        await wal.close()
