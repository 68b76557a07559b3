"""One topic served by this broker: its WAL, its producers and its subscriptions.

Producing (policy limits, rates, validation, idempotent appends) is here; the subscriptions
are :class:`~broker.topics.subscriptions.TopicSubscriptions` (``Topic.subscriptions``).
"""

from __future__ import annotations

import asyncio
import logging

from danube_pipeline.format.batches import BatchHeader, batch_payloads, parse_header, validate_batch
from danube_pipeline.errors import DanubeError, PolicyLimitError, SchemaMismatchError
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.protocols import MetadataReader, MetadataWriter
from danube_pipeline.modes import DeliveryMode
from danube_pipeline.names import TopicName

from broker import metrics
from broker.config import (
    DEFAULT_MAX_BATCH_BYTES,
    DEFAULT_MAX_CONSUMER_BUFFER_BYTES,
    DEFAULT_SUBSCRIPTION_IDLE_S,
)
from broker.topics.producer_sequences import ProducerSequences
from broker.storage.memory_log import MemoryLog
from broker.cluster.ownership import Ownership
from broker.replication.owner import ReplicaTracker
from broker.topics.producer import Producer
from broker.topics.rate_limit import RateLimiter
from broker.storage.remote import RemoteLog
from broker.dispatch.read_position import BELOW_RETENTION_EARLIEST, UNAVAILABLE_WAIT, earliest_offset
from broker.tasks import BackgroundWrites
from broker.storage.wal import WriteAheadLog
from broker.topics.subscriptions import TopicSubscriptions

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
        subscriptions: the loaded subscriptions by name
            (:class:`~broker.topics.subscriptions.TopicSubscriptions`).
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
        self.subscriptions = TopicSubscriptions(
            self, store=store, cache=cache, background=background, cursor_flush_acks=cursor_flush_acks
        )
        self._cache = cache
        self.max_batch_bytes = max_batch_bytes
        self.max_consumer_buffer_bytes = max_consumer_buffer_bytes
        self.subscription_idle_s = subscription_idle_s
        self._policy_key = keys.namespace_policy(name.namespace)
        self._topic_policy_key = keys.topic_policy(name)
        self._policy_raw: tuple[object, object] = (None, None)
        self._policy: values.NamespacePolicy | None = None
        self.closed = False
        self.ownership: Ownership | None = None  # set by the broker: owner epoch and reserved offsets
        self.replication: ReplicaTracker | None = None  # set by the loader at a replication factor above 1
        self.sequences = ProducerSequences(name.path)
        self.publish_limiter = RateLimiter(self.max_publish_rate, name=f"{name.path} publish")
        self.dispatch_limiters: dict[str, RateLimiter] = {}
        self.metrics = metrics.active().topic(name.path)  # bound once: the produce path only increments

    @property
    def path(self) -> str:
        """``/ns/topic``."""
        return self.name.path

    @property
    def earliest_offset(self) -> int:
        """The earliest offset a subscription can read
        (:func:`broker.dispatch.read_position.earliest_offset`)."""
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
            policy, problems = values.merged_policy(*raw)
            for problem in problems:
                log.warning("%s: %s", self.path, problem)
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
                    self.metrics.schema_validated(False)
                    raise SchemaMismatchError(schema.subject, schema.schema_id, f"message {i}: {exc}") from exc
            self.metrics.schema_validated(True)
        return header

    def publish(self, producer: Producer, batch: bytes) -> asyncio.Future[tuple[int, int]]:
        """Validate and enqueue one record batch; its offsets are assigned now, in call order.

        Returns:
            A future of ``(first_offset, last_offset)`` resolving after the WAL sync (for a
            ``NonReliable`` topic: once the batch is in memory, :mod:`broker.storage.memory_log`);
            on a replicated topic, once the high watermark passed the batch as well
            (:meth:`ReplicaTracker.replicated`; a resend of a written batch waits the same way).

        Raises:
            MalformedRequestError, MessageTooLargeError, SchemaMismatchError: see
                :meth:`validate`; nothing is written then.
            DuplicateSequenceError: the batch's sequence numbers were written already, not as
                this batch (:mod:`broker.topics.producer_sequences`); a resend of a remembered batch gets
                the offsets it was written at instead.
            NotEnoughReplicasError: a replicated topic's ISR is below ``min_insync_replicas``
                (``docs/etcd-layout.md`` §2.1, §5.9); nothing is written (retriable).
        """
        header = self.validate(producer, batch)
        replication = self.replication
        written = self.sequences.check(header)
        if written is not None:  # a resend of a batch written already (idempotent produce)
            return written if replication is None else replication.replicated(written)
        if replication is not None:
            replication.check_produce()
        first_offset = self.wal.next_offset
        future = self.wal.enqueue(batch, header.record_count)
        self.sequences.record(header, future, first_offset)
        producer.sent_messages += header.record_count
        self.metrics.produced(header.record_count, len(batch), future)
        return future if replication is None else replication.replicated(future)

    async def close(self) -> None:
        """Close every subscription (storing cursors), the replica tracker (producers still
        waiting for followers get the retriable ``NotEnoughReplicasError``) and the WAL (synced)."""
        self.closed = True
        if self.replication is not None:
            await self.replication.close()
        await self.subscriptions.close()
        if self.remote is not None:
            self.remote.close()
        await self.wal.close()


def _rate(value: object) -> int:
    """A policy rate in messages per second; anything but a positive integer is 0 (unlimited)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
