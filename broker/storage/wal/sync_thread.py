"""The threads that write and ``fdatasync`` the WALs, and how a commit wakes the event loop.

:func:`submit_sync` hands one piece of blocking work (a commit round, below; an epoch write) to
a sync thread; when the work returned, the thread schedules ONE callback on the event loop
(``call_soon_threadsafe``) with the work's error or ``None``. That callback acknowledges the
commit's appends directly (:meth:`broker.storage.wal.group_commit.GroupCommit._synced`), so an
acknowledgement costs one loop wake-up instead of the chain of futures and tasks that
``run_in_executor`` and a waiting writer task go through (a one-message-in-flight producer
waits for every one of them).

The threads are shared by every WAL of the process, started on demand up to
:data:`MAX_SYNC_THREADS` (a thread per WAL would not scale to thousands of topics); a WAL has at
most one commit in flight, so its commits stay in order. Idle threads wait on a
:class:`queue.SimpleQueue`, which costs the loop a lock-free ``put`` per commit.

**Commit rounds.** The group commits that WALs hand over in one turn of the event loop
(:func:`submit_commit`) go to one thread as one round: every WAL's write, then what makes them
all durable, then every WAL's closing write, and one loop callback that acknowledges them all.
With many topics each written a little (thousands of topics, a message each), the per-commit
thread hand-off and loop wake-up are paid per round. A round of at least
:attr:`SyncThreads.syncfs_min_files` files on one file system is made durable by ONE
``syncfs(2)``, which writes back the file system's dirty data and metadata and commits its
journal once, instead of one ``fdatasync`` per file (each its own journal commit): on ext4,
at 128 files, 7 µs of CPU per file against 32 µs, and 2.6 ms against 16.3 ms a round
(``benchmarks/wal_sync.py``, ``benchmarks/README.md``). It is used only where it reports write-back errors (Linux 5.8 and
later); it also writes back whatever else is dirty on that file system, so the WAL directory is
best on a file system of its own.

**Rounds in flight.** At most :attr:`SyncThreads.max_rounds_in_flight` rounds of a loop are in
the threads at once; the commits handed over meanwhile wait for the next round, which starts
when a round in flight ends (group commit applied to the rounds themselves). A round that
reaches :attr:`SyncThreads.round_start_jobs` commits goes to a thread at once, if one may, instead
of at the end of the loop turn: its sync then overlaps the loop's work on the commits after it,
and its acknowledgements go out sooner. Without the bound, every loop turn started a round of its
own: with 1,000 topics, rounds of two commits queued a hundred deep behind sixteen threads whose
``syncfs`` calls all waited for the same journal commits; without the early start, the commits
of a loop turn made one round, and the loop, the sync thread and the producers took turns
instead of overlapping (``benchmarks/README.md``, "Commit rounds in flight"). One topic is not
affected: a WAL has one commit in flight.

**One GIL release per round.** A round's system calls (each WAL's write record and ``pwritev``,
the ``syncfs`` or the ``fdatasync`` calls, the closing write records) run in C
(``broker/storage/wal/_commit_round.c``) between one release of the GIL and one re-acquisition.
Made from Python, each call releases the GIL and must take it back from the loop's thread, which
holds it while it works: under load a round of 32 WALs took about 15 ms for 1.5 ms of system
calls (``benchmarks/README.md``, "One GIL release per commit round"). Without the extension (no C
compiler at install, or ``DANUBE_NO_EXTENSIONS`` set) :func:`run_round` makes the same calls from
Python.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import os
import platform
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from danube_pipeline import faults

from broker import metrics
from broker.storage.wal.pending import PendingAppend, write_all

MAX_SYNC_THREADS = 16
"""Most sync threads at once: commits of more WALs than this wait for a free thread."""

Done = Callable[[BaseException | None], None]
"""Called on the loop once a job's work returned: with what it raised, else ``None``."""

SYNCFS_MIN_FILES = 2
"""Default of :attr:`SyncThreads.syncfs_min_files`."""

MAX_ROUNDS_IN_FLIGHT = 2
"""Default of :attr:`SyncThreads.max_rounds_in_flight`: one round syncs while the next one's
writes go out."""

