"""Cluster metadata: which brokers exist and which broker serves each topic.

The design follows what Kafka clients learned about cluster metadata (``bootstrap.servers``
in Kafka's Java client, ``bootstrap_servers`` in aiokafka):

* **Bootstrap addresses only bootstrap.** They are contacted only to fill the broker map (and
  again when every known broker has failed); the map is the one set of brokers, indexed by
  id, and a bootstrap address is never stored in it unless a broker registered under it.
* **One map.** :attr:`ClusterMetadata.brokers` is ``{broker_id: "host:port"}``, replaced by
  every successful ``Discovery.ClusterMetadata`` answer. There is no separate dead-address list.
* **Connected brokers first.** A pass tries brokers with a ready connection before the others.
* **One refresh in flight.** Every caller that needs fresh metadata joins the single
  :class:`asyncio.Task` running the refresh; topics asked for while it runs are looked up by
  it if it has not yet reached its lookups, otherwise by the next one. Never two at once.
* **A partitioned topic has no owner.** ``TopicLookup`` answers it with its partition count
  (``docs/etcd-layout.md`` §3.1); :meth:`ClusterMetadata.lookup` raises
  :class:`~danube_pipeline.errors.PartitionedTopicError` carrying the count (cached like an
  owner), which the producer and consumer take as the signal to work per partition.
* **A retry has one meaning.** A *pass* tries each candidate broker once, in order, until one
  answers. A refresh makes at most ``1 + metadata_retries`` passes, sleeping
  ``retry_backoff_ms`` between them. A pass goes over the known brokers; when the map is
  empty, or the previous pass found every known broker dead, the pass goes over the bootstrap
  addresses instead (re-bootstrap), which therefore costs one retry like any other pass.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
from collections.abc import Sequence

import grpc

from danube_pipeline.client._connection import ConnectionPool, Stubs
from danube_pipeline.client.status import (
    from_rpc_error,
    is_transport_failure,
    rpc_errors,
    unavailable,
)
from danube_pipeline.client._tasks import cancel_and_wait
from danube_pipeline.client.types import (
    BrokerAddress,
    ClusterInfo,
    _cluster_info_from_pb,
)
from danube_pipeline.errors import (
    AuthenticationError,
    BrokerUnavailableError,
    DanubeError,
    PartitionedTopicError,
    PermissionDeniedError,
)
from danube_pipeline.proto import danube_pb2 as pb

log = logging.getLogger(__name__)

_LookupResult = BrokerAddress | DanubeError


class _BrokerFailed(Exception):
    """A candidate broker did not give a usable answer; the pass moves to the next one."""

    def __init__(self, address: str, error: DanubeError, stubs: Stubs) -> None:
        super().__init__(address, error)
        self.address = address
        self.error = error
        self.stubs = stubs  # those of the failed call: its channel is dropped only while current


class ClusterMetadata:
    """The client's view of the cluster.

    Args:
        pool: the channel pool shared with producers, consumers and the admin client.
        bootstrap_addresses: ``"host:port"`` addresses used only to bootstrap :attr:`brokers`.
        request_timeout_ms: deadline of each discovery RPC, in milliseconds.
        metadata_retries: passes allowed after the first failed pass of a refresh.
        retry_backoff_ms: sleep between passes, in milliseconds.

    Raises:
        ValueError: if ``bootstrap_addresses`` is empty or an option is negative.
    """

    def __init__(
        self,
        pool: ConnectionPool,
        bootstrap_addresses: Sequence[str],
        *,
        request_timeout_ms: int,
        metadata_retries: int,
        retry_backoff_ms: int,
    ) -> None:
        bootstrap = [a.strip() for a in bootstrap_addresses if a and a.strip()]
        if not bootstrap:
            raise ValueError("at least one bootstrap broker address is required")
        if request_timeout_ms <= 0 or metadata_retries < 0 or retry_backoff_ms < 0:
            raise ValueError("request_timeout_ms must be > 0; metadata_retries and retry_backoff_ms >= 0")
        # Randomized so that clients started together contact different brokers first.
        random.shuffle(bootstrap)
        self._bootstrap: tuple[str, ...] = tuple(dict.fromkeys(bootstrap))
        self._pool = pool
        self._timeout_s = request_timeout_ms / 1000
        self._retries = metadata_retries
        self._backoff_s = retry_backoff_ms / 1000
        self.brokers: dict[int, str] = {}
        """The one broker map: ``{broker_id: "host:port"}``."""
        self.cluster: ClusterInfo | None = None
        """The last ``Discovery.ClusterMetadata`` answer, or ``None`` before bootstrap."""
        self._topics: dict[str, int] = {}
        self._partitioned: dict[str, int] = {}  # partitioned topic -> partition count
        self._wanted: set[str] = set()
        self._task: asyncio.Task[dict[str, _LookupResult]] | None = None
        self.refresh_count = 0
        """Refresh tasks started (concurrent callers share one; for tests)."""
        self.rpc_counts: collections.Counter[str] = collections.Counter()
        """Discovery RPCs sent, by method name (for tests)."""

    # ------------------------------------------------------------------ public

    async def lookup(self, topic: str, *, refresh: bool = False) -> BrokerAddress:
        """The broker serving ``topic``, from the cache or from a refresh.

        Args:
            topic: ``"/{namespace}/{topic}"``.
            refresh: ignore the cached answer (the caller saw ``invalid_metadata``).

        Returns:
            The owning broker's id and address.

        Raises:
            TopicNotFoundError: the cluster does not know the topic.
            PartitionedTopicError: the topic is partitioned: it has no owner, its partitions
                ``{topic}-part-{i}`` do (the error's ``partitions`` is the count).
            BrokerUnavailableError: every pass of the refresh failed.
            AuthenticationError: a broker refused the client's credentials (raised at once).
            PermissionDeniedError: a broker refused the principal ``ClusterMetadata`` (at once).
            DanubeError: another definite answer from the broker (e.g. ``InvalidNameError``).
        """
        if not refresh:
            count = self._partitioned.get(topic)
            if count is not None:
                raise PartitionedTopicError(topic, count)
            cached = self.cached(topic)
            if cached is not None:
                return cached
        while True:
            self._wanted.add(topic)
            results = await self._join_refresh()
            if topic in results:
                answer = results[topic]
                if isinstance(answer, DanubeError):
                    raise answer
                return answer
            # The shared refresh had already sent its lookups; the next one will carry ours.

    def cached(self, topic: str) -> BrokerAddress | None:
        """The cached owner of ``topic``, or ``None`` if unknown or its broker left the map."""
        broker_id = self._topics.get(topic)
        if broker_id is None:
            return None
        address = self.brokers.get(broker_id)
        return None if address is None else BrokerAddress(broker_id, address)

    def invalidate(self, topic: str) -> None:
        """Forget the cached owner (or partition count) of ``topic``."""
        self._topics.pop(topic, None)
        self._partitioned.pop(topic, None)

    async def refresh(self) -> ClusterInfo:
        """Refresh the broker map, joining a refresh already in flight.

        Returns:
            The cluster as the refresh saw it.

        Raises:
            BrokerUnavailableError: every pass failed.
            AuthenticationError: a broker refused the client's credentials (raised at once).
            PermissionDeniedError: a broker refused the principal ``ClusterMetadata`` (at once).
        """
        await self._join_refresh()
        assert self.cluster is not None
        return self.cluster

    async def any_broker(self) -> BrokerAddress:
        """A broker for requests that no topic owner serves (e.g. creating a topic).

        Prefers a connected broker, bootstrapping first if the map is empty.

        Raises:
            BrokerUnavailableError: the map is empty and bootstrapping failed.
        """
        if not self.brokers:
            await self.refresh()
        return self.ordered_brokers()[0]

    def ordered_brokers(self) -> list[BrokerAddress]:
        """Known brokers, connected ones first (no new connection while one is open), then by id."""
        return sorted(
            (BrokerAddress(i, a) for i, a in self.brokers.items()),
            key=lambda b: (self._pool.rank(b.address), b.broker_id),
        )

    async def close(self) -> None:
        """Cancel a refresh in flight."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            await cancel_and_wait(task)

    # ------------------------------------------------------------------ refresh

    async def _join_refresh(self) -> dict[str, _LookupResult]:
        task = self._task
        if task is None or task.done():
            self.refresh_count += 1
            task = asyncio.get_running_loop().create_task(self._refresh())
            task.add_done_callback(_retrieve)
            self._task = task
        # shield: a caller that gives up must not cancel the refresh the others wait for.
        return await asyncio.shield(task)

    async def _refresh(self) -> dict[str, _LookupResult]:
        try:
            return await self._refresh_passes()
        except BaseException:
            # Every caller waiting on this refresh receives the error; none of their topics may
            # linger in the wanted set and ride along in (and fail) later refreshes.
            self._wanted.clear()
            raise

    async def _refresh_passes(self) -> dict[str, _LookupResult]:
        failures: list[_BrokerFailed] = []
        from_bootstrap = not self.brokers
        passes = 1 + self._retries
        for attempt in range(passes):
            if attempt:
                await asyncio.sleep(self._backoff_s)
            if not self.brokers:
                from_bootstrap = True
            candidates = list(self._bootstrap) if from_bootstrap else [b.address for b in self.ordered_brokers()]
            results = await self._pass(candidates, failures, bootstrap=from_bootstrap)
            if results is not None:
                return results
            log.info(
                "metadata pass %d/%d over %s failed",
                attempt + 1,
                passes,
                "bootstrap addresses" if from_bootstrap else "known brokers",
            )
            # Every candidate failed: the next pass goes over the bootstrap addresses if this one
            # went over the known brokers, and back to the known brokers after a failed bootstrap.
            from_bootstrap = not from_bootstrap
        tried = ",".join(dict.fromkeys(f.address for f in failures))
        last = failures[-1].error if failures else None
        raise unavailable(
            tried or ",".join(self._bootstrap),
            f"no broker answered in {passes} metadata passes; last error: {last}",
        )

    async def _pass(
        self, candidates: list[str], failures: list[_BrokerFailed], *, bootstrap: bool
    ) -> dict[str, _LookupResult] | None:
        for address in candidates:
            try:
                return await self._ask(address, bootstrap=bootstrap)
            except _BrokerFailed as failed:
                if isinstance(failed.error, (AuthenticationError, PermissionDeniedError)):
                    # the broker answered: these credentials are refused, and another pass or
                    # broker would refuse them too
                    raise failed.error from failed
                failures.append(failed)
                if isinstance(failed.error, BrokerUnavailableError):
                    self._pool.discard(address, failed.stubs)
        return None

    async def _ask(self, address: str, *, bootstrap: bool) -> dict[str, _LookupResult]:
        stubs = self._pool.stubs(address)
        try:
            self.rpc_counts["ClusterMetadata"] += 1
            with rpc_errors(address):
                response = await stubs.discovery.ClusterMetadata(
                    pb.ClusterMetadataRequest(), timeout=self._timeout_s
                )
        except DanubeError as exc:
            raise _BrokerFailed(address, exc, stubs) from exc
        if not response.brokers:
            raise _BrokerFailed(address, unavailable(address, "ClusterMetadata listed no brokers"), stubs)
        self.brokers = {b.broker_id: b.broker_addr for b in response.brokers}
        self.cluster = _cluster_info_from_pb(response)
        if bootstrap:
            known = set(self.brokers.values())
            for address in self._bootstrap:
                if address not in known:
                    self._pool.discard(address)
        topics = sorted(self._wanted)
        answers = await asyncio.gather(*(self._lookup_one(stubs, t) for t in topics))
        results: dict[str, _LookupResult] = {}
        for topic, (answer, transport_failed) in zip(topics, answers, strict=True):
            if transport_failed:
                # this broker stopped answering mid-pass: try the next one
                assert isinstance(answer, DanubeError)
                raise _BrokerFailed(address, answer, stubs)
            # Any answer the broker gave, even a retriable error about this one topic (its
            # owner is gone), is this topic's result: other topics in the pass are unaffected,
            # and only this topic's caller decides whether to retry.
            results[topic] = answer
        self._wanted.difference_update(topics)
        for topic, answer in results.items():
            self._partitioned.pop(topic, None)
            if isinstance(answer, BrokerAddress):
                self._topics[topic] = answer.broker_id
            else:
                self._topics.pop(topic, None)
                if isinstance(answer, PartitionedTopicError):
                    self._partitioned[topic] = answer.partitions
        return results

    async def _lookup_one(self, stubs: Stubs, topic: str) -> tuple[_LookupResult, bool]:
        """One ``TopicLookup``: ``(answer, transport_failed)``.

        ``transport_failed`` is true when the broker asked did not answer at all (connection
        level), as opposed to answering with an error about the topic.
        """
        self.rpc_counts["TopicLookup"] += 1
        try:
            response = await stubs.discovery.TopicLookup(
                pb.TopicLookupRequest(topic=topic), timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            return from_rpc_error(exc, stubs.address), is_transport_failure(exc)
        if response.partitions:
            return PartitionedTopicError(topic, response.partitions), False
        self.brokers[response.broker_id] = response.broker_addr
        return BrokerAddress(response.broker_id, response.broker_addr), False


def _retrieve(task: asyncio.Task[object]) -> None:
    if not task.cancelled():
        task.exception()


__all__ = ["ClusterMetadata"]
