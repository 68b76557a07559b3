"""Waits with a deadline that never swallow a cancellation.

On Python 3.11, ``asyncio.wait_for(aw, timeout)`` can hide a cancellation: when the task is
cancelled in the loop turn that ``aw`` completes, ``wait_for`` returns ``aw``'s result and the
``CancelledError`` is lost (CPython gh-86296; 3.12 rebuilt ``wait_for`` on ``asyncio.timeout``,
gh-96764). A background loop stopped by ``task.cancel()`` then goes on running, and whoever
awaits it hangs: a broker's shutdown did, twice in 68 stops on a loaded test machine, when
an etcd change woke the replica manager in the turn the shutdown cancelled it. ``asyncio.timeout`` counts cancellations
(``Task.uncancel``) and delivers every one, so the product code waits with it, never with
``wait_for``.
"""

from __future__ import annotations

import asyncio


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


__all__ = ["wait_set"]