ROUND_START_JOBS = 32
"""Default of :attr:`SyncThreads.round_start_jobs` (measured: 16 to 64 did as well at 1,000
topics; ``benchmarks/README.md``)."""


def _load_syncfs() -> Callable[[int], int] | None:
    """``syncfs(2)`` from the C library where it reports write-back errors (Linux >= 5.8),
    else ``None``."""
    if platform.system() != "Linux":
        return None
    try:
        major, minor = (int(part) for part in platform.release().split(".")[:2])
    except ValueError:
        return None
    if (major, minor) < (5, 8):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        syncfs: Callable[[int], int] = libc.syncfs
    except (OSError, AttributeError):
        return None
    return syncfs


_SYNCFS = _load_syncfs()

NativeRound = Callable[
    [list[tuple[int, bytes, int, list[bytes | memoryview], int, bytes]], int], tuple[list[int], bool, list[float]]
]


def _load_native_round() -> NativeRound | None:
    """``commit_round`` of the C extension (``broker/storage/wal/_commit_round.c``), or ``None``
    when it was not built (no C compiler at install) or ``DANUBE_NO_EXTENSIONS`` is set."""
    if os.environ.get("DANUBE_NO_EXTENSIONS"):
        return None
    try:
        from broker.storage.wal import _commit_round  # type: ignore[attr-defined]  # noqa: PLC0415 - built optionally
    except ImportError:
        return None
    native: NativeRound = _commit_round.commit_round
    return native


native_round = _load_native_round()
"""The C commit round :func:`run_round` uses, or ``None`` (the same calls from Python). Tests
that fake a failing system call (``os.fdatasync``, :func:`sync_filesystem`) set it to ``None``."""


def sync_filesystem(fd: int) -> None:
    """``syncfs(fd)``: every dirty page and inode of ``fd``'s file system written back, its
    journal committed.

    Raises:
        OSError: the write-back failed (or the call is unavailable: ``ENOSYS``).
    """
    if _SYNCFS is None:
        raise OSError(errno.ENOSYS, "syncfs is not available")
    if _SYNCFS(fd) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


@dataclass(slots=True, eq=False)
class CommitJob:
    """One WAL's share of a commit round (module docstring).

    Attributes:
        fd: the file it writes.
        header: written at ``header_at`` first, made durable with the write (the segment's write
            record: a write of this size is under way, :mod:`broker.storage.wal.segment`).
        header_at: the byte position of ``header`` and ``closing``.
        buffers: the commit's bytes, written one after the other from ``position``.
        position: where the write starts, bytes.
        closing: written at ``header_at`` once the write is durable; best effort.
        done: called on the loop with the job's error (``None``: durable).
    """

    fd: int
    header: bytes
    header_at: int
    buffers: list[bytes | memoryview]
    position: int
    closing: bytes
    done: Done

    def write(self) -> None:
        """The header, then the buffers (not durable yet).

        Raises:
            OSError: a write failed (e.g. ``ENOSPC``).
        """
        os.pwrite(self.fd, self.header, self.header_at)
        write_all(self.fd, self.buffers, self.position)

    def after(self) -> None:
        """The closing header, once the write is durable.

        Raises:
            OSError: it failed (the write is durable either way).
        """
        os.pwrite(self.fd, self.closing, self.header_at)


