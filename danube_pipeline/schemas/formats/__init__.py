"""The three schema formats of the registry: Avro, JSON Schema and Protobuf.

:func:`parse_schema` turns a schema text into a :class:`ParsedSchema`, which knows its
fingerprint, validates payloads (the broker, for every message of a producer with a schema) and
decodes them (tiering). The registry stores the text exactly as registered
(``docs/etcd-layout.md`` §4.3, ``schema_def`` is ``{"<type>": {"fingerprint", "raw_schema"}}``).

=============  ====================================  =========================================
format         ``raw_schema``                        fingerprint (``"sha256:<hex>"`` of ...)
=============  ====================================  =========================================
``Avro``       Avro schema JSON (Avro spec 1.11)     the Parsing Canonical Form (Avro spec,
                                                     "Parsing Canonical Form for Schemas")
``JsonSchema`` a JSON Schema object; draft 2020-12   the canonical JSON: keys sorted, no
               unless ``$schema`` names draft 7      spaces, UTF-8 (non-ASCII kept as is)
``Protobuf``   ``.proto`` source, ``syntax =         the serialized ``FileDescriptorProto``
               "proto3"``; the FIRST top-level       of the file (deterministic
               message is the record type            serialization; comments are not in it)
=============  ====================================  =========================================

JSON Schema: only drafts 2020-12 (the default) and 7 are accepted; the schema must be a JSON
object, must pass its draft's meta-schema, and may use only local ``$ref`` (``#...``), so
validating never fetches anything. Formats (``"format"``) are not asserted.

Protobuf: the text is compiled at run time by ``protoc`` (``python -m grpc_tools.protoc``, in a
subprocess and a temporary directory, with a time limit) into a ``FileDescriptorSet``; its
files are added to a private ``DescriptorPool`` and the message class is built with
``google.protobuf.message_factory``. Nothing generated is written to the package or imported
from disk. The file may import Google's well-known types (``google/protobuf/*.proto``) and no
other file.

Every format refuses a schema text over :data:`MAX_SCHEMA_BYTES` or nested deeper than
:data:`MAX_SCHEMA_DEPTH`. Parsed schemas are cached (:func:`cached_schema`,
:func:`schema_for_fingerprint`): the broker compiles a Protobuf schema once, not per producer.

This package's modules: :mod:`.parsed_schema` (the type names, the limits and the
:class:`ParsedSchema` base), :mod:`.avro`, :mod:`.json_schema` and :mod:`.protobuf` (each
format's parsing, payload validation and decoding); this module picks the format and caches.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from typing import Final

from danube_pipeline.errors import InvalidSchemaError
from danube_pipeline.schemas.formats.avro import ParsedAvro, parse_avro_schema
from danube_pipeline.schemas.formats.json_schema import ParsedJsonSchema, parse_json_schema
from danube_pipeline.schemas.formats.parsed_schema import (
    AVRO,
    JSON_SCHEMA,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    PROTOBUF,
    SCHEMA_TYPES,
    Payload,
    ParsedSchema,
)
from danube_pipeline.schemas.formats.protobuf import ParsedProtobuf, parse_protobuf_schema

__all__ = [
    "AVRO",
    "JSON_SCHEMA",
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "PROTOBUF",
    "SCHEMA_TYPES",
    "ParsedAvro",
    "ParsedJsonSchema",
    "ParsedProtobuf",
    "ParsedSchema",
    "Payload",
    "cached_schema",
    "parse_schema",
    "schema_for_fingerprint",
]

CACHE_ENTRIES: Final = 512
"""Parsed schemas kept by :func:`parse_schema` (least recently used dropped first)."""

_PARSERS = {AVRO: parse_avro_schema, JSON_SCHEMA: parse_json_schema, PROTOBUF: parse_protobuf_schema}

_lock = threading.Lock()
_by_text: collections.OrderedDict[tuple[str, str], ParsedSchema] = collections.OrderedDict()
_by_fingerprint: dict[tuple[str, str], ParsedSchema] = {}


def _text_key(schema_type: str, raw_schema: str) -> tuple[str, str]:
    return schema_type, hashlib.sha256(raw_schema.encode("utf-8", errors="surrogatepass")).hexdigest()


def cached_schema(schema_type: str, raw_schema: str) -> ParsedSchema | None:
    """The parsed schema of exactly this text, if :func:`parse_schema` parsed it recently."""
    key = _text_key(schema_type, raw_schema)
    with _lock:
        parsed = _by_text.get(key)
        if parsed is not None:
            _by_text.move_to_end(key)
        return parsed


def schema_for_fingerprint(schema_type: str, fingerprint: str) -> ParsedSchema | None:
    """A cached parsed schema with this fingerprint (any text of it), or ``None``."""
    with _lock:
        return _by_fingerprint.get((schema_type, fingerprint))


def parse_schema(schema_type: str, raw_schema: str, *, subject: str) -> ParsedSchema:
    """Parse and validate a schema of ``schema_type`` (see the module docstring).

    Cached: the same text of the same type is parsed (and a Protobuf one compiled) once while
    it stays among the last :data:`CACHE_ENTRIES` parsed. Compiling Protobuf runs ``protoc``
    in a subprocess (about 0.1-0.2 s): call this in a worker thread from async code when
    :func:`cached_schema` misses.

    Args:
        schema_type: one of :data:`SCHEMA_TYPES`.
        raw_schema: the schema text.
        subject: the subject, named in errors.

    Returns:
        The parsed schema (shared: do not mutate it).

    Raises:
        InvalidSchemaError: an unknown type, a text over :data:`MAX_SCHEMA_BYTES` or nested
            deeper than :data:`MAX_SCHEMA_DEPTH`, or a text that is not a valid schema of its
            type; ``reason`` says why.
    """
    parser = _PARSERS.get(schema_type)
    if parser is None:
        raise InvalidSchemaError(subject, f"unknown schema type {schema_type!r}; one of {', '.join(SCHEMA_TYPES)}")
    found = cached_schema(schema_type, raw_schema)
    if found is not None:
        return found
    parsed = parser(subject, raw_schema)
    key = _text_key(schema_type, raw_schema)
    with _lock:
        _by_text[key] = parsed
        _by_fingerprint[(schema_type, parsed.fingerprint)] = parsed
        while len(_by_text) > CACHE_ENTRIES:
            _, dropped = _by_text.popitem(last=False)
            if _by_fingerprint.get((dropped.schema_type, dropped.fingerprint)) is dropped:
                del _by_fingerprint[(dropped.schema_type, dropped.fingerprint)]
    return parsed

