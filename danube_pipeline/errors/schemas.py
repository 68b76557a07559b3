"""Schema errors: unknown, invalid or incompatible schemas and payloads that do not match theirs.

Part of :mod:`danube_pipeline.errors`, which re-exports every name."""

from __future__ import annotations

import grpc

from danube_pipeline.errors.base import DanubeError, bounded


class SchemaMismatchError(DanubeError, ValueError):
    """A payload does not decode with, or does not match, its registered schema."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, subject: str, schema_id: int, reason: str) -> None:
        self.subject = subject
        self.schema_id = schema_id
        self.reason = reason
        super().__init__(f"payload does not match schema {subject!r} (id {schema_id}): {reason}")


class SchemaNotFoundError(DanubeError, LookupError):
    """No schema is registered under that id, subject or version (``docs/etcd-layout.md`` §4)."""

    grpc_code = grpc.StatusCode.NOT_FOUND

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"schema not found: {what}")


class InvalidSchemaError(DanubeError, ValueError):
    """A schema definition does not parse (e.g. not valid Avro)."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, subject: str, reason: str) -> None:
        self.subject = subject
        self.reason = reason
        super().__init__(f"invalid schema for subject {bounded(subject)!r}: {reason}")


class SchemaEvolutionError(DanubeError, ValueError):
    """A table cannot take a schema in place: a change outside Iceberg's in-place evolution
    (Iceberg spec, "Schema Evolution"), such as ``int`` to ``string``; rewriting the table's
    data files (the ``schema_rewrite`` asset) is needed.

    Attributes:
        table: the table's identifier, ``ns.topic``.
        changes: one line per change that cannot be made in place.
    """

    def __init__(self, table: str, changes: list[str]) -> None:
        self.table = table
        self.changes = changes
        super().__init__(f"table {table} needs schema_rewrite: {'; '.join(changes)}")


class IncompatibleSchemaError(DanubeError):
    """A new schema version breaks its subject's compatibility mode (``docs/etcd-layout.md`` §4.2
    ``compatibility_mode``; rules in :mod:`danube_pipeline.schemas.compatibility`). Nothing is written.

    Args:
        subject: the subject.
        mode: the compatibility mode checked (Danube spelling, e.g. ``Backward``).
        version: the earlier version the schema conflicts with.
        path: the field, dotted (``""`` for the whole schema).
        rule: the rule broken, e.g. ``FIELD_ADDED_WITHOUT_DEFAULT``.
        reason: what is wrong.
    """

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, subject: str, mode: str, version: int, path: str, rule: str, reason: str) -> None:
        self.subject = subject
        self.mode = mode
        self.version = version
        self.path = path
        self.rule = rule
        self.reason = reason
        where = f"field {bounded(path)!r}" if path else "the whole schema"
        super().__init__(
            f"schema for subject {bounded(subject)!r} is incompatible with version {version} under "
            f"compatibility mode {mode}: {rule} at {where}: {reason}"
        )


class SchemaRequiredError(DanubeError):
    """A producer without a schema was refused on a topic that carries one, and whose schema
    policy does not allow raw messages (``docs/etcd-layout.md`` §3.7)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, topic: str, subject: str) -> None:
        self.topic = topic
        self.subject = subject
        super().__init__(
            f"topic {bounded(topic)!r} carries schema subject {bounded(subject)!r}: a producer without a schema is "
            f"refused; produce with the subject's schema, or allow raw messages on the topic "
            f"(danube-admin topics set-schema-policy {bounded(topic)} --allow-raw)"
        )
