"""This broker's replicas: a :class:`~broker.replication.follower.ReplicaFetcher` for every topic
it holds a replica of (§1.9) and does not own, and the hand-over when it becomes the owner.

The manager follows the replica assignments and this broker's topic assignments through the
cache. A fetcher runs while the broker is in a topic's replica set and does not own it; when the
topic is assigned here, :meth:`ReplicaManager.take_over` stops the fetcher (its WAL closed and
durable) before the topic loader opens the same WAL directory as the owner's. Fetchers start
and stop under the topic's :meth:`ServedTopics.exclusive` section, so a fetcher and an owner
never hold the directory at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Awaitable, Callable

from danube_pipeline.aio import wait_set
from danube_pipeline.errors import NotServedHereError
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.names import TopicName

from broker.cluster_view import ClusterView
from broker.config import BrokerConfig
from broker.replication.follower import ReplicaFetcher
from broker.rpc.tls import BrokerChannels
from broker.topics.served import ServedTopics
from broker.topics.topic import Topic

log = logging.getLogger(__name__)

RECONCILE_INTERVAL_S = 1.0
"""The fetchers are also reconciled this often (a topic unloaded here is followed afterwards)."""


def replica_assignment(cache: LocalCache, name: TopicName) -> values.ReplicaAssignment | None:
    """The topic's replica assignment (§1.9) from the cache; ``None`` without one (or unreadable)."""
    raw = cache.get(keys.replica_assignment(name))
    if raw is None:
        return None
    try:
        return values.ReplicaAssignment.from_json(raw)
    except (ValueError, TypeError):
        return None


def replica_set(cache: LocalCache, name: TopicName) -> set[int]:
    """The brokers of the topic's replica assignment (§1.9); empty without one (or unreadable)."""
    assignment = replica_assignment(cache, name)
    return set() if assignment is None else set(assignment.replicas)


def in_sync_record(cache: LocalCache, name: TopicName) -> values.InSyncReplicas | None:
    """The topic's ISR record (§5.9) from the cache; ``None`` without one (or unreadable)."""
    raw = cache.get(keys.in_sync_replicas(name))
    if raw is None:
        return None
    try:
        return values.InSyncReplicas.from_json(raw)
    except (ValueError, TypeError):
        return None


