"""Commit rounds (``broker/storage/wal/sync_thread.py``): the group commits of several WALs
handed over in one loop turn share one thread hand-off and, when they are at least
``syncfs_min_files``, one ``syncfs``; a job whose write fails fails alone.

A write-back error of ``syncfs`` cannot be produced for real here: FAKE ``sync_filesystem``
raising ``EIO``. Which sync ran is observed by wrapping the real calls (counting, then calling
them).
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from danube_pipeline.format.batches import BatchBuilder

from broker.storage.wal import WriteAheadLog
from broker.storage.wal import sync_thread
from broker.storage.wal.sync_thread import CommitJob, run_round

pytestmark = [pytest.mark.unit]


def _counting(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    calls: list[int] = []
    real: Callable[[int], None] = getattr(owner, name)

    def counted(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _jobs(tmp_path: Path, count: int, failing: int | None = None) -> tuple[list[CommitJob], list[str]]:
    """``count`` jobs each writing ``b"data i"`` to its own file; job ``failing`` raises ENOSPC."""
    jobs: list[CommitJob] = []
    events: list[str] = []
    for i in range(count):
        fd = os.open(tmp_path / f"f{i}", os.O_CREAT | os.O_RDWR, 0o600)

        def write(fd: int = fd, i: int = i) -> None:
            if i == failing:
                raise OSError(errno.ENOSPC, "No space left on device")
            os.pwrite(fd, b"data %d" % i, 0)

        def after(i: int = i) -> None:
            events.append(f"after {i}")

        jobs.append(CommitJob(write, fd, after, lambda error: None))
    return jobs, events


def test_a_round_of_several_files_is_made_durable_by_one_syncfs_and_a_failed_write_fails_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if sync_thread._SYNCFS is None:  # noqa: SLF001 - what the round would use
        pytest.skip("syncfs with write-back errors needs Linux 5.8 or later")
    syncfs = _counting(monkeypatch, sync_thread, "sync_filesystem")
    fdatasync = _counting(monkeypatch, os, "fdatasync")
    jobs, events = _jobs(tmp_path, 4, failing=1)
    errors = run_round(jobs, syncfs_min_files=2)
    assert [type(e).__name__ if e else None for e in errors] == [None, "OSError", None, None]
    assert len(syncfs) == 1 and fdatasync == []
    assert events == ["after 0", "after 2", "after 3"]
    for i in (0, 2, 3):
        assert (tmp_path / f"f{i}").read_bytes() == b"data %d" % i


def test_below_the_threshold_each_file_gets_its_fdatasync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    syncfs = _counting(monkeypatch, sync_thread, "sync_filesystem")
    fdatasync = _counting(monkeypatch, os, "fdatasync")
    jobs, events = _jobs(tmp_path, 3)
    assert run_round(jobs, syncfs_min_files=0) == [None, None, None]  # 0: never syncfs
    assert syncfs == [] and sorted(fdatasync) == sorted(job.fd for job in jobs)
    (tmp_path / "one").mkdir()
    single, _ = _jobs(tmp_path / "one", 1)
    fdatasync.clear()
    assert run_round(single, syncfs_min_files=2) == [None]
    assert syncfs == [] and fdatasync == [single[0].fd]
    assert events == ["after 0", "after 1", "after 2"]


def test_a_failed_syncfs_fails_every_job_it_covered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if sync_thread._SYNCFS is None:  # noqa: SLF001
        pytest.skip("syncfs with write-back errors needs Linux 5.8 or later")

    def failing(fd: int) -> None:  # FAKE: a write-back error
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(sync_thread, "sync_filesystem", failing)
    jobs, events = _jobs(tmp_path, 3)
    errors = run_round(jobs, syncfs_min_files=2)
    assert all(isinstance(e, OSError) and e.errno == errno.EIO for e in errors)
    assert events == []  # nothing is marked synced


def frame(i: int) -> tuple[bytes, int]:
    builder = BatchBuilder(1_700_000_000_000_000 + i)
    builder.append(f"m{i}".encode(), timestamp_us=1_700_000_000_000_000 + i)
    return builder.build(producer_id=7, producer_name="p"), 1


@pytest.mark.asyncio
async def test_commits_of_several_wals_in_one_loop_turn_share_one_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wals = await _opened(tmp_path, 3)
    rounds = _record_rounds(monkeypatch)
    try:
        results = await asyncio.gather(*(wal.append(*frame(10 + i)) for i, wal in enumerate(wals)))
        assert results == [(1, 1)] * 3
        assert rounds == [3]
    finally:
        for wal in wals:
            await wal.close()


def _record_rounds(monkeypatch: pytest.MonkeyPatch, hold_first: threading.Event | None = None) -> list[int]:
    """The size of every round run from now on; with ``hold_first``, the first round waits for
    it before it writes (a round kept in flight)."""
    rounds: list[int] = []
    real = sync_thread.run_round

    def recorded(jobs: list[CommitJob], syncfs_min_files: int) -> list[BaseException | None]:
        rounds.append(len(jobs))
        if hold_first is not None and len(rounds) == 1:
            assert hold_first.wait(10)
        return real(jobs, syncfs_min_files)

    monkeypatch.setattr(sync_thread, "run_round", recorded)
    return rounds


async def _opened(tmp_path: Path, count: int) -> list[WriteAheadLog]:
    wals = [await WriteAheadLog.open(tmp_path / f"wal{i}", segment_max_age_s=3600.0) for i in range(count)]
    for i, wal in enumerate(wals):  # each WAL's first append records its epoch
        assert await wal.append(*frame(i)) == (0, 0)
    return wals


@pytest.mark.asyncio
async def test_commits_handed_over_while_rounds_are_in_flight_wait_for_the_next_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sync_thread.SYNC_THREADS, "max_rounds_in_flight", 1)
    wals = await _opened(tmp_path, 4)
    release = threading.Event()
    rounds = _record_rounds(monkeypatch, hold_first=release)
    try:
        first = asyncio.ensure_future(wals[0].append(*frame(10)))
        while not rounds:
            await asyncio.sleep(0.01)
        later = []
        for i, wal in enumerate(wals[1:], start=1):  # one per loop turn, each its own round before
            later.append(asyncio.ensure_future(wal.append(*frame(10 + i))))
            await asyncio.sleep(0.02)
        assert rounds == [1] and not first.done()  # nothing else went to a thread meanwhile
        release.set()
        assert await asyncio.gather(first, *later) == [(1, 1)] * 4
        assert rounds == [1, 3]  # the three waited, then shared one round
    finally:
        release.set()
        for wal in wals:
            await wal.close()


@pytest.mark.asyncio
async def test_a_round_goes_to_a_thread_once_it_holds_round_start_jobs_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sync_thread.SYNC_THREADS, "round_start_jobs", 2)
    monkeypatch.setattr(sync_thread.SYNC_THREADS, "max_rounds_in_flight", 4)
    wals = await _opened(tmp_path, 5)
    rounds = _record_rounds(monkeypatch)
    try:
        results = await asyncio.gather(*(wal.append(*frame(10 + i)) for i, wal in enumerate(wals)))
        assert results == [(1, 1)] * 5
        assert sorted(rounds) == [1, 2, 2]  # two full rounds at once, the rest at the turn's end
    finally:
        for wal in wals:
            await wal.close()
