"""The group commit's sync threads (:mod:`broker.storage.wal.sync_thread`): a commit's appends
are acknowledged from the one loop callback the sync thread schedules once ``fdatasync``
returned, never before; a failed ``fdatasync`` fails every append of its commit and everything
queued after it, and nothing after it is acknowledged.

The disk is FAKE where a test must hold or fail an ``fdatasync``: ``os.fdatasync`` wrapped to
wait for a :class:`threading.Event` (then sync for real) or to raise ``EIO``.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from danube_pipeline.format.batches import BatchBuilder, batch_records

from broker.storage.wal import WriteAheadLog
from broker.storage.wal.sync_thread import SyncThreads, Write, until_synced

pytestmark = [pytest.mark.unit, pytest.mark.asyncio]


def frame(i: int) -> tuple[bytes, int]:
    builder = BatchBuilder(1_700_000_000_000_000 + i)
    builder.append(f"m{i}".encode(), timestamp_us=1_700_000_000_000_000 + i)
    return builder.build(producer_id=7, producer_name="p"), 1


class HeldDisk:
    """FAKE disk: each ``os.fdatasync`` announces itself (:attr:`entered`), waits until
    :attr:`release` is set, then fails once with :attr:`error` (and clears it) or syncs for
    real and records that it returned (:attr:`returned`)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.returned = 0
        self.error: OSError | None = None
        self._real: Callable[[int], None] = os.fdatasync

    def fdatasync(self, fd: int) -> None:
        self.entered.set()
        self.release.wait(30)
        if self.error is not None:
            error, self.error = self.error, None  # one failed sync; the next ones succeed
            raise error
        self._real(fd)
        self.returned += 1


async def wait_until_entered(disk: HeldDisk) -> None:
    await asyncio.get_running_loop().run_in_executor(None, disk.entered.wait, 30)


def offsets(wal: WriteAheadLog) -> list[int]:
    return [r.offset for b in wal.read(0, 100) for r in batch_records(b.data)]


async def test_appends_are_acknowledged_only_after_their_fdatasync_returned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wal_syscalls_from_python: None
) -> None:
    wal = await WriteAheadLog.open(tmp_path, segment_max_age_s=3600.0)
    disk = HeldDisk()
    try:
        monkeypatch.setattr(os, "fdatasync", disk.fdatasync)
        first = [wal.enqueue(*frame(i)) for i in range(3)]  # one commit
        seen_returned: list[int] = []
        first[0].add_done_callback(lambda _: seen_returned.append(disk.returned))
        await wait_until_entered(disk)
        later = wal.enqueue(*frame(3))  # queued behind the commit in flight
        for _ in range(20):
            await asyncio.sleep(0)
        assert not any(f.done() for f in [*first, later])
        assert wal.durable_end == 0
        disk.release.set()
        assert await asyncio.gather(*first) == [(0, 0), (1, 1), (2, 2)]
        assert seen_returned == [1]  # resolved after the fdatasync returned, not before
        assert await later == (3, 3)
        assert wal.sync_count == 2
        assert offsets(wal) == [0, 1, 2, 3]
    finally:
        disk.release.set()
        await wal.close()


async def test_a_failed_fdatasync_fails_its_commit_and_everything_queued_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wal_syscalls_from_python: None
) -> None:
    wal = await WriteAheadLog.open(tmp_path, segment_max_age_s=3600.0)
    disk = HeldDisk()
    try:
        assert await wal.append(*frame(0)) == (0, 0)
        disk.error = OSError(errno.EIO, "injected I/O error")
        monkeypatch.setattr(os, "fdatasync", disk.fdatasync)
        commit = [wal.enqueue(*frame(i)) for i in (1, 2)]
        await wait_until_entered(disk)
        behind = [wal.enqueue(*frame(i)) for i in (3, 4)]
        disk.release.set()
        results = await asyncio.gather(*commit, *behind, return_exceptions=True)
        assert all(isinstance(r, OSError) and r.errno == errno.EIO for r in results), results
        assert wal.durable_end == 1  # nothing of the failed commit or after it is acknowledged
        monkeypatch.setattr(os, "fdatasync", disk._real)
        assert await wal.append(*frame(5)) == (1, 1)  # the offsets were handed out again
        assert offsets(wal) == [0, 1]
    finally:
        disk.release.set()
        await wal.close()


