"""The registry's writer schemas of the records, parsed: one lookup for tiering and bulk loads.

Each ``(schema_id, schema_version)`` of the records is asked of the registry once and parsed
into a :class:`~danube_pipeline.lake.iceberg.RegisteredWriter`. An id the registry lacks or a
schema that does not parse is not an error: the answer carries the dead-letter ``_error`` of
its records (``unknown schema`` / ``unreadable schema``,
:mod:`danube_pipeline.lake.iceberg.dead_letter`).
"""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any, Protocol

from danube_pipeline.errors import InvalidSchemaError, SchemaNotFoundError
from danube_pipeline.format.records import Record
from danube_pipeline.lake import iceberg
from danube_pipeline.lake.segment_columns import schema_keys

__all__ = [
    "SchemaLookup",
    "SchemaParser",
    "default_schema_parser",
    "registered_writer",
    "registered_writers",
]


class SchemaLookup(Protocol):
    """The part of ``SchemaRegistry`` the table commit uses."""

    async def get_by_id(self, schema_id: int, *, version: int | None = None) -> Any: ...


def _schema_dict(raw: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    parsed = json.loads(raw)
    return parsed if isinstance(parsed, dict) else {"type": parsed}


async def _schemas_for(
    records: Sequence[Record], registry: SchemaLookup
) -> tuple[dict[str, Any] | None, dict[tuple[int, int], dict[str, Any]]]:
    """Avro only: the latest version widened with fields older writers still carry
    (:func:`~danube_pipeline.lake.iceberg.widen_avro_schema`) and each ``(schema_id, version)``'s
    writer schema, for :func:`~danube_pipeline.lake.iceberg.append_records`. Tiering itself resolves
    writers of every format with :func:`registered_writers` instead."""
    pairs = [k for k in schema_keys(records) if k[0] != 0]
    if not pairs:
        return None, {}
    writers: dict[tuple[int, int], dict[str, Any]] = {}
    for schema_id, version in pairs:
        registered = await registry.get_by_id(schema_id, version=version or None)
        writers[(schema_id, version)] = _schema_dict(registered.raw_schema)
    newest_id = pairs[-1][0]
    latest = await registry.get_by_id(newest_id)
    # Fields a later version removed still hold data in records written before the removal.
    table_schema = iceberg.widen_avro_schema(_schema_dict(latest.raw_schema), writers.values())
    return table_schema, writers


SchemaParser = Callable[..., Any]
"""``parse(schema_type, raw_schema, *, subject) -> parsed`` with the attributes
:func:`~danube_pipeline.lake.iceberg.writer_for_parsed` reads (``schema_type``, ``avro``,
``json_schema``, ``message_descriptor``): ``danube_pipeline.schemas.formats.parse_schema``."""


def default_schema_parser() -> SchemaParser:
    """The registry's ``danube_pipeline.schemas.formats.parse_schema``; where that module is
    missing, a parser of Avro and JSON Schema texts (``json.loads``) that refuses Protobuf."""
    try:
        module = importlib.import_module("danube_pipeline.schemas.formats")
    except ImportError:
        return _json_parser
    parser: SchemaParser = module.parse_schema
    return parser


def _json_parser(schema_type: str, raw_schema: str, *, subject: str) -> Any:
    if schema_type not in (iceberg.writer.AVRO, iceberg.writer.JSON_SCHEMA):
        raise InvalidSchemaError(subject, f"no parser for {schema_type} schemas here")
    loaded = json.loads(raw_schema) if raw_schema.strip()[:1] in ("{", "[", '"') else raw_schema
    return SimpleNamespace(schema_type=schema_type, avro=loaded, json_schema=loaded)


_PARSE_ERRORS = (InvalidSchemaError, ValueError, TypeError, KeyError, AttributeError)
"""What a schema that cannot be parsed or mapped raises: its records are dead-lettered."""


async def registered_writer(
    key: tuple[int, int], registry: SchemaLookup, parse: SchemaParser
) -> iceberg.RegisteredWriter:
    """What the registry has for ``(schema_id, version)``, parsed (version 0: the latest).

    Args:
        key: the ``(schema_id, schema_version)`` of records.
        registry: the schema registry.
        parse: parses the registered text (:data:`SchemaParser`); run in a worker thread.

    Returns:
        The :class:`~danube_pipeline.lake.iceberg.RegisteredWriter`, with its writer schema and
        ``raw_schema`` text, or with the ``_error`` of its records when the registry lacks the
        id (``unknown schema``) or the text does not parse or map (``unreadable schema``).

    Raises:
        MetadataStoreError: the registry could not read etcd.
    """
    schema_id, version = key
    try:
        registered = await registry.get_by_id(schema_id, version=version or None)
    except SchemaNotFoundError as exc:
        return iceberg.RegisteredWriter(
            schema_id, version,
            error=f"{iceberg.DeadLetterReason.UNKNOWN_SCHEMA}: schema id {schema_id} version {version} "
            f"is not in the registry ({exc})",
        )
    schema_type = getattr(registered, "schema_type", iceberg.writer.AVRO)
    subject = getattr(registered, "subject", None)
    raw = registered.raw_schema if isinstance(registered.raw_schema, str) else str(registered.raw_schema)
    try:
        parsed = await asyncio.to_thread(parse, schema_type, raw, subject=subject or "?")
        writer = iceberg.writer_for_parsed(parsed)
    except _PARSE_ERRORS as exc:
        return iceberg.RegisteredWriter(
            schema_id, version, subject, schema_type,
            error=f"{iceberg.DeadLetterReason.UNREADABLE_SCHEMA}: schema id {schema_id} version {version} "
            f"({schema_type}): {exc}",
        )
    return iceberg.RegisteredWriter(schema_id, version, subject, schema_type, writer, raw_schema=raw)


async def registered_writers(
    records: Sequence[Record],
    registry: SchemaLookup,
    parse: SchemaParser,
    cache: dict[tuple[int, int], iceberg.RegisteredWriter],
) -> dict[tuple[int, int], iceberg.RegisteredWriter]:
    """The :func:`registered_writer` of each ``(schema_id, schema_version)`` of ``records`` that
    has a schema, asking the registry once per pair.

    Args:
        records: the records, in offset order.
        registry: the schema registry.
        parse: parses the registered text (:data:`SchemaParser`).
        cache: the answers so far, per pair; new answers are added.

    Returns:
        ``{(schema_id, schema_version): RegisteredWriter}`` in pair order (schema id 0, no
        schema, left out).

    Raises:
        MetadataStoreError: the registry could not read etcd.
    """
    out: dict[tuple[int, int], iceberg.RegisteredWriter] = {}
    for key in [k for k in schema_keys(records) if k[0] != 0]:
        if key not in cache:
            cache[key] = await registered_writer(key, registry, parse)
        out[key] = cache[key]
    return out
