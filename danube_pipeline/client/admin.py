"""The admin facade: topics, sealed WAL segments and cluster metadata.

Every per-topic call goes to the broker that owns the topic (looked up through the cluster
metadata) and is retried there after a refresh when the broker answers with an
``invalid_metadata`` error. The calls themselves live in
:mod:`~danube_pipeline.client._topic_admin` (topics and subscriptions) and
:mod:`~danube_pipeline.client._segment_admin` (sealed segments).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from danube_pipeline.client import _segment_admin, _topic_admin
from danube_pipeline.client._context import Context
from danube_pipeline.client.status import rpc_errors
from danube_pipeline.client.types import (
    ClusterInfo,
    LocalRetentionResult,
    SegmentInfo,
    TopicDescription,
    TopicInfo,
    TopicSchemaPolicy,
)
from danube_pipeline.modes import DeliveryMode
from danube_pipeline.names import TopicName
from danube_pipeline.partitions import partition_names
from danube_pipeline.proto import danube_pb2 as pb


class AdminClient:
    """Administrative calls. Obtain it as :attr:`DanubeClient.admin`."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx

    async def create_topic(
        self, topic: str, *, delivery: DeliveryMode = DeliveryMode.RELIABLE, partitions: int = 0
    ) -> bool:
        """Create a topic; the cluster assigns its owner.

        Sent to any broker (connected ones first): a topic that does not exist has no owner.

        Args:
            topic: ``"/{namespace}/{topic}"``.
            delivery: the topic's delivery mode (``docs/etcd-layout.md`` §3.2).
            partitions: 0 (the default) for a plain topic; N > 0 for a partitioned topic: its
                root holds N (§3.1) and its N partitions ``{topic}-part-{i}`` are plain topics,
                each assigned its own owner (created and assigned before this returns).
                Producers and consumers of the client handle a partitioned topic by themselves.

        Returns:
            True if created, False if it already existed (a partitioned topic keeps its own
            partition count; partitions missing after an earlier failed creation are created).

        Raises:
            InvalidNameError: the name, or a partition's, is malformed (checked before sending),
                or a partition's name is taken by an existing topic.
            MalformedRequestError: ``partitions`` is negative or above
                :data:`~danube_pipeline.partitions.MAX_PARTITIONS` (checked before sending).
            BrokerUnavailableError: no broker answered.
            DanubeError: another refusal from the broker.
        """
        name = TopicName.parse(topic)
        if partitions:
            partition_names(name, partitions)  # the count and every name, before anything is sent
        return await self._ctx.create_topic(name.path, delivery=DeliveryMode(delivery), partitions=partitions)

    async def topic_partitions(self, topic: str) -> int:
        """The topic's partition count (``docs/etcd-layout.md`` §3.1), from a lookup.

        Returns:
            N > 0 for a partitioned topic (its partitions are ``{topic}-part-{i}``), 0 for a
            plain topic.

        Raises:
            InvalidNameError: the name is malformed.
            TopicNotFoundError: the topic does not exist.
            BrokerUnavailableError: every metadata pass failed.
        """
        return await _topic_admin.topic_partitions(self._ctx, topic)

    async def list_topics(self, namespace: str = "") -> list[TopicInfo]:
        """Topics of one namespace, or of all namespaces.

        Asks every known broker (each reports the topics it serves) and merges the answers;
        when two brokers list the same topic, the entry with the higher ``next_offset`` wins.

        Args:
            namespace: e.g. ``"default"``; empty for every namespace.

        Returns:
            Topics sorted by name.

        Raises:
            InvalidNameError: ``namespace`` is malformed.
            BrokerUnavailableError: a broker did not answer, or none is known.
            DanubeError: another refusal from a broker.
        """
        return await _topic_admin.list_topics(self._ctx, namespace)

    async def list_sealed_segments(self, topic: str) -> list[SegmentInfo]:
        """Sealed (immutable) WAL segments of a topic, ascending by ``start_offset``.

        Raises:
            InvalidNameError: the name is malformed.
            TopicNotFoundError: the topic does not exist.
            BrokerUnavailableError: the owner could not be reached within the retry budget.
        """
        return await _segment_admin.list_sealed_segments(self._ctx, topic)

    async def seal_active_segment(self, topic: str) -> SegmentInfo | None:
        """Seal the topic's active WAL segment now.

        Returns:
            The newly sealed segment, or ``None`` if the active segment was empty.

        Raises:
            InvalidNameError: the name is malformed.
            TopicNotFoundError: the topic does not exist.
            BrokerUnavailableError: the owner could not be reached within the retry budget.
        """
        return await _segment_admin.seal_active_segment(self._ctx, topic)

    async def apply_local_retention(
        self, topic: str, *, retention_bytes: int | None = None, retention_ms: int | None = None
    ) -> LocalRetentionResult:
        """Apply the topic's local WAL retention now, on the broker that owns it.

        Only sealed segments whose object is verified in object storage (size and MD5 etag of
        a completed descriptor, ``docs/etcd-layout.md`` §5.1) are deleted, oldest first, while
        they fall outside the retention.

        Args:
            topic: ``/ns/topic``.
            retention_bytes: keep at most this many WAL bytes, for this call only (``0``: only
                the active segment stays); ``None`` = the topic's override (§3.6) or the
                broker's ``--local-retention-bytes``.
            retention_ms: delete such segments sealed longer ago than this, in milliseconds,
                for this call only; ``None`` = the configured value.

        Returns:
            A :class:`LocalRetentionResult`.

        Raises:
            InvalidNameError: the name is malformed.
            MalformedRequestError: a limit is negative.
            TopicNotFoundError: the topic does not exist.
            BrokerUnavailableError: the owner could not be reached within the retry budget.
        """
        return await _segment_admin.apply_local_retention(
            self._ctx, topic, retention_bytes=retention_bytes, retention_ms=retention_ms
        )

    async def describe_topic(self, topic: str) -> TopicDescription:
        """Where the topic's offsets live (WAL, object storage) and its loaded subscriptions.

        Raises:
            InvalidNameError: the name is malformed.
            TopicNotFoundError: the topic does not exist.
            BrokerUnavailableError: the owner could not be reached within the retry budget.
        """
        return await _topic_admin.describe_topic(self._ctx, topic)

    async def unload_topic(self, topic: str) -> int:
        """Release the topic from its owner; the leader assigns it to another broker
        (``docs/etcd-layout.md`` §1.5, §5.3). Producers and consumers follow it on their own.

        Returns:
            The first offset the next owner hands out.

        Raises:
            InvalidNameError: the name is malformed.
            TopicNotFoundError: the topic does not exist.
            BrokerUnavailableError: the owner could not be reached within the retry budget.
        """
        return await _topic_admin.unload_topic(self._ctx, topic)

    async def delete_topic(self, topic: str, *, force: bool = False) -> list[str]:
        """Delete the topic and everything it holds, on its owner.

        Deleted: the topic's etcd keys (``docs/etcd-layout.md`` §1.4, §1.5, §2.2, every key
        under ``/topics/{ns}/{topic}/`` (§3) and ``/danube-data/storage/topics/{ns}/{topic}/``
        (§5)), its WAL on the owner and the segments the owner kept from earlier releases,
        and its segment objects in object storage. Not deleted: its Iceberg table. The name
        can be created again afterwards; it starts at offset 0, and the next tiering renames
        the old table to ``{topic}__incarnation_{id}`` (kept for readers) and starts a new one.

        A partitioned topic (§3.1) is deleted through any broker, which deletes each partition
        ``{topic}-part-{i}`` through the partition's owner, then the topic's own keys.

        Nothing asks for confirmation. A retry after an answer that was lost finds the topic
        gone (``TopicNotFoundError``); a deletion that failed half-way (etcd or object storage
        down) leaves the topic existing, and deleting it again finishes the work.

        Args:
            topic: ``"/{namespace}/{topic}"``.
            force: delete even with producers or consumers connected: they are closed (their
                streams end; a client producer that keeps sending creates the topic again).

        Returns:
            The topics deleted: ``[topic]``, or the partitions of a partitioned topic.

        Raises:
            InvalidNameError: the name is malformed (checked before sending).
            TopicNotFoundError: the topic does not exist.
            TopicInUseError: producers or consumers are connected and ``force`` is false;
                ``producers`` and ``consumers`` say how many. Nothing of that topic was deleted
                (of a partitioned topic, the partitions before it were).
            BrokerUnavailableError: the owner could not be reached within the retry budget.
            DanubeError: another refusal from the broker (``MetadataStoreError`` when etcd
                was unreachable).
        """
        return await _topic_admin.delete_topic(self._ctx, topic, force=force)

    async def reset_cursor(
        self,
        topic: str,
        subscription: str,
        *,
        offset: int | None = None,
        earliest: bool = False,
        latest: bool = False,
        timestamp_ms: int | None = None,
    ) -> int:
        """Move a subscription's cursor, on the topic's owner: give exactly one position.

        Unacknowledged deliveries are dropped and the stored cursor (§3.5) becomes the new
        offset - 1 at once. Connected consumers' streams end and the client consumers
        subscribe again by themselves, continuing from the new offset; acks they buffered
        before the reset and send after it may still acknowledge offsets delivered again.

        Args:
            topic: ``"/{namespace}/{topic}"`` (a plain topic or one partition).
            subscription: an existing subscription of the topic.
            offset: the next offset to deliver, from the topic's earliest offset to its next
                offset (both included; see :meth:`describe_topic`).
            earliest: deliver from the earliest offset a subscription can read (object
                storage included).
            latest: deliver only messages published from now on.
            timestamp_ms: deliver from the first message published at or after this time, in
                milliseconds since the Unix epoch; searched in the owner's WAL: a time before
                the WAL's first message gives the earliest offset, one after the last message
                the next offset.

        Returns:
            The next offset the subscription delivers.

        Raises:
            MalformedRequestError: not exactly one position, or a negative ``offset`` or
                ``timestamp_ms`` (checked before sending).
            InvalidNameError: the topic or subscription name is malformed (checked before
                sending).
            TopicNotFoundError: the topic does not exist.
            PartitionedTopicError: the topic is partitioned: reset each partition.
            SubscriptionNotFoundError: the topic has no such subscription (§3.4).
            OffsetOutOfRangeError: ``offset`` is below the earliest offset or above the next
                one; ``earliest_offset`` and ``next_offset`` give the range.
            BrokerUnavailableError: the owner could not be reached within the retry budget.
            DanubeError: another refusal from the broker (``MetadataStoreError`` when the
                cursor could not be stored; retrying is safe).
        """
        return await _topic_admin.reset_cursor(
            self._ctx, topic, subscription, offset=offset, earliest=earliest, latest=latest, timestamp_ms=timestamp_ms
        )

    async def abandon_unavailable_range(self, topic: str, start_offset: int) -> int:
        """Give up waiting for the topic's unavailable range starting at ``start_offset``
        (``docs/etcd-layout.md`` §5.5): the offsets a failed broker held and nobody tiered are
        skipped by subscriptions (counted in ``skipped_unavailable``) and by tiering.

        Returns:
            How many offsets will never be delivered.

        Raises:
            InvalidNameError: the name is malformed.
            TopicNotFoundError: the topic does not exist.
            UnavailableRangeNotFoundError: no range starts at ``start_offset``.
            BrokerUnavailableError: the owner could not be reached within the retry budget.
        """
        return await _topic_admin.abandon_unavailable_range(self._ctx, topic, start_offset)

    async def set_topic_schema_policy(self, topic: str, *, allow_raw: bool) -> list[TopicSchemaPolicy]:
        """Set whether producers without a schema may publish to ``topic`` once it has a schema
        subject (``Admin.SetTopicSchemaPolicy``, ``docs/etcd-layout.md`` §3.7). Their messages
        carry schema id 0 and stay raw. Sent to any broker; on a partitioned topic, set on every
        partition.

        Args:
            topic: ``"/{namespace}/{topic}"``.
            allow_raw: true to accept producers without a schema, false to refuse them
                (``SchemaRequiredError``) once the topic has a subject.

        Returns:
            The settings now stored, one per topic written.

        Raises:
            InvalidNameError: the name is malformed.
            TopicNotFoundError: the topic does not exist.
            BrokerUnavailableError: no broker answered.
        """
        return await _topic_admin.set_topic_schema_policy(self._ctx, topic, allow_raw=allow_raw)

    async def drain_broker(self, address: str) -> list[str]:
        """Drain the broker at ``address``: it is marked ``draining``, releases every topic it
        owns (the leader assigns them elsewhere), and is marked ``drained`` (§1.3).

        Returns:
            The topics it released.

        Raises:
            BrokerUnavailableError: the broker could not be reached.
            MetadataStoreError: the broker could not write etcd.
        """
        stubs = self._ctx.pool.stubs(address)
        with rpc_errors(address):
            response = await stubs.admin.DrainBroker(pb.DrainBrokerRequest(), timeout=None)
        return list(response.topics)

    async def list_released_segments(self, topic: str) -> list[tuple[str, SegmentInfo]]:
        """Sealed segments of ``topic`` that brokers kept after releasing it (they are served
        until their objects are tiered), from every registered broker.

        Returns:
            ``(broker address, segment)`` pairs, ascending by start offset.

        Raises:
            InvalidNameError: the name is malformed.
            BrokerUnavailableError: the cluster metadata could not be read.
        """
        return await _segment_admin.list_released_segments(self._ctx, topic)

    async def read_segment(self, topic: str, start_offset: int, *, address: str | None = None) -> AsyncIterator[bytes]:
        """Stream the bytes of one sealed segment, in chunks of at most 1 MiB.

        Args:
            topic: ``"/{namespace}/{topic}"``.
            start_offset: the segment's first offset.
            address: read a segment the broker at this address kept after releasing the topic
                (:meth:`list_released_segments`) instead of one of the owner's.

        Yields:
            Consecutive chunks of the segment file (header included).

        Raises:
            SegmentNotFoundError: no sealed segment starts at ``start_offset``.
            CorruptRecordError: the chunks' byte positions are not contiguous.
            TopicNotFoundError: the topic does not exist.
            BrokerUnavailableError: the owner could not be reached.
        """
        chunks = _segment_admin.read_segment(self._ctx, topic, start_offset, address=address)
        async with contextlib.aclosing(chunks):  # closing this generator closes (cancels) the stream
            async for chunk in chunks:
                yield chunk

    async def read_segment_bytes(self, topic: str, start_offset: int, *, address: str | None = None) -> bytes:
        """The whole sealed segment as bytes (see :meth:`read_segment`).

        Raises:
            SegmentNotFoundError: no sealed segment starts at ``start_offset``.
            CorruptRecordError: the chunks' byte positions are not contiguous.
            TopicNotFoundError: the topic does not exist.
            BrokerUnavailableError: the owner could not be reached.
        """
        return b"".join([chunk async for chunk in self.read_segment(topic, start_offset, address=address)])

    async def cluster_metadata(self) -> ClusterInfo:
        """Refresh and return the cluster's brokers and leader.

        Joins a metadata refresh already in flight instead of starting a second one.

        Raises:
            BrokerUnavailableError: every metadata pass failed.
        """
        return await self._ctx.metadata.refresh()
