"""Producer and consumer sessions: what the producer and consumer services act on.

:class:`ProducerSessions` creates producers (their keys, §3.3, and the topic's schema
settings, §3.7), publishes and throttles their batches, and closes them (their keys then
expire). :class:`ConsumerSessions` subscribes consumers (§3.4), acknowledges and negatively
acknowledges offsets (§3.5), closes consumers and publishes dead letters, forwarding them to
the dead-letter topic's owner when that is another broker.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
from collections.abc import Collection, Iterable
from typing import Any

from danube_pipeline.errors import ConsumerNotFoundError, MetadataStoreError, NotServedHereError, ProducerNotFoundError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.modes import DeliveryMode, InitialPosition, SubscriptionType
from danube_pipeline.names import TopicName, validate_part
from danube_pipeline.schemas.registry import SchemaRegistry

from broker.cluster_view import ClusterView
from broker.config import BrokerConfig
from broker.dispatch.consumer import DEFAULT_RECEIVER_QUEUE_SIZE, Consumer
from broker.dispatch.dead_letter_forwarding import forward_dead_letter
from broker.dispatch.redelivery import RedeliverySettings
from broker.reconcile import Reconciler
from broker.topics.lifecycle import TopicLoader
from broker.topics.producer import Producer
from broker.topics.producer_expiry import ExpiringKeys
from broker.topics.schema_policy import check_producer_schema
from broker.topics.served import ServedTopics
from broker.topics.topic import Topic

__all__ = ["ConsumerSessions", "ProducerSessions"]

log = logging.getLogger(__name__)

_MAX_REMEMBERED_CLOSED_CONSUMERS = 10_000
_MAX_PUTS_PER_TXN = 100
"""Keys written per etcd transaction when many are closed at once (etcd's ``--max-txn-ops``
is 128 by default)."""


def _new_id(taken: Collection[int]) -> int:
    """A random non-zero u64 not in ``taken``."""
    while True:
        candidate = secrets.randbits(64)
        if candidate and candidate not in taken:
            return candidate


class ProducerSessions:
    """The open producers of one broker.

    Args:
        served: the topics served here.
        store: etcd, for the producers' keys.
        cache: the LocalCache, for the topics' schema settings.
        registry: the schema registry.
        loader: finds (or creates) the topic a producer publishes to.
        reconciler: started when a key could not be written.
        closed_keys: where closed producers' keys are written (they expire).

    Attributes:
        producers: the open producers by id.
        store, cache, registry: as given (what :func:`check_producer_schema` reads).
    """

    def __init__(
        self,
        served: ServedTopics,
        *,
        store: MetadataStore,
        cache: LocalCache,
        registry: SchemaRegistry,
        loader: TopicLoader,
        reconciler: Reconciler,
        closed_keys: ExpiringKeys,
    ) -> None:
        self._served = served
        self.store = store
        self.cache = cache
        self.registry = registry
        self._loader = loader
        self._reconciler = reconciler
        self._closed_keys = closed_keys
        self.producers: dict[int, Producer] = {}

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
        topic = await self._loader.topic_for(name, create=True, delivery=delivery)
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
        with self._reconciler.creating(producer.id):
            topic.pending_producers += 1
            try:
                await self.store.put(keys.topic_producer(name, producer.id), producer.metadata(status=True))
            except MetadataStoreError:
                self._reconciler.uncertain_write()  # etcd may apply the write later: the key is then closed
                raise
            finally:
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
        topic = self._served.served(producer.topic.path)
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

    def publish_unless_limited(self, producer_id: int, batch: bytes) -> asyncio.Future[tuple[int, int]] | None:
        """:meth:`publish`, unless the producer's topic has a ``max_publish_rate`` now (§2.1):
        then nothing is appended and ``None`` is returned, and the caller waits with
        :meth:`throttle_publish` before :meth:`publish`. One lookup of the producer serves both
        the check and the append.

        Raises:
            ProducerNotFoundError, NotServedHereError: see :meth:`served_producer`.
            MalformedRequestError, MessageTooLargeError, SchemaMismatchError: nothing written.
        """
        producer, topic = self.served_producer(producer_id)
        if topic.max_publish_rate() > 0:
            return None
        return topic.publish(producer, batch)

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

    async def close_topic_producers(self, topic: Topic) -> None:
        """Forget every producer of ``topic`` and mark its key closed (the topic is given up)."""
        for pid in [p for p, prod in self.producers.items() if prod.topic is topic]:
            await self._mark_closed(self.producers.pop(pid))

    async def close_all(self) -> None:
        """Forget every producer and mark their keys closed, many per etcd transaction; when
        etcd is unreachable, the next owner of their topics marks them closed."""
        closed: list[tuple[str, Any]] = [
            (keys.topic_producer(p.topic.name, p.id), p.metadata(status=False)) for p in self.producers.values()
        ]
        for producer in self.producers.values():
            producer.closed = True
        self.producers.clear()
        try:
            for start in range(0, len(closed), _MAX_PUTS_PER_TXN):
                await self._closed_keys.put_many(closed[start : start + _MAX_PUTS_PER_TXN])
        except MetadataStoreError as exc:
            log.warning("cannot mark producers closed (the next owner of their topics will): %s", exc)

    async def _mark_closed(self, producer: Producer) -> None:
        """Write the producer's key closed under the expiring lease now, or by reconciliation
        once etcd answers."""
        producer.closed = True
        key = keys.topic_producer(producer.topic.name, producer.id)
        try:
            await self._closed_keys.put(key, producer.metadata(status=False))
        except MetadataStoreError as exc:
            log.info("producer %d: closed here; its key is marked closed once etcd answers (%s)", producer.id, exc)
            self._reconciler.uncertain_write()


class ConsumerSessions:
    """The consumers of one broker, open ones and recently closed ones (for late acks).

    Args:
        served: the topics served here.
        config: the broker's configuration (``max_receiver_queue_size``).
        cache: the LocalCache, for stored redelivery settings.
        loader: finds (or creates) the topic of a subscription or a dead-letter topic.
        cluster: finds the owner of a dead-letter topic served elsewhere.
        reconciler: started when a subscription's keys could not be written.

    Attributes:
        consumers: consumers by id, oldest first.
    """

    def __init__(
        self,
        served: ServedTopics,
        config: BrokerConfig,
        *,
        cache: LocalCache,
        loader: TopicLoader,
        cluster: ClusterView,
        reconciler: Reconciler,
    ) -> None:
        self._served = served
        self._config = config
        self._cache = cache
        self._loader = loader
        self._cluster = cluster
        self._reconciler = reconciler
        self.consumers: collections.OrderedDict[int, Consumer] = collections.OrderedDict()

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
        """Attach a new consumer to a subscription of a topic served here (§3.4).

        A new subscription (no stored cursor) with ``start_publish_time_us`` (µs since the
        epoch) starts at the first offset published at or after it
        (:mod:`broker.storage.publish_time`), whatever ``initial_position``.

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
        topic = await self._loader.topic_for(name)
        window = min(receiver_queue_size or DEFAULT_RECEIVER_QUEUE_SIZE, self._config.max_receiver_queue_size)
        if settings is None:
            loaded = topic.subscriptions.get(subscription)
            settings = loaded.settings if loaded is not None else RedeliverySettings.from_stored(
                self._cache.get(keys.topic_subscription(name, subscription))
            )
        settings.dead_letter_topic_for(name.path, subscription)  # InvalidNameError for a too long default
        consumer = await topic.subscriptions.subscribe(
            subscription=subscription,
            subscription_type=subscription_type,
            consumer_id=_new_id(self.consumers.keys()),
            consumer_name=consumer_name,
            earliest=initial_position is InitialPosition.EARLIEST,
            start_publish_time_us=start_publish_time_us,
            receiver_queue_size=window,
            on_uncertain_write=self._reconciler.uncertain_write,
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
            topic = await self._loader.topic_for(name, create=True)
        except NotServedHereError:
            owner = await self._cluster.lookup(name)
            if owner.broker_id == self._served.broker_id:  # assigned here meanwhile: the next try loads it
                raise
            return await forward_dead_letter(owner.peer_address, name.path, producer_name, batch, config=self._config)
        producer = Producer(id=0, name=producer_name, access_mode=0, topic=topic)
        # Shielded: a cancelled caller must not cancel the write (the sequence state follows it).
        return await asyncio.shield(topic.publish(producer, batch))

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

    def detach_all(self, *, reason: str) -> None:
        """Detach every consumer of every topic served here (their ``Receive`` streams end)."""
        for topic in self._served.topics.values():
            for sub in topic.subscriptions.values():
                for consumer in list(sub.consumers):
                    sub.remove_consumer(consumer, reason=reason)

    def _remember_consumer(self, consumer: Consumer) -> None:
        self.consumers[consumer.id] = consumer
        while len(self.consumers) > _MAX_REMEMBERED_CLOSED_CONSUMERS:
            oldest_id, oldest = next(iter(self.consumers.items()))
            if not oldest.closed:
                self.consumers.move_to_end(oldest_id)
                break
            del self.consumers[oldest_id]