async def test_the_sync_threads_report_each_outcome_on_the_loop() -> None:
    loop = asyncio.get_running_loop()
    pool = SyncThreads(max_threads=2, name="test-sync")
    gate = threading.Event()
    running = 0
    most_running = 0
    lock = threading.Lock()
    outcomes: list[tuple[int, BaseException | None, bool]] = []
    all_done = asyncio.Event()

    def job(i: int) -> Callable[[], None]:
        def work() -> None:
            nonlocal running, most_running
            with lock:
                running += 1
                most_running = max(most_running, running)
            gate.wait(30)
            with lock:
                running -= 1
            if i == 3:
                raise ValueError("job 3 fails")
        return work

    def done(i: int) -> Callable[[BaseException | None], None]:
        def report(error: BaseException | None) -> None:
            outcomes.append((i, error, threading.current_thread() is threading.main_thread()))
            if len(outcomes) == 5:
                all_done.set()
        return report

    for i in range(5):
        pool.submit(job(i), loop, done(i))
    gate.set()
    await all_done.wait()
    assert sorted(i for i, _, _ in outcomes) == [0, 1, 2, 3, 4]
    assert all(on_loop for _, _, on_loop in outcomes)  # called on the loop's thread
    errors = {i: e for i, e, _ in outcomes}
    assert isinstance(errors[3], ValueError)
    assert all(errors[i] is None for i in (0, 1, 2, 4))
    assert most_running <= 2  # never more threads than max_threads


async def test_a_cancelled_writer_waits_for_the_outcome_of_its_write() -> None:
    loop = asyncio.get_running_loop()
    write = Write([], [], -1, 0, 0, None, loop.create_future())
    waiting = asyncio.create_task(until_synced(write))
    await asyncio.sleep(0)
    waiting.cancel()
    for _ in range(10):
        await asyncio.sleep(0)
    assert not waiting.done()  # the write's outcome is not known yet
    write.finished = True
    assert write.waiter is not None
    write.waiter.set_result(None)
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_the_queued_epoch_follows_epoch_starts_through_a_failed_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wal_syscalls_from_python: None
) -> None:
    """``queued_epoch`` (kept without scanning the queue): the last epoch start queued while a
    write is in flight; still that epoch after the write fails (the epoch start stays queued,
    moved down to the offsets handed back, then recorded); the first append after it gets the
    offsets handed back, in that epoch."""
    wal = await WriteAheadLog.open(tmp_path, segment_max_age_s=3600.0)
    disk = HeldDisk()
    commit = wal._commit
    try:
        await wal.begin_epoch(1)
        assert commit.queued_epoch == 1
        disk.error = OSError(errno.EIO, "injected I/O error")
        monkeypatch.setattr(os, "fdatasync", disk.fdatasync)
        failing = wal.enqueue(*frame(0))
        await wait_until_entered(disk)
        begun = asyncio.ensure_future(wal.begin_epoch(2))
        behind = wal.enqueue(*frame(1))
        await asyncio.sleep(0)
        assert commit.queued_epoch == 2
        disk.release.set()
        for fut in (failing, behind):
            with pytest.raises(OSError):
                await fut
        assert commit.queued_epoch == 2  # kept queued through the hand-back
        monkeypatch.setattr(os, "fdatasync", disk._real)
        await begun
        assert await wal.append(*frame(2)) == (0, 0)
        assert commit.queued_epoch == 2 and not commit.queued
        assert wal._local.epochs.latest_epoch == 2
    finally:
        disk.error = None
        disk.release.set()
        await wal.close()


async def test_a_seal_waiting_for_the_io_lock_gets_it_while_appends_keep_coming(tmp_path: Path) -> None:
    """A write from the loop's callbacks holds the WAL's I/O lock until it is settled. Here every
    write's acknowledgement queues the next append (a listener), so one is always queued when a
    write ends: a seal waiting for the lock must still get it after the write in flight, and the
    appends go on behind it in order, none lost."""
    wal = await WriteAheadLog.open(tmp_path, segment_max_bytes=1 << 30, segment_max_age_s=3600.0)  # never full
    appended: list[asyncio.Future[tuple[int, int]]] = []
    appending = True

    def append_next(durable_end: int) -> None:
        if appending:
            appended.append(wal.enqueue(*frame(len(appended))))

    try:
        wal.add_listener(append_next)
        appended.append(wal.enqueue(*frame(0)))
        while len(appended) < 50:
            await asyncio.sleep(0.001)
        sealed = await asyncio.wait_for(wal.seal_active(), timeout=10)
        appending = False
        results = await asyncio.gather(*appended)
        assert results == [(i, i) for i in range(len(appended))]
        assert sealed is not None and sealed.start_offset == 0 and sealed.end_offset < len(appended) - 1
        stored = [r.offset for b in wal.read(0, len(appended), max_bytes=1 << 30) for r in batch_records(b.data)]
        assert stored == list(range(len(appended)))
    finally:
        appending = False
        await wal.close()
