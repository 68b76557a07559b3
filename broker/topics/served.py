"""The topics this broker serves: the table every part of the broker core shares.

:class:`ServedTopics` holds the loaded topics by path, the paths fenced against loading while
they are released or deleted, and whether the broker is stopping. The parts of
:class:`broker.core.Broker` (loading, releasing, sessions, reconciliation) hold one and the
same instance.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator

from danube_pipeline.errors import NotServedHereError

from broker.topics.topic import Topic

__all__ = ["ServedTopics"]


class ServedTopics:
    """The loaded topics of one broker, and the fence against loading them.

    Args:
        broker_id: this broker's u64 id (named in :class:`NotServedHereError`).
        on_changed: called whenever a topic is loaded or unloaded (the load report).

    Attributes:
        broker_id: this broker's u64 id.
        topics: the loaded topics by path (``/{ns}/{topic}``).
        releasing: paths being released (unload, drain), unloaded (fenced) or deleted: a load
            of one answers :class:`NotServedHereError`.
        stopping: the broker is stopping: assignments are no longer followed and no
            reconciliation starts.
    """

    def __init__(self, broker_id: int, on_changed: Callable[[], None] = lambda: None) -> None:
        self.broker_id = broker_id
        self.topics: dict[str, Topic] = {}
        self.releasing: set[str] = set()
        self.stopping = False
        self._on_changed = on_changed
        self._exclusive: dict[str, _PathLock] = {}

    def changed(self) -> None:
        """Report that a topic was loaded or unloaded (the load report)."""
        self._on_changed()

    def served(self, path: str) -> Topic:
        """The loaded topic at ``path``.

        Raises:
            NotServedHereError: this broker does not serve it (anymore).
        """
        topic = self.topics.get(path)
        if topic is None or topic.closed:
            raise NotServedHereError(path, self.broker_id)
        return topic

    @contextlib.asynccontextmanager
    async def exclusive(self, path: str) -> AsyncIterator[None]:
        """Run the block alone among the loads, releases and unloads of ``path`` on this broker,
        in the order they asked (a load that waits here sees what the release or unload before
        it left: the WAL kept as released, the last offset written recorded)."""
        entry = self._exclusive.get(path)
        if entry is None:
            entry = self._exclusive[path] = _PathLock()
        entry.users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._exclusive[path]

    @contextlib.contextmanager
    def fenced(self, path: str) -> Iterator[None]:
        """Keep ``path`` from being loaded on this broker inside the block (a load answers
        ``NotServedHereError``, as during a release).

        Raises:
            NotServedHereError: ``path`` is fenced already (being released or deleted).
        """
        if path in self.releasing:
            raise NotServedHereError(path, self.broker_id)
        self.releasing.add(path)
        try:
            yield
        finally:
            self.releasing.discard(path)


class _PathLock:
    """The lock of one path in :meth:`ServedTopics.exclusive`, and how many hold or wait for it."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0
