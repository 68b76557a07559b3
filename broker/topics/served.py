"""The topics this broker serves: the table every part of the broker core shares.

:class:`ServedTopics` holds the loaded topics by path, the paths fenced against loading while
they are released or deleted, and whether the broker is stopping. The parts of
:class:`broker.core.Broker` (loading, releasing, sessions, reconciliation) hold one and the
same instance.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

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
        releasing: paths being released (unload, drain) or deleted: a load of one answers
            :class:`NotServedHereError`.
        stopping: the broker is stopping: assignments are no longer followed and no
            reconciliation starts.
    """

    def __init__(self, broker_id: int, on_changed: Callable[[], None] = lambda: None) -> None:
        self.broker_id = broker_id
        self.topics: dict[str, Topic] = {}
        self.releasing: set[str] = set()
        self.stopping = False
        self._on_changed = on_changed

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
