"""The broker core: the topics this broker serves, their producers and consumers.

:class:`Broker` owns the process-wide bookkeeping and every operation the gRPC servicers
(:mod:`broker.rpc.services`) translate to: creating and closing producers, publishing,
subscribing, acknowledging, creating and looking up topics. It reads metadata from the
:class:`~danube_pipeline.metadata.cache.LocalCache` and writes it through the
:class:`~danube_pipeline.metadata.store.MetadataStore` (``docs/etcd-layout.md``).

A topic is served here while ``/cluster/brokers/{own id}/{ns}/{topic}`` exists (§1.4): the
broker follows that prefix and loads or unloads topics as assignments appear and disappear.

etcd may be unreachable at any time, and a write that timed out may still be applied by etcd
later. So when a creation or a close could not be written (``CreateProducer``, ``Subscribe``,
``CloseProducer`` failing with :class:`~danube_pipeline.errors.MetadataStoreError`), the broker
*reconciles* etcd with what it knows, every :data:`RECONCILE_INTERVAL_S` until
:data:`RECONCILE_PASSES` passes succeeded: a producer key of a topic served here that says
``status: true`` for a producer not open here is marked closed, and the keys of a subscription
whose first ``Subscribe`` failed are deleted unless it was created since. Closed producers' keys
expire on their own (:class:`broker.topics.producer_expiry.ExpiringKeys`, §3.3). Other writes that must happen
(the active consumer of a subscription) are retried by :class:`broker.tasks.BackgroundWrites`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import os
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from pathlib import Path
from typing import Any

from danube_pipeline.errors import (
    BrokerUnavailableError,
    ConsumerNotFoundError,
    MetadataStoreError,
    NotServedHereError,
    OffsetRangeError,
    ProducerNotFoundError,
    TopicNotFoundError,
    UnavailableRangeNotFoundError,
)
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore, WatchEvent, WatchEventType, remaining_budget_s
from danube_pipeline.modes import DeliveryMode, InitialPosition, SubscriptionType
from danube_pipeline.names import TopicName, validate_part
from danube_pipeline.storage.objectstore import ObjectStore
from danube_pipeline.format.records import SEGMENT_HEADER_SIZE
from danube_pipeline.outages import OutageLog
from danube_pipeline.schemas.registry import SchemaRegistry

from broker.config import BrokerConfig
from broker.dispatch.consumer import DEFAULT_RECEIVER_QUEUE_SIZE, Consumer
from broker.dispatch.dead_letter_forwarding import forward_dead_letter
from broker.topics.producer_expiry import ExpiringKeys
from broker.cluster.ownership import commit_takeover, plan_takeover, record_last_written, wal_has_records
from broker.rpc.request_ids import RecentRequests
from broker.storage.memory_log import MemoryLog
from broker.topics.producer import Producer
from broker.dispatch.redelivery import RedeliverySettings
from broker.storage.remote import ObjectCache, RemoteLog
from broker.storage.local_retention import LocalRetention, RetentionLimits, RetentionOutcome
from broker.topics.schema_policy import check_producer_schema
from broker.storage.disk import DiskMonitor
from broker.tasks import BackgroundWrites, spawn
from broker.topics.topic import Topic
from broker.storage.wal import WriteAheadLog
from broker.storage.wal.segment import SEALED_NAME_RE

log = logging.getLogger(__name__)

ASSIGN_TIMEOUT_S = 10.0
"""How long a request waits for the leader to assign a topic nobody owns (§1.5)."""
RECONCILE_INTERVAL_S = 2.0
"""Pause between two reconciliation passes (see the module docstring)."""
RECONCILE_PASSES = 10
"""Successful passes made after the last uncertain write: late writes of etcd are caught too."""
_MAX_REMEMBERED_CLOSED_CONSUMERS = 10_000
_MAX_PUTS_PER_TXN = 100
"""Keys written per etcd transaction when many are closed at once (etcd's ``--max-txn-ops``
is 128 by default)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RegisteredBroker:
    """A broker as ``/cluster/register/{id}`` and ``/cluster/brokers/{id}/state`` describe it.

    Attributes:
        broker_id: the u64 broker id.
        address: ``host:port`` clients use (``advertised_addr``).
        mode: the state's ``mode`` (``active``, ``draining``), empty when unknown.
    """

    broker_id: int
    address: str
    mode: str


