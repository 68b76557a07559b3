"""``danube.v1.Replication``: what an owner answers its followers (``FetchLog``,
``OffsetForLeaderEpoch``; :mod:`broker.replication.serving`). Called by the cluster's brokers
only: on the internal port under authentication (:mod:`broker.rpc.auth`).

The servicer only translates; every exception becomes a status in one place,
:func:`broker.rpc.status.rpc`.
"""

from __future__ import annotations

from typing import Any

from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

from broker.core import Broker
from broker.replication.serving import fetch_log, offset_for_leader_epoch
from broker.rpc.status import rpc

__all__ = ["ReplicationServicer"]

MAX_FETCH_BYTES = 16 * 1024 * 1024
MAX_WAIT_S = 5.0


class ReplicationServicer(pb_grpc.ReplicationServicer):
    """``danube.v1.Replication``: a topic's owner serving its followers."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    @rpc
    async def FetchLog(self, request: pb.FetchLogRequest, context: Any) -> pb.FetchLogResponse:
        topic = self._broker.replicated_topic(TopicName.parse(request.topic))
        result = await fetch_log(
            topic, self._broker.broker_id, follower_id=request.follower_id, fetch_offset=request.fetch_offset,
            owner_epoch=request.owner_epoch, max_bytes=max(1, min(request.max_bytes, MAX_FETCH_BYTES)),
            max_wait_s=min(request.max_wait_ms / 1000, MAX_WAIT_S),
        )
        return pb.FetchLogResponse(
            batches=[pb.ReplicaBatch(leader_epoch=epoch, data=data) for epoch, data in result.batches],
            high_watermark=result.high_watermark, log_start_offset=result.log_start_offset,
            log_end_offset=result.log_end_offset, owner_epoch=result.owner_epoch, stale=result.stale,
        )

    @rpc
    async def OffsetForLeaderEpoch(
        self, request: pb.OffsetForLeaderEpochRequest, context: Any
    ) -> pb.OffsetForLeaderEpochResponse:
        topic = self._broker.replicated_topic(TopicName.parse(request.topic))
        end = offset_for_leader_epoch(topic, self._broker.broker_id, request.leader_epoch)
        return pb.OffsetForLeaderEpochResponse(
            leader_epoch=end.leader_epoch, end_offset=end.end_offset, owner_epoch=end.owner_epoch,
            log_start_offset=end.log_start_offset,
        )
