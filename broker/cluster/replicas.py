"""Where the cluster leader puts a replicated topic's copies (``docs/etcd-layout.md`` §1.9, §5.9).

A topic whose effective ``replication_factor`` (the namespace policy §2.1 merged with the topic's
override §3.8) is above 1 has its log on several brokers: the owner (§1.4) and followers that
fetch from it. The leader records which brokers in ``/cluster/replicas/{ns}/{topic}`` (§1.9), in
the same transaction as the assignment, and the owner records which of them are in sync in
``.../isr`` (§5.9). :meth:`ReplicaPlacement.place` chooses the owner and the replica set for
:meth:`broker.cluster.leader.LeaderDuties.assign_pass`:

* the topic has a replica assignment and an ISR record: the new owner is an ISR member that is
  registered and active, least loaded first (Kafka's clean leader election, KIP-101), the
  releasing ``from_broker`` only when no other ISR member can take it. The transaction compares
  the ISR key's mod revision, so the choice is made on the ISR as it stands;
* no ISR member can take it: any active broker, as for an unreplicated topic (its takeover
  records an unavailable range, §5.5), unless ``--unclean-replica-election`` is on: then a
  registered replica outside the ISR, with a warning that acked messages may be lost (Kafka's
  ``unclean.leader.election.enable``);
* no replica assignment yet: the owner as for an unreplicated topic, and
  ``replication_factor - 1`` followers on other active brokers, fewest replica assignments
  first, the lowest id on a tie.

The replica set written keeps every replica plus the new owner (a broker gone keeps its place
until it is replaced, so one that returns in time rejoins as a follower), filled up to
``replication_factor`` with active brokers not in it. :meth:`ReplicaPlacement.rereplicate_pass`
replaces a replica whose broker stayed unregistered for ``--replica-replace-after-s``, and fills
up a set left short when too few brokers were active.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection, Mapping

from danube_pipeline.metadata import keys, values
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.replica_values import InSyncReplicas, ReplicaAssignment
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName

from broker.cluster.load_manager import BrokerLoad, Strategy, choose_broker

log = logging.getLogger(__name__)

REREPLICATION_INTERVAL_S = 5.0
"""The leader looks for replicas to replace at most this often (seconds)."""

DEFAULT_REPLICA_REPLACE_AFTER_S = 60.0
"""``--replica-replace-after-s``: how long a replica's broker stays unregistered before the
leader replaces that replica (seconds)."""


def effective_policy(cache: LocalCache, topic: TopicName) -> values.NamespacePolicy:
    """The topic's policy as its owner applies it (§2.1 merged with §3.8), from the cache;
    unreadable values are set aside as the owner does (the owner logs them)."""
    policy, _problems = values.merged_policy(
        cache.get(keys.namespace_policy(topic.namespace)), cache.get(keys.topic_policy(topic))
    )
    return policy


def _read(cache: LocalCache, key: str, kind: type[ReplicaAssignment] | type[InSyncReplicas]) -> tuple[object, int]:
    """The parsed value at ``key`` (``None`` when absent or unreadable) and its mod revision
    (0 when absent)."""
    raw = cache.get(key)
    revision = cache.mod_revision(key) or 0
    if raw is None:
        return None, revision
    try:
        return kind.from_json(raw), revision
    except (ValueError, TypeError):
        log.warning("unreadable %s at %s: %r; treated as absent", kind.__name__, key, raw)
        return None, revision


def replica_counts(cache: LocalCache) -> dict[int, int]:
    """``broker id -> how many replica assignments (§1.9) name it``."""
    counts: dict[int, int] = {}
    for raw in cache.get_prefix(keys.REPLICA_ASSIGNMENT_PREFIX).values():
        try:
            replicas = ReplicaAssignment.from_json(raw).replicas
        except (ValueError, TypeError):
            continue
        for broker_id in replicas:
            counts[broker_id] = counts.get(broker_id, 0) + 1
    return counts


def fill_replicas(replicas: list[int], target: int, active: Collection[int], counts: Mapping[int, int]) -> list[int]:
    """``replicas`` plus active brokers not in it, fewest replica assignments first (the lowest
    id on a tie), until it has ``target`` brokers or no active broker is left."""
    spare = sorted((b for b in active if b not in replicas), key=lambda b: (counts.get(b, 0), b))
    return replicas + spare[: max(0, target - len(replicas))]


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """The leader's choice for one replicated topic.

    Attributes:
        owner: the broker that gets the assignment (§1.4).
        replicas: the replica set to write (§1.9), the owner included.
        guards: ``key -> mod revision`` the transaction compares (0: must be absent): the
            replica key and the ISR key as read.
    """

    owner: int
    replicas: list[int]
    guards: dict[str, int]


class ReplicaPlacement:
    """The leader's replica decisions: :meth:`place` at assignment, :meth:`rereplicate_pass`.

    Args:
        store: etcd, for writes.
        cache: the leader's cache.
        unclean_replica_election: when no ISR member can take a topic, give it to a registered
            replica outside the ISR (acked messages may be lost) rather than to any broker.
        replica_replace_after_s: a replica whose broker stayed unregistered this long (as seen
            by this leader) is replaced.
    """

    def __init__(
        self,
        store: MetadataStore,
        cache: LocalCache,
        *,
        unclean_replica_election: bool = False,
        replica_replace_after_s: float = DEFAULT_REPLICA_REPLACE_AFTER_S,
    ) -> None:
        self.store = store
        self.cache = cache
        self.unclean_replica_election = unclean_replica_election
        self.replica_replace_after_s = replica_replace_after_s
        self.replaced = 0
        self._short: set[str] = set()
        self._unregistered_since: dict[int, float] = {}
        self._last_pass = 0.0
        self._pass_epoch: int | None = None

    def place(
        self,
        topic: TopicName,
        candidates: list[BrokerLoad],
        active: list[BrokerLoad],
        registered: Collection[int],
        *,
        preferred: int = -1,
        released_by: int | None = None,
    ) -> Placement | None:
        """Choose the owner and replica set of ``topic`` (module docstring).

        Args:
            topic: the topic being assigned.
            candidates: the active brokers that may take it (the releasing ``from_broker`` left
                out when another one can), as :meth:`LeaderDuties.assign_pass` computed them.
            active: every active registered broker.
            registered: every registered broker id.
            preferred: a broker a rebalancing move names; taken when it may take the topic.
            released_by: the broker that released the topic, if one did: its copy is the first
                to go when the set is over ``replication_factor`` (a move added the destination
                as one more replica, :mod:`broker.cluster.replica_moves`).

        Returns:
            ``None`` when the topic's ``replication_factor`` is 1 (nothing to place: the
            assignment is the unreplicated one), else the placement.

        Raises:
            ValueError: ``candidates`` is empty.
        """
        factor = effective_policy(self.cache, topic).replication_factor
        if factor <= 1:
            return None
        assignment, replicas_revision = _read(self.cache, keys.replica_assignment(topic), ReplicaAssignment)
        isr, isr_revision = _read(self.cache, keys.in_sync_replicas(topic), InSyncReplicas)
        guards = {keys.replica_assignment(topic): replicas_revision, keys.in_sync_replicas(topic): isr_revision}
        counts = replica_counts(self.cache)
        active_ids = [load.broker_id for load in active]
        if not isinstance(assignment, ReplicaAssignment):  # first assignment (§1.9)
            owner = self.choose(topic, candidates, preferred)
            replicas = fill_replicas([owner], factor, active_ids, counts)
            if len(replicas) < factor and topic.path not in self._short:
                self._short.add(topic.path)
                log.warning("topic %s: replication_factor %d but only %d active brokers; replicas %s",
                            topic, factor, len(replicas), replicas)
            return Placement(owner, replicas, guards)
        if isinstance(isr, InSyncReplicas):
            in_sync = [load for load in candidates if load.broker_id in isr.isr]
            in_sync = in_sync or [load for load in active if load.broker_id in isr.isr]
            outside = [load for load in candidates if load.broker_id in assignment.replicas
                       and load.broker_id not in isr.isr and load.broker_id in registered]
            if in_sync:
                owner = self.choose(topic, in_sync, preferred)
            elif self.unclean_replica_election and outside:
                owner = self.choose(topic, outside, preferred)
                log.warning("topic %s: unclean replica election: no in-sync replica %s is available, broker %d "
                            "(a replica outside the ISR) takes it; messages acked by the ISR may be lost",
                            topic, isr.isr, owner)
            else:
                owner = self.choose(topic, candidates, preferred)
        else:
            owner = self.choose(topic, candidates, preferred)
        # Every replica is kept, an unregistered one too: back before --replica-replace-after-s,
        # it truncates by epoch and follows again (the re-replication pass replaces it after).
        kept = [b for b in assignment.replicas if b != owner]
        in_sync_ids = isr.isr if isinstance(isr, InSyncReplicas) else []
        # When the set must shrink, the last ones go: the releaser (a move added its destination
        # as one more copy), then the unregistered, then those out of sync.
        kept.sort(key=lambda b: (b == released_by, b not in registered, b not in in_sync_ids))
        replicas = fill_replicas([owner, *kept][:factor], factor, active_ids, counts)
        return Placement(owner, replicas, guards)

    @staticmethod
    def choose(topic: TopicName, loads: list[BrokerLoad], preferred: int) -> int:
        """``preferred`` when it is among ``loads``, else the least loaded (``fair`` strategy,
        the lowest id on a tie).

        Raises:
            ValueError: ``loads`` is empty.
        """
        if any(load.broker_id == preferred for load in loads):
            return preferred
        return choose_broker(topic.path, loads, Strategy.FAIR)

    async def rereplicate_pass(
        self, epoch: int, registered: Collection[int], active: Collection[int], owners: Mapping[str, int]
    ) -> int:
        """Replace the replicas whose broker stayed unregistered for ``replica_replace_after_s``
        (§1.9), and fill up sets shorter than the topic's ``replication_factor`` (an assignment
        made while too few brokers were active), at most once every
        :data:`REREPLICATION_INTERVAL_S`.

        A broker's absence is timed from when this leadership first saw it unregistered. Each
        replica is replaced by an active broker not in the set (fewest replica assignments
        first), in a transaction guarded by the leader epoch and the replica key's mod
        revision. The topic's current owner (the broker holding its assignment key) is never
        replaced.

        Args:
            epoch: this leader's epoch (§1.7).
            registered: every registered broker id.
            active: every active registered broker id.
            owners: ``/ns/topic -> owner id`` from the assignment keys (§1.4).

        Returns:
            How many replica sets were rewritten.

        Raises:
            MetadataStoreError: etcd unreachable.
        """
        now = time.monotonic()
        if self._pass_epoch != epoch:
            self._pass_epoch, self._unregistered_since = epoch, {}
        elif now - self._last_pass < REREPLICATION_INTERVAL_S:
            return 0
        self._last_pass = now
        entries = self.cache.get_prefix(keys.REPLICA_ASSIGNMENT_PREFIX)
        named = {b for raw in entries.values() if isinstance(raw, dict) for b in raw.get("replicas") or ()}
        for broker_id in named:
            if broker_id in registered:
                self._unregistered_since.pop(broker_id, None)
            else:
                self._unregistered_since.setdefault(broker_id, now)
        gone = {b for b, since in self._unregistered_since.items() if now - since >= self.replica_replace_after_s}
        counts = replica_counts(self.cache)
        rewritten = 0
        for key in entries:
            try:
                topic = TopicName.parse("/" + key[len(keys.REPLICA_ASSIGNMENT_PREFIX) :])
            except ValueError:
                continue
            assignment, revision = _read(self.cache, key, ReplicaAssignment)
            if not isinstance(assignment, ReplicaAssignment):
                continue
            owner = owners.get(topic.path)
            dead = [b for b in assignment.replicas if b in gone and b != owner]
            spare = sorted((b for b in active if b not in assignment.replicas), key=lambda b: (counts.get(b, 0), b))
            replicas = [spare.pop(0) if b in dead and spare else b for b in assignment.replicas]
            factor = effective_policy(self.cache, topic).replication_factor
            replicas += spare[: max(0, factor - len(replicas))]  # a set left short at an assignment
            if replicas == assignment.replicas:
                continue  # nothing to replace, or no active broker to put a copy on
            new = ReplicaAssignment(replicas=replicas, since=int(time.time()))
            done = await self.store.transaction(
                created={keys.CLUSTER_LEADER: epoch}, modified={key: revision}, puts=[(key, new)]
            )
            if done is None:
                continue  # the set or the leadership changed: the next pass looks again
            await self.cache.wait_for_revision(done)
            for b in set(replicas) - set(assignment.replicas):
                counts[b] = counts.get(b, 0) + 1
            rewritten += 1
            self.replaced += 1
            log.warning("topic %s: replicas %s -> %s (replaced: %s, unregistered for %.0f s or more; "
                        "replication_factor %d; leader epoch %d)", topic, assignment.replicas, replicas,
                        sorted(set(assignment.replicas) - set(replicas)), self.replica_replace_after_s, factor, epoch)
        return rewritten
