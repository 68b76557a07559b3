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


def _jobs(tmp_path: Path, count: int, failing: int | None = None) -> list[CommitJob]:
    """``count`` jobs, each writing header ``Hi`` at byte 0 and ``data i`` at byte 8 of its own
    file, then closing header ``Ci``. Job ``failing``'s file is open read-only: its writes fail
    for real (``EBADF``)."""
    jobs: list[CommitJob] = []
    for i in range(count):
        path = tmp_path / f"f{i}"
        path.touch()
        fd = os.open(path, os.O_RDONLY if i == failing else os.O_RDWR)
        jobs.append(CommitJob(fd, b"H%d" % i, 0, [b"da", memoryview(b"ta %d" % i)], 8, b"C%d" % i, lambda error: None))
    return jobs


def _contents(tmp_path: Path, count: int) -> list[bytes]:
    return [(tmp_path / f"f{i}").read_bytes() for i in range(count)]


def _closed(i: int) -> bytes:
    """File ``i`` once its job is durable and its closing header written."""
    return b"C%d" % i + bytes(6) + b"data %d" % i


@pytest.fixture(params=["python", "native"])
def round_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each round test runs twice: system calls from Python, and from the C extension (skipped
    where it was not built)."""
    if request.param == "python":
        monkeypatch.setattr(sync_thread, "native_round", None)
    elif sync_thread.native_round is None:
        pytest.skip("the C extension broker.storage.wal._commit_round is not built")
    return str(request.param)


def _syncs(monkeypatch: pytest.MonkeyPatch, path: str) -> Callable[[], tuple[int, int]]:
    """How many ``(syncfs, fdatasync)`` calls the rounds made since: counted by wrapping the
    real calls (Python), or from what the C round reports (native)."""
    if path == "python":
        syncfs = _counting(monkeypatch, sync_thread, "sync_filesystem")
        fdatasync = _counting(monkeypatch, os, "fdatasync")
        return lambda: (len(syncfs), len(fdatasync))
    native = sync_thread.native_round
    assert native is not None
    counts = [0, 0]

    def counted(jobs: Any, syncfs_min_files: int) -> tuple[list[int], bool, list[float]]:
        errors, used_syncfs, sync_ms = native(jobs, syncfs_min_files)
        counts[0 if used_syncfs else 1] += len(sync_ms)
        return errors, used_syncfs, sync_ms

    monkeypatch.setattr(sync_thread, "native_round", counted)
    return lambda: (counts[0], counts[1])


def test_a_round_of_several_files_is_made_durable_by_one_syncfs_and_a_failed_write_fails_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, round_path: str
) -> None:
    if sync_thread._SYNCFS is None:  # noqa: SLF001 - what the round would use
        pytest.skip("syncfs with write-back errors needs Linux 5.8 or later")
    syncs = _syncs(monkeypatch, round_path)
    jobs = _jobs(tmp_path, 4, failing=1)
    errors = run_round(jobs, syncfs_min_files=2)
    assert [e.errno if isinstance(e, OSError) else e for e in errors] == [None, errno.EBADF, None, None]
    assert syncs() == (1, 0)
    assert _contents(tmp_path, 4) == [_closed(0), b"", _closed(2), _closed(3)]


def test_below_the_threshold_each_file_gets_its_fdatasync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, round_path: str
) -> None:
    syncs = _syncs(monkeypatch, round_path)
    jobs = _jobs(tmp_path, 3)
    assert run_round(jobs, syncfs_min_files=0) == [None, None, None]  # 0: never syncfs
    assert syncs() == (0, 3)
    (tmp_path / "one").mkdir()
    single = _jobs(tmp_path / "one", 1)
    assert run_round(single, syncfs_min_files=2) == [None]
    assert syncs() == (0, 4)
    assert _contents(tmp_path, 3) == [_closed(i) for i in range(3)]
    assert _contents(tmp_path / "one", 1) == [_closed(0)]


def test_a_failed_syncfs_fails_every_job_it_covered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wal_syscalls_from_python: None
) -> None:
    if sync_thread._SYNCFS is None:  # noqa: SLF001
        pytest.skip("syncfs with write-back errors needs Linux 5.8 or later")

    def failing(fd: int) -> None:  # FAKE: a write-back error
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(sync_thread, "sync_filesystem", failing)
    jobs = _jobs(tmp_path, 3)
    errors = run_round(jobs, syncfs_min_files=2)
    assert all(isinstance(e, OSError) and e.errno == errno.EIO for e in errors)
    assert _contents(tmp_path, 3) == [b"H%d" % i + bytes(6) + b"data %d" % i for i in range(3)]  # none closed


def test_the_c_round_writes_what_the_python_round_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """More buffers than one ``pwritev`` takes (``IOV_MAX``), empty ones among them, a
    memoryview into a larger buffer: the two rounds leave the same bytes."""
    native = sync_thread.native_round
    if native is None:
        pytest.skip("the C extension broker.storage.wal._commit_round is not built")
    source = bytes(range(256)) * 40
    buffers: list[bytes | memoryview] = [
        b"" if i % 7 == 0 else memoryview(source)[i % 200 : i % 200 + 1 + i % 13] for i in range(2500)
    ]
    written: list[bytes] = []
    for path in ("python", "native"):
        monkeypatch.setattr(sync_thread, "native_round", native if path == "native" else None)
        (tmp_path / path).mkdir()
        target = tmp_path / path / "f"
        target.write_bytes(b"x" * 100)
        fd = os.open(target, os.O_RDWR)
        try:
            assert run_round([CommitJob(fd, b"head", 3, buffers, 40, b"done", lambda error: None)], 2) == [None]
        finally:
            os.close(fd)
        written.append(target.read_bytes())
    assert written[0] == written[1]
    assert written[0][3:7] == b"done" and written[0][40:] == b"".join(bytes(b) for b in buffers)


def test_the_c_round_refuses_a_malformed_job_before_writing(tmp_path: Path) -> None:
    native = sync_thread.native_round
    if native is None:
        pytest.skip("the C extension broker.storage.wal._commit_round is not built")
    target = tmp_path / "f"
    target.touch()
    fd = os.open(target, os.O_RDWR)
    call: Callable[[list[Any]], object] = lambda jobs: native(jobs, 2)  # noqa: E731 - wrong shapes on purpose
    try:
        good = (fd, b"H", 0, [b"data"], 8, b"C")
        with pytest.raises(TypeError):
            call([good, (fd, b"H", 0, (b"not", b"a list"), 8, b"C")])
        with pytest.raises(ValueError):
            call([good, (fd, b"H", 0, [b"data"], -1, b"C")])
        with pytest.raises(TypeError):
            call([good, (fd, "text", 0, [b"data"], 8, b"C")])
        assert target.read_bytes() == b""  # nothing of the round was written
    finally:
        os.close(fd)


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
