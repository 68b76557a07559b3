"""Waits with a deadline that never swallow a cancellation.

On Python 3.11, ``asyncio.wait_for(aw, timeout)`` can hide a cancellation: when the task is
cancelled in the loop turn that ``aw`` completes, ``wait_for`` returns ``aw``'s result and the
``CancelledError`` is lost (CPython gh-86296; 3.12 rebuilt ``wait_for`` on ``asyncio.timeout``,
gh-96764). A background loop stopped by ``task.cancel()`` then goes on running, and whoever
awaits it hangs: a broker's shutdown did, twice in 68 stops on a loaded test machine, when
an etcd change woke the replica manager in the turn the shutdown cancelled it. ``asyncio.timeout`` counts cancellations
(``Task.uncancel``) and delivers every one, so the product code waits with it, never with
``wait_for``.

:class:`HandoffLock` is an ``asyncio.Lock`` that a loop callback can also take and hold without
a task: the WAL's group commit writes from the loop's callbacks while seals and truncations
await the same lock.
"""

from __future__ import annotations

import asyncio
import collections


async def wait_set(event: asyncio.Event, timeout_s: float | None) -> bool:
    """Wait until ``event`` is set, for at most ``timeout_s`` seconds (``None``: no limit).

    Returns:
        Whether the event is set: ``False`` when the time ran out first.

    Raises:
        asyncio.CancelledError: the calling task was cancelled, even in the loop turn the
            event was set.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True


class HandoffLock:
    """A first-come-first-served ``asyncio`` lock that code outside a task can also hold.

    ``async with lock`` and :meth:`acquire` / :meth:`release` behave as ``asyncio.Lock``'s.
    :meth:`try_acquire` takes the lock at once, from a plain callback, or tells it cannot.
    :meth:`release` hands the lock straight to the first waiter: it stays locked, so
    :meth:`try_acquire` never overtakes a waiter.
    """

    def __init__(self) -> None:
        self._locked = False
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def locked(self) -> bool:
        """Whether someone holds the lock."""
        return self._locked

    def try_acquire(self) -> bool:
        """Take the lock if it is free (no waiter can be waiting then); never blocks.

        Returns:
            Whether the caller holds it now (and must :meth:`release` it).
        """
        if self._locked:
            return False
        self._locked = True
        return True

    async def acquire(self) -> bool:
        """Wait for the lock, after every earlier waiter, and take it.

        Returns:
            ``True``, as ``asyncio.Lock.acquire``.

        Raises:
            asyncio.CancelledError: the caller was cancelled while waiting; it does not hold
                the lock (handed to it in the meantime, it is passed on).
        """
        if not self._locked:
            self._locked = True
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed over before the cancellation arrived: pass it on
            elif waiter in self._waiters:  # a release may have dropped it already
                self._waiters.remove(waiter)
            raise
        return True

    def release(self) -> None:
        """Hand the lock to the first waiter, else free it.

        Raises:
            RuntimeError: the lock is not held.
        """
        if not self._locked:
            raise RuntimeError("HandoffLock is not acquired")
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the lock stays locked: the waiter holds it now
                return
        self._locked = False

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()


__all__ = ["HandoffLock", "wait_set"]
