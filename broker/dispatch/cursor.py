"""When one subscription's cursor is stored (``docs/etcd-layout.md`` §3.5): in the background
after every ``cursor_flush_acks`` acknowledgements, when the broker flushes it, when the
subscription closes, and at once on a cursor reset; never two writes at a time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from broker.tasks import spawn


class CursorWriter:
    """Stores the cursor of one subscription, one write at a time.

    Args:
        topic: the topic path ``/ns/topic`` (for the background task's name).
        name: the subscription name.
        cursor: the in-memory cursor now, ``None`` while nothing is acknowledged.
        persisted_cursor: the cursor value already stored in etcd, or ``None``.
        persist_cursor: coroutine storing a cursor value (the last acknowledged offset).
        cursor_flush_acks: store in the background after this many acks (§3.5: 1000).
    """

    def __init__(
        self,
        *,
        topic: str,
        name: str,
        cursor: Callable[[], int | None],
        persisted_cursor: int | None,
        persist_cursor: Callable[[int], Awaitable[None]],
        cursor_flush_acks: int,
    ) -> None:
        self._task_name = f"cursor:{topic}:{name}"
        self._cursor = cursor
        self.cursor_flush_acks = cursor_flush_acks
        self._persisted_cursor = persisted_cursor
        self._persist_cursor = persist_cursor
        self._acks_since_flush = 0
        self._flush_lock = asyncio.Lock()
        self._flush_task: asyncio.Task[None] | None = None

    @property
    def dirty(self) -> bool:
        """Whether the in-memory cursor differs from the stored one."""
        cursor = self._cursor()
        return cursor is not None and cursor != self._persisted_cursor

    def acked(self, count: int, flush: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Count ``count`` new acknowledgements; once ``cursor_flush_acks`` are counted, run
        ``flush()`` in the background (unless one runs already: that one stores again when
        ``cursor_flush_acks`` more were counted while it wrote).

        Args:
            count: acknowledgements just made.
            flush: makes the coroutine that stores the cursor (the subscription's
                ``flush_cursor``).
        """
        self._acks_since_flush += count
        if self._acks_since_flush >= self.cursor_flush_acks and (self._flush_task is None or self._flush_task.done()):
            # A failure is counted by the cursor writer and retried at the next flush.
            self._flush_task = spawn(self._flush_while_due(flush), name=self._task_name, on_error=lambda _exc: None)

    async def _flush_while_due(self, flush: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """``flush()``, then again as long as the acknowledgements counted meanwhile reach
        ``cursor_flush_acks`` and the cursor moved (they were not lost, only not stored yet)."""
        await flush()
        while self._acks_since_flush >= self.cursor_flush_acks and self.dirty:
            await flush()

    def forget_acks(self) -> None:
        """Start counting acknowledgements again from 0 (a cursor reset)."""
        self._acks_since_flush = 0

    async def flush(self) -> None:
        """Store the cursor if it changed since the last write.

        Raises:
            MetadataStoreError: etcd refused or could not be reached (retried next flush).
        """
        async with self._flush_lock:
            cursor = self._cursor()
            if cursor is None or cursor == self._persisted_cursor:
                return
            self._acks_since_flush = 0
            await self._persist_cursor(cursor)
            self._persisted_cursor = cursor

    async def store(self, cursor: int) -> None:
        """Store ``cursor`` now, whatever the in-memory cursor (a cursor reset).

        Raises:
            MetadataStoreError: the cursor could not be stored.
        """
        async with self._flush_lock:
            await self._persist_cursor(cursor)
            self._persisted_cursor = cursor

    async def wait(self) -> None:
        """Wait for the background write under way, if any (its failure is ignored)."""
        if self._flush_task is not None:
            with contextlib.suppress(Exception):
                await self._flush_task
