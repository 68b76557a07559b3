"""What an owner answers its followers (``danube.v1.Replication``): batches of its WAL from a
fetch offset, and where a leader epoch ends in its log (KIP-101, KIP-279).

Both read only the owner's durable log; neither changes anything but the follower's progress
(:meth:`ReplicaTracker.fetched`).
"""

from __future__ import annotations

from dataclasses import dataclass

from danube_pipeline.errors import NotServedHereError

from broker.replication.owner import ReplicaTracker
from broker.topics.topic import Topic

__all__ = ["FetchResult", "EpochEnd", "fetch_log", "offset_for_leader_epoch"]


@dataclass(frozen=True, slots=True)
class FetchResult:
    """A ``FetchLog`` answer.

    Attributes:
        batches: ``(leader_epoch, stored batch bytes)`` from the fetch offset, in offset order.
        high_watermark: the owner's HW.
        log_start_offset: the owner's first local offset.
        log_end_offset: the owner's durable end.
        owner_epoch: the owner's epoch.
        stale: the follower must truncate by epoch first (another owner epoch, or its fetch
            offset is past this log's end).
    """

    batches: list[tuple[int, bytes]]
    high_watermark: int
    log_start_offset: int
    log_end_offset: int
    owner_epoch: int
    stale: bool = False


@dataclass(frozen=True, slots=True)
class EpochEnd:
    """An ``OffsetForLeaderEpoch`` answer: the largest epoch at or below the one asked that
    the owner's log holds and one past its last offset (``-1, -1``: none), the owner's epoch and
    first local offset."""

    leader_epoch: int
    end_offset: int
    owner_epoch: int
    log_start_offset: int


def tracker_of(topic: Topic, broker_id: int) -> ReplicaTracker:
    """The topic's :class:`ReplicaTracker`.

    Raises:
        NotServedHereError: the topic is not replicated from here (replication factor 1, or
            it is being released).
    """
    tracker = topic.replication
    if tracker is None or tracker.closed:
        raise NotServedHereError(topic.path, broker_id)
    return tracker


async def fetch_log(
    topic: Topic, broker_id: int, *, follower_id: int, fetch_offset: int, owner_epoch: int, max_bytes: int, max_wait_s: float,
) -> FetchResult:
    """Record the follower's log end and answer its batches from ``fetch_offset``, waiting up
    to ``max_wait_s`` when there is nothing yet.

    Raises:
        NotServedHereError: not replicated from here.
    """
    tracker = tracker_of(topic, broker_id)
    wal = topic.wal

    def answer(batches: list[tuple[int, bytes]], stale: bool = False) -> FetchResult:
        return FetchResult(
            batches=batches, high_watermark=tracker.high_watermark, log_start_offset=wal.first_offset,
            log_end_offset=wal.durable_end, owner_epoch=tracker.owner_epoch, stale=stale,
        )

    if owner_epoch != tracker.owner_epoch or fetch_offset > wal.durable_end:
        return answer([], stale=True)
    tracker.fetched(follower_id, fetch_offset)
    if fetch_offset < wal.first_offset:
        return answer([])
    await tracker.wait_for_data(fetch_offset, max_wait_s)
    if tracker.closed:
        raise NotServedHereError(topic.path, tracker.broker_id)
    entries = wal.read_for_replication(fetch_offset, max_bytes)
    return answer([(epoch, batch.data) for epoch, batch in entries])


def offset_for_leader_epoch(topic: Topic, broker_id: int, leader_epoch: int) -> EpochEnd:
    """Where ``leader_epoch`` ends in the owner's log (KIP-279 semantics of
    :meth:`LeaderEpochCache.end_offset_for`, against the durable end).

    Raises:
        NotServedHereError: not replicated from here.
    """
    tracker = tracker_of(topic, broker_id)
    wal = topic.wal
    if leader_epoch < 0:
        epoch, end = -1, -1
    else:
        epoch, end = wal.epochs.end_offset_for(leader_epoch, wal.durable_end)
    return EpochEnd(
        leader_epoch=epoch, end_offset=end, owner_epoch=tracker.owner_epoch, log_start_offset=wal.first_offset
    )
