"""Replication when a topic is loaded here as its owner (``docs/etcd-layout.md`` §5.9).

* Before the takeover plan: the ISR the previous owner recorded, read from etcd with the
  takeover's other keys (:func:`previous_isr`). A broker in it takes the topic over from its own log
  (``plan_takeover(in_sync=True)``): no unavailable range, whatever the previous owner's reserved
  block held above this log was never acknowledged nor read (readers stay below the HW).
* After it: at a replication factor above 1, the new leader epoch is recorded in the WAL before
  any append (:meth:`WriteAheadLog.begin_epoch`; the owner epoch of §1.4 is the leader epoch),
  and a :class:`~broker.replication.owner.ReplicaTracker` starts with the ISR members of the
  previous record that are still registered (:func:`start_replication`).
"""

from __future__ import annotations

import logging

from danube_pipeline.metadata import values
from danube_pipeline.metadata.cache import LocalCache

from broker.cluster.ownership import Ownership
from broker.cluster.takeover_reads import TakeoverReads
from broker.cluster_view import ClusterView
from broker.replication.manager import replica_set
from broker.replication.owner import ReplicaTracker
from broker.topics.topic import Topic

log = logging.getLogger(__name__)


def previous_isr(reads: TakeoverReads) -> values.InSyncReplicas | None:
    """The ISR record (§5.9) as the takeover read it from etcd (:class:`TakeoverReads`, a
    linearizable read); ``None`` when absent or unreadable."""
    kv = reads.isr
    if kv is None:
        return None
    try:
        return values.InSyncReplicas.from_json(kv.value)
    except (ValueError, TypeError):
        return None


async def start_replication(
    topic: Topic,
    ownership: Ownership,
    *,
    previous: values.InSyncReplicas | None,
    in_sync_takeover: bool,
    fetched_high_watermark: int | None,
    cache: LocalCache,
    cluster: ClusterView,
    lag_max_s: float,
) -> ReplicaTracker | None:
    """Start replicating ``topic`` from this owner when its replication factor is above 1.

    Args:
        topic: the topic just opened (its WAL, its policy).
        ownership: this broker's ownership (the ISR record is written under its epoch).
        previous: the ISR record read before the takeover.
        in_sync_takeover: this broker took over as a member of ``previous``'s ISR.
        fetched_high_watermark: the HW this broker last fetched as a follower, if it was one.
        cache: the broker's cache (replica assignment, registrations).
        cluster: the cluster view.
        lag_max_s: ``--replica-lag-max-s``.

    Returns:
        The started tracker, ``None`` at replication factor 1.

    Raises:
        NotServedHereError: fenced before the ISR record was written.
        MetadataStoreError: etcd unreachable.
    """
    policy = topic.policy()
    if policy.replication_factor <= 1:
        return None
    name = topic.name
    wal = topic.wal
    me = ownership.broker_id
    await wal.begin_epoch(ownership.epoch)
    registered = {b.broker_id for b in cluster.registered_brokers()}
    isr = {me}
    high_watermark = wal.durable_end
    same_owner = previous is not None and previous.owner == me and previous.owner_epoch == ownership.epoch
    if previous is not None and (in_sync_takeover or same_owner):
        isr |= {b for b in previous.isr if b in registered and b != previous.owner}
        start = fetched_high_watermark if fetched_high_watermark is not None else previous.high_watermark
        high_watermark = min(max(start, previous.high_watermark), wal.durable_end)
    tracker = ReplicaTracker(
        name, wal, broker_id=me, owner_epoch=ownership.epoch, isr=isr, high_watermark=high_watermark,
        replicas=lambda: replica_set(cache, name),
        registered=lambda: {b.broker_id for b in cluster.registered_brokers()},
        min_insync_replicas=lambda: topic.policy().min_insync_replicas,
        write_isr=ownership.put, lag_max_s=lag_max_s,
    )
    wal.set_high_watermark(tracker.high_watermark)
    await tracker.start()
    log.info("topic %s: replicated from here (factor %d, min in-sync %d), ISR %s, high watermark %d",
             name, policy.replication_factor, policy.min_insync_replicas, sorted(tracker.isr),
             tracker.high_watermark)
    return tracker
