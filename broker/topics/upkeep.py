"""The periodic work on the topics served here: cursor flushes and local WAL retention.

Every ``cursor_flush_interval_s`` the subscriptions' cursors are stored; every
``local_retention_check_s`` local retention (:mod:`broker.storage.local_retention`) runs on
each topic with an object store, then on the released segments
(:class:`broker.topics.released.ReleasedSegments`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from danube_pipeline.metadata.cache import LocalCache

from broker.config import BrokerConfig
from broker.storage.local_retention import LocalRetention, RetentionLimits, RetentionOutcome
from broker.topics.released import ReleasedSegments
from broker.topics.served import ServedTopics
from broker.topics.topic import Topic

__all__ = ["TopicUpkeep"]

log = logging.getLogger(__name__)


class TopicUpkeep:
    """The cursor flusher and the local retention loop of one broker.

    Args:
        served: the topics served here.
        config: the broker's configuration (the intervals).
        cache: the LocalCache, for the topics' retention overrides.
        local_retention: applies the limits to a WAL.
        released: the released segments, retained after the served topics.
    """

    def __init__(
        self,
        served: ServedTopics,
        config: BrokerConfig,
        *,
        cache: LocalCache,
        local_retention: LocalRetention,
        released: ReleasedSegments,
    ) -> None:
        self._served = served
        self._config = config
        self._cache = cache
        self._local_retention = local_retention
        self._released = released
        self._flusher: asyncio.Task[None] | None = None
        self._retention_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the cursor flusher and the local retention loop."""
        self._flusher = asyncio.create_task(self._cursor_flusher(), name="cursor-flush")
        self._retention_task = asyncio.create_task(self._retention_loop(), name="local-retention")

    async def stop(self) -> None:
        """Cancel both loops and wait for their end."""
        for task in (self._flusher, self._retention_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def apply_local_retention(
        self, topic: Topic, *, retention_bytes: int | None = None, retention_ms: int | None = None
    ) -> RetentionOutcome:
        """Apply local WAL retention to ``topic`` now (:mod:`broker.storage.local_retention`).

        Args:
            topic: a topic served here.
            retention_bytes, retention_ms: limits for this call only; ``None`` = the topic's
                override (``docs/etcd-layout.md`` §3.6) or the broker's setting.

        Returns:
            What was deleted, and the WAL's first offset and size afterwards.

        Raises:
            OSError: a segment file could not be deleted.
        """
        if topic.remote is None:
            return RetentionOutcome(0, 0, topic.wal.first_offset, topic.wal.size_bytes)
        limits = self._local_retention.limits(self._cache, topic.remote)
        limits = RetentionLimits(
            bytes=limits.bytes if retention_bytes is None else retention_bytes,
            ms=limits.ms if retention_ms is None else retention_ms,
        )
        return await self._local_retention.apply(topic.wal, topic.remote, limits)

    async def _retention_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.local_retention_check_s)
            for topic in list(self._served.topics.values()):
                if topic.closed or topic.remote is None:
                    continue
                try:
                    await self.apply_local_retention(topic)
                except OSError as exc:
                    log.warning("%s: local retention failed (tried again in %.0f s): %s",
                                topic.path, self._config.local_retention_check_s, exc)
            try:
                await self._released.retain()
            except OSError as exc:
                log.warning("released segments: local retention failed: %s", exc)

    async def _cursor_flusher(self) -> None:
        while True:
            await asyncio.sleep(self._config.cursor_flush_interval_s)
            for topic in list(self._served.topics.values()):
                await topic.subscriptions.flush_cursors()  # failures are logged once per outage
