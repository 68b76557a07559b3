"""The subscriptions of one topic: subscribing, loading and unloading them, their cursors.

:class:`TopicSubscriptions` is the mapping ``name -> Subscription`` of the subscriptions
loaded on a :class:`~broker.topics.topic.Topic` (``Topic.subscriptions``). It attaches
consumers (§3.4, within the count limits of the policy, §2.1, §3.8), writes the subscription
and cursor keys (§3.4, §3.5), unloads subscriptions left without consumers, deletes the keys
of subscriptions whose first ``Subscribe`` failed, and moves a cursor for ``Admin.ResetCursor``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from danube_pipeline.errors import PolicyLimitError, SubscriptionNotFoundError
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.protocols import MetadataReader, MetadataWriter
from danube_pipeline.modes import SubscriptionType

from broker.dispatch.consumer import Consumer
from broker.dispatch.redelivery import RedeliverySettings
from broker.dispatch.subscription import Subscription
from broker.storage.publish_time import first_offset_at
from broker.tasks import BackgroundWrites, spawn

if TYPE_CHECKING:
    from broker.topics.topic import Topic

__all__ = ["TopicSubscriptions"]

log = logging.getLogger(__name__)


class TopicSubscriptions(Mapping[str, Subscription]):
    """The loaded subscriptions of one topic, by name.

    Args:
        topic: the topic they read (its log, remote log, policy and settings).
        store: etcd, for writes (subscriptions, cursors).
        cache: the broker's LocalCache, for reads (stored subscriptions and cursors).
        background: where writes that must eventually happen are retried (the active
            consumer); its outage log also counts cursor writes.
        cursor_flush_acks: see :class:`broker.dispatch.subscription.Subscription`.
    """

    def __init__(
        self,
        topic: Topic,
        *,
        store: MetadataWriter,
        cache: MetadataReader,
        background: BackgroundWrites,
        cursor_flush_acks: int,
    ) -> None:
        self._topic = topic
        self._store = store
        self._cache = cache
        self._background = background
        self._cursor_flush_acks = cursor_flush_acks
        self._by_name: dict[str, Subscription] = {}
        self._unloaded_cursors: dict[str, int] = {}  # last cursor of unloaded subscriptions
        self._doomed: dict[str, float] = {}  # subscriptions whose first Subscribe failed
        self._subscribe_lock = asyncio.Lock()

    def __getitem__(self, name: str) -> Subscription:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def check_consumer_limits(self, subscription: str) -> None:
        """Refuse a new consumer of ``subscription`` at any count limit of the policy: a new
        subscription past ``max_subscriptions_per_topic`` (loaded or stored, §3.4), a consumer
        past ``max_consumers_per_topic`` or ``max_consumers_per_subscription``.

        Raises:
            PolicyLimitError: at a limit (0 = unlimited).
        """
        policy = self._topic.policy()
        sub = self._by_name.get(subscription)
        if policy.max_subscriptions_per_topic and sub is None:
            stored = set(self._by_name)
            prefix = keys.topic_subscription(self._topic.name, "")
            for key in self._cache.get_prefix(prefix):
                rest = key[len(prefix):]
                if rest and "/" not in rest:
                    stored.add(rest)
            if subscription not in stored and len(stored) >= policy.max_subscriptions_per_topic:
                raise PolicyLimitError(
                    self._topic.path, "max_subscriptions_per_topic", policy.max_subscriptions_per_topic
                )
        if policy.max_consumers_per_topic:
            count = sum(len(s.consumers) for s in self._by_name.values())
            if count >= policy.max_consumers_per_topic:
                raise PolicyLimitError(self._topic.path, "max_consumers_per_topic", policy.max_consumers_per_topic)
        if policy.max_consumers_per_subscription and sub is not None:
            if len(sub.consumers) >= policy.max_consumers_per_subscription:
                raise PolicyLimitError(
                    self._topic.path, "max_consumers_per_subscription", policy.max_consumers_per_subscription
                )

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
        start_publish_time_us: int | None = None,
    ) -> Consumer:
        """Attach a consumer, creating (or loading) the subscription if needed, and record it
        in etcd.

        The start position of a subscription loaded here is the stored cursor + 1 if one
        exists, else the earliest retained offset, in object storage or in the WAL (EARLIEST),
        or the next offset (LATEST); with ``start_publish_time_us``, the first offset published
        at or after that time (:func:`broker.storage.publish_time.first_offset_at`). A position
        below retention is handled by the subscription (``below_retention``).

        Raises:
            PolicyLimitError: the topic is at a count limit of its policy (§2.1, §3.8);
                nothing changed.
            SubscriptionBusyError: see :meth:`Subscription.add_consumer`.
            TableReadError, CorruptRecordError, OSError: a start publish time was given and the
                table, an object or the WAL could not be read to find its offset.
            MetadataStoreError: etcd could not be written. A subscription this call created is
                unloaded again, and :meth:`reconcile` deletes its keys if etcd
                applies the failed writes later (``on_uncertain_write`` is called to start it).
        """
        async with self._subscribe_lock:
            self.check_consumer_limits(subscription)
            sub = self._by_name.get(subscription)
            sub_key = keys.topic_subscription(self._topic.name, subscription)
            created = sub is None and self._cache.get(sub_key) is None
            if sub is None:
                start: int | None = None
                if start_publish_time_us is not None and self._stored_cursor(subscription) is None:
                    start = await first_offset_at(self._topic.wal, self._topic.remote, start_publish_time_us)
                sub = self._load_subscription(subscription, subscription_type, earliest, start_offset=start)
            consumer = sub.add_consumer(
                consumer_id, consumer_name, subscription_type, receiver_queue_size,
                max_buffer_bytes=self._topic.max_consumer_buffer_bytes,
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

    def _stored_cursor(self, name: str) -> int | None:
        stored = self._cache.get(keys.subscription_cursor(self._topic.name, name))
        cursor = stored if isinstance(stored, int) and not isinstance(stored, bool) else None
        unloaded = self._unloaded_cursors.get(name)
        return unloaded if unloaded is not None and (cursor is None or unloaded > cursor) else cursor

    def _load_subscription(
        self, name: str, subscription_type: SubscriptionType, earliest: bool, *, start_offset: int | None = None
    ) -> Subscription:
        stored = self._cache.get(keys.subscription_cursor(self._topic.name, name))
        cursor = stored if isinstance(stored, int) and not isinstance(stored, bool) else None
        unloaded = self._unloaded_cursors.pop(name, None)
        if unloaded is not None and (cursor is None or unloaded > cursor):
            cursor = unloaded  # stored while unloading; the cache may not have it yet
        if cursor is not None:
            # Below the WAL's first offset, the subscription reads from object storage.
            start = cursor + 1
        elif start_offset is not None:
            start = start_offset  # by publish time
        elif earliest:
            start = self._topic.earliest_offset
        else:
            start = self._topic.wal.next_offset
        sub = Subscription(
            topic=self._topic.path,
            name=name,
            subscription_type=subscription_type,
            wal=self._topic.wal,
            start_offset=start,
            persisted_cursor=cursor,
            persist_cursor=self._cursor_writer(name),
            cursor_flush_acks=self._cursor_flush_acks,
            on_active_change=functools.partial(self._active_changed, name),
            on_idle=self._subscription_idle,
            remote=self._topic.remote,
            below_retention=self._topic.below_retention,
            unavailable_range=self._topic.unavailable_range,
            table_snapshot=self._stored_table_snapshot(name),
            persist_table_snapshot=self._table_snapshot_writer(name),
        )
        self._by_name[name] = sub
        log.info("%s: subscription %s (%s) starts at offset %d", self._topic.path, name, subscription_type.name, start)
        return sub

    async def _drop_created_subscription(self, sub: Subscription) -> None:
        """Unload a subscription whose first ``Subscribe`` failed; its keys, if etcd writes
        them after all, are deleted by :meth:`reconcile`."""
        if self._by_name.get(sub.name) is sub:
            del self._by_name[sub.name]
        await sub.close(store_cursor=False)
        self._doomed[sub.name] = time.monotonic()
        log.info("%s: subscription %s unloaded again: its Subscribe failed", self._topic.path, sub.name)

    async def reconcile(self, *, done: bool = False) -> None:
        """Delete the keys of every subscription whose first ``Subscribe`` failed and that was
        not created since (``docs/etcd-layout.md`` §3.4, §3.5); forget them when ``done``.

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        async with self._subscribe_lock:
            for name in list(self._doomed):
                if name in self._by_name:
                    del self._doomed[name]
                    continue
                removed = 0
                for key in (
                    keys.subscription_cursor(self._topic.name, name),
                    keys.subscription_table_snapshot(self._topic.name, name),
                    keys.topic_subscription(self._topic.name, name),
                ):
                    removed += await self._store.delete(key)
                if removed:
                    log.info("%s: keys of subscription %s deleted: its Subscribe failed", self._topic.path, name)
            if done:
                self._doomed.clear()

    def _subscription_idle(self, sub: Subscription) -> None:
        """``sub`` has no consumer left: unload it if it stays so for ``subscription_idle_s``."""
        asyncio.get_running_loop().call_later(
            self._topic.subscription_idle_s, lambda: spawn(self._unload_if_idle(sub), name=f"unload:{self._topic.path}:{sub.name}")
        )

    async def _unload_if_idle(self, sub: Subscription) -> None:
        async with self._subscribe_lock:
            if self._topic.closed or self._by_name.get(sub.name) is not sub or sub.consumers:
                return
            if sub.idle_s < self._topic.subscription_idle_s:
                self._subscription_idle(sub)  # a consumer came and went meanwhile
                return
            try:
                await sub.flush_cursor()
            except Exception:  # noqa: BLE001 - counted by the cursor writer; try again later
                self._subscription_idle(sub)
                return
            del self._by_name[sub.name]
            if sub.cursor is not None:
                self._unloaded_cursors[sub.name] = sub.cursor
            await sub.close(store_cursor=False)
            log.info("%s: subscription %s unloaded after %.0f s without consumers", self._topic.path, sub.name, sub.idle_s)

    def _cursor_writer(self, subscription: str) -> Callable[[int], Awaitable[None]]:
        key = keys.subscription_cursor(self._topic.name, subscription)
        outage = self._background.outage

        async def write(cursor: int) -> None:
            try:
                if self._topic.ownership is not None:  # fenced: fails once the topic changed hands (§1.4)
                    await self._topic.ownership.put(key, cursor)
                else:
                    await self._store.put(key, cursor)
            except Exception as exc:
                outage.failed(exc)
                raise
            outage.succeeded()

        return write

    def _stored_table_snapshot(self, subscription: str) -> values.TableSnapshot | None:
        """The subscription's table snapshot (§3.5.1) from the cache; an unreadable one is
        logged and ignored (the next table read starts without it)."""
        raw = self._cache.get(keys.subscription_table_snapshot(self._topic.name, subscription))
        if raw is None:
            return None
        try:
            return values.TableSnapshot.from_json(raw)
        except (ValueError, TypeError) as exc:
            log.warning("%s/%s: ignoring unreadable table snapshot: %s", self._topic.path, subscription, exc)
            return None

    def _table_snapshot_writer(self, subscription: str) -> Callable[[values.TableSnapshot], Awaitable[None]]:
        key = keys.subscription_table_snapshot(self._topic.name, subscription)

        async def write(snapshot: values.TableSnapshot) -> None:
            if self._topic.ownership is not None:  # fenced, as the cursor (§1.4)
                await self._topic.ownership.put(key, snapshot)
            else:
                await self._store.put(key, snapshot)

        return write

    def _active_changed(self, subscription: str, consumer: Consumer | None) -> None:
        if self._topic.closed or consumer is None:
            return
        sub = self._by_name.get(subscription)
        if sub is None:
            return
        value = values.SubscriptionMetadata(
            consumer_id=consumer.id,
            consumer_name=consumer.name,
            subscription_name=subscription,
            subscription_type=int(sub.type),
            **sub.settings.stored_fields(),
        )
        key = keys.topic_subscription(self._topic.name, subscription)
        self._background.submit(key, functools.partial(self._store.put, key, value))

    async def flush_cursors(self) -> None:
        """Store every changed subscription cursor (``docs/etcd-layout.md`` §3.5).

        Failures are counted by the outage log (one warning per etcd outage) and retried at
        the next flush.
        """
        for sub in list(self._by_name.values()):
            with contextlib.suppress(Exception):
                await sub.flush_cursor()

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
            old = self._by_name.get(subscription)
            stored = self._cache.get(keys.topic_subscription(self._topic.name, subscription))
            if old is None and stored is None:
                raise SubscriptionNotFoundError(self._topic.path, subscription)
            if old is not None:
                subscription_type = old.type
                del self._by_name[subscription]
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

    async def close(self) -> None:
        """Close every subscription, storing its cursor (a failure is logged)."""
        for sub in list(self._by_name.values()):
            try:
                await sub.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("%s/%s: close failed: %s", self._topic.path, sub.name, exc)
