"""asyncio helpers the broker's long-running parts share."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

_T = TypeVar("_T")


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
