"""The Danube Pipeline client: a small public facade over a private wire layer.

Usage::

    async with DanubeClient(["127.0.0.1:6650"]) as client:
        async with client.producer("/default/flights", producer_name="loader") as producer:
            offset = await producer.send(b"hello", attributes={"k": "v"})
        async with client.consumer("/default/flights", subscription="s",
                                   initial_position=InitialPosition.EARLIEST) as consumer:
            async for message in consumer:
                await consumer.ack(message)

A broker serving TLS: ``DanubeClient([...], tls_ca_file="ca.pem")``, with
``tls_cert_file``/``tls_key_file`` for a client certificate and ``token=`` for a bearer token
(or the ``DANUBE_TLS_*`` and ``DANUBE_TOKEN_FILE`` variables, :mod:`danube_pipeline.settings`).

Layout (nats.py / aiokafka style): this module, :mod:`.producer`,
:mod:`.consumer`, :mod:`.admin`, :mod:`.types` and :mod:`.status` (gRPC status to
:class:`~danube_pipeline.errors.DanubeError`) are public; ``_connection`` (channel pool),
``_metadata`` (broker map and topic owners), ``_accumulator`` (batching), ``_redelivery``
(subscription settings and ack ranges in wire form) and ``_context`` (the shared retry loop)
are private. Generated protobuf types never leave the client.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from danube_pipeline import settings
from danube_pipeline.client._connection import ChannelSecurity, ConnectionPool
from danube_pipeline.client._context import Context
from danube_pipeline.client._metadata import ClusterMetadata
from danube_pipeline.client.admin import AdminClient
from danube_pipeline.client.consumer import Consumer, start_publish_time_us_of
from danube_pipeline.client.producer import Producer
from danube_pipeline.client.schemas import SchemaClient
from danube_pipeline.client.types import (
    AvroSchema,
    BrokerAddress,
    BrokerInfo,
    ClusterInfo,
    DeliveryMode,
    InitialPosition,
    JsonSchema,
    Message,
    MessageId,
    ProtobufSchema,
    Schema,
    SchemaInfo,
    SegmentInfo,
    SubscriptionType,
    TopicInfo,
    TopicSchemaPolicy,
)
from danube_pipeline.errors import ConsumerClosedError, ProducerClosedError
from danube_pipeline.names import TopicName

__all__ = [
    "AdminClient",
    "AvroSchema",
    "BrokerAddress",
    "BrokerInfo",
    "ClusterInfo",
    "Consumer",
    "ConsumerClosedError",
    "DanubeClient",
    "DeliveryMode",
    "InitialPosition",
    "JsonSchema",
    "Message",
    "MessageId",
    "Producer",
    "ProducerClosedError",
    "ProtobufSchema",
    "Schema",
    "SchemaClient",
    "SchemaInfo",
    "SegmentInfo",
    "SubscriptionType",
    "TopicInfo",
    "TopicSchemaPolicy",
]


class DanubeClient:
    """Entry point: owns the channel pool and the cluster metadata. An async context manager.

    Entering the context bootstraps the broker map from ``bootstrap_addresses``; leaving it
    closes every producer (flushing) and consumer it created, then every channel.

    Args:
        bootstrap_addresses: ``"host:port"`` brokers used only to learn the broker map; after
            that the client talks to brokers by id (Kafka's ``bootstrap.servers``). A single
            string may hold several addresses separated by commas.
        request_timeout_ms: deadline of each unary RPC, in milliseconds.
        metadata_retries: how many more metadata passes (and owner-call attempts) follow a
            failed first one. A pass tries every known broker once (connected first); a
            pass over the bootstrap addresses, made when every known broker failed, counts as one.
        retry_backoff_ms: sleep between passes and attempts, in milliseconds.
        tls_ca_file: PEM CA bundle verifying the brokers' certificates; TLS is on when this or
            a client certificate is given. Default ``DANUBE_TLS_CA_FILE`` (with
            ``DANUBE_TLS_CERT_FILE`` and ``DANUBE_TLS_KEY_FILE``) when none of the three
            ``tls_*`` arguments is given, else plaintext.
        tls_cert_file: PEM client certificate chain for mutual TLS, with ``tls_key_file``.
        tls_key_file: its PEM private key.
        token: a bearer token sent as ``authorization: Bearer <token>`` on every call; default
            the content of the file ``DANUBE_TOKEN_FILE`` names, else none.

    Raises:
        ValueError: no bootstrap address, a non-positive timeout or negative retry option,
            only one of ``tls_cert_file`` and ``tls_key_file``, or an empty token.
        OSError: a TLS or token file cannot be read.
    """

    def __init__(
        self,
        bootstrap_addresses: Sequence[str],
        *,
        request_timeout_ms: int = 30_000,
        metadata_retries: int = 3,
        retry_backoff_ms: int = 200,
        tls_ca_file: str | Path | None = None,
        tls_cert_file: str | Path | None = None,
        tls_key_file: str | Path | None = None,
        token: str | None = None,
    ) -> None:
        if isinstance(bootstrap_addresses, str):
            bootstrap_addresses = bootstrap_addresses.split(",")
        if tls_ca_file is None and tls_cert_file is None and tls_key_file is None:
            tls_ca_file, tls_cert_file, tls_key_file = settings.client_tls_files()
        if token is None:
            token = settings.client_token()
        security = ChannelSecurity.from_files(
            tls_ca_file=tls_ca_file, tls_cert_file=tls_cert_file, tls_key_file=tls_key_file, token=token
        )
        pool = ConnectionPool(security=security)
        metadata = ClusterMetadata(
            pool,
            bootstrap_addresses,
            request_timeout_ms=request_timeout_ms,
            metadata_retries=metadata_retries,
            retry_backoff_ms=retry_backoff_ms,
        )
        self._pool = pool
        self._metadata = metadata
        self._ctx = Context(
            pool=pool,
            metadata=metadata,
            request_timeout_s=request_timeout_ms / 1000,
            retries=metadata_retries,
            backoff_s=retry_backoff_ms / 1000,
        )
        self._admin = AdminClient(self._ctx)
        self._schemas = SchemaClient(self._ctx)
        self._closed = False

    async def __aenter__(self) -> DanubeClient:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def connect(self) -> None:
        """Bootstrap the broker map from the bootstrap addresses.

        Raises:
            BrokerUnavailableError: no bootstrap address answered in ``1 + metadata_retries`` passes.
            AuthenticationError: a broker refused the token or certificate (raised at once, not
                retried).
            PermissionDeniedError: the principal may not call ``ClusterMetadata`` (at once).
        """
        await self._metadata.refresh()

    def producer(
        self,
        topic: str,
        *,
        producer_name: str,
        schema: Schema | None = None,
        linger_ms: int = 0,
        max_batch_messages: int = 1000,
        max_batch_bytes: int = 1 << 20,
        max_in_flight_batches: int = 8,
    ) -> Producer:
        """A producer for ``topic``; open it with ``async with`` (or ``await p.open()``).

        Args:
            topic: ``"/{namespace}/{topic}"``; created on open if it does not exist. A
                partitioned topic (``docs/etcd-layout.md`` §3.1) gets one inner producer per
                partition: a message with a ``key`` goes to the partition of the key's murmur2
                hash (Kafka's default partitioner), one without goes round-robin.
            producer_name: ``[A-Za-z0-9_-]{1,128}``.
            schema: an :class:`AvroSchema`, :class:`JsonSchema` or :class:`ProtobufSchema`
                registered on open; the broker checks every payload against it. Without one,
                the producer is refused on a topic that has a schema subject, unless the topic
                allows raw messages (``admin.set_topic_schema_policy``).
            linger_ms: how long a batch waits for more messages, in milliseconds; 0 (the
                default) sends a batch as soon as an in-flight slot is free, so batches grow
                only under load.
            max_batch_messages: messages per batch, at most.
            max_batch_bytes: payload and attribute bytes per batch, at most.
            max_in_flight_batches: batches sent but not yet acknowledged, at most.

        Returns:
            An unopened :class:`Producer`.

        Raises:
            InvalidNameError: ``topic`` or ``producer_name`` is malformed.
            ValueError: a size or count option is not positive.
        """
        return Producer(
            self._ctx,
            topic,
            producer_name=producer_name,
            schema=schema,
            linger_ms=linger_ms,
            max_batch_messages=max_batch_messages,
            max_batch_bytes=max_batch_bytes,
            max_in_flight_batches=max_in_flight_batches,
        )

    def consumer(
        self,
        topic: str,
        *,
        subscription: str,
        subscription_type: SubscriptionType = SubscriptionType.EXCLUSIVE,
        consumer_name: str | None = None,
        initial_position: InitialPosition = InitialPosition.LATEST,
        receiver_queue_size: int = 1000,
        ack_batch_size: int = 500,
        ack_flush_ms: int = 100,
        ack_timeout_ms: int | None = None,
        nack_redelivery_delay_ms: int | None = None,
        nack_redelivery_max_delay_ms: int | None = None,
        max_redeliveries: int | None = None,
        dead_letter_topic: str | None = None,
        start_publish_time_us: int | None = None,
        start_publish_time: datetime.datetime | None = None,
    ) -> Consumer:
        """A consumer of ``subscription`` on ``topic``; open it with ``async with``.

        Args:
            topic: ``"/{namespace}/{topic}"``; must exist. On a partitioned topic the
                consumer subscribes to every partition under ``subscription`` and merges
                their messages (each names its partition; acks go back to it).
            subscription: the subscription name; its cursor lives on the broker.
            subscription_type: Exclusive, Shared, Failover or Key_Shared. Key_Shared sends
                all messages of one ``key`` (given on ``send``) to one consumer, in order;
                messages without a key count as the empty key. Keys move between consumers
                when consumers join or leave, and a key's new consumer gets its messages only
                after the old one acknowledged those it had.
            consumer_name: defaults to ``consumer-<random hex>``.
            initial_position: where a new subscription starts.
            start_publish_time_us: a new subscription (one without a stored cursor) starts at
                the first message published at or after this time, in µs since the Unix epoch,
                instead of at ``initial_position`` (the broker finds it in the topic's table,
                objects or WAL; ``docs/etcd-layout.md`` §3.5). An existing subscription resumes
                at its cursor.
            start_publish_time: the same as a timezone-aware ``datetime`` (a naive one is
                refused); give one of the two.
            receiver_queue_size: unacked messages the broker may have outstanding to this
                consumer. Once that many are delivered and not acked, the broker sends no
                more until some are acked, so a consumer that never acks stops receiving. On a
                partitioned topic, per partition.
            ack_batch_size: acks buffered before they are sent.
            ack_flush_ms: longest time an ack stays buffered, in milliseconds.
            ack_timeout_ms: the subscription redelivers a message unacknowledged this many
                milliseconds after it was sent (``redelivery_count + 1``); 0 = never.
            nack_redelivery_delay_ms: a message :meth:`Consumer.nack`-ed is redelivered after
                this many milliseconds, doubled for each earlier redelivery (default 60,000).
            nack_redelivery_max_delay_ms: the cap of that backoff (default 600,000).
            max_redeliveries: a message is delivered at most ``1 + max_redeliveries`` times;
                then it is published to the dead-letter topic and acknowledged. 0 = unlimited.
            dead_letter_topic: ``"/{namespace}/{topic}"`` of the dead-letter topic; default
                ``"{topic}-{subscription}-DLQ"``. Its messages carry the original key,
                payload and attributes plus ``danube.dlq.topic``, ``danube.dlq.offset``,
                ``danube.dlq.subscription``, ``danube.dlq.reason`` and
                ``danube.dlq.redelivery_count``.

            The five redelivery settings belong to the subscription (stored in its etcd value,
            ``docs/etcd-layout.md`` §3.4): a consumer that gives any of them replaces them all
            (those not given take their defaults) for every consumer of the subscription; one
            that gives none keeps them.

        Returns:
            An unopened :class:`Consumer`.

        Raises:
            InvalidNameError: a name is malformed.
            ValueError: a size or interval option is not positive, or a redelivery setting is
                negative (a time over 7 days too), or a start publish time is negative, naive,
                or given twice.
        """
        return Consumer(
            self._ctx,
            topic,
            subscription=subscription,
            subscription_type=subscription_type,
            consumer_name=consumer_name,
            initial_position=initial_position,
            receiver_queue_size=receiver_queue_size,
            ack_batch_size=ack_batch_size,
            ack_flush_ms=ack_flush_ms,
            ack_timeout_ms=ack_timeout_ms,
            nack_redelivery_delay_ms=nack_redelivery_delay_ms,
            nack_redelivery_max_delay_ms=nack_redelivery_max_delay_ms,
            max_redeliveries=max_redeliveries,
            dead_letter_topic=dead_letter_topic,
            start_publish_time_us=start_publish_time_us_of(start_publish_time_us, start_publish_time),
        )

    @property
    def admin(self) -> AdminClient:
        """Administrative calls (topics, sealed segments, cluster metadata)."""
        return self._admin

    @property
    def schemas(self) -> SchemaClient:
        """Schema registry calls (register, get, set a subject's compatibility mode)."""
        return self._schemas

    async def lookup_topic(self, topic: str) -> BrokerAddress:
        """The broker that serves ``topic`` (cached; refreshed on demand).

        Concurrent lookups share one metadata refresh.

        Raises:
            InvalidNameError: the name is malformed.
            TopicNotFoundError: the topic does not exist.
            PartitionedTopicError: the topic is partitioned: it has no owner, each of its
                partitions ``{topic}-part-{i}`` has one (``partitions`` is the count).
            BrokerUnavailableError: every metadata pass failed.
        """
        return await self._metadata.lookup(TopicName.parse(topic).path)

    async def close(self) -> None:
        """Close every producer (after flushing) and consumer, then every channel.

        Safe to call twice.
        """
        if self._closed:
            return
        self._closed = True
        children = list(self._ctx.children)
        errors: list[BaseException] = []
        for child in itertools.chain(
            (c for c in children if isinstance(c, Producer)),
            (c for c in children if not isinstance(c, Producer)),
        ):
            try:
                await child.close()
            except Exception as exc:  # keep closing the others
                errors.append(exc)
        await self._ctx.produce_streams.close()
        await self._metadata.close()
        await self._pool.close()
        if errors:
            raise errors[0]
