"""The schema registry facade: register schemas, read them back, set a subject's compatibility
mode (``docs/etcd-layout.md`` §4). Every call goes to any broker (the registry lives in etcd).
Obtain it as :attr:`DanubeClient.schemas <danube_pipeline.client.DanubeClient.schemas>`.
"""

from __future__ import annotations

from danube_pipeline.client._connection import Stubs
from danube_pipeline.client._context import Context
from danube_pipeline.client.types import (
    _SCHEMA_TYPE_FROM_PB,
    _SCHEMA_TYPE_TO_PB,
    Schema,
    SchemaInfo,
)
from danube_pipeline.names import validate_part, validate_subject
from danube_pipeline.proto import danube_pb2 as pb

__all__ = ["SchemaClient"]


class SchemaClient:
    """Schema registry calls."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx

    async def register(
        self, schema: Schema, *, created_by: str = "danube-client", compatibility_mode: str = ""
    ) -> SchemaInfo:
        """Register ``schema`` under its subject (``SchemaRegistry.RegisterSchema``).

        Registering a schema equal to an existing version of the subject (same fingerprint)
        returns that version. A new version must pass the subject's compatibility mode.

        Args:
            schema: an :class:`AvroSchema`, :class:`JsonSchema` or :class:`ProtobufSchema`.
            created_by: recorded with the version (``[A-Za-z0-9_-]{1,128}``).
            compatibility_mode: for a new subject, its mode: ``NONE``, ``BACKWARD`` (the
                default), ``BACKWARD_TRANSITIVE``, ``FORWARD``, ``FORWARD_TRANSITIVE``,
                ``FULL``, ``FULL_TRANSITIVE`` (or ``Backward``, ``FullTransitive``...). For an
                existing subject it must be the subject's mode, or empty.

        Returns:
            The version (``raw_schema`` is the text sent).

        Raises:
            InvalidNameError: ``created_by`` is malformed (checked before sending).
            InvalidSchemaError: the schema does not parse.
            IncompatibleSchemaError: the schema breaks the subject's compatibility mode, or is
                of another schema type than the subject's (``path``, ``rule`` and ``version``
                say where).
            MalformedRequestError: an unknown mode, or one that differs from the subject's.
            BrokerUnavailableError: no broker answered.
        """
        validate_part("created_by", created_by)
        request = pb.RegisterSchemaRequest(
            subject=schema.subject,
            schema_type=_SCHEMA_TYPE_TO_PB[schema.schema_type],
            raw_schema=schema.raw_schema,
            created_by=created_by,
            compatibility_mode=compatibility_mode,
        )

        async def call(stubs: Stubs) -> SchemaInfo:
            response = await stubs.schema.RegisterSchema(request, timeout=self._ctx.request_timeout_s)
            return SchemaInfo(
                subject=schema.subject,
                schema_id=response.schema_id,
                version=response.version,
                schema_type=schema.schema_type,
                raw_schema=schema.raw_schema,
                fingerprint=response.fingerprint,
            )

        return await self._ctx.call_any(call)

    async def get(self, schema_id: int, *, version: int = 0) -> SchemaInfo:
        """A registered schema by id (``SchemaRegistry.GetSchema``).

        Args:
            schema_id: the subject's id.
            version: the version; 0 (the default) = the latest.

        Raises:
            SchemaNotFoundError: no such id or version.
            BrokerUnavailableError: no broker answered.
        """

        async def call(stubs: Stubs) -> SchemaInfo:
            response = await stubs.schema.GetSchema(
                pb.GetSchemaRequest(schema_id=schema_id, version=version), timeout=self._ctx.request_timeout_s
            )
            return SchemaInfo(
                subject=response.subject,
                schema_id=response.schema_id,
                version=response.version,
                schema_type=_SCHEMA_TYPE_FROM_PB.get(response.schema_type, "Avro"),
                raw_schema=response.raw_schema,
                fingerprint=response.fingerprint,
            )

        return await self._ctx.call_any(call)

    async def set_compatibility_mode(self, subject: str, mode: str) -> str:
        """Set a subject's compatibility mode (``SchemaRegistry.SetCompatibilityMode``,
        ``docs/etcd-layout.md`` §4.2); it applies from the subject's next registration.

        Args:
            subject: a registered subject.
            mode: as ``compatibility_mode`` of :meth:`register`.

        Returns:
            The mode stored, in Danube's spelling (e.g. ``"FullTransitive"``).

        Raises:
            InvalidNameError: ``subject`` is malformed (checked before sending).
            MalformedRequestError: an unknown mode.
            SchemaNotFoundError: the subject is not registered.
            BrokerUnavailableError: no broker answered.
        """
        validate_subject(subject)

        async def call(stubs: Stubs) -> str:
            response = await stubs.schema.SetCompatibilityMode(
                pb.SetCompatibilityModeRequest(subject=subject, compatibility_mode=mode),
                timeout=self._ctx.request_timeout_s,
            )
            return str(response.compatibility_mode)

        return await self._ctx.call_any(call)