def _new_id(taken: Collection[int]) -> int:
    """A random non-zero u64 not in ``taken``."""
    while True:
        candidate = secrets.randbits(64)
        if candidate and candidate not in taken:
            return candidate


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
        self.topics: dict[str, Topic] = {}
        self.producers: dict[int, Producer] = {}
        self.consumers: collections.OrderedDict[int, Consumer] = collections.OrderedDict()
        self._on_topics_changed = on_topics_changed
        self._loading: dict[str, asyncio.Task[Topic]] = {}
        self._remove_listener: Callable[[], None] | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._stopping = False
        self.disk = DiskMonitor(config.wal_dir, on_change=on_storage_full)
        self.background = BackgroundWrites(OutageLog(log, "metadata writes to etcd"))
        self.closed_keys = ExpiringKeys(store, config.closed_producer_ttl_s)
        self.requests = RecentRequests()
        self._creating: set[int] = set()  # producer ids whose key is being written
        self._reconcile_passes = 0
        self._reconciler: asyncio.Task[None] | None = None
        self.objects = ObjectStore(config.object_store_url, storage_options=config.object_store_options or None)
        self.object_cache = ObjectCache(config.object_cache_bytes)
        self.local_retention = LocalRetention(
            self.objects, RetentionLimits(bytes=config.local_retention_bytes, ms=config.local_retention_ms)
        )
        self._retention_task: asyncio.Task[None] | None = None
        self._releasing: set[str] = set()  # topics being released (unload, drain)
        self.draining = False
        self.set_state: Callable[[str, str], Awaitable[None]] = self._put_state
        """Writes this broker's state (§1.3); the server makes it keep the registration lease."""

    async def _put_state(self, mode: str, reason: str) -> None:
        await self.store.put(keys.broker_state(self.broker_id), values.BrokerState(mode=mode, reason=reason))

    def other_active_brokers(self) -> list[int]:
        """Registered brokers other than this one whose state is ``active`` (§1.2, §1.3)."""
        return sorted(
            b.broker_id for b in self.registered_brokers() if b.broker_id != self.broker_id and b.mode == "active"
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Load every topic assigned here, follow new assignments, start the cursor flusher."""
        prefix = keys.broker_prefix(self.broker_id)
        self._remove_listener = self.cache.add_listener(prefix, self._on_assignment_event)
        await self.keep_unowned_wals()
        for key in self.cache.get_prefix(prefix):
            name = self._assignment_topic(key)
            if name is not None:
                try:
                    await self.load_topic(name)
                except Exception:
                    log.exception("cannot load assigned topic %s", name)
        self._flusher = asyncio.create_task(self._cursor_flusher(), name="cursor-flush")
        self._retention_task = asyncio.create_task(self._retention_loop(), name="local-retention")

    def end_consumer_streams(self) -> None:
        """Detach every consumer (their ``Receive`` streams end); the first step of a stop."""
        self._stopping = True
        if self._remove_listener is not None:
            self._remove_listener()
            self._remove_listener = None
        for topic in self.topics.values():
            for sub in topic.subscriptions.values():
                for consumer in list(sub.consumers):
                    sub.remove_consumer(consumer, reason="broker shutdown")

    async def close(self) -> None:
        """Mark every open producer closed in etcd, store cursors, close the WALs (synced)."""
        self.end_consumer_streams()
        for task in (self._flusher, self._reconciler, self._retention_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        closed: list[tuple[str, Any]] = [
            (keys.topic_producer(p.topic.name, p.id), p.metadata(status=False)) for p in self.producers.values()
        ]
        for producer in self.producers.values():
            producer.closed = True
        self.producers.clear()
        try:
            for start in range(0, len(closed), _MAX_PUTS_PER_TXN):
                await self.closed_keys.put_many(closed[start : start + _MAX_PUTS_PER_TXN])
        except MetadataStoreError as exc:
            log.warning("cannot mark producers closed (the next owner of their topics will): %s", exc)
        for topic in list(self.topics.values()):
            try:
                await topic.close()
            except Exception:
                log.exception("closing topic %s failed", topic.path)
        self.topics.clear()
        await self.background.close()
        self.disk.stop()

    async def _retention_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.local_retention_check_s)
            for topic in list(self.topics.values()):
                if topic.closed or topic.remote is None:
                    continue
                try:
                    await self.apply_local_retention(topic)
                except OSError as exc:
                    log.warning("%s: local retention failed (tried again in %.0f s): %s",
                                topic.path, self.config.local_retention_check_s, exc)
            try:
                await self.retain_released()
            except OSError as exc:
                log.warning("released segments: local retention failed: %s", exc)

    async def retain_released(self) -> int:
        """Delete the released segments (:meth:`release_topic`) whose object is verified in
        object storage, or whose offsets expired (below the topic's first descriptor), and the
        directories left empty.

        Returns:
            The segment files deleted.

        Raises:
            OSError: a file could not be deleted.
        """
        deleted = 0
        base = self.released_dir
        if not base.is_dir():
            return 0
        for topic_dir in sorted(p for ns in base.iterdir() if ns.is_dir() for p in ns.iterdir() if p.is_dir()):
            try:
                name = TopicName.parse(f"/{topic_dir.parent.name}/{topic_dir.name}")
            except ValueError:
                continue
            remote = RemoteLog(name, cache=self.cache, objects=self.objects, object_cache=self.object_cache, prefetch_bytes=0)
            try:
                for path, start, end, size in self.released_segments(name):
                    expired = remote.first_offset is not None and end < remote.first_offset
                    if not expired:
                        d = remote.descriptor_for(start)
                        if d is None or (d.start_offset, d.end_offset, d.size) != (start, end, size):
                            continue
                        if not await self.local_retention.verified_in_store(remote, d):
                            continue
                    await asyncio.to_thread(path.unlink)
                    deleted += 1
                    log.info("%s: released segment %s deleted: %s", name, path.name,
                             "expired" if expired else "held in object storage")
            finally:
                remote.close()
            for release in list(topic_dir.iterdir()):
                # Gone once nothing is left but empty active segments (a header, no record).
                if release.is_dir() and all(
                    f.suffix == ".log" and f.stat().st_size <= SEGMENT_HEADER_SIZE for f in release.iterdir()
                ):
                    await asyncio.to_thread(shutil.rmtree, release, True)
            with contextlib.suppress(OSError):
                topic_dir.rmdir()
        return deleted

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
        limits = self.local_retention.limits(self.cache, topic.remote)
        limits = RetentionLimits(
            bytes=limits.bytes if retention_bytes is None else retention_bytes,
            ms=limits.ms if retention_ms is None else retention_ms,
        )
        return await self.local_retention.apply(topic.wal, topic.remote, limits)

    async def _cursor_flusher(self) -> None:
        while True:
            await asyncio.sleep(self.config.cursor_flush_interval_s)
            for topic in list(self.topics.values()):
                await topic.flush_cursors()  # failures are logged once per outage

    # ------------------------------------------------------------------ reconciling

    def uncertain_write(self) -> None:
        """A creation or close could not be written to etcd, which may still apply it later:
        reconcile (again) for the next :data:`RECONCILE_PASSES` successful passes."""
        self._reconcile_passes = RECONCILE_PASSES
        if (self._reconciler is None or self._reconciler.done()) and not self._stopping:
            self._reconciler = spawn(self._reconcile(), name="reconcile")

    async def _reconcile(self) -> None:
        while self._reconcile_passes > 0 and not self._stopping:
            await asyncio.sleep(RECONCILE_INTERVAL_S)
            try:
                for topic in list(self.topics.values()):
                    await self._reconcile_producers(topic)
                    await topic.reconcile_subscriptions(done=self._reconcile_passes == 1)
            except MetadataStoreError as exc:
                self.background.outage.failed(exc)
                continue
            self._reconcile_passes -= 1

    async def _reconcile_producers(self, topic: Topic) -> None:
        """Mark closed every producer key of ``topic`` that says ``status: true`` for a producer
        not open here (a create that failed, or a close whose write failed).

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        kvs, _ = await self.store.get_prefix(keys.topic_producers_prefix(topic.name))
        for kv in kvs:
            try:
                producer = values.ProducerMetadata.from_json(kv.value)
            except ValueError:
                continue
            pid = producer.producer_id
            if not producer.status or pid in topic.producers or pid in self._creating:
                continue
            closed = dataclasses.replace(producer, status=False)
            if await self.closed_keys.compare_and_put(kv.key, closed, expected_mod_revision=kv.mod_revision):
                log.info("%s: producer %d (%s) marked closed: its create or close did not complete",
                         topic.path, pid, producer.producer_name)

    # ------------------------------------------------------------------ assignments

    def _assignment_topic(self, key: str) -> TopicName | None:
        rest = key.removeprefix(keys.broker_prefix(self.broker_id))
        if rest.count("/") != 1:
            return None
        try:
            return TopicName.parse(f"/{rest}")
        except Exception:  # noqa: BLE001 - not an assignment key (e.g. "state")
            return None

    def _on_assignment_event(self, event: WatchEvent) -> None:
        name = self._assignment_topic(event.key)
        if name is None or self._stopping:
            return
        if event.type is WatchEventType.PUT:
            spawn(self._load_quietly(name), name=f"load:{name}")
        else:
            spawn(self.unload_topic(name), name=f"unload:{name}")

    async def _load_quietly(self, name: TopicName) -> None:
        try:
            await self.load_topic(name)
        except Exception:
            log.exception("cannot load newly assigned topic %s", name)

    def is_assigned_here(self, name: TopicName) -> bool:
        """Whether ``/cluster/brokers/{own id}/{ns}/{topic}`` exists (``docs/etcd-layout.md`` §1.4)."""
        return self.cache.contains(keys.topic_assignment(self.broker_id, name))

    def assigned_broker(self, name: TopicName) -> int | None:
        """The broker id the topic is assigned to, from ``/cluster/brokers/*/{ns}/{topic}``."""
        suffix = f"/{name.namespace}/{name.topic}"
        for key in self.cache.get_prefix(keys.BROKERS_PREFIX):
            if not key.endswith(suffix):
                continue
            broker_part = key[len(keys.BROKERS_PREFIX) : -len(suffix)]
            if broker_part.isdigit():
                return int(broker_part)
        return None

    # ------------------------------------------------------------------ topics

    async def load_topic(self, name: TopicName) -> Topic:
        """Open ``name`` locally (idempotent): its WAL, started at the sealed state's
        ``last_committed_offset + 1`` when the WAL is empty (``docs/etcd-layout.md`` §5.3).

        Raises:
            OSError, CorruptRecordError: the WAL cannot be opened.
        """
        path = name.path
        topic = self.topics.get(path)
        if topic is not None:
            return topic
        if path in self._releasing:
            raise NotServedHereError(path, self.broker_id)
        task = self._loading.get(path)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._open_topic(name))
            self._loading[path] = task
            task.add_done_callback(functools.partial(self._loading_done, path))
        return await asyncio.shield(task)

    def _loading_done(self, path: str, _task: asyncio.Task[Topic]) -> None:
        self._loading.pop(path, None)

    def offset_floor(self, name: TopicName, remote: RemoteLog | None) -> int:
        """The lowest offset ``name`` may hand out next: above the sealed state's
        ``last_committed_offset`` (§5.3) and the last completed descriptor's ``end_offset``
        (§5.1). The table's committed offset is never above the latter: the table is built from
        the descriptors, and retention always keeps the newest descriptor."""
        floor = 0
        sealed_raw = self.cache.get(keys.sealed_state(name))
        if sealed_raw is not None:
            with contextlib.suppress(ValueError, TypeError):
                floor = values.SealedState.from_json(sealed_raw).last_committed_offset + 1
        if remote is not None and remote.end_offset is not None:
            floor = max(floor, remote.end_offset + 1)
        return floor

    async def _open_topic(self, name: TopicName) -> Topic:
        cfg = self.config
        if DeliveryMode.from_stored(self.cache.get(keys.topic_delivery(name))) == DeliveryMode.NON_RELIABLE:
            return await self._open_memory_topic(name)
        remote = RemoteLog(
            name, cache=self.cache, objects=self.objects, object_cache=self.object_cache, prefetch_bytes=cfg.prefetch_bytes
        )
        wal_dir = cfg.wal_dir / name.namespace / name.topic
        try:
            holds_data = wal_has_records(wal_dir)
            plan = await plan_takeover(
                self.store, name, self.broker_id, wal_holds_data=holds_data, tiered_end=remote.end_offset
            )
            floor = max(plan.floor, self.offset_floor(name, remote))
            wal = await WriteAheadLog.open(
                wal_dir,
                segment_max_bytes=cfg.segment_max_bytes,
                segment_max_age_s=cfg.segment_max_age_s,
                initial_offset=floor,
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
                self.store, name, self.broker_id, plan, wal.next_offset, block=cfg.offset_block,
                wal_holds_data=holds_data, tiered_end=remote.end_offset,
            )
        except BaseException:
            await wal.close()
            remote.close()
            raise
        wal.offset_guard = ownership
        wal.storage_monitor = self.disk
        topic = Topic(
            name,
            wal,
            store=self.store,
            cache=self.cache,
            background=self.background,
            delivery=DeliveryMode.from_stored(self.cache.get(keys.topic_delivery(name))),
            cursor_flush_acks=cfg.cursor_flush_acks,
            max_batch_bytes=cfg.max_batch_bytes,
            max_consumer_buffer_bytes=cfg.max_consumer_buffer_bytes,
            subscription_idle_s=cfg.subscription_idle_s,
            remote=remote,
            below_retention=cfg.position_below_retention,
            unavailable_range=cfg.unavailable_range,
        )
        topic.ownership = ownership
        self._restore_sequences(topic)
        self.topics[name.path] = topic
        if self.cache.contains(keys.sealed_state(name)):
            with contextlib.suppress(Exception):
                await self.store.delete(keys.sealed_state(name))
        try:
            await self._close_stale_producers(name)
        except MetadataStoreError as exc:  # the keys only describe producers: the topic still serves
            log.warning("topic %s: stale producer keys not closed: %s", name, exc)
        log.info("topic %s loaded, next offset %d", name, wal.next_offset)
        self._on_topics_changed()
        return topic

    async def _open_memory_topic(self, name: TopicName) -> Topic:
        """Open a ``NonReliable`` topic (``docs/etcd-layout.md`` §3.2): an empty in-memory log
        (:mod:`broker.storage.memory_log`) whose offsets continue past every offset handed out before
        (the reservation, §5.4, and the sealed state, §5.3). No WAL, no object store: nothing
        of the topic is on disk, so nothing is unavailable (§5.5) when an owner dies."""
        cfg = self.config
        plan = await plan_takeover(self.store, name, self.broker_id, wal_holds_data=False, tiered_end=None)
        plan = dataclasses.replace(plan, unavailable=None)
        floor = max(plan.floor, self.offset_floor(name, None))
        log_ = MemoryLog(
            name.path, initial_offset=floor,
            max_messages=cfg.nonreliable_buffer_messages, max_bytes=cfg.nonreliable_buffer_bytes,
        )
        ownership, _plan = await commit_takeover(
            self.store, name, self.broker_id, plan, log_.next_offset, block=cfg.offset_block,
            wal_holds_data=False, tiered_end=None,
        )
        log_.offset_guard = ownership
        topic = Topic(
            name,
            log_,
            store=self.store,
            cache=self.cache,
            background=self.background,
            delivery=DeliveryMode.NON_RELIABLE,
            cursor_flush_acks=cfg.cursor_flush_acks,
            max_batch_bytes=cfg.max_batch_bytes,
            max_consumer_buffer_bytes=cfg.max_consumer_buffer_bytes,
            subscription_idle_s=cfg.subscription_idle_s,
            remote=None,
        )
        topic.ownership = ownership
        handover = self.cache.get(keys.producer_sequences(name))
        if handover is not None:
            topic.sequences.load(handover)
        self.topics[name.path] = topic
        if self.cache.contains(keys.sealed_state(name)):
            with contextlib.suppress(Exception):
                await self.store.delete(keys.sealed_state(name))
        try:
            await self._close_stale_producers(name)
        except MetadataStoreError as exc:
            log.warning("topic %s: stale producer keys not closed: %s", name, exc)
        log.info(
            "topic %s loaded (NonReliable: in memory, at most %d messages / %d bytes, drop-oldest), next offset %d",
            name, cfg.nonreliable_buffer_messages, cfg.nonreliable_buffer_bytes, log_.next_offset,
        )
        self._on_topics_changed()
        return topic

    def _restore_sequences(self, topic: Topic) -> None:
        """Rebuild the idempotent producers' state (:mod:`broker.topics.producer_sequences`): the previous
        owner's handover (§5.6), then the batch headers of the WAL's newest sealed segment and
        its active segment."""
        handover = self.cache.get(keys.producer_sequences(topic.name))
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
        if seen:
            log.info("topic %s: producer sequences rebuilt from %d batches", topic.name, seen)

    async def _close_stale_producers(self, name: TopicName) -> None:
        """Set ``status`` false on every producer key of ``name`` still marked open, under the
        expiring lease of closed producers.

        Called when this broker loads the topic, before any producer is created on it here:
        an open producer key can only belong to an earlier owner (or an earlier run of this
        broker) whose connections are gone. Each write is conditional on the key's
        ``mod_revision``, so a key changed meanwhile is left alone (§3.3).

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        kvs, _ = await self.store.get_prefix(keys.topic_producers_prefix(name))
        for kv in kvs:
            try:
                producer = values.ProducerMetadata.from_json(kv.value)
            except ValueError:
                log.warning("ignoring malformed producer key %s", kv.key)
                continue
            if producer.status:
                closed = dataclasses.replace(producer, status=False)
                await self.closed_keys.compare_and_put(kv.key, closed, expected_mod_revision=kv.mod_revision)
                log.info("producer %d (%s) on %s marked closed: its owner is gone",
                         producer.producer_id, producer.producer_name, name)

    @property
    def released_dir(self) -> Path:
        """Where the WAL directories of released topics are kept until their segments are
        tiered: ``data_dir/released/{ns}/{topic}/{released at, ms}/``."""
        return self.config.data_dir / "released"

    async def release_topic(self, name: TopicName, *, reason: str = "unload") -> int:
        """Give ``name`` up so the leader assigns it to another broker (``docs/etcd-layout.md``
        §1.5, §5.3).

        Steps: stop taking batches (producers get ``NotServedHereError`` and look the topic up
        again); seal the active segment once every batch already taken is durable; mark the
        producers closed; store every cursor and close the WAL; then, in one etcd transaction,
        write the sealed state (``last_committed_offset``), delete this broker's assignment and
        put the topic in the unassigned queue with ``{"reason", "from_broker"}``. The WAL
        directory moves to :attr:`released_dir`, whose sealed segments this broker keeps
        serving over ``ListSealedSegments`` / ``ReadSegment`` (``released``) until local
        retention finds them tiered.

        Returns:
            The first offset the next owner hands out.

        Raises:
            NotServedHereError: the topic is not served here (or is being released).
            MetadataStoreError: etcd unreachable at the hand-over (the topic stays assigned
                here and is loaded again by the next request).
        """
        path = name.path
        topic = self.topics.get(path)
        if topic is None or path in self._releasing:
            raise NotServedHereError(path, self.broker_id)
        self._releasing.add(path)
        try:
            topic.closed = True  # served_topic refuses new batches from here on
            del self.topics[path]
            try:
                await topic.wal.seal_active()  # waits for every batch already taken
            except OSError as exc:
                log.warning("topic %s: sealing before the release failed (%s); the active segment moves as it is", name, exc)
            last = topic.wal.next_offset - 1
            for pid in [p for p, prod in self.producers.items() if prod.topic is topic]:
                await self._mark_closed(self.producers.pop(pid))
            await topic.close()
            self._on_topics_changed()
            puts: list[tuple[str, Any]] = [
                (keys.sealed_state(name), values.SealedState(
                    sealed=True, last_committed_offset=last, broker_id=self.broker_id, timestamp=int(time.time())
                )),
                (keys.unassigned_topic(name), values.UnassignedReason(reason=reason, from_broker=self.broker_id)),
            ]
            ownership = topic.ownership
            if ownership is not None:  # the block shrinks to what was handed out (§5.4)
                puts.append((keys.offset_reservation(name), ownership.reservation(last)))
            puts.append((keys.producer_sequences(name), topic.sequences.to_json()))  # §5.6
            untiered_from = self._untiered_from(topic)
            if untiered_from is not None and untiered_from <= last:
                # Offsets only this broker holds until they are tiered (§5.5): if it dies before,
                # consumers and tiering wait for it rather than take the gap for a loss.
                puts.append((keys.unavailable_range(name, untiered_from), values.UnavailableRange(
                    start_offset=untiered_from, end_offset=last, broker_id=self.broker_id,
                    since=int(time.time()), last_written=last,
                )))
            revision = await self.store.transaction(
                created=ownership.guard if ownership is not None else None,
                exists=[keys.topic_assignment(self.broker_id, name)],
                puts=puts,
                deletes=[keys.topic_assignment(self.broker_id, name)],
            )
            if revision is None:
                raise NotServedHereError(path, self.broker_id)
            self._move_to_released(name)
            await self.cache.wait_for_revision(revision)
            log.info("topic %s released (%s): the next owner starts at offset %d", name, reason, last + 1)
            return last + 1
        finally:
            self._releasing.discard(path)

    async def abandon_unavailable_range(self, name: TopicName, start_offset: int) -> int:
        """Give up waiting for the unavailable range of ``name`` starting at ``start_offset``
        (``docs/etcd-layout.md`` §5.5): subscriptions skip its offsets that object storage does
        not hold, counted, and tiering passes over them. Done on the topic's owner.

        Returns:
            The offsets of the range that were not in object storage (and were not known to
            be unused).

        Raises:
            TopicNotFoundError, NotServedHereError: see :meth:`topic_for`.
            UnavailableRangeNotFoundError: no range starts there.
            MetadataStoreError: etcd unreachable, or the range changed meanwhile (retriable).
        """
        topic = await self.topic_for(name)
        key = keys.unavailable_range(name, start_offset)
        kv = await self.store.get(key)
        if kv is None:
            raise UnavailableRangeNotFoundError(name.path, start_offset)
        rng = values.UnavailableRange.from_json(kv.value)
        if rng.abandoned:
            return 0
        revision = await self.store.transaction(
            modified={key: kv.mod_revision}, puts=[(key, dataclasses.replace(rng, abandoned=True))]
        )
        if revision is None:
            raise MetadataStoreError("abandon unavailable range", f"{key} changed meanwhile; try again")
        await self.cache.wait_for_revision(revision)
        end = rng.end_offset if rng.last_written is None else min(rng.end_offset, rng.last_written)
        tiered_end = topic.remote.end_offset if topic.remote is not None else None
        first_missing = rng.start_offset if tiered_end is None else max(rng.start_offset, tiered_end + 1)
        skipped = max(0, end - first_missing + 1)
        log.error("topic %s: unavailable range %d..%d of broker %d abandoned: %d offsets will never be delivered",
                  name, rng.start_offset, rng.end_offset, rng.broker_id, skipped)
        return skipped

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
                await self.release_topic(TopicName.parse(path), reason="drain")
                released.append(path)
        await self.set_state("drained", "drain")
        log.info("broker %d drained: %d topics released", self.broker_id, len(released))
        return released

    def released_segments(self, name: TopicName) -> list[tuple[Path, int, int, int]]:
        """Sealed segments kept from earlier ownerships of ``name``:
        ``(path, start_offset, end_offset, size_bytes)``, ascending by start offset."""
        base = self.released_dir / name.namespace / name.topic
        found = []
        if base.is_dir():
            for release in base.iterdir():
                if not release.is_dir():
                    continue
                for f in release.iterdir():
                    m = SEALED_NAME_RE.fullmatch(f.name)
                    if m is not None:
                        found.append((f, int(m.group(1)), int(m.group(2)), f.stat().st_size))
        return sorted(found, key=lambda t: t[1])

    @staticmethod
    def _untiered_from(topic: Topic) -> int | None:
        """The first offset of ``topic`` not in object storage, ``None`` without an object store."""
        remote = topic.remote
        if remote is None:
            return None
        return 0 if remote.end_offset is None else remote.end_offset + 1

    def _move_to_released(self, name: TopicName) -> Path | None:
        """Move the topic's WAL directory to :attr:`released_dir` (its sealed segments are
        served for tiering from there); ``None`` when there is none."""
        wal_dir = self.config.wal_dir / name.namespace / name.topic
        if not wal_dir.exists():
            return None
        target = self.released_dir / name.namespace / name.topic / str(time.time_ns() // 1_000_000)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(wal_dir, target)
        return target

    async def unload_topic(self, name: TopicName) -> None:
        """Stop serving ``name``: its assignment was removed by someone else (the leader failed
        this broker over, or the topic was deleted). Producers are closed; the WAL is kept as
        released segments (:meth:`keep_as_released`)."""
        topic = self.topics.pop(name.path, None)
        if topic is None:
            return
        topic.closed = True
        for pid in [p for p, prod in self.producers.items() if prod.topic is topic]:
            await self._mark_closed(self.producers.pop(pid))
        await topic.close()
        self._on_topics_changed()
        log.warning("topic %s unloaded: its assignment to broker %d was removed (fenced)", name, self.broker_id)
        if name.path not in self._releasing:
            await self.keep_as_released(name)

    async def keep_as_released(self, name: TopicName) -> int | None:
        """Keep a WAL of a topic this broker no longer owns as released segments, and record
        the last offset it holds (``docs/etcd-layout.md`` §5.4, §5.5).

        The WAL is opened (recovery drops a torn tail), its active segment sealed, and the
        directory moved to :attr:`released_dir`, from where its sealed segments are served for
        tiering under their own offsets. The last offset is recorded on this broker's
        reservation, or on the unavailable ranges the next owner recorded for it, so consumers
        and tiering pass over the offsets above it, which were never handed out.

        Returns:
            The last offset held, ``None`` when there was no WAL.

        Raises:
            OSError, CorruptRecordError: the WAL cannot be opened.
            MetadataStoreError: etcd unreachable (the WAL is moved all the same).
        """
        wal_dir = self.config.wal_dir / name.namespace / name.topic
        if not wal_dir.exists():
            return None
        wal = await WriteAheadLog.open(
            wal_dir, segment_max_bytes=self.config.segment_max_bytes, segment_max_age_s=self.config.segment_max_age_s
        )
        try:
            await wal.seal_active()
        finally:
            await wal.close()
        last = wal.next_offset - 1
        self._move_to_released(name)
        log.warning("topic %s: WAL kept as released segments (last offset %d); served for tiering", name, last)
        await record_last_written(self.store, name, self.broker_id, last)
        return last

    async def keep_unowned_wals(self) -> list[str]:
        """At start: keep as released (:meth:`keep_as_released`) every local WAL of a topic
        not assigned to this broker (it was taken over while this broker was away).

        Returns:
            The topics whose WAL was kept.
        """
        kept: list[str] = []
        base = self.config.wal_dir
        if not base.is_dir():
            return kept
        for ns_dir in sorted(p for p in base.iterdir() if p.is_dir()):
            for topic_dir in sorted(p for p in ns_dir.iterdir() if p.is_dir()):
                try:
                    name = TopicName.parse(f"/{ns_dir.name}/{topic_dir.name}")
                except ValueError:
                    continue
                if self.is_assigned_here(name):
                    continue
                try:
                    await self.keep_as_released(name)
                except Exception:
                    log.exception("topic %s: the WAL of a topic no longer owned could not be kept", name)
                    continue
                kept.append(name.path)
        return kept

    async def create_topic(self, name: TopicName, *, delivery: DeliveryMode = DeliveryMode.RELIABLE) -> bool:
        """Create ``name`` in etcd and wait until the leader assigns it (§1.5); open it if it
        is assigned here.

        The topic's keys (§2.2, §3.1, §3.2) and its unassigned marker (§1.5) are written in one
        transaction that succeeds only if the topic root does not exist yet.

        Returns:
            False if the topic already existed (then nothing is written).

        Raises:
            MetadataStoreError: etcd unreachable.
            BrokerUnavailableError: no broker was assigned within :data:`ASSIGN_TIMEOUT_S`
                (no leader; retriable).
            OSError: the WAL cannot be created.
        """
        if self.cache.contains(keys.topic_root(name)):
            return False
        policy_key = keys.namespace_policy(name.namespace)
        if not self.cache.contains(policy_key):
            # Conditional: an operator's policy written (etcdctl put) just before this call may
            # not have reached the cache yet, and must not be replaced by the defaults.
            await self.store.put_if_absent(policy_key, values.NamespacePolicy())
        revision = await self.store.transaction(
            created={keys.topic_root(name): 0},
            puts=[
                (keys.namespace_topic(name), None),
                (keys.topic_root(name), 0),
                (keys.topic_delivery(name), delivery.value),
                (keys.unassigned_topic(name), None),
            ],
        )
        if revision is None:
            return False
        await self.cache.wait_for_revision(revision)
        owner = await self._await_owner(name)
        if owner == self.broker_id:
            await self.load_topic(name)
        log.info("topic %s created (%s), assigned to broker %d", name, delivery.value, owner)
        return True

    async def _topic_exists(self, name: TopicName) -> bool:
        """Whether the topic root (§3.1) exists. A cache miss is checked against etcd (another
        broker may have created the topic a moment ago), and the cache waits for that write.

        Raises:
            MetadataStoreError: etcd unreachable (on a cache miss only).
        """
        if self.cache.contains(keys.topic_root(name)):
            return True
        kv = await self.store.get(keys.topic_root(name))
        if kv is None:
            return False
        await self.cache.wait_for_revision(kv.mod_revision)
        return True

    async def _request_assignment(self, name: TopicName) -> None:
        """Put ``name`` in the unassigned queue (§1.5) unless it is there already.

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        revision = await self.store.transaction(
            created={keys.unassigned_topic(name): 0},
            exists=[keys.topic_root(name)],
            puts=[(keys.unassigned_topic(name), None)],
        )
        if revision is not None:
            await self.cache.wait_for_revision(revision)

    async def _await_owner(self, name: TopicName, timeout_s: float = ASSIGN_TIMEOUT_S, *, registered: bool = False) -> int:
        """Wait until ``name`` has an owner (§1.4) in the cache, at most ``timeout_s`` seconds
        and never past the request's deadline (so the client gets the typed cause). With
        ``registered``, the owner must also be registered (§1.2): an owner whose lease expired
        is waited out until the leader fails the topic over.

        Raises:
            BrokerUnavailableError: none in time (retriable).
        """
        budget = remaining_budget_s()  # the client's deadline, less a margin (deadline_scope)
        if budget is not None:
            timeout_s = min(timeout_s, budget)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        changed = asyncio.Event()
        unlisten = self.cache.add_listener(keys.BROKERS_PREFIX, lambda _event: changed.set())
        listeners = [unlisten]
        if registered:
            listeners.append(self.cache.add_listener(keys.BROKER_REGISTER_PREFIX, lambda _event: changed.set()))
        try:
            while True:
                owner = self.assigned_broker(name)
                if owner is not None and (not registered or self.cache.contains(keys.broker_register(owner))):
                    return owner
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise BrokerUnavailableError(
                        name.path, f"no broker was assigned the topic within {timeout_s:.0f} s (is a leader elected?)"
                    )
                changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(remaining, 0.5))
        finally:
            for remove in listeners:
                remove()

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
        topic = self.topics.get(name.path)
        if topic is not None:
            return topic
        if not await self._topic_exists(name):
            if not create:
                raise TopicNotFoundError(name.path)
            await self.create_topic(name, delivery=delivery)
        owner = self.assigned_broker(name)
        if owner is None:
            await self._request_assignment(name)
            owner = await self._await_owner(name)
        if owner != self.broker_id:
            raise NotServedHereError(name.path, self.broker_id)
        return await self.load_topic(name)

    def served_topic(self, path: str) -> Topic:
        """The loaded topic at ``path``.

        Raises:
            NotServedHereError: this broker does not serve it (anymore).
        """
        topic = self.topics.get(path)
        if topic is None or topic.closed:
            raise NotServedHereError(path, self.broker_id)
        return topic

    # ------------------------------------------------------------------ discovery

    async def lookup(self, name: TopicName) -> RegisteredBroker:
        """The broker serving ``name``; an unassigned topic is queued for the leader to assign.

        Raises:
            TopicNotFoundError: the topic does not exist.
            BrokerUnavailableError: its owner is not registered.
        """
        if not await self._topic_exists(name):
            raise TopicNotFoundError(name.path)
        broker_id = self.assigned_broker(name)
        if broker_id is None:  # unassigned: the leader assigns it (§1.5)
            await self._request_assignment(name)
            broker_id = await self._await_owner(name)
        raw = self.cache.get(keys.broker_register(broker_id))
        if raw is None:  # its lease expired: the leader fails the topic over (§1.4)
            try:
                broker_id = await self._await_owner(name, registered=True)
            except BrokerUnavailableError:
                raise BrokerUnavailableError(
                    f"broker {broker_id}", f"serves {name.path} but is not registered (the leader fails its "
                    "topics over once its lease expired)"
                ) from None
            raw = self.cache.get(keys.broker_register(broker_id))
        if raw is None:
            raise BrokerUnavailableError(f"broker {broker_id}", f"serves {name.path} but is not registered")
        registration = values.BrokerRegistration.from_json(raw)
        return RegisteredBroker(broker_id, registration.advertised_addr, self._broker_mode(broker_id))

    def registered_brokers(self) -> list[RegisteredBroker]:
        """Every broker under ``/cluster/register/`` with its state's mode (§1.2, §1.3)."""
        out = []
        for key, raw in self.cache.get_prefix(keys.BROKER_REGISTER_PREFIX).items():
            suffix = key[len(keys.BROKER_REGISTER_PREFIX) :]
            if not suffix.isdigit():
                continue
            try:
                registration = values.BrokerRegistration.from_json(raw)
            except ValueError:
                continue
            out.append(RegisteredBroker(int(suffix), registration.advertised_addr, self._broker_mode(int(suffix))))
        return out

    def _broker_mode(self, broker_id: int) -> str:
        state = self.cache.get(keys.broker_state(broker_id))
        return str(state.get("mode", "")) if isinstance(state, dict) else ""

    def leader_id(self) -> int:
        """The id in ``/cluster/leader`` (§1.7), 0 when none is recorded."""
        leader = self.cache.get(keys.CLUSTER_LEADER)
        return leader if isinstance(leader, int) and not isinstance(leader, bool) else 0

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
        """Register a producer on a topic, creating the topic if needed (§3.3).

        The topic's schema settings apply first (:mod:`broker.topics.schema_policy`, §3.7): a producer
        with a schema records the topic's subject (if it has none yet) and the topic in the
        subject's ``topics_using`` (§4.2); one without a schema is refused on a topic with a
        subject unless raw messages are allowed.

        Args:
            topic_path: ``/{namespace}/{topic}``.
            producer_name: the producer's name.
            access_mode: 0 = shared.
            schema_id: the global schema id its payloads must match; 0 = none.
            schema_version: the version within the schema's subject; 0 = the latest.
            delivery: the delivery mode of a topic this call creates.

        Raises:
            InvalidNameError: a name is malformed.
            SchemaNotFoundError, InvalidSchemaError: the schema is unknown, or its stored text
                does not parse.
            SchemaRequiredError: no schema, on a topic with a subject that refuses raw messages.
            PolicyLimitError: the topic has ``max_producers_per_topic`` producers (§2.1, §3.8);
                nothing is created.
            NotServedHereError: another broker owns the topic.
            MetadataStoreError: etcd unreachable. The producer key may still be written by
                etcd later; reconciliation then marks it closed, and it expires.
        """
        name = TopicName.parse(topic_path)
        validate_part("producer", producer_name)
        schema = parsed = None
        if schema_id:
            schema = await self.registry.get_by_id(schema_id, version=schema_version or None)
            parsed = await self.registry.parse(schema)
        topic = await self.topic_for(name, create=True, delivery=delivery)
        topic.check_producer_limit()
        await check_producer_schema(self, name, schema)
        topic.check_producer_limit()  # again: producers may have been created meanwhile
        producer = Producer(
            id=_new_id(self.producers.keys()),
            name=producer_name,
            access_mode=access_mode,
            topic=topic,
            schema=schema,
            parsed_schema=parsed,
        )
        self._creating.add(producer.id)
        topic.pending_producers += 1
        try:
            await self.store.put(keys.topic_producer(name, producer.id), producer.metadata(status=True))
        except MetadataStoreError:
            self.uncertain_write()  # etcd may apply the write later: the key is then closed
            raise
        finally:
            self._creating.discard(producer.id)
            topic.pending_producers -= 1
        self.producers[producer.id] = producer
        topic.producers[producer.id] = producer
        log.info("producer %d (%s) on %s", producer.id, producer_name, name)
        return producer

    def served_producer(self, producer_id: int) -> tuple[Producer, Topic]:
        """The open producer and the topic it publishes to, still served here.

        Raises:
            ProducerNotFoundError: unknown or closed, or its topic was reloaded since.
            NotServedHereError: its topic is no longer served here.
        """
        producer = self.producers.get(producer_id)
        if producer is None:
            raise ProducerNotFoundError(producer_id)
        topic = self.served_topic(producer.topic.path)
        if topic is not producer.topic:  # the topic was reloaded: the producer is stale
            self.producers.pop(producer_id, None)
            raise ProducerNotFoundError(producer_id)
        return producer, topic

    async def throttle_publish(self, producer_id: int, batch: bytes) -> float:
        """Wait until the topic's ``max_publish_rate`` admits ``batch``
        (:meth:`Topic.throttle_publish`); call it before :meth:`publish`.

        Returns:
            Seconds waited (0.0 when unlimited, or for an unknown producer: :meth:`publish`
            then raises).
        """
        try:
            _producer, topic = self.served_producer(producer_id)
        except (ProducerNotFoundError, NotServedHereError):
            return 0.0
        return await topic.throttle_publish(batch)

    def publish(self, producer_id: int, batch: bytes) -> asyncio.Future[tuple[int, int]]:
        """Validate and enqueue one record batch of a producer (see :meth:`Topic.publish`).

        Returns:
            A future of ``(first_offset, last_offset)`` resolving after the WAL sync.

        Raises:
            ProducerNotFoundError, NotServedHereError: see :meth:`served_producer`.
            MalformedRequestError, MessageTooLargeError, SchemaMismatchError: nothing written.
        """
        producer, topic = self.served_producer(producer_id)
        return topic.publish(producer, batch)

    async def close_producer(self, producer_id: int) -> None:
        """Forget the producer and set ``status`` false in its key, which then expires (§3.3).

        When etcd is unreachable the key is written by reconciliation, once etcd answers.

        Raises:
            ProducerNotFoundError: unknown or already closed.
        """
        producer = self.producers.pop(producer_id, None)
        if producer is None:
            raise ProducerNotFoundError(producer_id)
        producer.topic.producers.pop(producer.id, None)
        await self._mark_closed(producer)

    async def _mark_closed(self, producer: Producer) -> None:
        """Write the producer's key closed under the expiring lease now, or by reconciliation
        once etcd answers."""
        producer.closed = True
        key = keys.topic_producer(producer.topic.name, producer.id)
        try:
            await self.closed_keys.put(key, producer.metadata(status=False))
        except MetadataStoreError as exc:
            log.info("producer %d: closed here; its key is marked closed once etcd answers (%s)", producer.id, exc)
            self.uncertain_write()

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
    ) -> Consumer:
        """Attach a new consumer to a subscription of a topic served here (§3.4).

        The consumer's window is ``receiver_queue_size`` messages (the default when 0), at
        most the broker's ``max_receiver_queue_size``. ``settings`` replace the subscription's
        redelivery settings; ``None`` keeps the loaded subscription's, or those stored in its
        etcd value (§3.4), or the defaults.

        Raises:
            InvalidNameError: a name is malformed.
            TopicNotFoundError: the topic does not exist.
            NotServedHereError: another broker owns it.
            SubscriptionBusyError: see :meth:`Subscription.add_consumer`.
            MetadataStoreError: etcd unreachable (a subscription this call created is removed
                again, in etcd too, once etcd answers).
        """
        name = TopicName.parse(topic_path)
        validate_part("subscription", subscription)
        validate_part("consumer", consumer_name)
        topic = await self.topic_for(name)
        window = min(receiver_queue_size or DEFAULT_RECEIVER_QUEUE_SIZE, self.config.max_receiver_queue_size)
        if settings is None:
            loaded = topic.subscriptions.get(subscription)
            settings = loaded.settings if loaded is not None else RedeliverySettings.from_stored(
                self.cache.get(keys.topic_subscription(name, subscription))
            )
        settings.dead_letter_topic_for(name.path, subscription)  # InvalidNameError for a too long default
        consumer = await topic.subscribe(
            subscription=subscription,
            subscription_type=subscription_type,
            consumer_id=_new_id(self.consumers.keys()),
            consumer_name=consumer_name,
            earliest=initial_position is InitialPosition.EARLIEST,
            receiver_queue_size=window,
            on_uncertain_write=self.uncertain_write,
            settings=settings,
        )
        consumer.subscription.dead_letter_publisher = self.publish_dead_letter
        self._remember_consumer(consumer)
        log.info("consumer %d (%s) subscribed %s/%s as %s",
                 consumer.id, consumer_name, name, subscription, subscription_type.name)
        return consumer

    def consumer(self, consumer_id: int, *, open_only: bool = False) -> Consumer:
        """The consumer ``consumer_id``; closed ones are remembered a while for late acks.

        Raises:
            ConsumerNotFoundError: never known, forgotten, or closed when ``open_only``.
        """
        consumer = self.consumers.get(consumer_id)
        if consumer is None or (open_only and consumer.closed):
            raise ConsumerNotFoundError(consumer_id)
        return consumer

    def ack(self, consumer_id: int, ranges: Iterable[tuple[int, int]]) -> None:
        """Acknowledge the inclusive offset ``ranges`` on the consumer's subscription: only
        offsets sent to this consumer and not acknowledged yet (``docs/etcd-layout.md`` §3.5).

        Raises:
            ConsumerNotFoundError: unknown consumer (never known, or forgotten).
            InvalidAckError: an offset is not the consumer's to acknowledge (never delivered,
                delivered to another consumer, already acknowledged, or the consumer is
                closed); nothing of the request was acknowledged.
        """
        consumer = self.consumer(consumer_id)
        consumer.subscription.ack_ranges(ranges, consumer=consumer)

    def nack(self, consumer_id: int, ranges: Iterable[tuple[int, int]], *, reason: str = "") -> int:
        """Negatively acknowledge the inclusive offset ``ranges``: they are redelivered after
        the subscription's nack delay (:meth:`Subscription.nack_ranges`).

        Returns:
            How many offsets were taken back.

        Raises:
            ConsumerNotFoundError: unknown consumer (never known, or forgotten).
            InvalidAckError: an offset is not the consumer's (as for :meth:`ack`); nothing changed.
        """
        consumer = self.consumer(consumer_id)
        return consumer.subscription.nack_ranges(consumer, ranges, reason=reason)

    async def publish_dead_letter(self, topic_path: str, producer_name: str, batch: bytes) -> tuple[int, int]:
        """Append a dead-letter batch (producer id 0, :mod:`broker.dispatch.dead_letter_topic`) to
        ``topic_path``, creating the topic if needed; a batch written already (same producer
        name and sequence) answers its first offsets instead (:mod:`broker.topics.producer_sequences`).

        When another broker owns the dead-letter topic, the batch is forwarded to it over gRPC
        under the same producer name and base sequence, so its idempotence check dedups a
        repeat too (:mod:`broker.dispatch.dead_letter_forwarding`).

        Returns:
            ``(first_offset, last_offset)`` once durable.

        Raises:
            NotServedHereError: the dead-letter topic moved while it was being looked up (the
                messages wait and are tried again).
            BrokerUnavailableError: its owner could not be reached (retriable, likewise).
            DanubeError: the batch was refused or the topic could not be created.
        """
        name = TopicName.parse(topic_path)
        try:
            topic = await self.topic_for(name, create=True)
        except NotServedHereError:
            owner = await self.lookup(name)
            if owner.broker_id == self.broker_id:  # assigned here meanwhile: the next try loads it
                raise
            return await forward_dead_letter(owner.address, name.path, producer_name, batch)
        producer = Producer(id=0, name=producer_name, access_mode=0, topic=topic)
        return await topic.publish(producer, batch)

    async def close_consumer(self, consumer_id: int) -> None:
        """Detach the consumer (its unacknowledged messages are redelivered) and store the cursor.

        Raises:
            ConsumerNotFoundError: unknown consumer.
            MetadataStoreError: the cursor could not be stored.
        """
        consumer = self.consumer(consumer_id)
        sub = consumer.subscription
        sub.remove_consumer(consumer, reason="closed by client")
        await sub.flush_cursor()

    def _remember_consumer(self, consumer: Consumer) -> None:
        self.consumers[consumer.id] = consumer
        while len(self.consumers) > _MAX_REMEMBERED_CLOSED_CONSUMERS:
            oldest_id, oldest = next(iter(self.consumers.items()))
            if not oldest.closed:
                self.consumers.move_to_end(oldest_id)
                break
            del self.consumers[oldest_id]


__all__ = ["Broker", "RegisteredBroker"]
