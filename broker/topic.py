"""One topic served by this broker: its WAL, its producers and its subscriptions."""

from __future__ import annotations

import asyncio
import functools
import io
import logging
from collections.abc import Awaitable, Callable

import fastavro

from danube_pipeline.batches import BatchHeader, batch_payloads, validate_batch
from danube_pipeline.errors import SchemaMismatchError
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.protocols import MetadataReader, MetadataWriter
from danube_pipeline.modes import DeliveryMode, SubscriptionType
from danube_pipeline.names import TopicName

from broker.config import DEFAULT_MAX_BATCH_BYTES
from broker.consumer import Consumer
from broker.producer import Producer
from broker.subscription import Subscription
from broker.wal import WriteAheadLog

log = logging.getLogger(__name__)


class Topic:
    """A topic this broker serves.

    Args:
        name: the topic.
        wal: its opened write-ahead log.
        store: etcd, for writes (producers, subscriptions, cursors).
        cache: the broker's LocalCache, for reads (policy, cursors).
        delivery: the topic's delivery mode (``docs/etcd-layout.md`` §3.2).
        cursor_flush_acks: see :class:`broker.subscription.Subscription`.
        max_batch_bytes: largest record batch a producer may send, in bytes.
    """

    def __init__(
        self,
        name: TopicName,
        wal: WriteAheadLog,
        *,
        store: MetadataWriter,
        cache: MetadataReader,
        delivery: DeliveryMode = DeliveryMode.RELIABLE,
        cursor_flush_acks: int = 1000,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    ) -> None:
        self.name = name
        self.wal = wal
        self.delivery = delivery
        self.producers: dict[int, Producer] = {}
        self.subscriptions: dict[str, Subscription] = {}
        self._store = store
        self._cache = cache
        self._cursor_flush_acks = cursor_flush_acks
        self.max_batch_bytes = max_batch_bytes
        self._policy_key = keys.namespace_policy(name.namespace)
        self._policy_raw: object = None
        self._policy: values.NamespacePolicy | None = None
        self._subscribe_lock = asyncio.Lock()
        self.closed = False

    @property
    def path(self) -> str:
        """``/ns/topic``."""
        return self.name.path

    # ------------------------------------------------------------------ producing

    def policy(self) -> values.NamespacePolicy:
        """The namespace policy (``docs/etcd-layout.md`` §2.1), defaults when absent or unreadable.

        Parsed again only when the cached value changed (the cache holds a new object then).
        """
        raw = self._cache.get(self._policy_key)
        if raw is not self._policy_raw or self._policy is None:
            policy = values.NamespacePolicy()
            if raw is not None:
                try:
                    policy = values.NamespacePolicy.from_json(raw)
                except ValueError:
                    log.warning("%s: unreadable namespace policy %r; using defaults", self.path, raw)
            self._policy_raw, self._policy = raw, policy
        return self._policy

    def max_message_size_bytes(self) -> int:
        """``max_message_size`` of the namespace policy in bytes; 0 = unlimited (§2.1)."""
        return self.policy().max_message_size

    def validate(self, producer: Producer, batch: bytes) -> BatchHeader:
        """Check a whole record batch before anything is written.

        Raises:
            MalformedRequestError: the batch is truncated, oversized, fails its CRC, breaks
                the record framing, or names another producer or schema.
            MessageTooLargeError: a payload exceeds the namespace's ``max_message_size``.
            SchemaMismatchError: a payload does not decode with the producer's Avro schema
                (or leaves bytes over).
        """
        header = validate_batch(
            batch, max_message_size_bytes=self.max_message_size_bytes(), max_batch_bytes=self.max_batch_bytes
        )
        producer.check_batch_identity(header)
        if producer.schema is not None:
            schema = producer.schema
            for i, payload in enumerate(batch_payloads(batch, header)):
                buf = io.BytesIO(payload)
                try:
                    fastavro.schemaless_reader(buf, producer.parsed_schema, None)
                except Exception as exc:  # noqa: BLE001 - fastavro raises many types
                    raise SchemaMismatchError(
                        schema.subject, schema.schema_id, f"message {i}: {type(exc).__name__}: {exc}"
                    ) from exc
                if buf.tell() != len(payload):
                    raise SchemaMismatchError(
                        schema.subject, schema.schema_id, f"message {i}: {len(payload) - buf.tell()} bytes left after decoding"
                    )
        return header

    def publish(self, producer: Producer, batch: bytes) -> asyncio.Future[tuple[int, int]]:
        """Validate and enqueue one record batch; its offsets are assigned now, in call order.

        Returns:
            A future of ``(first_offset, last_offset)`` resolving after the WAL sync.

        Raises:
            MalformedRequestError, MessageTooLargeError, SchemaMismatchError: see
                :meth:`validate`; nothing is written then.
        """
        header = self.validate(producer, batch)
        producer.sent_messages += header.record_count
        return self.wal.enqueue(batch, header.record_count)

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
    ) -> Consumer:
        """Attach a consumer, creating the subscription if needed, and record it in etcd.

        The start position of a new subscription is the stored cursor + 1 if one exists, else
        the first local offset (EARLIEST) or the next offset (LATEST).

        Raises:
            SubscriptionBusyError: see :meth:`Subscription.add_consumer`.
            MetadataStoreError: etcd could not be written.
        """
        async with self._subscribe_lock:
            sub = self.subscriptions.get(subscription)
            if sub is None:
                stored = self._cache.get(keys.subscription_cursor(self.name, subscription))
                cursor = stored if isinstance(stored, int) and not isinstance(stored, bool) else None
                if cursor is not None:
                    # A cursor older than the WAL start (e.g. after a topic move) resumes at
                    # the first offset held locally.
                    start = max(cursor + 1, self.wal.first_offset)
                elif earliest:
                    start = self.wal.first_offset
                else:
                    start = self.wal.next_offset
                sub = Subscription(
                    topic=self.path,
                    name=subscription,
                    subscription_type=subscription_type,
                    wal=self.wal,
                    start_offset=start,
                    persisted_cursor=cursor,
                    persist_cursor=self._cursor_writer(subscription),
                    cursor_flush_acks=self._cursor_flush_acks,
                    on_active_change=functools.partial(self._active_changed, subscription),
                )
                self.subscriptions[subscription] = sub
                log.info("%s: subscription %s (%s) starts at offset %d", self.path, subscription, subscription_type.name, start)
            consumer = sub.add_consumer(consumer_id, consumer_name, subscription_type, receiver_queue_size)
            try:
                await self._store.put(
                    keys.topic_subscription(self.name, subscription),
                    values.SubscriptionMetadata(
                        consumer_id=sub.active_consumer.id if sub.active_consumer else None,
                        consumer_name=consumer_name,
                        subscription_name=subscription,
                        subscription_type=int(subscription_type),
                    ),
                )
                if sub.cursor_dirty:  # a new subscription remembers where it started
                    await sub.flush_cursor()
            except BaseException:
                sub.remove_consumer(consumer, reason="subscribe failed")
                raise
            return consumer

    def _cursor_writer(self, subscription: str) -> Callable[[int], Awaitable[None]]:
        key = keys.subscription_cursor(self.name, subscription)

        async def write(cursor: int) -> None:
            await self._store.put(key, cursor)

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
        )

        async def write() -> None:
            try:
                await self._store.put(keys.topic_subscription(self.name, subscription), value)
            except Exception as exc:  # noqa: BLE001 - best effort, rewritten on next change
                log.warning("%s/%s: cannot record the active consumer: %s", self.path, subscription, exc)

        asyncio.get_running_loop().create_task(write())

    async def flush_cursors(self) -> None:
        """Store every changed subscription cursor (``docs/etcd-layout.md`` §3.5); errors are logged."""
        for sub in list(self.subscriptions.values()):
            try:
                await sub.flush_cursor()
            except Exception as exc:  # noqa: BLE001 - retried at the next flush
                log.warning("%s/%s: cursor flush failed: %s", self.path, sub.name, exc)

    async def close(self) -> None:
        """Close every subscription (storing cursors) and the WAL (synced)."""
        self.closed = True
        for sub in list(self.subscriptions.values()):
            try:
                await sub.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("%s/%s: close failed: %s", self.path, sub.name, exc)
        await self.wal.close()
