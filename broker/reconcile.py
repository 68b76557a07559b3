"""Reconciling etcd with what this broker knows, after writes whose outcome is uncertain.

etcd may be unreachable at any time, and a write that timed out may still be applied by etcd
later. So when a creation or a close could not be written (``CreateProducer``, ``Subscribe``,
``CloseProducer`` failing with :class:`~danube_pipeline.errors.MetadataStoreError`), the broker
*reconciles* etcd with what it knows, every :data:`RECONCILE_INTERVAL_S` until
:data:`RECONCILE_PASSES` passes succeeded: a producer key of a topic served here that says
``status: true`` for a producer not open here is marked closed, and the keys of a subscription
whose first ``Subscribe`` failed are deleted unless it was created since. Closed producers' keys
expire on their own (:class:`broker.topics.producer_expiry.ExpiringKeys`, §3.3). Other writes that must happen
(the active consumer of a subscription) are retried by :class:`broker.tasks.BackgroundWrites`.

When a topic is loaded, the producer keys an earlier owner left open are marked closed too
(:meth:`Reconciler.close_stale_producers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Iterator

from danube_pipeline.errors import MetadataStoreError
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName

from broker.tasks import BackgroundWrites, spawn
from broker.topics.producer_expiry import ExpiringKeys
from broker.topics.served import ServedTopics
from broker.topics.topic import Topic

__all__ = ["CACHE_WAIT_S", "RECONCILE_INTERVAL_S", "RECONCILE_PASSES", "Reconciler"]

log = logging.getLogger(__name__)

RECONCILE_INTERVAL_S = 2.0
"""Pause between two reconciliation passes (see the module docstring)."""
RECONCILE_PASSES = 10
"""Successful passes made after the last uncertain write: late writes of etcd are caught too."""
CACHE_WAIT_S = 2.0
"""How long :meth:`Reconciler.close_stale_producers` waits for the cache to reach the takeover's
revision before it reads the producer keys from etcd instead."""


class Reconciler:
    """Marks closed the producer keys etcd may hold open by mistake, and drops subscriptions
    whose creation failed (module docstring).

    Args:
        served: the topics served here.
        store: etcd.
        cache: the broker's cache of etcd.
        closed_keys: where closed producers' keys are written (they expire).
        background: whose outage log counts failed passes.
    """

    def __init__(
        self, served: ServedTopics, *, store: MetadataStore, cache: LocalCache, closed_keys: ExpiringKeys,
        background: BackgroundWrites,
    ) -> None:
        self._served = served
        self._store = store
        self._cache = cache
        self._closed_keys = closed_keys
        self._background = background
        self._creating: set[int] = set()  # producer ids whose key is being written
        self._passes = 0
        self._task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def creating(self, producer_id: int) -> Iterator[None]:
        """Inside the block, the key of producer ``producer_id`` is being written: a pass
        leaves it alone although no such producer is open yet."""
        self._creating.add(producer_id)
        try:
            yield
        finally:
            self._creating.discard(producer_id)

    def uncertain_write(self) -> None:
        """A creation or close could not be written to etcd, which may still apply it later:
        reconcile (again) for the next :data:`RECONCILE_PASSES` successful passes."""
        self._passes = RECONCILE_PASSES
        if (self._task is None or self._task.done()) and not self._served.stopping:
            self._task = spawn(self._reconcile(), name="reconcile")

    async def stop(self) -> None:
        """Cancel a running reconciliation and wait for its end."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _reconcile(self) -> None:
        while self._passes > 0 and not self._served.stopping:
            await asyncio.sleep(RECONCILE_INTERVAL_S)
            try:
                for topic in list(self._served.topics.values()):
                    await self._reconcile_producers(topic)
                    await topic.subscriptions.reconcile(done=self._passes == 1)
            except MetadataStoreError as exc:
                self._background.outage.failed(exc)
                continue
            self._passes -= 1

    async def _reconcile_producers(self, topic: Topic) -> None:
        """Mark closed every producer key of ``topic`` that says ``status: true`` for a producer
        not open here (a create that failed, or a close whose write failed).

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        kvs, _ = await self._store.get_prefix(keys.topic_producers_prefix(topic.name))
        for kv in kvs:
            try:
                producer = values.ProducerMetadata.from_json(kv.value)
            except ValueError:
                continue
            pid = producer.producer_id
            if not producer.status or pid in topic.producers or pid in self._creating:
                continue
            closed = dataclasses.replace(producer, status=False)
            if await self._closed_keys.compare_and_put(kv.key, closed, expected_mod_revision=kv.mod_revision):
                log.info("%s: producer %d (%s) marked closed: its create or close did not complete",
                         topic.path, pid, producer.producer_name)

    async def close_stale_producers(self, name: TopicName, *, revision: int) -> None:
        """Set ``status`` false on every producer key of ``name`` still marked open, under the
        expiring lease of closed producers.

        Called when this broker loads the topic, before any producer is created on it here:
        an open producer key can only belong to an earlier owner (or an earlier run of this
        broker) whose connections are gone. Each write is conditional on the key's
        ``mod_revision``, so a key changed meanwhile is left alone (§3.3).

        The keys are read from the cache once it has applied ``revision`` (the takeover's
        transaction): it then holds every key written before the takeover, as a read from
        etcd after it would. When the cache lags by more than :data:`CACHE_WAIT_S`, they are
        read from etcd.

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        prefix = keys.topic_producers_prefix(name)
        try:
            await self._cache.wait_for_revision(revision, timeout_s=CACHE_WAIT_S)
            cached = self._cache.get_prefix(prefix)
            found = [(key, value, self._cache.mod_revision(key)) for key, value in cached.items()]
        except MetadataStoreError:
            kvs, _ = await self._store.get_prefix(prefix)
            found = [(kv.key, kv.value, kv.mod_revision) for kv in kvs]
        for key, value, mod_revision in found:
            try:
                producer = values.ProducerMetadata.from_json(value)
            except ValueError:
                log.warning("ignoring malformed producer key %s", key)
                continue
            if producer.status and mod_revision is not None:
                closed = dataclasses.replace(producer, status=False)
                await self._closed_keys.compare_and_put(key, closed, expected_mod_revision=mod_revision)
                log.info("producer %d (%s) on %s marked closed: its owner is gone",
                         producer.producer_id, producer.producer_name, name)
