"""The JSON values of the schema registry under ``/schemas/`` and of a topic's schema binding
(``docs/etcd-layout.md`` §4): subjects' versions, metadata and index entries, and the
``schema_def`` body they share. Encoded and decoded like every value
(:mod:`danube_pipeline.metadata.values`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Self

from danube_pipeline.metadata.values import JsonRecord

__all__ = ["AvroSchemaDef", "SchemaIndexEntry", "SchemaMetadata", "SchemaVersion", "TopicSchema"]


@dataclasses.dataclass(frozen=True, slots=True)
class AvroSchemaDef(JsonRecord):
    """The body of ``schema_def`` (§4.3): ``{"Avro": {...}}``, ``{"JsonSchema": {...}}`` or
    ``{"Protobuf": {...}}``, the same two fields for every schema type."""

    fingerprint: str
    raw_schema: str


SchemaDefBody = AvroSchemaDef
"""The body of ``schema_def`` for any schema type (the Avro one's name is historical)."""


@dataclasses.dataclass(frozen=True, slots=True)
class SchemaVersion(JsonRecord):
    """§4.3 ``/schemas/{subject}/versions/{version}``.

    ``schema_def`` is ``{"<type>": {"fingerprint": "sha256:…", "raw_schema": "…"}}`` with
    ``<type>`` one of ``Avro``, ``JsonSchema``, ``Protobuf``; ``fingerprint`` is ``"sha256:"``
    plus a hex SHA-256 (:mod:`danube_pipeline.schemas.formats`: of the Avro Parsing Canonical
    Form, of the canonical JSON, of the serialized ``FileDescriptorProto``).
    """

    @property
    def schema_type(self) -> str:
        """The key of ``schema_def`` (``"Avro"`` for a malformed empty one)."""
        return next(iter(self.schema_def), "Avro")

    @property
    def raw_schema(self) -> str:
        """The schema text of ``schema_def``."""
        body = self.schema_def.get(self.schema_type)
        return str(body.get("raw_schema", "")) if isinstance(body, dict) else ""


    created_at: int
    created_by: str
    version: int
    fingerprint: str
    is_deprecated: bool
    schema_def: dict[str, Any]
    tags: list[str]


@dataclasses.dataclass(frozen=True, slots=True)
class SchemaMetadata(JsonRecord):
    """§4.2 ``/schemas/{subject}/metadata``.

    ``compatibility_mode`` is one of ``None``, ``Backward``, ``BackwardTransitive``,
    ``Forward``, ``ForwardTransitive``, ``Full``, ``FullTransitive``
    (:mod:`danube_pipeline.schemas.compatibility`); ``topics_using`` lists, once each, the topics
    (``/{ns}/{topic}``) a producer with the subject's schema was created on.
    """

    compatibility_mode: str
    created_at: int
    created_by: str
    id: int
    latest_version: int
    subject: str
    topics_using: list[str]
    updated_at: int
    versions: list[SchemaVersion]
    _nested: ClassVar[dict[str, type[JsonRecord]]] = {"versions": SchemaVersion}


@dataclasses.dataclass(frozen=True, slots=True)
class TopicSchema(JsonRecord):
    """§3.7 ``/topics/{ns}/{topic}/schema``: the topic's schema settings.

    Attributes:
        subject: the subject of the first producer with a schema created on the topic; ``""``
            while none was (the key may exist for ``allow_raw`` alone).
        allow_raw: whether producers without a schema are accepted on the topic once it has a
            subject; their messages carry schema id 0 and stay raw.
    """

    subject: str = ""
    allow_raw: bool = False

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """Build from a decoded JSON object.

        Raises:
            ValueError: ``data`` is not an object, ``subject`` not a string or ``allow_raw``
                not a boolean.
        """
        value = cls._from_fields(data)
        if not isinstance(value.subject, str) or not isinstance(value.allow_raw, bool):
            raise ValueError(f"TopicSchema: subject must be a string and allow_raw a boolean, got {data!r}")
        return value


@dataclasses.dataclass(frozen=True, slots=True)
class SchemaIndexEntry(JsonRecord):
    """§4.4 ``/schemas/_index/by_id/{schema_id}``."""

    schema_id: int
    subject: str
