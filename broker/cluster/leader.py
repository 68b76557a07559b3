"""What only the cluster leader does: assign unassigned topics (``docs/etcd-layout.md`` §1.5).

A topic without an owner waits in ``/cluster/unassigned/{ns}/{topic}`` (written when it is
created, or when a broker is asked for a topic nobody owns). The leader (§1.7) follows that
prefix through its cache and assigns each one with :func:`assign_topic`: one etcd transaction
that writes ``/cluster/brokers/{id}/{ns}/{topic}`` (§1.4) and deletes the marker, and that
succeeds only if

* the leader key still has the create revision of this leader's election (its *epoch*), so a
  deposed leader's writes fail;
* the marker still exists, so two passes never assign the same marker twice;
* no registered broker holds an assignment of the topic, so a topic never has two owners.

The broker is chosen by :func:`broker.cluster.load_manager.choose_broker` with the ``fair`` strategy
(fewest topics) among the registered brokers whose state (§1.3) is ``active``, other than the
broker that released the topic (the entry's ``from_broker``) when another one can take it, or the
broker a rebalancing move names (``LeaderDuties.preferred``) while it is active; a broker's
topics are what its assignment keys say, read from the cache, which is never older than the
leader's own last write.

A topic whose effective ``replication_factor`` is above 1 is placed by
:class:`broker.cluster.replicas.ReplicaPlacement` instead: the owner among its in-sync replicas
(§5.9), and its replica set (§1.9) written in the same transaction, which also compares the
replica and ISR keys' mod revisions as read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping

from danube_pipeline.aio import wait_set
from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.replica_values import ReplicaAssignment
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.outages import OutageLog

from broker.cluster.load_manager import BrokerLoad
from broker.cluster.replicas import DEFAULT_REPLICA_REPLACE_AFTER_S, ReplicaPlacement

log = logging.getLogger(__name__)

UNASSIGNED_PREFIX = f"{keys.CLUSTER}/unassigned/"
PASS_INTERVAL_S = 1.0
"""The leader looks at the unassigned queue at least this often (and at every change)."""


def registered_brokers(cache: LocalCache) -> list[int]:
    """Ids of the brokers registered now (§1.2), ascending."""
    found = []
    for key in cache.get_prefix(keys.BROKER_REGISTER_PREFIX):
        tail = key[len(keys.BROKER_REGISTER_PREFIX) :]
        if tail.isdigit():
            found.append(int(tail))
    return sorted(found)


def assignments(cache: LocalCache) -> dict[int, list[str]]:
    """``broker id -> topics`` (``/ns/topic``) from the assignment keys (§1.4)."""
    out: dict[int, list[str]] = {}
    for key in cache.get_prefix(keys.BROKERS_PREFIX):
        parts = key[len(keys.BROKERS_PREFIX) :].split("/")
        if len(parts) == 3 and parts[0].isdigit():
            out.setdefault(int(parts[0]), []).append(f"/{parts[1]}/{parts[2]}")
    return out


def broker_mode(cache: LocalCache, broker_id: int) -> str:
    """The broker's state ``mode`` (§1.3); ``active`` when unreadable."""
    raw = cache.get(keys.broker_state(broker_id))
    try:
        return values.BrokerState.from_json(raw).mode if raw is not None else "active"
    except ValueError:
        return "active"


async def assign_topic(
    store: MetadataStore,
    topic: TopicName,
    broker_id: int,
    *,
    epoch: int,
    brokers: list[int],
    replicas: list[int] | None = None,
    modified: Mapping[str, int] | None = None,
) -> int | None:
    """Assign ``topic`` to ``broker_id`` and delete its unassigned marker, in one transaction
    guarded by the leader's epoch (module docstring).

    Args:
        store: etcd.
        topic: the topic.
        broker_id: the new owner.
        epoch: the leader key's create revision when this broker won the election (§1.7).
        brokers: every broker whose assignment key of ``topic`` must not exist.
        replicas: the topic's replica set (§1.9), written in the same transaction; ``None``
            (an unreplicated topic) writes none.
        modified: ``key -> mod revision`` the transaction also compares (0: must be absent):
            the replica and ISR keys as read (§1.9, §5.9).

    Returns:
        The revision of the write, or ``None`` when a guard failed: not the leader of that
        epoch any more, the marker is gone, a broker already owns the topic, or a key of
        ``modified`` changed.

    Raises:
        MetadataStoreError: etcd unreachable.
    """
    created = {keys.CLUSTER_LEADER: epoch}
    for other in brokers:
        created[keys.topic_assignment(other, topic)] = 0
    puts: list[tuple[str, values.JsonValue | values.JsonRecord]] = [(keys.topic_assignment(broker_id, topic), None)]
    if replicas is not None:
        puts.append((keys.replica_assignment(topic), ReplicaAssignment(replicas=replicas, since=int(time.time()))))
    return await store.transaction(
        created=created,
        modified=modified,
        exists=[keys.unassigned_topic(topic)],
        puts=puts,
        deletes=[keys.unassigned_topic(topic)],
    )


