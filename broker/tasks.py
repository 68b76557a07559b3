"""asyncio helpers the broker's long-running parts share."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from danube_pipeline.errors import DanubeError
from danube_pipeline.outages import OutageLog

log = logging.getLogger(__name__)

_T = TypeVar("_T")

_R = TypeVar("_R")

_running: set[asyncio.Task[Any]] = set()
"""Strong references to spawned tasks (the event loop keeps only weak ones)."""


def spawn(
    coro: Coroutine[Any, Any, Any],
    *,
    name: str,
    on_error: Callable[[BaseException], None] | None = None,
) -> asyncio.Task[Any]:
    """Run ``coro`` as a background task whose outcome is always retrieved.

    The task starts in an empty context, so no RPC's deadline
    (:func:`danube_pipeline.metadata.connection.deadline_scope`) applies to it. When it fails, its
    exception goes to ``on_error``; without one, a :class:`DanubeError` is logged as a warning
    line and anything else with its traceback. Cancellation is not an error.

    Returns:
        The task.
    """
    task = asyncio.get_running_loop().create_task(coro, name=name, context=contextvars.Context())
    _running.add(task)

    def done(t: asyncio.Task[Any]) -> None:
        _running.discard(t)
        if t.cancelled():
            return
        exc = t.exception()
        if exc is None:
            return
        if on_error is not None:
            on_error(exc)
        elif isinstance(exc, DanubeError):
            log.warning("background task %s failed: %s", name, exc)
        else:
            log.error("background task %s failed", name, exc_info=exc)

    task.add_done_callback(done)
    return task


async def run_to_completion(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` in its own task and wait for its end even if the caller is cancelled
    meanwhile; the caller's cancellation is re-raised only once ``coro`` has finished.

    Used where stopping half-way would leave files and in-memory state disagreeing (a WAL
    seal: sync, rename, new active segment).

    Returns:
        What ``coro`` returned.

    Raises:
        asyncio.CancelledError: the caller was cancelled (after ``coro`` finished).
        Exception: whatever ``coro`` raised, when the caller was not cancelled.
    """
    task = asyncio.ensure_future(coro)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        if not task.cancelled() and task.exception() is not None:
            log.error("operation finished during cancellation with an error: %s", task.exception())
        raise asyncio.CancelledError
    return task.result()


class BackgroundWrites:
    """Metadata writes that must reach etcd eventually, retried in the background.

    Each write is submitted under a name (usually its etcd key); a newer write under the same
    name replaces a pending older one, so the last value wins. Attempts are retried with a
    backoff from :data:`FIRST_RETRY_S` doubling to :data:`MAX_RETRY_S` until they succeed or
    :meth:`close` is called. Failures go to one :class:`~danube_pipeline.outages.OutageLog`: a
    warning when etcd becomes unreachable, a line when it answers again.

    Args:
        outage: where failures are counted and logged.
    """

    FIRST_RETRY_S = 0.25
    MAX_RETRY_S = 5.0

    def __init__(self, outage: OutageLog) -> None:
        self.outage = outage
        self._pending: dict[str, asyncio.Task[None]] = {}
        self._closed = False

    def submit(self, name: str, write: Callable[[], Awaitable[object]]) -> None:
        """Run ``write()`` now and again after each failure until it succeeds."""
        if self._closed:
            return
        older = self._pending.pop(name, None)
        if older is not None:
            older.cancel()
        self._pending[name] = spawn(self._retry(name, write), name=f"write:{name}")

    async def _retry(self, name: str, write: Callable[[], Awaitable[object]]) -> None:
        delay_s = self.FIRST_RETRY_S
        try:
            while True:
                try:
                    await write()
                except Exception as exc:  # noqa: BLE001 - any failure is retried
                    self.outage.failed(exc)
                    await asyncio.sleep(delay_s)
                    delay_s = min(delay_s * 2, self.MAX_RETRY_S)
                    continue
                self.outage.succeeded()
                return
        finally:
            if self._pending.get(name) is asyncio.current_task():
                del self._pending[name]

    @property
    def pending(self) -> int:
        """Writes not done yet."""
        return len(self._pending)

    async def close(self, *, grace_s: float = 1.0) -> None:
        """Give pending writes ``grace_s`` seconds, then cancel the rest."""
        self._closed = True
        tasks = list(self._pending.values())
        if tasks:
            _done, left = await asyncio.wait(tasks, timeout=grace_s)
            for task in left:
                task.cancel()
            if left:
                log.warning("%d metadata writes not done at shutdown", len(left))
                await asyncio.wait(left)


def copy_outcome(
    source: asyncio.Future[_T], target: asyncio.Future[_R], result: Callable[[_T], _R] | None = None
) -> None:
    """Give ``target`` the outcome of ``source`` (done): cancelled, its exception, or its result
    (through ``result`` when given); nothing if ``target`` is done already. Used as a done
    callback, so that a waiter's own future can be cancelled without cancelling the work's."""
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif (exc := source.exception()) is not None:
        target.set_exception(exc)
    elif result is None:
        target.set_result(source.result())  # type: ignore[arg-type]
    else:
        target.set_result(result(source.result()))
