"""Avro schemas (Avro specification 1.11): parsing a schema text, validating and decoding payloads.

The fingerprint hashes the schema's Parsing Canonical Form (Avro spec, "Parsing Canonical Form
for Schemas").
"""

from __future__ import annotations

import io
from typing import Any

import fastavro
import fastavro.schema

from danube_pipeline.errors import InvalidSchemaError
from danube_pipeline.schemas.formats.parsed_schema import (
    AVRO,
    Payload,
    ParsedSchema,
    check_size,
    json_depth,
    load_json,
    sha256_fingerprint,
)


class ParsedAvro(ParsedSchema):
    """An Avro schema (Avro specification 1.11).

    Attributes:
        fastavro_schema: fastavro's parsed form, for ``schemaless_reader`` / ``schemaless_writer``.
    """

    schema_type = AVRO

    def __init__(self, raw_schema: str, loaded: Any, parsed: Any) -> None:
        self.raw_schema = raw_schema
        self._loaded = loaded
        self.fastavro_schema = parsed
        canonical = fastavro.schema.to_parsing_canonical_form(parsed)
        self.fingerprint = sha256_fingerprint(canonical.encode("utf-8"))

    @property
    def avro(self) -> Any:
        return self._loaded

    def validate(self, payload: Payload) -> None:
        buf = io.BytesIO(payload)
        try:
            fastavro.schemaless_reader(buf, self.fastavro_schema, None)
        except Exception as exc:  # noqa: BLE001 - fastavro raises many types
            raise ValueError(f"{type(exc).__name__}: {exc}") from exc
        left = len(payload) - buf.tell()
        if left:
            raise ValueError(f"{left} bytes left after decoding")

    def decode(self, payload: Payload) -> Any:
        try:
            return fastavro.schemaless_reader(io.BytesIO(payload), self.fastavro_schema, None)
        except Exception as exc:  # noqa: BLE001 - fastavro raises many types
            raise ValueError(f"{type(exc).__name__}: {exc}") from exc


def parse_avro_schema(subject: str, raw_schema: str) -> ParsedAvro:
    """Parse an Avro schema text.

    Raises:
        InvalidSchemaError: too large or deep, not JSON, or not a valid Avro schema.
    """
    check_size(subject, raw_schema, json_depth(raw_schema))
    try:
        loaded = load_json(raw_schema)
    except ValueError as exc:
        raise InvalidSchemaError(subject, f"not JSON: {exc}") from exc
    try:
        parsed = fastavro.schema.parse_schema(loaded)
    except Exception as exc:  # noqa: BLE001 - fastavro raises many unrelated types
        raise InvalidSchemaError(subject, f"{type(exc).__name__}: {exc}") from exc
    return ParsedAvro(raw_schema, loaded, parsed)
