"""Ending the client's own background tasks without swallowing the caller's cancellation."""

from __future__ import annotations

import asyncio
from typing import Any


def being_cancelled() -> bool:
    """Whether the running task itself was asked to stop (``Task.cancel``), as opposed to a
    ``CancelledError`` that only came out of something it awaited (a gRPC call cancelled
    because its channel was closed under it)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel ``tasks`` and wait until each has ended, discarding their outcome.

    A cancellation of the caller itself (Ctrl-C, a timeout around ``close()``) is not
    discarded: it propagates once the wait is interrupted.

    Raises:
        asyncio.CancelledError: the calling task was cancelled while waiting.
    """
    for task in tasks:
        if task is not None:
            task.cancel()
    for task in tasks:
        if task is None:
            continue
        try:
            await task
        except asyncio.CancelledError:
            if being_cancelled():
                raise
        except Exception:  # noqa: BLE001 - the task's own failure was already handled or is moot
            pass
