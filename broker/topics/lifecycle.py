"""Opening topics on this broker: loading assigned topics, creating topics, finding the owner.

A topic is served here while ``/cluster/brokers/{own id}/{ns}/{topic}`` exists (§1.4).
:class:`TopicLoader` opens such a topic (idempotent, one load at a time per topic): it takes the
ownership over (:mod:`broker.cluster.ownership`), opens the WAL at the right offset (or an
in-memory log for a ``NonReliable`` topic), rebuilds the producers' sequences and marks the
producer keys an earlier owner left open closed. It also creates topics (§1.5) and answers
which local :class:`~broker.topics.topic.Topic` serves a name (:meth:`TopicLoader.topic_for`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging

from danube_pipeline import faults, logs
from danube_pipeline.errors import MetadataStoreError, NotServedHereError, OffsetRangeError, TopicNotFoundError
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.modes import DeliveryMode
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore

from broker.cluster.ownership import OwnerSession, commit_takeover, plan_takeover, wal_has_records
from broker.cluster.takeover_reads import TakeoverReader
from broker.cluster_view import ClusterView
from broker.config import BrokerConfig
from broker.reconcile import Reconciler
from broker.replication.manager import ReplicaManager, replica_set
from broker.replication.takeover import previous_isr, start_replication
from broker.storage.disk import DiskMonitor
from broker.storage.memory_log import MemoryLog
from broker.storage.remote import ObjectCache, RemoteLog
from broker.storage.wal import WriteAheadLog
from broker.tasks import BackgroundWrites
from broker.topics.served import ServedTopics
from broker.topics.topic import Topic

__all__ = ["REQUEST_ID_FIELD", "TopicLoader", "created_by_request", "topic_registration"]

log = logging.getLogger(__name__)

REQUEST_ID_FIELD = "request_id"
"""Field of the namespace registration (§2.2): the request id of the creation that wrote it."""


def topic_registration(request_id: str) -> values.JsonValue:
    """The value of a topic's namespace registration (``docs/etcd-layout.md`` §2.2).

    Args:
        request_id: the creating request's id (``""``: none).

    Returns:
        ``{"request_id": ...}``, or ``None`` (JSON ``null``) without a request id.
    """
    return {REQUEST_ID_FIELD: request_id} if request_id else None


def created_by_request(registration: values.JsonValue, request_id: str) -> bool:
    """Whether a namespace registration (§2.2) was written by the creation ``request_id``.

    Args:
        registration: the key's decoded value (``null`` for topics created without one).
        request_id: the id of the request asking (``""``: none, never a match).

    Returns:
        True when ``request_id`` is set and the registration records it.
    """
    return bool(request_id) and isinstance(registration, dict) and registration.get(REQUEST_ID_FIELD) == request_id


class TopicLoader:
    """Loads, creates and finds the topics of one broker.

    Args:
        served: the topics served here (loaded topics are added to it).
        config: the broker's configuration.
        store: etcd, for writes.
        cache: the LocalCache, for reads.
        cluster: who owns which topic.
        reconciler: marks closed the producer keys an earlier owner left open.
        background: metadata writes retried until etcd takes them (handed to each topic).
        objects: the object store the topics are tiered to.
        object_cache: the broker's cache of object ranges.
        disk: the storage-full state (handed to each WAL).
    """

    def __init__(
        self,
        served: ServedTopics,
        config: BrokerConfig,
        *,
        store: MetadataStore,
        cache: LocalCache,
        cluster: ClusterView,
        reconciler: Reconciler,
        background: BackgroundWrites,
        objects: ObjectStore,
        object_cache: ObjectCache,
        disk: DiskMonitor,
    ) -> None:
        self._served = served
        self._config = config
        self._store = store
        self._cache = cache
        self._cluster = cluster
        self._reconciler = reconciler
        self._background = background
        self._objects = objects
        self._object_cache = object_cache
        self._disk = disk
        self.owner_session: OwnerSession | None = None
        """The registration owners fence themselves on (set once the broker joined the cluster)."""
        self.replicas: ReplicaManager | None = None
        """This broker's replica fetchers, stopped for a topic it takes over (set by the broker)."""
        self._broker_id = served.broker_id
        self._loading: dict[str, asyncio.Task[Topic]] = {}
        self._takeover_reads = TakeoverReader(store, self._broker_id)  # shared etcd reads
        self.start_loaded = asyncio.Event()
        """Set once the topics assigned here at start are loaded (:meth:`Broker.start`): until
        then the WALs' seals by age wait (``WriteAheadLog.open(seals_after=...)``)."""

    async def load_topic(self, name: TopicName) -> Topic:
        """Open ``name`` locally (idempotent): its WAL, started at the sealed state's
        ``last_committed_offset + 1`` when the WAL is empty (``docs/etcd-layout.md`` §5.3).

        A load waits for a release or an unload of the same topic under way on this broker
        (:meth:`ServedTopics.exclusive`), so it never opens a WAL that is being kept as released
        segments, nor starts below the offsets they hold.

        Raises:
            NotServedHereError: the topic is not assigned here, or is being deleted.
            OSError, CorruptRecordError: the WAL cannot be opened.
        """
        path = name.path
        topic = self._served.topics.get(path)
        if topic is not None:
            return topic
        task = self._loading.get(path)
        if task is None:
            with logs.bind(topic=path):  # the loading task's log lines carry the topic
                task = asyncio.get_running_loop().create_task(self._open_alone(name))
            self._loading[path] = task
            task.add_done_callback(functools.partial(self._loading_done, path))
        return await asyncio.shield(task)

    def _loading_done(self, path: str, _task: asyncio.Task[Topic]) -> None:
        self._loading.pop(path, None)

    async def _open_alone(self, name: TopicName) -> Topic:
        """:meth:`_open_topic` once no release or unload of ``name`` runs here.

        Raises:
            NotServedHereError: it is being deleted (fenced), or not assigned here.
            OSError, CorruptRecordError: the WAL cannot be opened.
        """
        path = name.path
        async with self._served.exclusive(path):
            topic = self._served.topics.get(path)
            if topic is not None:
                return topic
            if path in self._served.releasing:
                raise NotServedHereError(path, self._broker_id)
            return await self._open_topic(name)

    def offset_floor(self, name: TopicName, remote: RemoteLog | None) -> int:
        """The lowest offset ``name`` may hand out next: above the sealed state's
        ``last_committed_offset`` (§5.3) and the last completed descriptor's ``end_offset``
        (§5.1). The table's committed offset is never above the latter: the table is built from
        the descriptors, and retention always keeps the newest descriptor."""
        floor = 0
        sealed_raw = self._cache.get(keys.sealed_state(name))
        if sealed_raw is not None:
            with contextlib.suppress(ValueError, TypeError):
                floor = values.SealedState.from_json(sealed_raw).last_committed_offset + 1
        if remote is not None and remote.end_offset is not None:
            floor = max(floor, remote.end_offset + 1)
        return floor

    async def _open_topic(self, name: TopicName) -> Topic:
        cfg = self._config
        if DeliveryMode.from_stored(self._cache.get(keys.topic_delivery(name))) == DeliveryMode.NON_RELIABLE:
            return await self._open_memory_topic(name)
        remote = RemoteLog(
            name, cache=self._cache, objects=self._objects, object_cache=self._object_cache,
            prefetch_bytes=cfg.prefetch_bytes, cold_read_path=cfg.cold_read_path,
        )
        wal_dir = cfg.wal_dir / name.namespace / name.topic
        try:
            fetched_hw = await self.replicas.take_over(name) if self.replicas is not None else None
            reads = await self._takeover_reads.read(name)
            previous = previous_isr(reads)
            in_sync = previous is not None and previous.owner != self._broker_id and self._broker_id in previous.isr
            holds_data = wal_has_records(wal_dir)
            plan = await plan_takeover(
                self._store, name, self._broker_id, wal_holds_data=holds_data, tiered_end=remote.end_offset,
                in_sync=in_sync, reads=reads,
            )
            floor = max(plan.floor, self.offset_floor(name, remote))
            wal = await WriteAheadLog.open(
                wal_dir,
                segment_max_bytes=cfg.segment_max_bytes,
                segment_max_age_s=cfg.segment_max_age_s,
                initial_offset=floor,
                seals_after=self.start_loaded,
            )
            if wal.next_offset < floor and not plan.in_sync and self.replicas is not None and (
                self._broker_id in replica_set(self._cache, name)
            ):
                # A replica log that fell behind (not in the ISR): the offsets it lacks are with
                # the previous owner and in object storage, so it goes (or is kept as released
                # segments when it may hold the only copy of an unavailable range, §5.5).
                log.warning("topic %s: the replica log here ends at %d, below %d: set aside, the WAL starts at %d",
                            name, wal.next_offset - 1, floor - 1, floor)
                await wal.close()
                await self.replicas.dispose(name)
                holds_data = False
                wal = await WriteAheadLog.open(
                    wal_dir, segment_max_bytes=cfg.segment_max_bytes, segment_max_age_s=cfg.segment_max_age_s,
                    initial_offset=floor, seals_after=self.start_loaded,
                )
        except BaseException:
            remote.close()
            raise
        if wal.next_offset < floor:
            # The local WAL lost offsets that were already handed out (a restored old copy):
            # appending would give them out again.
            await wal.close()
            remote.close()
            error = OffsetRangeError(floor, wal.next_offset, f"{name.path} WAL {wal.directory}")
            log.error(
                "topic %s not loaded: its WAL ends at offset %d but offsets up to %d were already handed out "
                "(sealed state, reservation or object descriptors); move the WAL directory aside to start at %d",
                name, wal.next_offset - 1, floor - 1, floor,
            )
            raise error
        try:
            ownership, plan = await commit_takeover(
                self._store, name, self._broker_id, plan, wal.next_offset, block=cfg.offset_block,
                wal_holds_data=holds_data, tiered_end=remote.end_offset, session=self.owner_session,
                abandoned=[(r.first_offset, r.last_offset) for r in wal.abandoned],
            )
        except BaseException:
            await wal.close()
            remote.close()
            raise
        wal.offset_guard = ownership
        wal.leader_epoch = ownership.epoch  # stored with each batch (segment format 3); takeover records it
        wal.storage_monitor = self._disk
        topic = Topic(
            name,
            wal,
            store=self._store,
            cache=self._cache,
            background=self._background,
            delivery=DeliveryMode.from_stored(self._cache.get(keys.topic_delivery(name))),
            cursor_flush_acks=cfg.cursor_flush_acks,
            max_batch_bytes=cfg.max_batch_bytes,
            max_consumer_buffer_bytes=cfg.max_consumer_buffer_bytes,
            subscription_idle_s=cfg.subscription_idle_s,
            remote=remote,
            below_retention=cfg.position_below_retention,
            unavailable_range=cfg.unavailable_range,
        )
        topic.ownership = ownership
        self._restore_sequences(topic)  # from the whole log: before the high watermark caps reads
        try:
            topic.replication = await start_replication(
                topic, ownership, previous=previous, in_sync_takeover=plan.in_sync, fetched_high_watermark=fetched_hw,
                cache=self._cache, cluster=self._cluster, lag_max_s=cfg.replica_lag_max_s,
            )
        except BaseException:
            await topic.close()
            raise
        if topic.replication is not None and self.replicas is not None:
            self.replicas.owned[name.path] = topic
        self._served.topics[name.path] = topic
        if self._cache.contains(keys.sealed_state(name)):
            with contextlib.suppress(Exception):
                await self._store.delete(keys.sealed_state(name))
        try:
            await self._reconciler.close_stale_producers(name, revision=ownership.reservation_revision)
        except MetadataStoreError as exc:  # the keys only describe producers: the topic still serves
            log.warning("topic %s: stale producer keys not closed: %s", name, exc)
        log.info("topic %s loaded, next offset %d", name, wal.next_offset)
        self._served.changed()
        return topic

    async def _open_memory_topic(self, name: TopicName) -> Topic:
        """Open a ``NonReliable`` topic (``docs/etcd-layout.md`` §3.2): an empty in-memory log
        (:mod:`broker.storage.memory_log`) whose offsets continue past every offset handed out before
        (the reservation, §5.4, and the sealed state, §5.3). No WAL, no object store: nothing
        of the topic is on disk, so nothing is unavailable (§5.5) when an owner dies."""
        cfg = self._config
        plan = await plan_takeover(self._store, name, self._broker_id, wal_holds_data=False, tiered_end=None)
        plan = dataclasses.replace(plan, unavailable=None)
        floor = max(plan.floor, self.offset_floor(name, None))
        log_ = MemoryLog(
            name.path, initial_offset=floor,
            max_messages=cfg.nonreliable_buffer_messages, max_bytes=cfg.nonreliable_buffer_bytes,
        )
        ownership, _plan = await commit_takeover(
            self._store, name, self._broker_id, plan, log_.next_offset, block=cfg.offset_block,
            wal_holds_data=False, tiered_end=None, session=self.owner_session,
        )
        log_.offset_guard = ownership
        topic = Topic(
            name,
            log_,
            store=self._store,
            cache=self._cache,
            background=self._background,
            delivery=DeliveryMode.NON_RELIABLE,
            cursor_flush_acks=cfg.cursor_flush_acks,
            max_batch_bytes=cfg.max_batch_bytes,
            max_consumer_buffer_bytes=cfg.max_consumer_buffer_bytes,
            subscription_idle_s=cfg.subscription_idle_s,
            remote=None,
        )
        topic.ownership = ownership
        handover = self._cache.get(keys.producer_sequences(name))
        if handover is not None:
            topic.sequences.load(handover)
        self._served.topics[name.path] = topic
        if self._cache.contains(keys.sealed_state(name)):
            with contextlib.suppress(Exception):
                await self._store.delete(keys.sealed_state(name))
        try:
            await self._reconciler.close_stale_producers(name, revision=ownership.reservation_revision)
        except MetadataStoreError as exc:
            log.warning("topic %s: stale producer keys not closed: %s", name, exc)
        log.info(
            "topic %s loaded (NonReliable: in memory, at most %d messages / %d bytes, drop-oldest), next offset %d",
            name, cfg.nonreliable_buffer_messages, cfg.nonreliable_buffer_bytes, log_.next_offset,
        )
        self._served.changed()
        return topic

    def _restore_sequences(self, topic: Topic) -> None:
        """Rebuild the idempotent producers' state (:mod:`broker.topics.producer_sequences`): the previous
        owner's handover (§5.6), then the batch headers of the WAL's newest sealed segment and
        its active segment."""
        handover = self._cache.get(keys.producer_sequences(topic.name))
        if handover is not None:
            topic.sequences.load(handover)
        wal = topic.wal
        sealed = wal.sealed_segments()
        position = sealed[-1].start_offset if sealed else wal.first_offset
        seen = 0
        try:
            while position < wal.durable_end:
                batches = wal.read(position, 100_000, max_bytes=8 * 1024 * 1024)
                if not batches:
                    break
                seen += topic.sequences.scan(batches)
                position = batches[-1].last_offset + 1
        except Exception as exc:  # noqa: BLE001 - only idempotence is weakened: resends may be written twice
            log.warning("topic %s: producer sequences not rebuilt from the WAL: %s", topic.name, exc)
        finally:
            wal.close_read_files()
        if seen:
            log.info("topic %s: producer sequences rebuilt from %d batches", topic.name, seen)

    async def create_topic(
        self, name: TopicName, *, delivery: DeliveryMode = DeliveryMode.RELIABLE, request_id: str = ""
    ) -> bool:
        """Create ``name`` in etcd and wait until the leader assigns it (§1.5); open it if it
        is assigned here.

        The topic's keys (§2.2, §3.1, §3.2) and its unassigned marker (§1.5) are written in one
        transaction that succeeds only if the topic root does not exist yet. The namespace
        registration (§2.2) records ``request_id``: a retry of the same request whose first
        attempt was applied but not answered (etcd timed out after applying it, the broker died
        after the write, the client's deadline passed), on this broker or another, finds its
        own request id there and answers ``True`` as the first attempt would have.

        Args:
            name: the topic.
            delivery: its delivery mode (§3.2).
            request_id: the client's id of this creation, the same on each of its retries
                (``""``: none).

        Returns:
            False if the topic already existed and was not created by ``request_id`` (then
            nothing is written).

        Raises:
            MetadataStoreError: etcd unreachable.
            BrokerUnavailableError: no broker was assigned within
                :data:`broker.cluster_view.ASSIGN_TIMEOUT_S` (no leader; retriable).
            OSError: the WAL cannot be created.
        """
        if self._cache.contains(keys.topic_root(name)):
            if not await self._created_by(name, request_id):
                return False
            return await self._await_created(name, delivery)
        policy_key = keys.namespace_policy(name.namespace)
        if not self._cache.contains(policy_key):
            # Conditional: an operator's policy written (etcdctl put) just before this call may
            # not have reached the cache yet, and must not be replaced by the defaults.
            await self._store.put_if_absent(policy_key, values.NamespacePolicy())
        revision = await self._store.transaction(
            created={keys.topic_root(name): 0},
            puts=[
                (keys.namespace_topic(name), topic_registration(request_id)),
                (keys.topic_root(name), 0),
                (keys.topic_delivery(name), delivery.value),
                (keys.unassigned_topic(name), None),
            ],
        )
        if revision is None:
            if not await self._created_by(name, request_id):
                return False
            return await self._await_created(name, delivery)
        faults.point(faults.TOPIC_AFTER_CREATE)
        await self._cache.wait_for_revision(revision)
        return await self._await_created(name, delivery)

    async def _created_by(self, name: TopicName, request_id: str) -> bool:
        """Whether the existing topic ``name`` was created by the request ``request_id``
        (its §2.2 registration, read straight from etcd).

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        if not request_id:
            return False
        kv = await self._store.get(keys.namespace_topic(name))
        if kv is None or not created_by_request(kv.value, request_id):
            return False
        await self._cache.wait_for_revision(kv.mod_revision)
        return True

    async def _await_created(self, name: TopicName, delivery: DeliveryMode) -> bool:
        """The end of a creation: wait for the topic's owner and open it if it is this broker.

        Raises:
            BrokerUnavailableError: no broker was assigned in time (retriable).
            OSError: the WAL cannot be created.
        """
        owner = await self._cluster.await_owner(name)
        if owner == self._broker_id:
            await self.load_topic(name)
        log.info("topic %s created (%s), assigned to broker %d", name, delivery.value, owner)
        return True

    async def topic_for(
        self, name: TopicName, *, create: bool = False, delivery: DeliveryMode = DeliveryMode.RELIABLE
    ) -> Topic:
        """The local :class:`Topic` for ``name``, loading (or creating) it as needed. A topic
        nobody owns is put in the unassigned queue for the leader to assign (§1.5).

        Raises:
            TopicNotFoundError: it does not exist and ``create`` is false.
            NotServedHereError: it is assigned to another broker.
            BrokerUnavailableError: no broker was assigned in time (retriable).
        """
        topic = self._served.topics.get(name.path)
        if topic is not None:
            return topic
        if not await self._cluster.topic_exists(name):
            if not create:
                raise TopicNotFoundError(name.path)
            await self.create_topic(name, delivery=delivery)
        owner = self._cluster.assigned_broker(name)
        if owner is None:
            await self._cluster.request_assignment(name)
            owner = await self._cluster.await_owner(name)
        if owner != self._broker_id:
            raise NotServedHereError(name.path, self._broker_id)
        return await self.load_topic(name)
