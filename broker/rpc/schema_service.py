"""``danube.v1.SchemaRegistry`` over :class:`danube_pipeline.schemas.registry.SchemaRegistry`.

The servicer only translates: protobuf requests become registry calls, results become protobuf
answers. Every exception becomes a status in one place, :func:`broker.rpc.status.rpc`.
"""

from __future__ import annotations

from typing import Any

from danube_pipeline.errors import MalformedRequestError
from danube_pipeline.proto import danube_pb2 as pb
from danube_pipeline.proto import danube_pb2_grpc as pb_grpc

from broker.core import Broker
from broker.rpc.status import rpc

__all__ = ["SchemaRegistryServicer"]

_SCHEMA_TYPES = {pb.AVRO: "Avro", pb.JSON_SCHEMA: "JsonSchema", pb.PROTOBUF: "Protobuf"}
"""``SchemaType`` numbers and the registry's type names (``docs/etcd-layout.md`` §4.3 ``schema_def``)."""
_SCHEMA_TYPE_NUMBERS = {name: number for number, name in _SCHEMA_TYPES.items()}


class SchemaRegistryServicer(pb_grpc.SchemaRegistryServicer):
    """``danube.v1.SchemaRegistry`` over :class:`danube_pipeline.schemas.registry.SchemaRegistry`."""

    def __init__(self, broker: Broker) -> None:
        self._registry = broker.registry

    @rpc
    async def RegisterSchema(self, request: pb.RegisterSchemaRequest, context: Any) -> pb.RegisterSchemaResponse:
        schema_type = _SCHEMA_TYPES.get(request.schema_type)
        if schema_type is None:
            raise MalformedRequestError(f"unsupported schema type {request.schema_type}")
        registered = await self._registry.register(
            request.subject,
            schema_type,
            request.raw_schema,
            created_by=request.created_by or "danube-client",
            compatibility_mode=request.compatibility_mode or None,
        )
        return pb.RegisterSchemaResponse(
            schema_id=registered.schema_id, version=registered.version, fingerprint=registered.fingerprint
        )

    @rpc
    async def GetSchema(self, request: pb.GetSchemaRequest, context: Any) -> pb.GetSchemaResponse:
        registered = await self._registry.get_by_id(request.schema_id, version=request.version or None)
        return pb.GetSchemaResponse(
            subject=registered.subject,
            schema_id=registered.schema_id,
            version=registered.version,
            schema_type=_SCHEMA_TYPE_NUMBERS.get(registered.schema_type, pb.AVRO),
            raw_schema=registered.raw_schema,
            fingerprint=registered.fingerprint,
        )

    @rpc
    async def SetCompatibilityMode(
        self, request: pb.SetCompatibilityModeRequest, context: Any
    ) -> pb.SetCompatibilityModeResponse:
        mode = await self._registry.set_compatibility_mode(request.subject, request.compatibility_mode)
        return pb.SetCompatibilityModeResponse(compatibility_mode=mode)
