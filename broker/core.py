"""The broker core: the topics this broker serves, their producers and consumers.

:class:`Broker` composes the parts of one broker process and offers every operation the gRPC
servicers (:mod:`broker.rpc`) translate to: creating and closing producers, publishing,
subscribing, acknowledging, creating and looking up topics. It reads metadata from the
:class:`~danube_pipeline.metadata.cache.LocalCache` and writes it through the
:class:`~danube_pipeline.metadata.store.MetadataStore` (``docs/etcd-layout.md``).

A topic is served here while ``/cluster/brokers/{own id}/{ns}/{topic}`` exists (§1.4): the
broker follows that prefix and loads or unloads topics as assignments appear and disappear.

The parts, each holding the shared :class:`~broker.topics.served.ServedTopics`:

* :class:`~broker.cluster_view.ClusterView`: brokers, the leader, topic owners, lookups;
* :class:`~broker.topics.lifecycle.TopicLoader`: loading, creating and finding topics;
* :class:`~broker.topics.release.TopicReleaser`: releasing and unloading topics;
* :class:`~broker.topics.released.ReleasedSegments`: the WALs of topics given up;
* :class:`~broker.topics.upkeep.TopicUpkeep`: cursor flushes and local retention;
* :class:`~broker.sessions.ProducerSessions`, :class:`~broker.sessions.ConsumerSessions`:
  producers and consumers;
* :class:`~broker.reconcile.Reconciler`: etcd reconciled after uncertain writes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

from danube_pipeline.errors import NotServedHereError
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.modes import DeliveryMode, InitialPosition, SubscriptionType
from danube_pipeline.names import TopicName
from danube_pipeline.outages import OutageLog
from danube_pipeline.schemas.registry import SchemaRegistry
from danube_pipeline.storage.objectstore import ObjectStore

from broker.cluster_view import ClusterView, RegisteredBroker
from broker.config import BrokerConfig
from broker.dispatch.consumer import Consumer
from broker.dispatch.redelivery import RedeliverySettings
from broker.reconcile import Reconciler
from broker.replication.follower import FETCH_CHANNEL_OPTIONS
from broker.replication.manager import ReplicaManager
from broker.rpc.tls import BrokerChannels, broker_tls_files
from broker.rpc.request_ids import RecentRequests
from broker.sessions import ConsumerSessions, ProducerSessions
from broker.storage.disk import DiskMonitor
from broker.storage.local_retention import LocalRetention, RetentionLimits, RetentionOutcome
from broker.storage.remote import ObjectCache
from broker.tasks import BackgroundWrites, spawn
from broker.topics.lifecycle import TopicLoader
from broker.topics.producer import Producer
from broker.topics.producer_expiry import ExpiringKeys
from broker.topics.release import TopicReleaser
from broker.topics.released import ReleasedSegments
from broker.topics.served import ServedTopics
from broker.topics.topic import Topic
from broker.topics.upkeep import TopicUpkeep

log = logging.getLogger(__name__)

LOAD_CONCURRENCY = 64
"""How many assigned topics :meth:`Broker.start` opens at once (and :meth:`Broker.close`
closes). Opening a topic is mostly waiting (etcd round trips for the takeover, WAL files synced
in worker threads), so loading one after the other made a restart with 10,000 topics take
minutes (``benchmarks/scale.py``)."""


class Broker:
    """Topics, producers and consumers of one broker process.

    Args:
        config: the broker's configuration.
        broker_id: its u64 id.
        store: etcd, for writes.
        cache: the LocalCache, for reads.
        registry: the schema registry.
        on_topics_changed: called whenever a topic is loaded or unloaded (the load report).
        on_storage_full: called with ``True`` when the WAL disk fills up and ``False`` when
            it takes writes again (:class:`broker.storage.disk.DiskMonitor`).

    Attributes:
        disk: the storage-full state.
        background: metadata writes retried until etcd takes them.
        requests: recent creations by client request id.
        served: the topics served here, shared by the parts.
        cluster, loader, releaser, released, upkeep, producer_sessions, consumer_sessions,
            reconciler: the parts (module docstring).
    """

    def __init__(
        self,
        config: BrokerConfig,
        broker_id: int,
        *,
        store: MetadataStore,
        cache: LocalCache,
        registry: SchemaRegistry,
        on_topics_changed: Callable[[], None] = lambda: None,
        on_storage_full: Callable[[bool], None] = lambda _full: None,
    ) -> None:
        self.config = config
        self.broker_id = broker_id
        self.store = store
        self.cache = cache
        self.registry = registry
        self.served = ServedTopics(broker_id, on_topics_changed)
        self._remove_listener: Callable[[], None] | None = None
        self.disk = DiskMonitor(config.wal_dir, on_change=on_storage_full)
        self.background = BackgroundWrites(OutageLog(log, "metadata writes to etcd"))
        self.closed_keys = ExpiringKeys(store, config.closed_producer_ttl_s)
        self.requests = RecentRequests()
        self.objects = ObjectStore(config.object_store_url, storage_options=config.object_store_options or None)
        self.object_cache = ObjectCache(config.object_cache_bytes)
        self.local_retention = LocalRetention(
            self.objects, RetentionLimits(bytes=config.local_retention_bytes, ms=config.local_retention_ms)
        )
        self.cluster = ClusterView(broker_id, store=store, cache=cache)
        self.reconciler = Reconciler(
            self.served, store=store, cache=cache, closed_keys=self.closed_keys, background=self.background
        )
        self.loader = TopicLoader(
            self.served, config, store=store, cache=cache, cluster=self.cluster, reconciler=self.reconciler,
            background=self.background, objects=self.objects, object_cache=self.object_cache, disk=self.disk,
        )
        self.released = ReleasedSegments(
            config, cache=cache, objects=self.objects, object_cache=self.object_cache,
            local_retention=self.local_retention,
        )
        self.upkeep = TopicUpkeep(
            self.served, config, cache=cache, local_retention=self.local_retention, released=self.released
        )
        self.producer_sessions = ProducerSessions(
            self.served, store=store, cache=cache, registry=registry, loader=self.loader,
            reconciler=self.reconciler, closed_keys=self.closed_keys,
        )
        self.consumer_sessions = ConsumerSessions(
            self.served, config, cache=cache, loader=self.loader, cluster=self.cluster, reconciler=self.reconciler
        )
        self.releaser = TopicReleaser(
            self.served, config, store=store, cache=cache, cluster=self.cluster, released=self.released,
            close_producers=self.producer_sessions.close_topic_producers, loader=self.loader,
        )
        self.replicas = ReplicaManager(
            self.served, config, cache=cache, cluster=self.cluster,
            channels=BrokerChannels(broker_tls_files(config), options=FETCH_CHANNEL_OPTIONS),
        )
        self.loader.replicas = self.replicas
        self.releaser.replicas = self.replicas
        self.replicas.dispose = self.releaser.dispose_replica_log
        self.draining = False
        self.set_state: Callable[[str, str], Awaitable[None]] = self._put_state
        """Writes this broker's state (§1.3); the server makes it keep the registration lease."""

    async def _put_state(self, mode: str, reason: str) -> None:
        await self.store.put(keys.broker_state(self.broker_id), values.BrokerState(mode=mode, reason=reason))

    @property
    def topics(self) -> dict[str, Topic]:
        """The loaded topics by path (:attr:`ServedTopics.topics`)."""
        return self.served.topics

    @property
    def producers(self) -> dict[int, Producer]:
        """The open producers by id (:attr:`ProducerSessions.producers`)."""
        return self.producer_sessions.producers

    @property
    def consumers(self) -> collections.OrderedDict[int, Consumer]:
        """Open and recently closed consumers by id (:attr:`ConsumerSessions.consumers`)."""
        return self.consumer_sessions.consumers

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Load every topic assigned here (:data:`LOAD_CONCURRENCY` at once), follow new assignments,
        start the cursor flusher. The WALs' seals by age wait until every assigned topic is
        loaded (:attr:`TopicLoader.start_loaded`)."""
        self._remove_listener = self.cluster.follow_assignments(self._on_assigned, self._on_unassigned)
        await self.releaser.keep_unowned_wals()
        slots = asyncio.Semaphore(LOAD_CONCURRENCY)

        async def load(name: TopicName) -> None:
            async with slots:
                try:
                    await self.loader.load_topic(name)
                except Exception:
                    log.exception("cannot load assigned topic %s", name)

        try:
            await asyncio.gather(*(load(name) for name in self.cluster.assigned_here()))
        finally:
            self.loader.start_loaded.set()
        self.upkeep.start()
        self.replicas.start()

    def _on_assigned(self, name: TopicName) -> None:
        if not self.served.stopping:
            spawn(self._load_quietly(name), name=f"load:{name}")

    def _on_unassigned(self, name: TopicName) -> None:
        if not self.served.stopping:
            spawn(self.releaser.unload_topic(name), name=f"unload:{name}")

    async def _load_quietly(self, name: TopicName) -> None:
        try:
            await self.loader.load_topic(name)
        except NotServedHereError:
            log.info("newly assigned topic %s not loaded: no longer assigned here, or being deleted", name)
        except Exception:
            log.exception("cannot load newly assigned topic %s", name)

    def end_consumer_streams(self) -> None:
        """Detach every consumer (their ``Receive`` streams end); the first step of a stop."""
        self.served.stopping = True
        if self._remove_listener is not None:
            self._remove_listener()
            self._remove_listener = None
        self.consumer_sessions.detach_all(reason="broker shutdown")

    async def close(self) -> None:
        """Mark every open producer closed in etcd, store cursors, close the WALs (synced;
        :data:`LOAD_CONCURRENCY` topics at once)."""
        self.end_consumer_streams()
        await self.replicas.stop()
        await self.upkeep.stop()
        await self.reconciler.stop()
        await self.producer_sessions.close_all()
        slots = asyncio.Semaphore(LOAD_CONCURRENCY)

        async def close(topic: Topic) -> None:
            async with slots:
                try:
                    await topic.close()
                except Exception:
                    log.exception("closing topic %s failed", topic.path)

        await asyncio.gather(*(close(topic) for topic in list(self.topics.values())))
        self.topics.clear()
        await self.background.close()
        self.disk.stop()

    async def drain(self) -> list[str]:
        """Mark this broker ``draining`` (§1.3: the leader assigns it nothing new), release
        every topic it owns, then mark it ``drained``.

        Returns:
            The topics released.

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        self.draining = True
        await self.set_state("draining", "drain")
        released = []
        for path in sorted(self.topics):
            with contextlib.suppress(NotServedHereError):
                await self.releaser.release_topic(TopicName.parse(path), reason="drain")
                released.append(path)
        await self.set_state("drained", "drain")
        log.info("broker %d drained: %d topics released", self.broker_id, len(released))
        return released

    # ------------------------------------------------------------------ topics

    async def topic_for(
        self, name: TopicName, *, create: bool = False, delivery: DeliveryMode = DeliveryMode.RELIABLE
    ) -> Topic:
        """See :meth:`TopicLoader.topic_for`."""
        return await self.loader.topic_for(name, create=create, delivery=delivery)

    async def create_topic(
        self, name: TopicName, *, delivery: DeliveryMode = DeliveryMode.RELIABLE, request_id: str = ""
    ) -> bool:
        """See :meth:`TopicLoader.create_topic`."""
        return await self.loader.create_topic(name, delivery=delivery, request_id=request_id)

    async def release_topic(self, name: TopicName, *, reason: str = "unload") -> int:
        """See :meth:`TopicReleaser.release_topic`."""
        return await self.releaser.release_topic(name, reason=reason)

    def replicated_topic(self, name: TopicName) -> Topic:
        """See :meth:`ReplicaManager.replicated_topic`."""
        return self.replicas.replicated_topic(name)

    async def abandon_unavailable_range(self, name: TopicName, start_offset: int) -> int:
        """See :meth:`TopicReleaser.abandon_unavailable_range`."""
        return await self.releaser.abandon_unavailable_range(name, start_offset)

    @property
    def released_dir(self) -> Path:
        """See :attr:`ReleasedSegments.directory`."""
        return self.released.directory

    def released_segments(self, name: TopicName) -> list[tuple[Path, int, int, int]]:
        """See :meth:`ReleasedSegments.segments`."""
        return self.released.segments(name)

    async def apply_local_retention(
        self, topic: Topic, *, retention_bytes: int | None = None, retention_ms: int | None = None
    ) -> RetentionOutcome:
        """See :meth:`TopicUpkeep.apply_local_retention`."""
        return await self.upkeep.apply_local_retention(topic, retention_bytes=retention_bytes, retention_ms=retention_ms)

    # ------------------------------------------------------------------ discovery

    async def lookup(self, name: TopicName) -> RegisteredBroker:
        """See :meth:`ClusterView.lookup`."""
        return await self.cluster.lookup(name)

    def registered_brokers(self) -> list[RegisteredBroker]:
        """See :meth:`ClusterView.registered_brokers`."""
        return self.cluster.registered_brokers()

    def other_active_brokers(self) -> list[int]:
        """See :meth:`ClusterView.other_active_brokers`."""
        return self.cluster.other_active_brokers()

    def leader_id(self) -> int:
        """See :meth:`ClusterView.leader_id`."""
        return self.cluster.leader_id()

    # ------------------------------------------------------------------ producers

    async def create_producer(
        self,
        topic_path: str,
        producer_name: str,
        *,
        access_mode: int,
        schema_id: int = 0,
        schema_version: int = 0,
        delivery: DeliveryMode = DeliveryMode.RELIABLE,
    ) -> Producer:
        """See :meth:`ProducerSessions.create_producer`."""
        return await self.producer_sessions.create_producer(
            topic_path, producer_name, access_mode=access_mode, schema_id=schema_id,
            schema_version=schema_version, delivery=delivery,
        )

    async def throttle_publish(self, producer_id: int, batch: bytes) -> float:
        """See :meth:`ProducerSessions.throttle_publish`."""
        return await self.producer_sessions.throttle_publish(producer_id, batch)

    def publish_unless_limited(self, producer_id: int, batch: bytes) -> asyncio.Future[tuple[int, int]] | None:
        """See :meth:`ProducerSessions.publish_unless_limited`."""
        return self.producer_sessions.publish_unless_limited(producer_id, batch)

    def publish(self, producer_id: int, batch: bytes) -> asyncio.Future[tuple[int, int]]:
        """See :meth:`ProducerSessions.publish`."""
        return self.producer_sessions.publish(producer_id, batch)

    async def close_producer(self, producer_id: int) -> None:
        """See :meth:`ProducerSessions.close_producer`."""
        await self.producer_sessions.close_producer(producer_id)

    # ------------------------------------------------------------------ consumers

    async def subscribe(
        self,
        topic_path: str,
        subscription: str,
        *,
        subscription_type: SubscriptionType,
        consumer_name: str,
        initial_position: InitialPosition,
        receiver_queue_size: int,
        settings: RedeliverySettings | None = None,
        start_publish_time_us: int | None = None,
    ) -> Consumer:
        """See :meth:`ConsumerSessions.subscribe`."""
        return await self.consumer_sessions.subscribe(
            topic_path, subscription, subscription_type=subscription_type, consumer_name=consumer_name,
            initial_position=initial_position, receiver_queue_size=receiver_queue_size, settings=settings,
            start_publish_time_us=start_publish_time_us,
        )

    def consumer(self, consumer_id: int, *, open_only: bool = False) -> Consumer:
        """See :meth:`ConsumerSessions.consumer`."""
        return self.consumer_sessions.consumer(consumer_id, open_only=open_only)

    def ack(self, consumer_id: int, ranges: Iterable[tuple[int, int]]) -> None:
        """See :meth:`ConsumerSessions.ack`."""
        self.consumer_sessions.ack(consumer_id, ranges)

    def nack(self, consumer_id: int, ranges: Iterable[tuple[int, int]], *, reason: str = "") -> int:
        """See :meth:`ConsumerSessions.nack`."""
        return self.consumer_sessions.nack(consumer_id, ranges, reason=reason)

    async def close_consumer(self, consumer_id: int) -> None:
        """See :meth:`ConsumerSessions.close_consumer`."""
        await self.consumer_sessions.close_consumer(consumer_id)


__all__ = ["Broker"]