class ReplicaManager:
    """Runs this broker's fetchers (module docstring).

    Args:
        served: the topics served here (their exclusive sections).
        config: the broker's configuration.
        cache: the broker's cache.
        cluster: the cluster view (owners and their addresses).
        channels: the channels to the other brokers.
    """

    def __init__(
        self, served: ServedTopics, config: BrokerConfig, *, cache: LocalCache, cluster: ClusterView,
        channels: BrokerChannels,
    ) -> None:
        self._served = served
        self._config = config
        self._cache = cache
        self._cluster = cluster
        self.channels = channels
        self.broker_id = served.broker_id
        self.fetchers: dict[str, ReplicaFetcher] = {}
        self._unlisten: list[Callable[[], None]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.owned: dict[str, Topic] = {}
        """Topic path → the topic replicated from here (its tracker open), also while it is
        being released: followers fetch until the release hands it over."""
        self.dispose: Callable[[TopicName], Awaitable[None]] = self._delete_log
        """Disposes of a replica log its owner's log does not continue (set by the broker to
        :meth:`TopicReleaser.dispose_replica_log`)."""
        self.handed_over_hw: dict[str, int] = {}
        """Topic path → the HW its fetcher last fetched, kept for the loader taking it over."""

    def start(self) -> None:
        """Follow the replica assignments and this broker's assignments."""
        for prefix in (keys.REPLICA_ASSIGNMENT_PREFIX, keys.broker_prefix(self.broker_id)):
            self._unlisten.append(self._cache.add_listener(prefix, lambda _event: self._wake.set()))
        self._wake.set()
        self._task = asyncio.create_task(self._run(), name="replica-manager")

    async def stop(self) -> None:
        """Stop every fetcher (their WALs closed)."""
        for unlisten in self._unlisten:
            unlisten()
        self._unlisten.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for fetcher in list(self.fetchers.values()):
            await fetcher.stop()
        self.fetchers.clear()
        await self.channels.close()

    def replicated_topic(self, name: TopicName) -> Topic:
        """The topic replicated from here, for its followers' fetches.

        Raises:
            NotServedHereError: not replicated from here (not the owner, or factor 1).
        """
        topic = self.owned.get(name.path)
        if topic is None or topic.replication is None or topic.replication.closed:
            self.owned.pop(name.path, None)
            raise NotServedHereError(name.path, self.broker_id)
        return topic

    def follows(self, name: TopicName) -> bool:
        """Whether this broker should follow ``name``: in its replica set, not its owner."""
        return (
            self.broker_id in replica_set(self._cache, name)
            and not self._cluster.is_assigned_here(name)
            and name.path not in self._served.topics
        )

    async def _run(self) -> None:
        while True:
            await wait_set(self._wake, RECONCILE_INTERVAL_S)
            self._wake.clear()
            try:
                await self._reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the next change or pass tries again
                log.exception("replica fetchers not reconciled")
            await asyncio.sleep(0.05)

    async def _reconcile(self) -> None:
        wanted: set[str] = set()
        for key in self._cache.get_prefix(keys.REPLICA_ASSIGNMENT_PREFIX):
            try:
                name = TopicName.parse("/" + key[len(keys.REPLICA_ASSIGNMENT_PREFIX):])
            except ValueError:
                continue
            if self.follows(name):
                wanted.add(name.path)
        for path in sorted(set(self.fetchers) - wanted):
            name = TopicName.parse(path)
            async with self._served.exclusive(path):
                fetcher = self.fetchers.pop(path, None)
                if fetcher is None:
                    continue
                hw = await fetcher.stop()
                if hw is not None:
                    self.handed_over_hw[path] = hw
                if not self._cluster.is_assigned_here(name) and path not in self._served.topics:
                    # Out of the replica set (replaced, moved away, or the topic deleted): the
                    # copy is not needed; deleted, or kept as released segments when an
                    # unavailable range still names this broker (TopicReleaser.dispose_replica_log).
                    log.info("topic %s: no longer a replica here; its replica log goes", name)
                    await self.dispose(name)
        for path in sorted(wanted - set(self.fetchers)):
            name = TopicName.parse(path)
            async with self._served.exclusive(path):
                if not self.follows(name) or path in self.fetchers:
                    continue
                fetcher = ReplicaFetcher(
                    name, self._config, broker_id=self.broker_id, owner_address=self._owner_address(name),
                    channels=self.channels, dispose=self.dispose,
                )
                fetcher.start()
                self.fetchers[path] = fetcher
                log.info("topic %s: following its owner as a replica", name)

    def _owner_address(self, name: TopicName) -> Callable[[], Awaitable[str | None]]:
        async def address() -> str | None:
            owner = self._cluster.assigned_broker(name)
            if owner is None or owner == self.broker_id:
                return None
            for broker in self._cluster.registered_brokers():
                if broker.broker_id == owner:
                    return broker.peer_address
            return None

        return address

    async def take_over(self, name: TopicName) -> int | None:
        """Stop following ``name`` because it is being loaded here as its owner; the caller
        holds the topic's exclusive section.

        Returns:
            The HW the fetcher last fetched (``None`` when it was not following or never fetched).
        """
        fetcher = self.fetchers.pop(name.path, None)
        if fetcher is not None:
            hw = await fetcher.stop()
            if hw is not None:
                self.handed_over_hw[name.path] = hw
        return self.handed_over_hw.pop(name.path, None)

    async def _delete_log(self, name: TopicName) -> None:
        await asyncio.to_thread(shutil.rmtree, self._config.wal_dir / name.namespace / name.topic, True)

    def wake(self) -> None:
        """Look at the assignments now (a topic was unloaded here)."""
        self._wake.set()
