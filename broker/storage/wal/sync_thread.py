"""The threads that write and ``fdatasync`` the WALs, and how a commit wakes the event loop.

:func:`submit_sync` hands one commit's blocking work (``pwrite`` + ``fdatasync``) to a sync
thread; when the work returned, the thread schedules ONE callback on the event loop
(``call_soon_threadsafe``) with the work's error or ``None``. That callback acknowledges the
commit's appends directly (:meth:`broker.storage.wal.group_commit.GroupCommit._synced`), so an
acknowledgement costs one loop wake-up instead of the chain of futures and tasks that
``run_in_executor`` and a waiting writer task go through (a one-message-in-flight producer
waits for every one of them).

The threads are shared by every WAL of the process, started on demand up to
:data:`MAX_SYNC_THREADS` (a thread per WAL would not scale to thousands of topics); a WAL has at
most one commit in flight, so its commits stay in order. Idle threads wait on a
:class:`queue.SimpleQueue`, which costs the loop a lock-free ``put`` per commit.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from broker.storage.wal.pending import PendingAppend

MAX_SYNC_THREADS = 16
"""Most sync threads at once: commits of more WALs than this wait for a free thread."""

Done = Callable[[BaseException | None], None]
"""Called on the loop once a job's work returned: with what it raised, else ``None``."""


class SyncThreads:
    """A pool of daemon threads running blocking WAL work (module docstring).

    Args:
        max_threads: the most threads it starts.
        name: their name prefix (``threading`` names; ``py-spy`` shows them).
    """

    def __init__(self, max_threads: int = MAX_SYNC_THREADS, name: str = "wal-sync") -> None:
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
        start_length: the active segment's length before it (where the write starts), bytes.
        size: bytes written.
        last_owned: the last offset it writes that the owner assigned (``None``: replica only).
        waiter: resolved on the loop once the outcome below is set.
        error: what the write or ``fdatasync`` raised.
        refused: the :class:`~broker.storage.wal.group_commit.OffsetGuard`'s refusal to
            acknowledge it after it was durable.
        finished: the sync thread returned and the outcome was handled on the loop.
    """

    batch: list[PendingAppend]
    positions: list[tuple[int, int]]
    start_length: int
    size: int
    last_owned: int | None
    waiter: asyncio.Future[None]
    error: BaseException | None = None
    refused: Exception | None = None
    finished: bool = field(default=False)


async def until_synced(write: Write) -> None:
    """Wait until ``write`` finished. Cancelling the caller does not end the wait before the
    write's outcome was handled (the WAL's state follows the file); the cancellation is
    re-raised after."""
    cancelled = False
    waiter = write.waiter
    while not write.finished:
        try:
            await waiter
        except asyncio.CancelledError:
            cancelled = True
            if not write.finished:
                waiter = write.waiter = asyncio.get_running_loop().create_future()
    if cancelled:
        raise asyncio.CancelledError
