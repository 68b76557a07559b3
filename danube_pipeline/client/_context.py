"""What producers, consumers and the admin client share: the pool, the metadata, the retry policy.

:meth:`Context.call_owner` is the one retry loop for calls addressed to a topic's owner: it
reads the ``retriable`` / ``invalid_metadata`` flags of the error (aiokafka's pattern) and
refreshes the topic lookup through :class:`~danube_pipeline.client._metadata.ClusterMetadata`
when the flags say the client's view is stale.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from danube_pipeline.client._connection import ConnectionPool, Stubs
from danube_pipeline.client._metadata import ClusterMetadata
from danube_pipeline.client._produce_stream import ProduceStreams
from danube_pipeline.client.status import rpc_errors, unavailable
from danube_pipeline.errors import (
    BrokerUnavailableError,
    DanubeError,
    TopicNotFoundError,
)
from danube_pipeline.modes import DeliveryMode
from danube_pipeline.proto import danube_pb2 as pb

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Context:
    """Shared state of one :class:`~danube_pipeline.client.DanubeClient`.

    Attributes:
        pool: one channel per broker address.
        metadata: the broker map and topic-owner cache.
        request_timeout_s: deadline of unary RPCs, in seconds.
        retries: extra attempts after the first (``metadata_retries``).
        backoff_s: sleep between attempts, in seconds.
        children: open producers and consumers, closed with the client.
        produce_streams: the producers' shared ``ProduceStream`` per broker.
    """

    pool: ConnectionPool
    metadata: ClusterMetadata
    request_timeout_s: float
    retries: int
    backoff_s: float
    children: set[Any] = field(default_factory=set)
    produce_streams: ProduceStreams = field(default_factory=ProduceStreams)

    async def call_owner(
        self,
        topic: str,
        fn: Callable[[Stubs], Awaitable[T]],
        *,
        refresh: bool = False,
        create_missing: bool = False,
    ) -> T:
        """Run ``fn`` against the broker that serves ``topic``, retrying on stale metadata.

        Makes at most ``1 + retries`` attempts (creating a missing topic is not one). An error
        whose ``invalid_metadata`` is true
        refreshes the topic lookup before the next attempt; one that is only ``retriable``
        retries the same broker; any other error is raised at once.

        Args:
            topic: ``"/{namespace}/{topic}"``.
            fn: the call, given the owner's stubs; raise ``grpc.aio.AioRpcError`` freely.
            refresh: skip the cached owner on the first attempt.
            create_missing: create the topic (``Admin.CreateTopic`` on any broker) when the
                lookup says it does not exist.

        Returns:
            What ``fn`` returned.

        Raises:
            TopicNotFoundError: the topic does not exist (and ``create_missing`` is false, or
                it still does not resolve after being created).
            PartitionedTopicError: the topic is partitioned (no owner; its partitions have).
            BrokerUnavailableError: the metadata refresh ran out of passes.
            DanubeError: a non-retriable error from the broker, or the last retriable one.
        """
        last: DanubeError | None = None
        created = False
        attempts = 1 + self.retries
        attempt = 0
        while attempt < attempts:
            if attempt:
                await asyncio.sleep(self.backoff_s)
            attempt += 1
            try:
                owner = await self.metadata.lookup(topic, refresh=refresh)
            except TopicNotFoundError as exc:
                if not create_missing:
                    raise
                last, refresh = exc, True
                if not created:
                    # Creating the topic is not a failed attempt: look it up again at once.
                    await self.create_topic(topic)
                    created = True
                    attempt -= 1
                continue
            stubs = self.pool.stubs(owner.address)
            try:
                with rpc_errors(owner.address):
                    return await fn(stubs)
            except DanubeError as exc:
                if not (exc.retriable or exc.invalid_metadata):
                    raise
                log.info("retrying %s on %s after %s", topic, owner.address, exc)
                last = exc
                if isinstance(exc, BrokerUnavailableError):
                    self.pool.discard(owner.address, stubs)
                refresh = exc.invalid_metadata
                if refresh:
                    self.metadata.invalidate(topic)
        assert last is not None
        raise last

    async def call_any(self, fn: Callable[[Stubs], Awaitable[T]]) -> T:
        """Run ``fn`` on any broker: connected ones first, the next one if a broker is down.

        Args:
            fn: the call, given a broker's stubs.

        Returns:
            What ``fn`` returned.

        Raises:
            BrokerUnavailableError: no known broker answered in ``1 + retries`` attempts.
            DanubeError: a non-retriable error from the broker.
        """
        last: DanubeError | None = None
        for attempt in range(1 + self.retries):
            if attempt:
                await asyncio.sleep(self.backoff_s)
                await self.metadata.refresh()
            elif not self.metadata.brokers:
                await self.metadata.refresh()
            for broker in self.metadata.ordered_brokers():
                stubs = self.pool.stubs(broker.address)
                try:
                    with rpc_errors(broker.address):
                        return await fn(stubs)
                except DanubeError as exc:
                    if not exc.retriable:
                        raise
                    last = exc
                    if isinstance(exc, BrokerUnavailableError):
                        self.pool.discard(broker.address, stubs)
        raise last if last is not None else unavailable("", "no broker known")

    async def create_topic(
        self, topic: str, *, delivery: DeliveryMode = DeliveryMode.RELIABLE, partitions: int = 0
    ) -> bool:
        """``Admin.CreateTopic`` on any broker; the topic's owner is assigned by the cluster.

        Args:
            topic: ``"/{namespace}/{topic}"``.
            delivery: the delivery mode (of every partition, for a partitioned topic).
            partitions: 0 for a plain topic; N > 0 for a partitioned topic whose N partitions
                ``{topic}-part-{i}`` are created and assigned one by one.

        Returns:
            True if the topic was created, false if it already existed.

        Raises:
            BrokerUnavailableError: no broker answered.
            DanubeError: the broker refused (e.g. ``InvalidNameError``).
        """

        # One request id for every attempt: a retry after an attempt that did create the topic
        # (its answer lost) still answers created = true from the same broker.
        request = pb.CreateTopicRequest(
            topic=topic, delivery=delivery.name, request_id=uuid.uuid4().hex, partitions=partitions
        )

        async def create(stubs: Stubs) -> bool:
            response = await stubs.admin.CreateTopic(request, timeout=self.request_timeout_s)
            return bool(response.created)

        created = await self.call_any(create)
        self.metadata.invalidate(topic)
        return created
