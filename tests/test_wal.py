"""Unit tests of the broker's write-ahead log (broker/storage/wal/): real files, no etcd."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import eventually, stays

import broker.storage.wal.local_log as localmod
import broker.storage.wal.segment as segmod
from broker.storage.wal import WriteAheadLog, active_name, sealed_name
from broker.storage.wal.segment import fsync_dir
from danube_pipeline.format.batches import BatchBuilder, batch_records, set_base_offset
from danube_pipeline.errors import CorruptRecordError, DanubeError, SegmentQuarantinedError, StorageFullError
from danube_pipeline.format.records import (
    FORMAT_VERSION,
    LEGACY_FORMAT_VERSION,
    SEGMENT_HEADER_SIZE,
    Record,
    SegmentHeader,
    encode_record,
)
from danube_pipeline.format.segments import decode_segment, scan_segment

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]


def patch_fsync_dir(monkeypatch: pytest.MonkeyPatch, fn: object) -> None:
    """Replace the directory fsync in both WAL modules that call it (seal and new segment)."""
    monkeypatch.setattr(localmod, "fsync_dir", fn)
    monkeypatch.setattr(segmod, "fsync_dir", fn)


@dataclass(frozen=True)
class Msg:
    payload: bytes
    publish_time_us: int
    attributes: dict[str, str]


def msg(i: int, size: int = 16) -> Msg:
    return Msg((f"m{i}:".encode() + b"x" * size)[: max(size, 4)], 1_700_000_000_000_000 + i, {"i": str(i)})


def frame(msgs: list[Msg]) -> tuple[bytes, int]:
    """One record batch of ``msgs`` from producer 7 ("p"), as a producer frames it."""
    builder = BatchBuilder(min(m.publish_time_us for m in msgs))
    for m in msgs:
        builder.append(m.payload, timestamp_us=m.publish_time_us, attributes=m.attributes)
    return builder.build(producer_id=7, producer_name="p"), len(msgs)


def stored(base_offset: int, msgs: list[Msg]) -> bytes:
    """The batch of ``msgs`` as the WAL stores it at ``base_offset``."""
    head, rest = set_base_offset(frame(msgs)[0], base_offset)
    return head + bytes(rest)


async def append(wal: WriteAheadLog, msgs: list[Msg]) -> tuple[int, int]:
    return await wal.append(*frame(msgs))


def enqueue(wal: WriteAheadLog, msgs: list[Msg]) -> asyncio.Future[tuple[int, int]]:
    return wal.enqueue(*frame(msgs))


def read(wal: WriteAheadLog, from_offset: int, max_records: int) -> list[Record]:
    """The records of ``wal.read``'s batches from ``from_offset``, at most ``max_records``."""
    records = [r for b in wal.read(from_offset, max_records) for r in batch_records(b.data)]
    return [r for r in records if r.offset >= from_offset][:max_records]


def payloads(records: list[Record]) -> list[bytes]:
    return [r.payload for r in records]


async def open_wal(path: Path, **kw: Any) -> WriteAheadLog:
    kw.setdefault("segment_max_bytes", 8 * 1024 * 1024)
    kw.setdefault("segment_max_age_s", 3600.0)
    return await WriteAheadLog.open(path, **kw)


