"""A minimal Avro schema registry over the ``/schemas/`` etcd keys (``docs/etcd-layout.md`` §4).

Layout (§4):

* ``/schemas/_global/next_schema_id`` (§4.1): the next free schema id.
* ``/schemas/{subject}/metadata`` (§4.2): :class:`~danube_pipeline.metadata.values.SchemaMetadata`,
  the subject's id, ``latest_version`` and every version.
* ``/schemas/{subject}/versions/{n}`` (§4.3): one immutable
  :class:`~danube_pipeline.metadata.values.SchemaVersion`.
* ``/schemas/_index/by_id/{id}`` (§4.4):
  :class:`~danube_pipeline.metadata.values.SchemaIndexEntry`, id -> subject.

The schema id belongs to the subject; versions count 1, 2, 3... within it. Compatibility
checking is not done yet (every new fingerprint becomes the next version).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
import time
from typing import Any

import fastavro.schema

from danube_pipeline.errors import InvalidSchemaError, SchemaNotFoundError
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import (
    AvroSchemaDef,
    SchemaIndexEntry,
    SchemaMetadata,
    SchemaVersion,
)
from danube_pipeline.names import validate_part, validate_subject

__all__ = ["RegisteredSchema", "SchemaRegistry", "avro_fingerprint", "parse_avro"]

AVRO = "Avro"
DEFAULT_COMPATIBILITY_MODE = "Backward"

MAX_SCHEMA_BYTES = 256 * 1024
"""Largest schema definition accepted, in bytes of UTF-8 JSON (``docs/etcd-layout.md`` §4.3)."""
MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of JSON objects and arrays accepted in a schema definition."""

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_DEPTH_STEP = {"{": 1, "[": 1, "}": -1, "]": -1}