def run_round(jobs: Sequence[CommitJob], syncfs_min_files: int) -> list[BaseException | None]:
    """Run one commit round in the calling (sync) thread: each write, then ``syncfs`` (at
    least ``syncfs_min_files`` files written, one file system) or one ``fdatasync`` per
    file, then each closing write; in C with the GIL released once (:data:`native_round`),
    else from Python. The ``wal.before_fdatasync`` fault point runs once per job first.

    Returns:
        Each job's error, in order: its write's, else the sync's (a failed ``syncfs`` fails
        every job it covered).
    """
    for _ in jobs:
        faults.point(faults.WAL_BEFORE_FDATASYNC)
    if native_round is not None:
        return _run_native(native_round, jobs, syncfs_min_files)
    errors: list[BaseException | None] = [None] * len(jobs)
    written: list[int] = []
    for i, job in enumerate(jobs):
        try:
            job.write()
            written.append(i)
        except BaseException as exc:  # noqa: BLE001 - that job fails, the others go on
            errors[i] = exc
    wal = metrics.active().wal
    if (
        _SYNCFS is not None and 0 < syncfs_min_files <= len(written)
        and len({os.fstat(jobs[i].fd).st_dev for i in written}) == 1
    ):
        try:
            started = time.perf_counter()
            sync_filesystem(jobs[written[0]].fd)
            wal.flushed((time.perf_counter() - started) * 1000.0)
        except BaseException as exc:  # noqa: BLE001 - nothing of the round is known durable
            for i in written:
                errors[i] = exc
            written = []
    else:
        still: list[int] = []
        for i in written:
            try:
                wal.fdatasync(jobs[i].fd)
                still.append(i)
            except BaseException as exc:  # noqa: BLE001 - that job fails
                errors[i] = exc
        written = still
    for i in written:
        try:
            jobs[i].after()
        except OSError:
            pass  # durable either way
    return errors


def _run_native(native: NativeRound, jobs: Sequence[CommitJob], syncfs_min_files: int) -> list[BaseException | None]:
    """:func:`run_round` in C (``broker/storage/wal/_commit_round.c``); each sync's time goes to
    ``danube_wal_flush_latency_ms``."""
    codes, _, sync_ms = native(
        [(job.fd, job.header, job.header_at, job.buffers, job.position, job.closing) for job in jobs],
        syncfs_min_files if _SYNCFS is not None else 0,
    )
    wal = metrics.active().wal
    for ms in sync_ms:
        wal.flushed(ms)
    return [OSError(code, os.strerror(code)) if code else None for code in codes]


