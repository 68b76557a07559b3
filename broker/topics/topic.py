"""One topic served by this broker: its WAL, its producers and its subscriptions."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable

from danube_pipeline.format.batches import BatchHeader, batch_payloads, parse_header, validate_batch
from danube_pipeline.errors import DanubeError, PolicyLimitError, SchemaMismatchError, SubscriptionNotFoundError
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.protocols import MetadataReader, MetadataWriter
from danube_pipeline.modes import DeliveryMode, SubscriptionType
from danube_pipeline.names import TopicName

from broker.config import (
    DEFAULT_MAX_BATCH_BYTES,
    DEFAULT_MAX_CONSUMER_BUFFER_BYTES,
    DEFAULT_SUBSCRIPTION_IDLE_S,
)
from broker.dispatch.consumer import Consumer
from broker.topics.producer_sequences import ProducerSequences
from broker.storage.memory_log import MemoryLog
from broker.cluster.ownership import Ownership
from broker.topics.producer import Producer
from broker.topics.rate_limit import RateLimiter
from broker.dispatch.redelivery import RedeliverySettings
from broker.storage.remote import RemoteLog
from broker.dispatch.subscription import BELOW_RETENTION_EARLIEST, UNAVAILABLE_WAIT, Subscription, earliest_offset
from broker.tasks import BackgroundWrites, spawn
from broker.storage.wal import WriteAheadLog

log = logging.getLogger(__name__)


class Topic:
    """A topic this broker serves.

    Args:
        name: the topic.
        wal: its opened write-ahead log; a :class:`~broker.storage.memory_log.MemoryLog` for a
            ``NonReliable`` topic.
        store: etcd, for writes (producers, subscriptions, cursors).
        cache: the broker's LocalCache, for reads (policy, cursors).
        background: where writes that must eventually happen are retried (the active
            consumer, undoing a failed subscribe); its outage log also counts cursor writes.
        delivery: the topic's delivery mode (``docs/etcd-layout.md`` §3.2). A ``NonReliable``
            topic reads from its in-memory log only (no ``remote``), and its subscriptions
            always jump over dropped messages (``below_retention`` is ``"earliest"``).
        cursor_flush_acks: see :class:`broker.dispatch.subscription.Subscription`.
        max_batch_bytes: largest record batch a producer may send, in bytes.
        max_consumer_buffer_bytes: see :class:`broker.dispatch.consumer.Consumer`.
        subscription_idle_s: a subscription without consumers is unloaded after this long.
        remote: the topic's offsets in object storage (read below the WAL's first offset);
            ``None`` without an object store.
        below_retention, unavailable_range: see :class:`broker.dispatch.subscription.Subscription`.

    Attributes:
        publish_limiter: paces publishing to the policy's ``max_publish_rate``
            (:mod:`broker.topics.rate_limit`).
        dispatch_limiters: per subscription name, paces dispatch to the policy's
            ``max_subscription_dispatch_rate`` (created on first use).
    """

    def __init__(
        self,
        name: TopicName,
        wal: WriteAheadLog,
        *,
        store: MetadataWriter,
        cache: MetadataReader,
        background: BackgroundWrites,
        delivery: DeliveryMode = DeliveryMode.RELIABLE,
        cursor_flush_acks: int = 1000,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        max_consumer_buffer_bytes: int = DEFAULT_MAX_CONSUMER_BUFFER_BYTES,
        subscription_idle_s: float = DEFAULT_SUBSCRIPTION_IDLE_S,
        remote: RemoteLog | None = None,
        below_retention: str = BELOW_RETENTION_EARLIEST,
        unavailable_range: str = UNAVAILABLE_WAIT,
    ) -> None:
        self.name = name
        self.wal = wal
        self.remote = remote
        self.below_retention = BELOW_RETENTION_EARLIEST if delivery == DeliveryMode.NON_RELIABLE else below_retention
        self.unavailable_range = unavailable_range
        self.delivery = delivery
        if isinstance(wal, MemoryLog):
            wal.read_floor = self._read_floor
        self.producers: dict[int, Producer] = {}
        self.pending_producers = 0  # being created (their etcd key is being written)
        self.subscriptions: dict[str, Subscription] = {}
        self._store = store
        self._cache = cache
        self._background = background
        self._cursor_flush_acks = cursor_flush_acks
        self.max_batch_bytes = max_batch_bytes
        self.max_consumer_buffer_bytes = max_consumer_buffer_bytes
        self.subscription_idle_s = subscription_idle_s
        self._unloaded_cursors: dict[str, int] = {}  # last cursor of unloaded subscriptions
        self._doomed: dict[str, float] = {}  # subscriptions whose first Subscribe failed
        self._policy_key = keys.namespace_policy(name.namespace)
        self._topic_policy_key = keys.topic_policy(name)
        self._policy_raw: tuple[object, object] = (None, None)
        self._policy: values.NamespacePolicy | None = None
        self._subscribe_lock = asyncio.Lock()
        self.closed = False
        self.ownership: Ownership | None = None  # set by the broker: owner epoch and reserved offsets
        self.sequences = ProducerSequences(name.path)
        self.publish_limiter = RateLimiter(self.max_publish_rate, name=f"{name.path} publish")
        self.dispatch_limiters: dict[str, RateLimiter] = {}

    @property
    def path(self) -> str:
        """``/ns/topic``."""
        return self.name.path

    @property
    def earliest_offset(self) -> int:
        """The earliest offset a subscription can read
        (:func:`broker.dispatch.subscription.earliest_offset`)."""
        return earliest_offset(self.wal, self.remote)

    # ------------------------------------------------------------------ producing

    def policy(self) -> values.NamespacePolicy:
        """The topic's policy: the namespace policy (``docs/etcd-layout.md`` §2.1), defaults
        when absent or unreadable, with the fields of the topic's override (§3.8) that are
        present replacing the namespace's (an unreadable override is logged and ignored).

        Read from the cache on every call and parsed again only when a cached value changed
        (the cache holds a new object then), so a policy written with etcdctl applies as soon
        as the cache's watch delivers it.
        """
        raw = (self._cache.get(self._policy_key), self._cache.get(self._topic_policy_key))
        if self._policy is None or raw[0] is not self._policy_raw[0] or raw[1] is not self._policy_raw[1]:
            namespace_raw, topic_raw = raw
            policy = values.NamespacePolicy()
            if namespace_raw is not None:
                try:
                    policy = values.NamespacePolicy.from_json(namespace_raw)
                except ValueError:
                    log.warning("%s: unreadable namespace policy %r; using defaults", self.path, namespace_raw)
            if topic_raw is not None:
                try:
                    policy = policy.overridden(topic_raw)
                except ValueError as exc:
                    log.warning("%s: unreadable topic policy override %r (%s); ignored", self.path, topic_raw, exc)
            self._policy_raw, self._policy = raw, policy
        return self._policy

    def check_producer_limit(self) -> None:
        """Refuse a new producer when the topic has ``max_producers_per_topic`` open ones.

        Raises:
            PolicyLimitError: at the limit (0 = unlimited).
        """
        limit = self.policy().max_producers_per_topic
        if limit and sum(not p.closed for p in self.producers.values()) + self.pending_producers >= limit:
            raise PolicyLimitError(self.path, "max_producers_per_topic", limit)

    def _check_consumer_limits(self, subscription: str) -> None:
        """Refuse a new consumer of ``subscription`` at any count limit of the policy: a new
        subscription past ``max_subscriptions_per_topic`` (loaded or stored, §3.4), a consumer
        past ``max_consumers_per_topic`` or ``max_consumers_per_subscription``.

        Raises:
            PolicyLimitError: at a limit (0 = unlimited).
        """
        policy = self.policy()
        sub = self.subscriptions.get(subscription)
        if policy.max_subscriptions_per_topic and sub is None:
            stored = set(self.subscriptions)
            prefix = keys.topic_subscription(self.name, "")
            for key in self._cache.get_prefix(prefix):
                rest = key[len(prefix):]
                if rest and "/" not in rest:
                    stored.add(rest)
            if subscription not in stored and len(stored) >= policy.max_subscriptions_per_topic:
                raise PolicyLimitError(self.path, "max_subscriptions_per_topic", policy.max_subscriptions_per_topic)
        if policy.max_consumers_per_topic:
            count = sum(len(s.consumers) for s in self.subscriptions.values())
            if count >= policy.max_consumers_per_topic:
                raise PolicyLimitError(self.path, "max_consumers_per_topic", policy.max_consumers_per_topic)
        if policy.max_consumers_per_subscription and sub is not None:
            if len(sub.consumers) >= policy.max_consumers_per_subscription:
                raise PolicyLimitError(
                    self.path, "max_consumers_per_subscription", policy.max_consumers_per_subscription
                )

    def max_publish_rate(self) -> int:
        """``max_publish_rate`` of the topic's policy (§2.1, §3.8) in messages per second;
        0 = unlimited (as is a value that is not a positive integer)."""
        return _rate(self.policy().max_publish_rate)

    def max_dispatch_rate(self) -> int:
        """``max_subscription_dispatch_rate`` of the topic's policy (§2.1, §3.8) in messages
        per second for each subscription; 0 = unlimited."""
        return _rate(self.policy().max_subscription_dispatch_rate)

    def dispatch_limiter(self, subscription: str) -> RateLimiter:
        """The token bucket pacing ``subscription``'s dispatch (created on first use, kept
        while the topic is loaded so its counters survive the subscription's reloads)."""
        limiter = self.dispatch_limiters.get(subscription)
        if limiter is None:
            limiter = RateLimiter(self.max_dispatch_rate, name=f"{self.path} subscription {subscription} dispatch")
            self.dispatch_limiters[subscription] = limiter
        return limiter

    async def throttle_publish(self, batch: bytes) -> float:
        """Wait until the topic's ``max_publish_rate`` admits ``batch``'s records
        (:class:`~broker.topics.rate_limit.RateLimiter`; backpressure, never an error). A batch whose
        header does not parse passes at once: :meth:`publish` refuses it.

        Returns:
            Seconds waited.
        """
        if not self.max_publish_rate():
            return 0.0
        try:
            count = parse_header(batch).record_count
        except DanubeError:
            return 0.0
        return await self.publish_limiter.acquire(count)

    def _read_floor(self) -> int | None:
        """The lowest read position of the loaded subscriptions, ``None`` without any."""
        return min((s.read_position for s in self.subscriptions.values()), default=None)

    def max_message_size_bytes(self) -> int:
        """``max_message_size`` of the topic's policy in bytes (§2.1, §3.8); 0 = unlimited."""
        return self.policy().max_message_size

    def validate(self, producer: Producer, batch: bytes) -> BatchHeader:
        """Check a whole record batch before anything is written.

        Raises:
            MalformedRequestError: the batch is truncated, oversized, fails its CRC, breaks
                the record framing, or names another producer or schema.
            MessageTooLargeError: a payload exceeds the namespace's ``max_message_size``.
            SchemaMismatchError: a payload is not a value of the producer's schema
                (:meth:`~danube_pipeline.schemas.formats.ParsedSchema.validate`: Avro that does
                not decode or leaves bytes over, JSON that is not UTF-8 JSON or fails the JSON
                Schema, Protobuf that does not parse or has unknown fields).
        """
        header = validate_batch(
            batch, max_message_size_bytes=self.max_message_size_bytes(), max_batch_bytes=self.max_batch_bytes
        )
        producer.check_batch_identity(header)
        schema, parsed = producer.schema, producer.parsed_schema
        if schema is not None and parsed is not None:
            validate = parsed.validate  # Avro: fastavro.schemaless_reader, and no byte left
            for i, payload in enumerate(batch_payloads(batch, header)):
                try:
                    validate(payload)
                except ValueError as exc:
                    raise SchemaMismatchError(schema.subject, schema.schema_id, f"message {i}: {exc}") from exc
        return header

    def publish(self, producer: Producer, batch: bytes) -> asyncio.Future[tuple[int, int]]:
        """Validate and enqueue one record batch; its offsets are assigned now, in call order.

        Returns:
            A future of ``(first_offset, last_offset)`` resolving after the WAL sync (for a
            ``NonReliable`` topic: once the batch is in memory, :mod:`broker.storage.memory_log`).

        Raises:
            MalformedRequestError, MessageTooLargeError, SchemaMismatchError: see
                :meth:`validate`; nothing is written then.
            DuplicateSequenceError: the batch's sequence numbers were written already, not as
                this batch (:mod:`broker.topics.producer_sequences`); a resend of a remembered batch gets
                the offsets it was written at instead.
        """
        header = self.validate(producer, batch)
        written = self.sequences.check(header)
        if written is not None:  # a resend of a batch written already (idempotent produce)
            return written
        first_offset = self.wal.next_offset
        future = self.wal.enqueue(batch, header.record_count)
        self.sequences.record(header, future, first_offset)
        producer.sent_messages += header.record_count
        return future

    # ------------------------------------------------------------------ consuming

    async def subscribe(
        self,
        *,
        subscription: str,
        subscription_type: SubscriptionType,
        consumer_id: int,
        consumer_name: str,
        earliest: bool,
        receiver_queue_size: int,
        on_uncertain_write: Callable[[], None] = lambda: None,
        settings: RedeliverySettings | None = None,
    ) -> Consumer:
        """Attach a consumer, creating (or loading) the subscription if needed, and record it
        in etcd.

        The start position of a subscription loaded here is the stored cursor + 1 if one
        exists, else the earliest retained offset, in object storage or in the WAL (EARLIEST),
        or the next offset (LATEST). A position below retention is handled by the
        subscription (``below_retention``).

        Raises:
            PolicyLimitError: the topic is at a count limit of its policy (§2.1, §3.8);
                nothing changed.
            SubscriptionBusyError: see :meth:`Subscription.add_consumer`.
            MetadataStoreError: etcd could not be written. A subscription this call created is
                unloaded again, and :meth:`reconcile_subscriptions` deletes its keys if etcd
                applies the failed writes later (``on_uncertain_write`` is called to start it).
        """
        async with self._subscribe_lock:
            self._check_consumer_limits(subscription)
            sub = self.subscriptions.get(subscription)
            sub_key = keys.topic_subscription(self.name, subscription)
            created = sub is None and self._cache.get(sub_key) is None
            if sub is None:
                sub = self._load_subscription(subscription, subscription_type, earliest)
            consumer = sub.add_consumer(
                consumer_id, consumer_name, subscription_type, receiver_queue_size,
                max_buffer_bytes=self.max_consumer_buffer_bytes,
            )
            if settings is not None:  # the subscription's redelivery settings (§3.4)
                sub.configure(settings)
            try:
                await self._store.put(
                    sub_key,
                    values.SubscriptionMetadata(
                        consumer_id=sub.active_consumer.id if sub.active_consumer else None,
                        consumer_name=consumer_name,
                        subscription_name=subscription,
                        subscription_type=int(subscription_type),
                        **sub.settings.stored_fields(),
                    ),
                )
                if sub.cursor_dirty:  # a new subscription remembers where it started
                    await sub.flush_cursor()
            except BaseException:
                sub.remove_consumer(consumer, reason="subscribe failed")
                if created and not sub.consumers:
                    await self._drop_created_subscription(sub)
                    on_uncertain_write()
                raise
            self._doomed.pop(subscription, None)
            return consumer

    def _load_subscription(self, name: str, subscription_type: SubscriptionType, earliest: bool) -> Subscription:
        stored = self._cache.get(keys.subscription_cursor(self.name, name))
        cursor = stored if isinstance(stored, int) and not isinstance(stored, bool) else None
        unloaded = self._unloaded_cursors.pop(name, None)
        if unloaded is not None and (cursor is None or unloaded > cursor):
            cursor = unloaded  # stored while unloading; the cache may not have it yet
        if cursor is not None:
            # Below the WAL's first offset, the subscription reads from object storage.
            start = cursor + 1
        elif earliest:
            start = self.earliest_offset
        else:
            start = self.wal.next_offset
        sub = Subscription(
            topic=self.path,
            name=name,
            subscription_type=subscription_type,
            wal=self.wal,
            start_offset=start,
            persisted_cursor=cursor,
            persist_cursor=self._cursor_writer(name),
            cursor_flush_acks=self._cursor_flush_acks,
            on_active_change=functools.partial(self._active_changed, name),
            on_idle=self._subscription_idle,
            remote=self.remote,
            below_retention=self.below_retention,
            unavailable_range=self.unavailable_range,
        )
        self.subscriptions[name] = sub
        log.info("%s: subscription %s (%s) starts at offset %d", self.path, name, subscription_type.name, start)
        return sub

    async def _drop_created_subscription(self, sub: Subscription) -> None:
        """Unload a subscription whose first ``Subscribe`` failed; its keys, if etcd writes
        them after all, are deleted by :meth:`reconcile_subscriptions`."""
        if self.subscriptions.get(sub.name) is sub:
            del self.subscriptions[sub.name]
        await sub.close(store_cursor=False)
        self._doomed[sub.name] = time.monotonic()
        log.info("%s: subscription %s unloaded again: its Subscribe failed", self.path, sub.name)

    async def reconcile_subscriptions(self, *, done: bool = False) -> None:
        """Delete the keys of every subscription whose first ``Subscribe`` failed and that was
        not created since (``docs/etcd-layout.md`` §3.4, §3.5); forget them when ``done``.

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        async with self._subscribe_lock:
            for name in list(self._doomed):
                if name in self.subscriptions:
                    del self._doomed[name]
                    continue
                removed = 0
                for key in (keys.subscription_cursor(self.name, name), keys.topic_subscription(self.name, name)):
                    removed += await self._store.delete(key)
                if removed:
                    log.info("%s: keys of subscription %s deleted: its Subscribe failed", self.path, name)
            if done:
                self._doomed.clear()

    def _subscription_idle(self, sub: Subscription) -> None:
        """``sub`` has no consumer left: unload it if it stays so for ``subscription_idle_s``."""
        asyncio.get_running_loop().call_later(
            self.subscription_idle_s, lambda: spawn(self._unload_if_idle(sub), name=f"unload:{self.path}:{sub.name}")
        )

    async def _unload_if_idle(self, sub: Subscription) -> None:
        async with self._subscribe_lock:
            if self.closed or self.subscriptions.get(sub.name) is not sub or sub.consumers:
                return
            if sub.idle_s < self.subscription_idle_s:
                self._subscription_idle(sub)  # a consumer came and went meanwhile
                return
            try:
                await sub.flush_cursor()
            except Exception:  # noqa: BLE001 - counted by the cursor writer; try again later
                self._subscription_idle(sub)
                return
            del self.subscriptions[sub.name]
            if sub.cursor is not None:
                self._unloaded_cursors[sub.name] = sub.cursor
            await sub.close(store_cursor=False)
            log.info("%s: subscription %s unloaded after %.0f s without consumers", self.path, sub.name, sub.idle_s)

    def _cursor_writer(self, subscription: str) -> Callable[[int], Awaitable[None]]:
        key = keys.subscription_cursor(self.name, subscription)
        outage = self._background.outage

        async def write(cursor: int) -> None:
            try:
                if self.ownership is not None:  # fenced: fails once the topic changed hands (§1.4)
                    await self.ownership.put(key, cursor)
                else:
                    await self._store.put(key, cursor)
            except Exception as exc:
                outage.failed(exc)
                raise
            outage.succeeded()

        return write

    def _active_changed(self, subscription: str, consumer: Consumer | None) -> None:
        if self.closed or consumer is None:
            return
        sub = self.subscriptions.get(subscription)
        if sub is None:
            return
        value = values.SubscriptionMetadata(
            consumer_id=consumer.id,
            consumer_name=consumer.name,
            subscription_name=subscription,
            subscription_type=int(sub.type),
            **sub.settings.stored_fields(),
        )
        key = keys.topic_subscription(self.name, subscription)
        self._background.submit(key, functools.partial(self._store.put, key, value))

    async def flush_cursors(self) -> None:
        """Store every changed subscription cursor (``docs/etcd-layout.md`` §3.5).

        Failures are counted by the outage log (one warning per etcd outage) and retried at
        the next flush.
        """
        for sub in list(self.subscriptions.values()):
            with contextlib.suppress(Exception):
                await sub.flush_cursor()

    async def close(self) -> None:
        """Close every subscription (storing cursors) and the WAL (synced)."""
        self.closed = True
        for sub in list(self.subscriptions.values()):
            try:
                await sub.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("%s/%s: close failed: %s", self.path, sub.name, exc)
        if self.remote is not None:
            self.remote.close()
        await self.wal.close()

    # ------------------------------------------------------------------ admin

    async def reset_cursor(self, subscription: str, offset: int) -> None:
        """Make ``subscription`` deliver from ``offset`` next, its cursor stored as
        ``offset - 1`` (``Admin.ResetCursor``; ``docs/etcd-layout.md`` §3.5). The caller checked
        that ``offset`` lies from :attr:`earliest_offset` to the WAL's next offset.

        The loaded instance, if any, is closed without storing its cursor: its consumers'
        streams end (clients subscribe again and continue from ``offset``), and the acks of the
        batches they held come from closed consumers and are refused
        (:class:`~danube_pipeline.errors.InvalidAckError`), so none of them can acknowledge an
        offset delivered again after the reset. A fresh instance, loaded as a
        ``Subscribe`` would load it (type from the stored metadata, §3.4, when it was not
        loaded), is moved with :meth:`Subscription.reset_to`; without consumers it is unloaded
        after ``subscription_idle_s``.

        Args:
            subscription: the subscription name (checked by the caller).
            offset: the next offset to deliver.

        Raises:
            SubscriptionNotFoundError: the subscription is neither loaded nor stored (§3.4).
            MetadataStoreError: the cursor could not be stored (see :meth:`Subscription.reset_to`).
        """
        async with self._subscribe_lock:
            old = self.subscriptions.get(subscription)
            stored = self._cache.get(keys.topic_subscription(self.name, subscription))
            if old is None and stored is None:
                raise SubscriptionNotFoundError(self.path, subscription)
            if old is not None:
                subscription_type = old.type
                del self.subscriptions[subscription]
                await old.close(store_cursor=False)
            else:
                subscription_type = SubscriptionType.EXCLUSIVE
                with contextlib.suppress(ValueError, TypeError):
                    subscription_type = SubscriptionType(
                        values.SubscriptionMetadata.from_json(stored).subscription_type
                    )
            self._unloaded_cursors.pop(subscription, None)
            sub = self._load_subscription(subscription, subscription_type, False)
            try:
                await sub.reset_to(offset)
            finally:
                if not sub.consumers:
                    self._subscription_idle(sub)


def _rate(value: object) -> int:
    """A policy rate in messages per second; anything but a positive integer is 0 (unlimited)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