def _json_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in JSON ``text``, found without recursion
    (strings are skipped; malformed text gets some number, and fails to parse later)."""
    brackets = (_DEPTH_STEP.get(ch, 0) for ch in _JSON_STRING.sub("", text) if ch in _DEPTH_STEP)
    return max(itertools.accumulate(brackets, initial=0))


@dataclasses.dataclass(frozen=True, slots=True)
class RegisteredSchema:
    """One version of a registered schema.

    Attributes:
        subject: the subject name, e.g. ``product-catalog``.
        schema_id: the subject's id (``docs/etcd-layout.md`` §4.2 ``id``), shared by all its versions.
        version: 1, 2, 3... within the subject.
        schema_type: ``"Avro"``.
        raw_schema: the schema text as registered.
        fingerprint: ``"sha256:<hex>"`` of the Avro Parsing Canonical Form.
    """

    subject: str
    schema_id: int
    version: int
    schema_type: str
    raw_schema: str
    fingerprint: str


def parse_avro(subject: str, raw_schema: str) -> Any:
    """Parse and validate an Avro schema (JSON text).

    Returns:
        fastavro's parsed schema: a ``dict`` for records, enums, arrays, maps and fixed; a
        ``str`` for a primitive; a ``list`` for a union.

    Raises:
        InvalidSchemaError: if ``raw_schema`` is over :data:`MAX_SCHEMA_BYTES`, nests deeper
            than :data:`MAX_SCHEMA_DEPTH`, is not JSON or is not a valid Avro schema.
    """
    size = len(raw_schema.encode("utf-8", errors="surrogatepass"))
    if size > MAX_SCHEMA_BYTES:
        raise InvalidSchemaError(subject, f"{size} bytes, more than the {MAX_SCHEMA_BYTES} allowed")
    depth = _json_depth(raw_schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidSchemaError(subject, f"nested {depth} levels deep, more than the {MAX_SCHEMA_DEPTH} allowed")
    try:
        loaded = json.loads(raw_schema)
    except ValueError as exc:
        raise InvalidSchemaError(subject, f"not JSON: {exc}") from exc
    try:
        return fastavro.schema.parse_schema(loaded)
    except Exception as exc:  # noqa: BLE001 - fastavro raises many unrelated types
        raise InvalidSchemaError(subject, f"{type(exc).__name__}: {exc}") from exc


def _fingerprint_of(parsed: Any) -> str:
    canonical = fastavro.schema.to_parsing_canonical_form(parsed)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def avro_fingerprint(raw_schema: str) -> str:
    """``"sha256:"`` + hex SHA-256 of the schema's Parsing Canonical Form (Avro spec).

    Schemas that differ only in whitespace, field order of JSON attributes, ``doc`` or
    ``default`` have the same fingerprint.

    Raises:
        InvalidSchemaError: if ``raw_schema`` is not a valid Avro schema.
    """
    return _fingerprint_of(parse_avro("<fingerprint>", raw_schema))


def _registered(subject: str, schema_id: int, version: SchemaVersion) -> RegisteredSchema:
    schema_type, body = next(iter(version.schema_def.items()))
    return RegisteredSchema(
        subject=subject,
        schema_id=schema_id,
        version=version.version,
        schema_type=schema_type,
        raw_schema=str(body.get("raw_schema", "")),
        fingerprint=version.fingerprint,
    )


class SchemaRegistry:
    """Register and look up Avro schemas in etcd (``docs/etcd-layout.md`` §4)."""

    def __init__(self, store: MetadataStore) -> None:
        self._store = store

    async def register_avro(
        self, subject: str, raw_schema: str, *, created_by: str = "danube-client"
    ) -> RegisteredSchema:
        """Register ``raw_schema`` under ``subject``.

        * New subject: allocates the next id from ``/schemas/_global/next_schema_id`` and writes
          ``versions/1``, ``metadata`` and ``_index/by_id/{id}`` in one etcd transaction.
        * A fingerprint equal to an existing version of the subject: returns that version and
          writes nothing.
        * A new fingerprint: writes ``versions/{latest+1}`` and the updated ``metadata``.

        Concurrent registrations are serialised by compare-and-put on the metadata key (and on
        the id counter for a new subject); the loser re-reads and retries.

        Args:
            subject: the subject name (``danube_pipeline.names.validate_subject``).
            raw_schema: Avro schema JSON text, stored verbatim.
            created_by: recorded in ``created_by``; a name of the producer grammar.

        Returns:
            The registered (or already existing) version.

        Raises:
            InvalidNameError: ``subject`` or ``created_by`` breaks its grammar
                (``docs/etcd-layout.md``, "Name grammar").
            InvalidSchemaError: the schema is too large, too deep, or does not parse.
            MetadataStoreError: if etcd cannot be reached.
        """
        validate_subject(subject)
        validate_part("created_by", created_by)
        fingerprint = _fingerprint_of(parse_avro(subject, raw_schema))
        metadata_key = keys.schema_metadata(subject)
        while True:
            now = int(time.time())
            current = await self._store.get(metadata_key)
            if current is None:
                registered = await self._create_subject(
                    subject, raw_schema, fingerprint, created_by, now
                )
                if registered is not None:
                    return registered
                continue
            meta = SchemaMetadata.from_json(current.value)
            for existing in meta.versions:
                if existing.fingerprint == fingerprint:
                    return _registered(subject, meta.id, existing)
            version = _new_version(
                meta.latest_version + 1, raw_schema, fingerprint, created_by, now
            )
            updated = dataclasses.replace(
                meta,
                latest_version=version.version,
                updated_at=now,
                versions=[*meta.versions, version],
            )
            written = await self._store.compare_and_put_many(
                [(keys.schema_version(subject, version.version), version), (metadata_key, updated)],
                expected_mod_revisions={metadata_key: current.mod_revision},
            )
            if written is not None:
                return _registered(subject, meta.id, version)

    async def _create_subject(
        self, subject: str, raw_schema: str, fingerprint: str, created_by: str, now: int
    ) -> RegisteredSchema | None:
        counter = await self._store.get(keys.SCHEMA_NEXT_ID)
        schema_id = 1 if counter is None else int(counter.value)  # type: ignore[arg-type]
        version = _new_version(1, raw_schema, fingerprint, created_by, now)
        meta = SchemaMetadata(
            compatibility_mode=DEFAULT_COMPATIBILITY_MODE,
            created_at=now,
            created_by=created_by,
            id=schema_id,
            latest_version=1,
            subject=subject,
            topics_using=[],
            updated_at=now,
            versions=[version],
        )
        metadata_key = keys.schema_metadata(subject)
        written = await self._store.compare_and_put_many(
            [
                (keys.SCHEMA_NEXT_ID, schema_id + 1),
                (keys.schema_version(subject, 1), version),
                (metadata_key, meta),
                (keys.schema_by_id(schema_id), SchemaIndexEntry(schema_id, subject)),
            ],
            expected_mod_revisions={
                metadata_key: 0,
                keys.SCHEMA_NEXT_ID: 0 if counter is None else counter.mod_revision,
            },
        )
        return None if written is None else _registered(subject, schema_id, version)

    async def _metadata(self, subject: str) -> SchemaMetadata:
        kv = await self._store.get(keys.schema_metadata(subject))
        if kv is None:
            raise SchemaNotFoundError(f"subject {subject!r}")
        return SchemaMetadata.from_json(kv.value)

    async def _version(self, meta: SchemaMetadata, version: int | None) -> RegisteredSchema:
        number = meta.latest_version if version is None else version
        kv = await self._store.get(keys.schema_version(meta.subject, number))
        if kv is None:
            raise SchemaNotFoundError(f"subject {meta.subject!r} version {number}")
        return _registered(meta.subject, meta.id, SchemaVersion.from_json(kv.value))

    async def get_by_id(self, schema_id: int, *, version: int | None = None) -> RegisteredSchema:
        """Look a schema up by its id (``docs/etcd-layout.md`` §4.4 index, then §4.3).

        Args:
            schema_id: the subject's schema id.
            version: the version within the subject; ``None`` = the latest.

        Raises:
            SchemaNotFoundError: if no subject has that id or it lacks that version.
            MetadataStoreError: if etcd cannot be reached.
        """
        kv = await self._store.get(keys.schema_by_id(schema_id))
        if kv is None:
            raise SchemaNotFoundError(f"schema id {schema_id}")
        entry = SchemaIndexEntry.from_json(kv.value)
        return await self._version(await self._metadata(entry.subject), version)

    async def get_latest(self, subject: str) -> RegisteredSchema:
        """The latest version of ``subject``.

        Raises:
            SchemaNotFoundError: if the subject is not registered.
            MetadataStoreError: if etcd cannot be reached.
        """
        return await self._version(await self._metadata(subject), None)

    async def get_version(self, subject: str, version: int) -> RegisteredSchema:
        """Version ``version`` of ``subject``.

        Raises:
            SchemaNotFoundError: if the subject or the version does not exist.
            MetadataStoreError: if etcd cannot be reached.
        """
        return await self._version(await self._metadata(subject), version)


def _new_version(
    number: int, raw_schema: str, fingerprint: str, created_by: str, now: int
) -> SchemaVersion:
    return SchemaVersion(
        created_at=now,
        created_by=created_by,
        version=number,
        fingerprint=fingerprint,
        is_deprecated=False,
        schema_def={AVRO: AvroSchemaDef(fingerprint=fingerprint, raw_schema=raw_schema).to_json()},
        tags=[],
    )
