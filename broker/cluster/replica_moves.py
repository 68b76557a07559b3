"""Moving a replicated topic to a broker outside its replica set, for the rebalancer (Kafka's
partition reassignment; ``docs/etcd-layout.md`` §1.9, §5.9).

Ownership may only pass to a broker whose log holds every acknowledged offset: a member of the
ISR. So before the rebalancer releases a replicated topic for a target outside its replica set,
the leader first adds the target to the set (one more copy: the target starts a fetcher and
copies the owner's log) and waits until the owner counts it in the ISR. The release then hands
the topic to the target (an ISR member, :meth:`ReplicaPlacement.place`), and the assignment
drops the source's copy, so the set is back to the replication factor. A target that does not
catch up within the wait is taken out of the set again, and the move fails (the rebalancer
does not retry it before the topic's cool-down).
"""

from __future__ import annotations

import asyncio
import logging
import time

from danube_pipeline.metadata import keys
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.replica_values import ReplicaAssignment
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName

from broker.replication.manager import in_sync_record, replica_assignment

log = logging.getLogger(__name__)

REPLICA_CATCH_UP_S = 60.0
"""How long a move waits for its target to join the ISR."""
_POLL_S = 0.1


def in_sync(cache: LocalCache, name: TopicName, broker_id: int) -> bool:
    """Whether the topic's ISR record (§5.9) names ``broker_id``."""
    record = in_sync_record(cache, name)
    return record is not None and broker_id in record.isr


async def _write_set(store: MetadataStore, cache: LocalCache, epoch: int, name: TopicName, replicas: list[int]) -> bool:
    key = keys.replica_assignment(name)
    revision = await store.transaction(
        created={keys.CLUSTER_LEADER: epoch},
        modified={key: cache.mod_revision(key) or 0},
        puts=[(key, ReplicaAssignment(replicas=replicas, since=int(time.time())))],
    )
    if revision is not None:
        await cache.wait_for_revision(revision)
    return revision is not None


async def replicate_to_target(
    store: MetadataStore, cache: LocalCache, epoch: int, name: TopicName, target: int, *,
    catch_up_s: float = REPLICA_CATCH_UP_S,
) -> bool:
    """Make ``target`` an in-sync replica of ``name`` before a move (module docstring).

    Args:
        store: etcd.
        cache: the leader's cache.
        epoch: the leader's epoch; every write is guarded by it and by the replica key's
            ``mod_revision`` as read.
        name: the topic.
        target: the broker the move gives the topic to.
        catch_up_s: how long to wait for ``target`` in the ISR.

    Returns:
        ``True`` when the topic is not replicated (no replica set, §1.9) or ``target`` is in its
        ISR; ``False`` when the set changed under the write, or the target did not catch up in
        time (then it is taken out of the set again).

    Raises:
        MetadataStoreError: etcd unreachable.
    """
    assignment = replica_assignment(cache, name)
    if assignment is None:
        return True
    if target not in assignment.replicas:
        if not await _write_set(store, cache, epoch, name, [*assignment.replicas, target]):
            return False
        log.info("topic %s: broker %d added to its replicas for a move; waiting for it to catch up", name, target)
    deadline = time.monotonic() + catch_up_s
    while not in_sync(cache, name, target):
        if time.monotonic() >= deadline:
            current = replica_assignment(cache, name)
            if current is not None and target in current.replicas and target not in assignment.replicas:
                await _write_set(store, cache, epoch, name, [b for b in current.replicas if b != target])
            log.warning("topic %s: broker %d did not join the ISR within %.0f s; the move is given up",
                        name, target, catch_up_s)
            return False
        await asyncio.sleep(_POLL_S)
    return True