async def test_append_read_round_trip(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    try:
        assert await append(wal, [msg(0), msg(1), msg(2)]) == (0, 2)
        assert await append(wal, [msg(3)]) == (3, 3)
        records = read(wal, 0, 100)
        assert [r.offset for r in records] == [0, 1, 2, 3]
        assert payloads(records) == [msg(i).payload for i in range(4)]
        assert records[1].attributes == {"i": "1"}
        assert records[1].producer_id == 7 and records[1].producer_name == "p"
        assert [r.offset for r in read(wal, 2, 1)] == [2]
        assert read(wal, 4, 10) == []
        assert wal.next_offset == 4 and wal.durable_end == 4
    finally:
        await wal.close()
    # reopen: same content, appends continue
    wal = await open_wal(tmp_path)
    try:
        assert wal.next_offset == 4
        assert await append(wal, [msg(4)]) == (4, 4)
        assert [r.offset for r in read(wal, 0, 100)] == [0, 1, 2, 3, 4]
    finally:
        await wal.close()


async def test_group_commit_uses_far_fewer_syncs(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    try:
        n = 2000
        results = await asyncio.gather(*(append(wal, [msg(i)]) for i in range(n)))
        # every append resolved with its own contiguous offset
        assert sorted(first for first, _ in results) == list(range(n))
        assert all(first == last for first, last in results)
        assert wal.record_count == n
        assert wal.sync_count < n / 10, wal.sync_count
        assert len(read(wal, 0, n)) == n
    finally:
        await wal.close()


async def test_offsets_are_assigned_in_enqueue_order(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    try:
        futures = [enqueue(wal, [msg(i), msg(i)]) for i in range(50)]
        results = await asyncio.gather(*futures)
        assert results == [(2 * i, 2 * i + 1) for i in range(50)]
    finally:
        await wal.close()


async def test_roll_by_size_creates_decodable_sealed_segments(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path, segment_max_bytes=4096)
    try:
        for i in range(100):
            await append(wal, [msg(i, size=200)])
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
        assert [r.offset for r in read(wal, 0, 1000)] == list(range(100))
    finally:
        await wal.close()


async def test_concurrent_appends_keep_segments_near_max_size(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path, segment_max_bytes=4096)
    try:
        await asyncio.gather(*(append(wal, [msg(i, size=200)]) for i in range(300)))
        sealed = wal.sealed_segments()
        assert len(sealed) >= 10
        record_bytes = len(frame([msg(0, size=200)])[0])
        for seg in sealed:
            assert seg.size_bytes < 4096 + 2 * record_bytes, seg
        assert [r.offset for r in read(wal, 0, 1000)] == list(range(300))
    finally:
        await wal.close()


async def test_roll_by_age(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path, segment_max_age_s=0.2)
    try:
        await append(wal, [msg(0), msg(1)])
        await eventually(lambda: bool(wal.sealed_segments()), timeout_s=5, what="sealed by age")
        sealed = wal.sealed_segments()
        assert [(s.start_offset, s.end_offset) for s in sealed] == [(0, 1)]
        # the empty active segment is never sealed
        await stays(lambda: len(wal.sealed_segments()) == 1, for_s=0.5, what="one sealed segment")
    finally:
        await wal.close()


async def test_seals_by_age_wait_for_the_seals_after_event(tmp_path: Path) -> None:
    loaded = asyncio.Event()
    wal = await open_wal(tmp_path, segment_max_age_s=0.1, seals_after=loaded)
    try:
        await append(wal, [msg(0), msg(1)])
        await stays(lambda: not wal.sealed_segments(), for_s=0.5, what="no seal by age before the event")
        loaded.set()
        await eventually(lambda: bool(wal.sealed_segments()), timeout_s=5, what="sealed by age after the event")
        assert [(s.start_offset, s.end_offset) for s in wal.sealed_segments()] == [(0, 1)]
    finally:
        await wal.close()


def open_files(under: Path | None = None) -> set[str]:
    """The files this process holds open (``/proc/self/fd``); with ``under``, the sealed
    segments below that directory only."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if under is None or (target.startswith(str(under)) and target.endswith(Path(sealed_name(0, 1)).suffix)):
                found.add(target)
    return found


async def test_close_read_files_closes_what_reads_opened(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    try:
        await append(wal, [msg(0), msg(1)])
        sealed = await wal.seal_active()
        assert sealed is not None
        path = str(tmp_path / sealed_name(0, 1))
        assert path not in open_files()  # sealing closes the file it was written through
        assert [r.offset for r in read(wal, 0, 10)] == [0, 1]
        assert path in open_files()
        wal.close_read_files()
        assert path not in open_files()
        assert [r.offset for r in read(wal, 0, 10)] == [0, 1]  # a later read opens it again
    finally:
        await wal.close()


async def test_sealed_files_open_for_reads_are_bounded_across_every_wal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads keep sealed segment files open up to a limit shared by every WAL read from the
    thread (the broker's loop), least recently read closed first; each read is still right."""
    files = localmod.ReadFiles(limit=4)
    monkeypatch.setattr(localmod, "read_files", lambda: files)
    wals = [await open_wal(tmp_path / f"wal-{i}") for i in range(3)]
    try:
        for wal in wals:
            for first in (0, 2, 4):  # three sealed segments of two messages each
                await append(wal, [msg(first), msg(first + 1)])
                assert await wal.seal_active() is not None
        for wal in wals:
            assert [r.offset for r in read(wal, 0, 10)] == list(range(6))  # across its 3 sealed segments
            assert len(open_files(tmp_path)) <= 4 and len(files) <= 4
        last = str(tmp_path / "wal-2" / sealed_name(4, 5))
        assert last in open_files(tmp_path)  # the most recently read stays open
        assert str(tmp_path / "wal-0" / sealed_name(0, 1)) not in open_files(tmp_path)
        assert [r.offset for r in read(wals[0], 0, 10)] == list(range(6))  # reopened as needed
        assert len(open_files(tmp_path)) <= 4
        wals[0].close_read_files()
        assert not {p for p in open_files(tmp_path) if "/wal-0/" in p}
    finally:
        for wal in wals:
            await wal.close()
    assert open_files(tmp_path) == set() and len(files) == 0


async def test_seal_active_and_empty_noop(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    try:
        assert await wal.seal_active() is None
        assert wal.sealed_segments() == []
        enqueue(wal, [msg(0), msg(1), msg(2)])  # not awaited: seal must still include them
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
            await append(wal, [msg(offset + i, size=100) for i in range(size)])
            offset += size
            await wal.seal_active()
        await append(wal, [msg(offset + i, size=100) for i in range(7)])
        total = offset + 7
        assert [s.start_offset for s in wal.sealed_segments()] == [0, 10, 30]
        for start in (0, 5, 9, 10, 29, 30, 34, 35, 40):
            got = read(wal, start, 12)
            assert [r.offset for r in got] == list(range(start, min(start + 12, total)))
            assert payloads(got) == [msg(o, size=100).payload for o in range(start, min(start + 12, total))]
    finally:
        await wal.close()
    # after reopen, sealed segments are discovered by name and read with a lazily built index
    wal = await open_wal(tmp_path, index_interval_bytes=256)
    try:
        assert [s.start_offset for s in wal.sealed_segments()] == [0, 10, 30]
        assert [r.offset for r in read(wal, 8, 30)] == list(range(8, 38))
    finally:
        await wal.close()


def _torn_record(good_records: int) -> bytes:
    return stored(good_records, [msg(good_records)])[:-7]


def _torn_frame(good_records: int) -> bytes:
    return stored(good_records, [msg(good_records)])[:5]


def _garbage(good_records: int) -> bytes:
    return os.urandom(100)


def _wrong_offset(good_records: int) -> bytes:
    return stored(good_records + 7, [msg(0)])  # a whole batch out of sequence


@pytest.mark.parametrize(
    "tail", [_torn_record, _torn_frame, _garbage, _wrong_offset], ids=lambda f: f.__name__.strip("_")
)
@pytest.mark.parametrize("good_records", [0, 5])
async def test_bad_tail_is_truncated(tmp_path: Path, tail: object, good_records: int) -> None:
    """A torn or corrupt tail after the last good record was never acknowledged: recovery
    cuts it off and appends continue at the last good offset + 1."""
    wal = await open_wal(tmp_path)
    if good_records:
        await append(wal, [msg(i) for i in range(good_records)])
    path = wal.active_path
    await wal.close()
    good_size = path.stat().st_size
    assert callable(tail)
    with open(path, "ab") as f:
        f.write(tail(good_records))
    wal = await open_wal(tmp_path)
    try:
        assert path.stat().st_size == good_size
        assert wal.next_offset == good_records
        assert await append(wal, [msg(50)]) == (good_records, good_records)
        got = read(wal, 0, 100)
        assert [r.offset for r in got] == list(range(good_records + 1))
        assert got[-1].payload == msg(50).payload
    finally:
        await wal.close()


async def test_short_active_file_gets_a_fresh_header(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path)
    await append(wal, [msg(0), msg(1)])
    await wal.seal_active()
    active = wal.active_path
    await wal.close()
    active.write_bytes(b"DNB")  # shorter than the header
    wal = await open_wal(tmp_path)
    try:
        assert wal.next_offset == 2
        assert wal.active_path.stat().st_size >= SEGMENT_HEADER_SIZE
        assert await append(wal, [msg(2)]) == (2, 2)
        assert [r.offset for r in read(wal, 0, 10)] == [0, 1, 2]
    finally:
        await wal.close()


async def test_initial_offset_for_empty_wal(tmp_path: Path) -> None:
    wal = await open_wal(tmp_path, initial_offset=22)
    try:
        assert wal.next_offset == 22 and wal.first_offset == 22
        assert await append(wal, [msg(0)]) == (22, 22)
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
        await stays(lambda: not waiter.done(), for_s=0.05, what="waiting for offset 0")
        await append(wal, [msg(0)])
        assert await waiter is True
        assert await wal.wait_for_offset(5, timeout_s=0.05) is False
    finally:
        await wal.close()


# ---------------------------------------------------------------- sealing races and faults


def file_offsets(path: Path) -> list[int]:
    """Offsets of every record in a segment file, read straight from disk."""
    return [r.offset for r in decode_segment(path.read_bytes()).records]


def dir_names(path: Path) -> list[str]:
    return sorted(os.listdir(path))


async def test_close_during_age_seal_keeps_acked_offsets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """close() while the age timer is inside a seal must let the seal finish: acked records
    written meanwhile go to the NEW active segment, never into the sealed file.

    FAKE fault injection: ``fsync_dir`` is replaced by one that blocks in the seal's worker
    thread, after the rename, until close() has started; a real directory fsync is too fast to
    hit this window deterministically.
    """
    wal = await open_wal(tmp_path, segment_max_age_s=0.2)
    assert await append(wal, [msg(i) for i in range(5)]) == (0, 4)
    real_fsync_dir = fsync_dir
    in_seal = asyncio.Event()
    release = threading.Event()
    loop = asyncio.get_running_loop()

    def held_fsync_dir(d: Path) -> None:
        loop.call_soon_threadsafe(in_seal.set)
        release.wait(10)
        real_fsync_dir(d)

    patch_fsync_dir(monkeypatch, held_fsync_dir)
    await asyncio.wait_for(in_seal.wait(), 5)  # the age timer is mid-seal
    patch_fsync_dir(monkeypatch, real_fsync_dir)
    fut = enqueue(wal, [msg(i) for i in range(5, 8)])
    closing = asyncio.create_task(wal.close())
    await eventually(lambda: wal.closed, timeout_s=5, what="close() started")
    release.set()
    await asyncio.wait_for(closing, 10)
    assert fut.done() and fut.result() == (5, 7)
    # nothing may still be running in the background
    assert not [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("wal-")]
    assert dir_names(tmp_path) == [sealed_name(0, 4), active_name(5)]
    assert file_offsets(tmp_path / sealed_name(0, 4)) == [0, 1, 2, 3, 4]
    assert file_offsets(tmp_path / active_name(5)) == [5, 6, 7]
    wal = await open_wal(tmp_path)
    try:
        assert wal.next_offset == 8
        assert payloads(read(wal, 5, 10)) == [msg(i).payload for i in range(5, 8)]
    finally:
        await wal.close()


async def test_cancelled_seal_still_completes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelling seal_active() while its worker thread runs must not leave the WAL pointing
    at the renamed file: the seal completes and later appends go to the new active segment.

    FAKE fault injection: ``fsync_dir`` blocks after the rename until the test cancelled the
    seal, so that the cancellation lands in the worker thread deterministically.
    """
    wal = await open_wal(tmp_path)
    try:
        await append(wal, [msg(i) for i in range(5)])
        real_fsync_dir = fsync_dir
        in_seal = asyncio.Event()
        release = threading.Event()
        loop = asyncio.get_running_loop()

        def held_fsync_dir(d: Path) -> None:
            loop.call_soon_threadsafe(in_seal.set)
            release.wait(10)
            real_fsync_dir(d)

        patch_fsync_dir(monkeypatch, held_fsync_dir)
        task = asyncio.create_task(wal.seal_active())
        await asyncio.wait_for(in_seal.wait(), 5)
        task.cancel()
        await asyncio.sleep(0)  # deliver the cancellation while the thread is held
        release.set()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        patch_fsync_dir(monkeypatch, real_fsync_dir)
        assert [(s.start_offset, s.end_offset) for s in wal.sealed_segments()] == [(0, 4)]
        assert wal.active_path == tmp_path / active_name(5)
        assert await append(wal, [msg(i) for i in range(5, 8)]) == (5, 7)
        assert file_offsets(tmp_path / sealed_name(0, 4)) == [0, 1, 2, 3, 4]
        assert file_offsets(tmp_path / active_name(5)) == [5, 6, 7]
        assert [r.offset for r in read(wal, 0, 100)] == list(range(8))
    finally:
        await wal.close()


async def test_seal_with_failed_directory_fsync_follows_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename succeeded but the directory fsync after it raised: the WAL must know the
    file is sealed (and renamed) and must not append to it.

    FAKE fault injection: ``fsync_dir`` raises EIO once; a failing directory fsync cannot be
    produced for real on a test file system.
    """
    wal = await open_wal(tmp_path)
    try:
        await append(wal, [msg(i) for i in range(5)])
        real_fsync_dir = fsync_dir
        calls = {"n": 0}

        def failing_once(d: Path) -> None:
            calls["n"] += 1
            if calls["n"] == 1:
                raise OSError(5, "Input/output error")
            real_fsync_dir(d)

        patch_fsync_dir(monkeypatch, failing_once)
        seg = await wal.seal_active()
        assert calls["n"] >= 2  # the failure was hit, then the directory was synced again
        assert seg is not None and seg.path == tmp_path / sealed_name(0, 4)
        assert wal.active_path == tmp_path / active_name(5)
        assert await append(wal, [msg(i) for i in range(5, 8)]) == (5, 7)
        assert file_offsets(tmp_path / sealed_name(0, 4)) == [0, 1, 2, 3, 4]
        assert file_offsets(tmp_path / active_name(5)) == [5, 6, 7]
    finally:
        await wal.close()
    wal = await open_wal(tmp_path)
    try:
        assert wal.next_offset == 8
    finally:
        await wal.close()


async def test_seal_with_failed_new_active_never_writes_into_the_sealed_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename succeeded but creating the next active segment failed: appends must fail
    (not land in the sealed file) until a new active segment can be created.

    FAKE fault injection: ``LocalLog._create_active`` raises ENOSPC while patched; a full
    disk cannot be produced for real in a test.
    """
    wal = await open_wal(tmp_path)
    try:
        await append(wal, [msg(i) for i in range(5)])
        real_create = localmod.LocalLog._create_active

        def no_space(self: localmod.LocalLog, start: int) -> object:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(localmod.LocalLog, "_create_active", no_space)
        with pytest.raises(OSError):
            await wal.seal_active()
        assert [(s.start_offset, s.end_offset) for s in wal.sealed_segments()] == [(0, 4)]
        with pytest.raises(StorageFullError):
            await append(wal, [msg(5)])
        assert file_offsets(tmp_path / sealed_name(0, 4)) == [0, 1, 2, 3, 4]
        assert wal.next_offset == 5 and wal.durable_end == 5
        assert [r.offset for r in read(wal, 0, 100)] == [0, 1, 2, 3, 4]
        monkeypatch.setattr(localmod.LocalLog, "_create_active", real_create)
        assert await append(wal, [msg(i) for i in range(5, 8)]) == (5, 7)
        assert file_offsets(tmp_path / sealed_name(0, 4)) == [0, 1, 2, 3, 4]
        assert file_offsets(tmp_path / active_name(5)) == [5, 6, 7]
        assert [r.offset for r in read(wal, 0, 100)] == list(range(8))
    finally:
        await wal.close()
    wal = await open_wal(tmp_path)
    try:
        assert wal.next_offset == 8
        assert [r.offset for r in read(wal, 0, 100)] == list(range(8))
    finally:
        await wal.close()


# ---------------------------------------------------------------- recovery of inconsistent files


async def make_sealed(dirpath: Path, first: int, count: int, tag: str = "m") -> Path:
    """A real sealed file holding ``first .. first+count-1`` (payloads ``{tag}{offset}``)."""
    wal = await open_wal(dirpath, initial_offset=first)
    for i in range(count):  # one batch per offset
        await append(wal, [Msg(f"{tag}{first + i}".encode(), 1, {})])
    seg = await wal.seal_active()
    await wal.close()
    assert seg is not None
    return seg.path


async def test_recovery_sealed_file_longer_than_its_name(tmp_path: Path) -> None:
    """A sealed file named 0-4 holding 0..7 (records appended after the seal by an older
    broker): recovery renames it to its true end and never hands out 5..7 again."""
    src = await make_sealed(tmp_path / "src", 0, 8)
    w = tmp_path / "w"
    w.mkdir()
    shutil.copy(src, w / sealed_name(0, 4))
    wal = await open_wal(w)
    try:
        assert wal.next_offset == 8
        assert [(s.start_offset, s.end_offset) for s in wal.sealed_segments()] == [(0, 7)]
        assert [r.offset for r in read(wal, 0, 100)] == list(range(8))
    finally:
        await wal.close()
    assert dir_names(w) == [sealed_name(0, 7), active_name(8)]


async def test_recovery_sealed_file_shorter_than_its_name_refuses(tmp_path: Path) -> None:
    src = await make_sealed(tmp_path / "src", 0, 3)
    w = tmp_path / "w"
    w.mkdir()
    shutil.copy(src, w / sealed_name(0, 4))
    with pytest.raises(CorruptRecordError):
        await open_wal(w)


async def test_reads_stop_at_a_sealed_segments_end(tmp_path: Path) -> None:
    """An older sealed file holding records past the end in its name: reads use only the
    records up to its named end and take the later offsets from the following segment."""
    a = await make_sealed(tmp_path / "a", 0, 8, tag="a")
    b = await make_sealed(tmp_path / "b", 5, 5, tag="b")
    w = tmp_path / "w"
    w.mkdir()
    shutil.copy(a, w / sealed_name(0, 4))
    shutil.copy(b, w / sealed_name(5, 9))
    wal = await open_wal(w)
    try:
        assert wal.next_offset == 10
        got = read(wal, 0, 100)
        assert [r.offset for r in got] == list(range(10))
        assert payloads(got) == [f"a{i}".encode() for i in range(5)] + [f"b{i}".encode() for i in range(5, 10)]
        assert payloads(read(wal, 3, 4)) == [b"a3", b"a4", b"b5", b"b6"]
    finally:
        await wal.close()


async def test_recovery_active_log_already_sealed_is_set_aside(tmp_path: Path) -> None:
    """A sealed 0-9 plus a .log at 0 holding 0..4 (left by a copy, a restore or an interrupted
    seal): the .log is set aside, offsets continue at 10."""
    sealed = await make_sealed(tmp_path / "a", 0, 10)
    small = await make_sealed(tmp_path / "b", 0, 5)
    w = tmp_path / "w"
    w.mkdir()
    shutil.copy(sealed, w / sealed_name(0, 9))
    shutil.copy(small, w / active_name(0))
    wal = await open_wal(w)
    try:
        assert wal.next_offset == 10
        assert [(s.start_offset, s.end_offset) for s in wal.sealed_segments()] == [(0, 9)]
        assert await append(wal, [msg(10)]) == (10, 10)
    finally:
        await wal.close()
    assert dir_names(w) == sorted([active_name(0) + ".stale", sealed_name(0, 9), active_name(10)])


@pytest.mark.parametrize("reverse_listing", [False, True])
async def test_recovery_same_start_overlap_survives_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reverse_listing: bool
) -> None:
    """A sealed 0-9 and a .log at 0 with the same records; after one more seal the next
    restart must still continue at 15 whatever order the directory is listed in."""
    sealed = await make_sealed(tmp_path / "a", 0, 10)
    w = tmp_path / "w"
    w.mkdir()
    shutil.copy(sealed, w / sealed_name(0, 9))
    shutil.copy(sealed, w / active_name(0))
    wal = await open_wal(w)
    assert wal.next_offset == 10
    assert await append(wal, [msg(i) for i in range(10, 15)]) == (10, 14)
    await wal.seal_active()
    await wal.close()
    if reverse_listing:
        real = os.scandir
        monkeypatch.setattr(os, "scandir", lambda d: sorted(real(d), key=lambda e: e.name, reverse=True))
    wal = await open_wal(w)
    try:
        assert wal.next_offset == 15
        assert [r.offset for r in read(wal, 0, 100)] == list(range(15))
    finally:
        await wal.close()


async def test_recovery_sets_aside_a_covered_sealed_segment(tmp_path: Path) -> None:
    """Sealed 0-4 and 0-9 (the same start): 0-4 is set aside, whatever the listing order."""
    big = await make_sealed(tmp_path / "a", 0, 10)
    small = await make_sealed(tmp_path / "b", 0, 5)
    w = tmp_path / "w"
    w.mkdir()
    shutil.copy(big, w / sealed_name(0, 9))
    shutil.copy(small, w / sealed_name(0, 4))
    wal = await open_wal(w)
    try:
        assert [(s.start_offset, s.end_offset) for s in wal.sealed_segments()] == [(0, 9)]
        assert wal.next_offset == 10
        assert [r.offset for r in read(wal, 0, 100)] == list(range(10))
    finally:
        await wal.close()
    assert sealed_name(0, 4) + ".stale" in dir_names(w)


async def test_recovery_refuses_active_log_overlapping_sealed_with_more_records(tmp_path: Path) -> None:
    """A sealed 0-9 and a .log at 0 holding 0..11: offsets 0..9 exist twice and 10..11 only in
    the .log; neither file can simply be dropped, so opening fails loudly."""
    sealed = await make_sealed(tmp_path / "a", 0, 10)
    longer = await make_sealed(tmp_path / "b", 0, 12)
    w = tmp_path / "w"
    w.mkdir()
    shutil.copy(sealed, w / sealed_name(0, 9))
    shutil.copy(longer, w / active_name(0))
    with pytest.raises(CorruptRecordError, match="refusing to open"):
        await open_wal(w)


async def test_seal_active_returns_when_the_appends_before_it_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wal_syscalls_from_python: None
) -> None:
    """FAKE fault injection: ``os.fdatasync`` fails once with ENOSPC (a full disk cannot be
    arranged on demand). The failed append's offsets are handed back; a seal asked for right
    after it must neither hang nor seal anything that was not written."""
    wal = await open_wal(tmp_path)
    try:
        assert await append(wal, [msg(0), msg(1)]) == (0, 1)
        real = os.fdatasync
        calls = {"n": 0}

        def failing_once(fd: int) -> None:
            calls["n"] += 1
            if calls["n"] == 1:
                raise OSError(28, "No space left on device")
            real(fd)

        monkeypatch.setattr(os, "fdatasync", failing_once)
        doomed = enqueue(wal, [msg(2)])
        sealed = await asyncio.wait_for(wal.seal_active(), timeout=5)
        with pytest.raises(StorageFullError):
            await doomed
        assert sealed is not None and (sealed.start_offset, sealed.end_offset) == (0, 1)
        assert await append(wal, [msg(3)]) == (2, 2)  # offset 2 handed out again, never acked before
    finally:
        await wal.close()


# ---------------------------------------------------------------- corruption is not truncation


async def ten_batches(dirpath: Path) -> Path:
    """A WAL holding offsets 0..9, one batch per offset, closed; returns its active file."""
    wal = await open_wal(dirpath)
    for i in range(10):
        await append(wal, [msg(i)])
    path = wal.active_path
    await wal.close()
    return path


def batch_positions(path: Path) -> dict[int, int]:
    """``{base_offset: byte_position}`` of every good batch of a segment file."""
    return dict(scan_segment(path.read_bytes(), keep_positions=True).positions)


def damage(path: Path, offset: int, how: str) -> tuple[bytes, int]:
    """Damage the batch holding ``offset`` in place (past its epoch in a version 3 file);
    returns the new bytes and its (entry) position."""
    data = bytearray(path.read_bytes())
    entry = batch_positions(path)[offset]
    pos = entry + (8 if SegmentHeader.decode(bytes(data[:32])).format_version == FORMAT_VERSION else 0)
    if how == "record_byte":
        data[pos + 70] ^= 0xFF  # inside the record: CRC mismatch
    elif how == "base_offset":
        data[pos : pos + 8] = (999).to_bytes(8, "little")  # not covered by the CRC
    elif how == "length":
        data[pos + 8 : pos + 12] = (0x7FFFFFFF).to_bytes(4, "little")
    elif how == "magic":
        data[pos + 16] = 9
    else:
        raise AssertionError(how)
    path.write_bytes(bytes(data))
    return bytes(data), entry


def marker_of(path: Path) -> Path:
    return path.with_name(path.name + ".quarantine")


def repair(directory: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """``python -m broker.storage.wal.repair DIRECTORY FLAGS`` as the operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "broker.storage.wal.repair", str(directory), *flags],
        capture_output=True, text=True, timeout=120, check=False,
    )


@pytest.mark.parametrize("how", ["record_byte", "base_offset", "length", "magic"])
@pytest.mark.parametrize("bad_offset", [0, 4])
async def test_corruption_in_the_middle_quarantines_the_segment(tmp_path: Path, how: str, bad_offset: int) -> None:
    """A bad batch followed by valid (acknowledged) batches is not a torn tail: the segment is
    kept byte for byte, a marker is written, reads stop at the last good offset and appends
    are refused with a typed error."""
    path = await ten_batches(tmp_path)
    damaged, pos = damage(path, bad_offset, how)
    last_good = bad_offset - 1
    wal = await open_wal(tmp_path)
    try:
        assert path.read_bytes() == damaged
        q = wal.quarantine
        assert q is not None
        assert (q.segment, q.position, q.last_good_offset) == (path, pos, last_good)
        assert q.next_valid_offset == bad_offset + 1
        assert q.error
        assert wal.durable_end == bad_offset
        assert [r.offset for r in read(wal, 0, 100)] == list(range(bad_offset))
        assert read(wal, bad_offset, 10) == [] and read(wal, 7, 10) == []
        with pytest.raises(SegmentQuarantinedError) as err:
            await append(wal, [msg(50)])
        e = err.value
        assert (e.path, e.position, e.last_good_offset) == (str(path), pos, last_good)
        assert e.next_valid_offset == bad_offset + 1
        assert isinstance(e, DanubeError) and not e.retriable
        assert e.grpc_code == grpc.StatusCode.FAILED_PRECONDITION and "operator" in str(e)
        with pytest.raises(SegmentQuarantinedError):
            enqueue(wal, [msg(51)])
    finally:
        await wal.close()
    assert path.read_bytes() == damaged
    marker = json.loads(marker_of(path).read_text())
    assert marker["segment"] == path.name
    assert (marker["position"], marker["last_good_offset"]) == (pos, last_good)
    assert marker["next_valid_offset"] == bad_offset + 1
    assert marker["error"] == q.error and marker["detected_at"]


async def test_quarantine_persists_across_reopens(tmp_path: Path) -> None:
    """Reopening does not lift the quarantine: it is found again in the bytes (even with the
    marker removed by hand), and an existing marker keeps its first detection time."""
    path = await ten_batches(tmp_path)
    damaged, pos = damage(path, 4, "record_byte")
    wal = await open_wal(tmp_path)
    await wal.close()
    first = json.loads(marker_of(path).read_text())
    wal = await open_wal(tmp_path)
    await wal.close()
    assert json.loads(marker_of(path).read_text()) == first
    marker_of(path).unlink()
    wal = await open_wal(tmp_path)
    try:
        assert wal.quarantine is not None and wal.quarantine.position == pos
        with pytest.raises(SegmentQuarantinedError):
            await append(wal, [msg(50)])
    finally:
        await wal.close()
    again = json.loads(marker_of(path).read_text())
    assert {k: v for k, v in again.items() if k != "detected_at"} == {
        k: v for k, v in first.items() if k != "detected_at"
    }
    assert path.read_bytes() == damaged


@pytest.mark.parametrize("tail", ["corrupt_last", "corrupt_then_torn"])
async def test_bad_batch_with_nothing_valid_after_is_a_torn_tail(tmp_path: Path, tail: str) -> None:
    """A bad last batch, or a bad batch followed only by a torn one, was never acknowledged:
    truncated as before, no marker, appends continue."""
    path = await ten_batches(tmp_path)
    positions = batch_positions(path)
    if tail == "corrupt_last":
        _, pos = damage(path, 9, "record_byte")
        good = 9
    else:
        _, pos = damage(path, 8, "record_byte")
        data = path.read_bytes()
        path.write_bytes(data[: positions[9] + 30])  # batch 9 torn
        good = 8
    wal = await open_wal(tmp_path)
    try:
        assert wal.quarantine is None
        assert path.stat().st_size == pos
        assert await append(wal, [msg(50)]) == (good, good)
        assert [r.offset for r in read(wal, 0, 100)] == list(range(good + 1))
    finally:
        await wal.close()
    assert not marker_of(path).exists()


async def test_repair_without_flag_only_reports(tmp_path: Path) -> None:
    path = await ten_batches(tmp_path)
    damaged, pos = damage(path, 4, "record_byte")
    wal = await open_wal(tmp_path)
    await wal.close()
    marker = marker_of(path).read_text()
    done = repair(tmp_path)
    assert done.returncode == 1, done.stderr
    out = done.stdout
    assert path.name in out and f"byte {pos}" in out
    assert "last good offset 3" in out and "offset 5" in out and "--truncate" in out
    assert path.read_bytes() == damaged and marker_of(path).read_text() == marker
    assert dir_names(tmp_path) == sorted([path.name, marker_of(path).name])


async def test_repair_truncate_keeps_the_evidence_and_the_wal_resumes(tmp_path: Path) -> None:
    """The operator accepts the loss: the dropped offsets are recorded as abandoned, the
    segment is kept aside as ``.quarantined``, the good prefix replaces it, the marker goes,
    and the WAL opens and appends past the abandoned offsets (never reusing one), at every
    later open too; reads step over the gap."""
    path = await ten_batches(tmp_path)
    damaged, pos = damage(path, 4, "record_byte")
    wal = await open_wal(tmp_path)
    await wal.close()
    done = repair(tmp_path, "--truncate")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 offsets" in done.stdout and "4..9" in done.stdout and "abandoned" in done.stdout
    aside = path.with_name(path.name + ".quarantined")
    assert aside.read_bytes() == damaged
    assert path.read_bytes() == damaged[:pos]
    assert not marker_of(path).exists()
    record = json.loads((tmp_path / "abandoned.json").read_text())["ranges"]
    assert [(r["first_offset"], r["last_offset"]) for r in record] == [(4, 9)]
    assert repair(tmp_path).returncode == 0  # nothing quarantined any more
    wal = await open_wal(tmp_path)
    try:
        assert wal.quarantine is None and wal.next_offset == 10
        assert [(r.first_offset, r.last_offset) for r in wal.abandoned] == [(4, 9)]
        assert wal.abandoned_offset_count == 6
        assert await append(wal, [msg(50)]) == (10, 10)
        got = read(wal, 0, 100)
        assert [r.offset for r in got] == [0, 1, 2, 3, 10] and got[-1].payload == msg(50).payload
        assert [r.offset for r in read(wal, 5, 100)] == [10]  # inside the gap: the next held offset
    finally:
        await wal.close()
    sealed = tmp_path / sealed_name(0, 3)
    assert sealed.read_bytes() == damaged[:pos]  # the good prefix, sealed below the gap
    wal = await open_wal(tmp_path)  # the record survives restarts
    try:
        assert wal.next_offset == 11
        assert await append(wal, [msg(51)]) == (11, 11)
    finally:
        await wal.close()
    assert dir_names(tmp_path) == sorted(["abandoned.json", sealed.name, aside.name, active_name(10)])


async def test_a_quarantined_segment_is_never_sealed(tmp_path: Path) -> None:
    """An admin seal of a quarantined active segment does nothing (its bytes run past the
    corruption, so it must never become a sealed segment that tiering would upload); the file
    stays as it is until the repair cuts it."""
    path = await ten_batches(tmp_path)
    damaged, pos = damage(path, 4, "record_byte")
    wal = await open_wal(tmp_path)
    try:
        assert await wal.seal_active() is None
        assert wal.sealed_segments() == []
        with pytest.raises(SegmentQuarantinedError):
            await append(wal, [msg(50)])
    finally:
        await wal.close()
    assert path.read_bytes() == damaged and marker_of(path).exists()
    assert not (tmp_path / sealed_name(0, 3)).exists()
    done = repair(tmp_path, "--truncate")
    assert done.returncode == 0, done.stdout + done.stderr
    assert path.read_bytes() == damaged[:pos]
    assert not [n for n in dir_names(tmp_path) if n.endswith(".quarantine")]
    wal = await open_wal(tmp_path)
    try:
        assert wal.quarantine is None
        assert await append(wal, [msg(50)]) == (10, 10)  # past the abandoned offsets 4..9
        assert [r.offset for r in read(wal, 0, 100)] == [0, 1, 2, 3, 10]
    finally:
        await wal.close()


async def test_legacy_segment_with_corruption_in_the_middle_is_quarantined(tmp_path: Path) -> None:
    """A version 1 active file (one frame per record) follows the same rule: not sealed, not
    truncated, until the repair cuts it; then it is sealed as before."""
    records = [
        Record(offset=i, publish_time_us=1, producer_id=7, producer_name="p", schema_id=0, schema_version=0,
               payload=f"v1-{i}".encode())
        for i in range(6)
    ]
    header = SegmentHeader(start_offset=0, created_at_ms=1, format_version=LEGACY_FORMAT_VERSION).encode()
    frames = [encode_record(r) for r in records]
    pos2 = len(header) + len(frames[0]) + len(frames[1])
    data = bytearray(header + b"".join(frames))
    data[pos2 + 20] ^= 0xFF
    path = tmp_path / active_name(0)
    path.write_bytes(bytes(data))
    wal = await open_wal(tmp_path)
    try:
        q = wal.quarantine
        assert q is not None and (q.position, q.last_good_offset, q.next_valid_offset) == (pos2, 1, 3)
        assert wal.sealed_segments() == [] and wal.active_path == path
        assert [r.payload for r in read(wal, 0, 100)] == [b"v1-0", b"v1-1"]
        with pytest.raises(SegmentQuarantinedError):
            await append(wal, [msg(50)])
    finally:
        await wal.close()
    assert path.read_bytes() == bytes(data)
    done = repair(tmp_path, "--truncate")
    assert done.returncode == 0, done.stdout + done.stderr
    wal = await open_wal(tmp_path)
    try:
        assert [(s.start_offset, s.end_offset) for s in wal.sealed_segments()] == [(0, 1)]
        assert await append(wal, [msg(50)]) == (6, 6)  # past the abandoned offsets 2..5
    finally:
        await wal.close()