def _released_by(raw: object) -> int | None:
    """The ``from_broker`` of an unassigned entry's unload reason (§1.5), ``None`` for ``null``."""
    if raw is None:
        return None
    try:
        return values.UnassignedReason.from_json(raw).from_broker
    except (ValueError, TypeError):
        return None


class LeaderDuties:
    """The leader's loop: while ``epoch()`` gives an epoch, assign every unassigned topic.

    Args:
        store: etcd, for writes.
        cache: the broker's cache.
        epoch: returns this broker's leader epoch, or ``None`` when it is not the leader.
        failover_grace_s: see :meth:`failover_pass`.
        unclean_replica_election: see :class:`~broker.cluster.replicas.ReplicaPlacement`.
        replica_replace_after_s: see :class:`~broker.cluster.replicas.ReplicaPlacement`.
    """

    def __init__(
        self,
        store: MetadataStore,
        cache: LocalCache,
        epoch: Callable[[], int | None],
        *,
        failover_grace_s: float = 0.0,
        unclean_replica_election: bool = False,
        replica_replace_after_s: float = DEFAULT_REPLICA_REPLACE_AFTER_S,
    ) -> None:
        self.store = store
        self.cache = cache
        self.epoch = epoch
        self.failover_grace_s = failover_grace_s
        self.failed_over = 0
        self._led_epoch: int | None = None
        self._led_since = 0.0
        self._seen_registered: set[int] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._unlisten: list[Callable[[], None]] = []
        self._owned: tuple[dict[int, list[str]], dict[str, int]] | None = None
        """:func:`assignments` and its inverse as of the last change under ``BROKERS_PREFIX``;
        kept only while the listener :meth:`start` adds runs (``None``: read them again)."""
        self._outage = OutageLog(log, "assigning unassigned topics")
        self.assigned = 0
        self.replicas = ReplicaPlacement(
            store, cache, unclean_replica_election=unclean_replica_election,
            replica_replace_after_s=replica_replace_after_s,
        )
        self.preferred: dict[str, int] = {}
        """Topic (``/ns/topic``) → the broker its next assignment goes to while that broker is
        active, whatever its load (set by :class:`broker.cluster.rebalance.Rebalancer` for a move);
        the entry is dropped once the topic is assigned."""

    def start(self) -> None:
        """Follow the unassigned queue and the registered brokers; act while the leader."""
        for prefix in (UNASSIGNED_PREFIX, keys.BROKER_REGISTER_PREFIX):
            self._unlisten.append(self.cache.add_listener(prefix, lambda _event: self._wake.set()))
        self._unlisten.append(self.cache.add_listener(keys.BROKERS_PREFIX, self._assignments_changed))
        self._task = asyncio.create_task(self._run(), name="leader-duties")

    def _assignments_changed(self, _event: object) -> None:
        self._owned = None
        self._wake.set()

    def _assignments(self) -> tuple[dict[int, list[str]], dict[str, int]]:
        """``(broker id -> topics, topic -> broker id)`` from the assignment keys (§1.4), read
        again only after a change under ``BROKERS_PREFIX``: a pass every
        :data:`PASS_INTERVAL_S` no longer parses every assignment key of an idle cluster
        (O(topics) a second). Callers do not modify them."""
        owned = self._owned
        if owned is None:
            by_broker = assignments(self.cache)
            owned = (by_broker, {path: b for b, paths in by_broker.items() for path in paths})
            if self._unlisten:  # only while the listener keeps it current
                self._owned = owned
        return owned

    def wake(self) -> None:
        """Look at the queue now (leadership changed)."""
        self._wake.set()

    async def stop(self) -> None:
        for unlisten in self._unlisten:
            unlisten()
        self._unlisten.clear()
        self._owned = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await wait_set(self._wake, PASS_INTERVAL_S)
            self._wake.clear()
            # Brokers seen registered since this broker started, leader or not: one whose
            # registration then expired died while this broker watched, so a new leader fails
            # it over at once (the grace is for brokers it never saw, which may be restarting).
            self._seen_registered |= set(registered_brokers(self.cache))
            epoch = self.epoch()
            if epoch is None:
                continue
            try:
                await self.failover_pass(epoch)
                await self.assign_pass(epoch)
                registered = registered_brokers(self.cache)
                active = [b for b in registered if broker_mode(self.cache, b) == "active"]
                await self.replicas.rereplicate_pass(epoch, registered, active, self._assignments()[1])
            except Exception as exc:  # noqa: BLE001 - etcd unreachable: the next pass retries
                self._outage.failed(exc)
                continue
            self._outage.succeeded()

    async def failover_pass(self, epoch: int) -> int:
        """Put the topics of every broker whose registration is gone (its lease expired, §1.2)
        in the unassigned queue with reason ``failover``, so :meth:`assign_pass` gives them to
        live brokers; the new owner fences the old one (:mod:`broker.cluster.ownership`).

        A broker this broker saw registered (since it started, as leader or not) is failed over
        as soon as its registration disappears: when the old leader dies, the new one fails its
        topics over right after its election, not a grace later. One this broker never saw
        registered may be restarting: it is failed over once this leadership is
        ``failover_grace_s`` old.

        Each topic moves in one transaction guarded by the leader epoch, the assignment's
        existence and the registration's absence (a broker registering again keeps its topics).

        Returns:
            How many topics were put in the queue.

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        now = time.monotonic()
        if self._led_epoch != epoch:
            self._led_epoch, self._led_since = epoch, now
        registered = set(registered_brokers(self.cache))
        self._seen_registered |= registered
        moved = 0
        for broker_id, topics in sorted(self._assignments()[0].items()):
            if broker_id in registered:
                continue
            if broker_id not in self._seen_registered and now - self._led_since < self.failover_grace_s:
                continue
            for path in sorted(topics):
                topic = TopicName.parse(path)
                assignment = keys.topic_assignment(broker_id, topic)
                revision = await self.store.transaction(
                    created={keys.CLUSTER_LEADER: epoch, keys.broker_register(broker_id): 0},
                    exists=[assignment],
                    puts=[(keys.unassigned_topic(topic), values.UnassignedReason(reason="failover", from_broker=broker_id))],
                    deletes=[assignment],
                )
                if revision is None:
                    if self.epoch() != epoch:
                        return moved
                    continue
                await self.cache.wait_for_revision(revision)
                moved += 1
                self.failed_over += 1
                log.warning("topic %s failed over: broker %d is gone (its lease expired); leader epoch %d",
                            topic, broker_id, epoch)
        return moved

    async def assign_pass(self, epoch: int) -> int:
        """Assign every topic waiting in the unassigned queue.

        Returns:
            How many were assigned.

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        markers = [k for k in self.cache.get_prefix(UNASSIGNED_PREFIX)]
        if not markers:
            return 0
        done = 0
        brokers = registered_brokers(self.cache)
        owned = assignments(self.cache)
        for key in markers:
            parts = key[len(UNASSIGNED_PREFIX) :].split("/")
            if len(parts) != 2:
                continue
            try:
                topic = TopicName.parse(f"/{parts[0]}/{parts[1]}")
            except ValueError:
                continue
            holders = [b for b, topics in owned.items() if topic.path in topics]
            root = self.cache.get(keys.topic_root(topic))
            partitioned = isinstance(root, int) and not isinstance(root, bool) and root > 0
            # Stale: owned, no topic, or a partitioned topic (its partitions are assigned, §3.1).
            if holders or partitioned or not self.cache.contains(keys.topic_root(topic)):
                await self.store.transaction(created={keys.CLUSTER_LEADER: epoch}, deletes=[key])
                continue
            active = [
                BrokerLoad(broker_id=b, cpu_percent=0.0, memory_percent=0.0, topics=list(owned.get(b, [])))
                for b in brokers
                if broker_mode(self.cache, b) == "active"
            ]
            released_by = _released_by(self.cache.get(key))
            loads = [load for load in active if load.broker_id != released_by]
            if not loads:  # a released topic goes elsewhere when another broker can take it
                loads = active
            if not loads:
                return done  # no active broker yet: wait for one
            preferred = self.preferred.get(topic.path, -1)
            placement = self.replicas.place(
                topic, loads, active, brokers, preferred=preferred, released_by=released_by
            )
            # replication factor 1 (no placement): exactly the unreplicated transaction
            target = placement.owner if placement else ReplicaPlacement.choose(topic, loads, preferred)
            revision = await assign_topic(
                self.store, topic, target, epoch=epoch, brokers=sorted(set(brokers) | set(owned)),
                replicas=placement.replicas if placement else None, modified=placement.guards if placement else None,
            )
            if revision is None:
                if self.epoch() != epoch:
                    return done  # deposed meanwhile
                continue  # the marker went or an owner appeared: the next pass sees it
            await self.cache.wait_for_revision(revision)
            owned.setdefault(target, []).append(topic.path)
            self.preferred.pop(topic.path, None)
            self.assigned += 1
            done += 1
            log.info("topic %s assigned to broker %d%s (leader epoch %d)", topic, target,
                     f", replicas {placement.replicas}" if placement is not None else "", epoch)
        return done