class SyncThreads:
    """A pool of daemon threads running blocking WAL work (module docstring).

    Args:
        max_threads: the most threads it starts.
        name: their name prefix (``threading`` names; ``py-spy`` shows them).
    """

    def __init__(self, max_threads: int = MAX_SYNC_THREADS, name: str = "wal-sync") -> None:
        self.syncfs_min_files = SYNCFS_MIN_FILES
        """Rounds of at least this many files on one file system use ``syncfs``; 0: never."""
        self.max_rounds_in_flight = MAX_ROUNDS_IN_FLIGHT
        """Rounds of one loop handed to the threads and not ended, at most (module docstring)."""
        self.round_start_jobs = ROUND_START_JOBS
        """A round this large goes to a thread before the loop turn ends, if one may (module docstring)."""
        self._rounds: dict[asyncio.AbstractEventLoop, list[CommitJob]] = {}  # the next round of each loop
        self._in_flight: dict[asyncio.AbstractEventLoop, int] = {}  # its rounds in the threads
        self._max_threads = max_threads
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], asyncio.AbstractEventLoop, Done]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._waiting = 0  # threads blocked on the queue, less jobs queued for them

    def submit(self, work: Callable[[], None], loop: asyncio.AbstractEventLoop, done: Done) -> None:
        """Run ``work`` in a sync thread, then ``done(error)`` on ``loop`` (module docstring).

        If ``loop`` is closed by then, ``done`` is not called.
        """
        self._jobs.put((work, loop, done))
        with self._lock:
            self._waiting -= 1
            if self._waiting >= 0 or self._threads >= self._max_threads:
                return
            self._threads += 1
            self._waiting += 1  # the new thread takes this job
            number = self._threads
        threading.Thread(target=self._serve, name=f"{self._name}-{number}", daemon=True).start()

    def submit_commit(self, job: CommitJob, loop: asyncio.AbstractEventLoop) -> None:
        """Add ``job`` to the next round of ``loop``. That round goes to a thread once it holds
        :attr:`round_start_jobs` commits, else when the loop runs its next callbacks; while
        :attr:`max_rounds_in_flight` rounds are in the threads, when one of them ends (module
        docstring)."""
        round_ = self._rounds.get(loop)
        if round_ is None:
            round_ = self._rounds[loop] = []
            loop.call_soon(self._start_round, loop)
        round_.append(job)
        if len(round_) >= self.round_start_jobs:
            self._start_round(loop)

    def _start_round(self, loop: asyncio.AbstractEventLoop) -> None:
        """Hand ``loop``'s next round to a thread, unless it has none or the rounds in flight
        are at :attr:`max_rounds_in_flight` (then the end of one of them starts it)."""
        if self._in_flight.get(loop, 0) >= self.max_rounds_in_flight:
            return
        jobs = self._rounds.pop(loop, [])
        if not jobs:
            return
        self._in_flight[loop] = self._in_flight.get(loop, 0) + 1
        syncfs_min_files = self.syncfs_min_files
        errors: list[BaseException | None] = []

        def work() -> None:
            errors.extend(run_round(jobs, syncfs_min_files))

        def done(error: BaseException | None) -> None:
            try:
                for job, job_error in zip(jobs, errors or [error] * len(jobs), strict=True):
                    job.done(job_error if error is None else error)
            finally:
                self._round_ended(loop)

        self.submit(work, loop, done)

    def _round_ended(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``, once a round's jobs were told: start the round that waited for it."""
        left = self._in_flight.pop(loop, 1) - 1
        if left:
            self._in_flight[loop] = left
        if loop in self._rounds:
            self._start_round(loop)

    def _serve(self) -> None:
        while True:
            work, loop, done = self._jobs.get()
            error: BaseException | None = None
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - handed to the loop, which fails the commit
                error = exc
            try:
                loop.call_soon_threadsafe(done, error)
            except RuntimeError:  # the loop is closed: nobody waits for the outcome any more
                pass
            with self._lock:
                self._waiting += 1


SYNC_THREADS = SyncThreads()
"""The process's sync threads (every WAL's commits, epoch writes and cut-backs)."""


def submit_commit(job: CommitJob) -> None:
    """Add ``job`` to this loop turn's commit round in :data:`SYNC_THREADS`."""
    SYNC_THREADS.submit_commit(job, asyncio.get_running_loop())


def submit_sync(work: Callable[[], None], done: Done) -> None:
    """Run ``work`` in :data:`SYNC_THREADS`, then ``done(error)`` on the running loop."""
    SYNC_THREADS.submit(work, asyncio.get_running_loop(), done)


async def in_sync_thread(work: Callable[[], None]) -> None:
    """Run ``work`` in :data:`SYNC_THREADS` and wait for it; raises what it raised."""
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()

    def done(error: BaseException | None) -> None:
        if finished.done():
            return
        if error is None:
            finished.set_result(None)
        else:
            finished.set_exception(error)

    SYNC_THREADS.submit(work, loop, done)
    await finished


@dataclass(slots=True, eq=False)
class Write:
    """One group commit in flight: what was written and how it ended.

    Attributes:
        batch: its appends, in offset order.
        positions: ``(offset, file position)`` index entries of its batches.
        fd: the active segment's file it writes.
        start_length: the active segment's length before it (where the write starts), bytes.
        size: bytes written.
        last_owned: the last offset it writes that the owner assigned (``None``: replica only).
        waiter: resolved on the loop once the outcome below is set (``None``: a write from the
            loop's callbacks, which nobody awaits).
        error: what the write or ``fdatasync`` raised.
        refused: the :class:`~broker.storage.wal.commit_failures.OffsetGuard`'s refusal to
            acknowledge it after it was durable.
        finished: the sync thread returned and the outcome was handled on the loop.
    """

    batch: list[PendingAppend]
    positions: list[tuple[int, int]]
    fd: int
    start_length: int
    size: int
    last_owned: int | None
    waiter: asyncio.Future[None] | None
    error: BaseException | None = None
    refused: Exception | None = None
    finished: bool = field(default=False)


async def until_synced(write: Write) -> None:
    """Wait until ``write`` finished. Cancelling the caller does not end the wait before the
    write's outcome was handled (the WAL's state follows the file); the cancellation is
    re-raised after."""
    cancelled = False
    waiter = write.waiter
    assert waiter is not None
    while not write.finished:
        try:
            await waiter
        except asyncio.CancelledError:
            cancelled = True
            if not write.finished:
                waiter = write.waiter = asyncio.get_running_loop().create_future()
    if cancelled:
        raise asyncio.CancelledError
