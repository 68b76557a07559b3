"""``danube.v1.Discovery``: topic lookups and cluster metadata, answered from the LocalCache.

The servicer only translates: protobuf requests become calls on :class:`broker.core.Broker`,
results become protobuf answers. Every exception becomes a status in one place,
:func:`broker.rpc.status.rpc`.
"""

from __future__ import annotations

from typing import Any

from danube_pipeline.names import TopicName
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

from broker.cluster.partitions import topic_partitions
from broker.core import Broker
from broker.rpc.status import rpc

__all__ = ["DiscoveryServicer"]


class DiscoveryServicer(pb_grpc.DiscoveryServicer):
    """``danube.v1.Discovery``: answered from the LocalCache."""

    def __init__(self, broker: Broker, cluster_name: str) -> None:
        self._broker = broker
        self._cluster_name = cluster_name

    @rpc
    async def TopicLookup(self, request: pb.TopicLookupRequest, context: Any) -> pb.TopicLookupResponse:
        name = TopicName.parse(request.topic)
        partitions = await topic_partitions(self._broker, name)
        if partitions:  # no owner: the client looks up each "{topic}-part-{i}" (§3.1)
            return pb.TopicLookupResponse(partitions=partitions)
        owner = await self._broker.lookup(name)
        return pb.TopicLookupResponse(broker_id=owner.broker_id, broker_addr=owner.address)

    @rpc
    async def ClusterMetadata(self, request: pb.ClusterMetadataRequest, context: Any) -> pb.ClusterMetadataResponse:
        return pb.ClusterMetadataResponse(
            cluster_name=self._cluster_name,
            brokers=[
                pb.BrokerInfo(broker_id=b.broker_id, broker_addr=b.address, mode=b.mode)
                for b in self._broker.registered_brokers()
            ],
            leader_broker_id=self._broker.leader_id(),
        )
