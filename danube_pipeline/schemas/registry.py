"""The schema registry over the ``/schemas/`` etcd keys (``docs/etcd-layout.md`` §4).

Layout (§4):

* ``/schemas/_global/next_schema_id`` (§4.1): the next free schema id.
* ``/schemas/{subject}/metadata`` (§4.2): :class:`~danube_pipeline.metadata.schema_values.SchemaMetadata`,
  the subject's id, ``compatibility_mode``, ``latest_version``, ``topics_using`` and every
  version.
* ``/schemas/{subject}/versions/{n}`` (§4.3): one immutable
  :class:`~danube_pipeline.metadata.schema_values.SchemaVersion`.
* ``/schemas/_index/by_id/{id}`` (§4.4):
  :class:`~danube_pipeline.metadata.schema_values.SchemaIndexEntry`, id -> subject.

The schema id belongs to the subject; versions count 1, 2, 3... within it. A subject holds one
schema type (Avro, JSON Schema or Protobuf: :mod:`danube_pipeline.schemas.formats`), and a new
version must pass the subject's compatibility mode (:mod:`danube_pipeline.schemas.compatibility`).

Writes go to etcd with compare-and-put on the metadata key's ``mod_revision`` (retried when a
concurrent write wins). Reads come from a :class:`~danube_pipeline.metadata.cache.LocalCache`
when one is given (the broker's, kept current by its etcd watch), and from etcd on a miss.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from danube_pipeline.errors import (
    IncompatibleSchemaError,
    MalformedRequestError,
    SchemaNotFoundError,
)
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.cache import LocalCache
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.schema_values import AvroSchemaDef, SchemaIndexEntry, SchemaMetadata, SchemaVersion
from danube_pipeline.metadata.values import JsonValue
from danube_pipeline.names import validate_part, validate_subject
from danube_pipeline.schemas.compatibility import (
    DEFAULT_MODE,
    check_compatibility,
    normalize_mode,
)
from danube_pipeline.schemas.formats import (
    AVRO,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    SCHEMA_TYPES,
    ParsedAvro,
    ParsedSchema,
    cached_schema,
    parse_schema,
)

__all__ = [
    "DEFAULT_COMPATIBILITY_MODE",
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "SCHEMA_TYPES",
    "RegisteredSchema",
    "SchemaRegistry",
    "avro_fingerprint",
    "parse_avro",
]

log = logging.getLogger(__name__)

DEFAULT_COMPATIBILITY_MODE = DEFAULT_MODE
"""``Backward``: the mode of a subject registered without one."""


@dataclasses.dataclass(frozen=True, slots=True)
class RegisteredSchema:
    """One version of a registered schema.

    Attributes:
        subject: the subject name, e.g. ``product-catalog``.
        schema_id: the subject's id (``docs/etcd-layout.md`` §4.2 ``id``), shared by all its versions.
        version: 1, 2, 3... within the subject.
        schema_type: ``"Avro"``, ``"JsonSchema"`` or ``"Protobuf"``.
        raw_schema: the schema text as registered.
        fingerprint: ``"sha256:<hex>"`` (:mod:`danube_pipeline.schemas.formats`).
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
    parsed = parse_schema(AVRO, raw_schema, subject=subject)
    assert isinstance(parsed, ParsedAvro)
    return parsed.fastavro_schema


def avro_fingerprint(raw_schema: str) -> str:
    """``"sha256:"`` + hex SHA-256 of the schema's Parsing Canonical Form (Avro spec).

    Schemas that differ only in whitespace, field order of JSON attributes, ``doc`` or
    ``default`` have the same fingerprint.

    Raises:
        InvalidSchemaError: if ``raw_schema`` is not a valid Avro schema.
    """
    return parse_schema(AVRO, raw_schema, subject="<fingerprint>").fingerprint


def _registered(subject: str, schema_id: int, version: SchemaVersion) -> RegisteredSchema:
    return RegisteredSchema(
        subject=subject,
        schema_id=schema_id,
        version=version.version,
        schema_type=version.schema_type,
        raw_schema=version.raw_schema,
        fingerprint=version.fingerprint,
    )


async def parse_in_thread(schema_type: str, raw_schema: str, *, subject: str) -> ParsedSchema:
    """:func:`~danube_pipeline.schemas.formats.parse_schema` from async code: from the cache, or
    in a worker thread (compiling Protobuf runs ``protoc``).

    Raises:
        InvalidSchemaError: the schema does not parse.
    """
    found = cached_schema(schema_type, raw_schema)
    if found is not None:
        return found
    return await asyncio.to_thread(parse_schema, schema_type, raw_schema, subject=subject)


class SchemaRegistry:
    """Register and look up schemas in etcd (``docs/etcd-layout.md`` §4).

    Args:
        store: etcd, for every write (and reads without a cache).
        cache: a started :class:`LocalCache` covering ``/schemas/`` (the broker passes its own):
            lookups are then served from memory, kept fresh by the cache's etcd watch, and go
            to etcd only for a key the cache does not hold (yet).

    Raises:
        ValueError: ``cache`` does not cover ``/schemas/``.
    """

    def __init__(self, store: MetadataStore, *, cache: LocalCache | None = None) -> None:
        if cache is not None and not any(f"{keys.SCHEMAS}/".startswith(p) for p in cache.prefixes):
            raise ValueError(f"the LocalCache covers {cache.prefixes}, not {keys.SCHEMAS}/")
        self._store = store
        self._cache = cache

    # ------------------------------------------------------------------ reads

    async def _read(self, key: str) -> JsonValue | None:
        if self._cache is not None:
            value = self._cache.get(key)
            if value is not None:
                return value
        kv = await self._store.get(key)
        return None if kv is None else kv.value

    async def _metadata(self, subject: str) -> SchemaMetadata:
        raw = await self._read(keys.schema_metadata(subject))
        if raw is None:
            raise SchemaNotFoundError(f"subject {subject!r}")
        return SchemaMetadata.from_json(raw)

    async def _version(self, meta: SchemaMetadata, version: int | None) -> RegisteredSchema:
        number = meta.latest_version if version is None else version
        for known in meta.versions:  # the metadata repeats every version (§4.2)
            if known.version == number:
                return _registered(meta.subject, meta.id, known)
        raw = await self._read(keys.schema_version(meta.subject, number))
        if raw is None:
            raise SchemaNotFoundError(f"subject {meta.subject!r} version {number}")
        return _registered(meta.subject, meta.id, SchemaVersion.from_json(raw))

    async def get_by_id(self, schema_id: int, *, version: int | None = None) -> RegisteredSchema:
        """Look a schema up by its id (``docs/etcd-layout.md`` §4.4 index, then §4.2).

        Args:
            schema_id: the subject's schema id.
            version: the version within the subject; ``None`` = the latest.

        Raises:
            SchemaNotFoundError: if no subject has that id or it lacks that version.
            MetadataStoreError: if etcd cannot be reached (on a cache miss).
        """
        raw = await self._read(keys.schema_by_id(schema_id))
        if raw is None:
            raise SchemaNotFoundError(f"schema id {schema_id}")
        entry = SchemaIndexEntry.from_json(raw)
        return await self._version(await self._metadata(entry.subject), version)

    async def get_latest(self, subject: str) -> RegisteredSchema:
        """The latest version of ``subject``.

        Raises:
            SchemaNotFoundError: if the subject is not registered.
            MetadataStoreError: if etcd cannot be reached (on a cache miss).
        """
        return await self._version(await self._metadata(subject), None)

    async def get_version(self, subject: str, version: int) -> RegisteredSchema:
        """Version ``version`` of ``subject``.

        Raises:
            SchemaNotFoundError: if the subject or the version does not exist.
            MetadataStoreError: if etcd cannot be reached (on a cache miss).
        """
        return await self._version(await self._metadata(subject), version)

    async def get_metadata(self, subject: str) -> SchemaMetadata:
        """The subject's §4.2 metadata (mode, ``topics_using``, every version).

        Raises:
            SchemaNotFoundError: if the subject is not registered.
            MetadataStoreError: if etcd cannot be reached (on a cache miss).
        """
        return await self._metadata(subject)

    async def parse(self, schema: RegisteredSchema) -> ParsedSchema:
        """The parsed form of a registered schema (cached by text; see
        :func:`~danube_pipeline.schemas.formats.parse_schema`).

        Raises:
            InvalidSchemaError: the stored text does not parse (etcd edited by hand).
        """
        return await parse_in_thread(schema.schema_type, schema.raw_schema, subject=schema.subject)

    # ------------------------------------------------------------------ writes

    async def register_avro(
        self, subject: str, raw_schema: str, *, created_by: str = "danube-client"
    ) -> RegisteredSchema:
        """:meth:`register` of an Avro schema."""
        return await self.register(subject, AVRO, raw_schema, created_by=created_by)

    async def register(
        self,
        subject: str,
        schema_type: str,
        raw_schema: str,
        *,
        created_by: str = "danube-client",
        compatibility_mode: str | None = None,
    ) -> RegisteredSchema:
        """Register ``raw_schema`` under ``subject``.

        * New subject: allocates the next id from ``/schemas/_global/next_schema_id`` and writes
          ``versions/1``, ``metadata`` (with ``compatibility_mode``, default ``Backward``) and
          ``_index/by_id/{id}`` in one etcd transaction.
        * A fingerprint equal to an existing version of the subject (same schema type): returns
          that version and writes nothing.
        * A new fingerprint: checked against the subject's versions under its
          ``compatibility_mode`` (:func:`~danube_pipeline.schemas.compatibility.check_compatibility`),
          then written as ``versions/{latest+1}`` with the updated ``metadata``.

        Concurrent registrations are serialised by compare-and-put on the metadata key (and on
        the id counter for a new subject); the loser re-reads, checks again and retries.

        Args:
            subject: the subject name (``danube_pipeline.names.validate_subject``).
            schema_type: ``"Avro"``, ``"JsonSchema"`` or ``"Protobuf"``.
            raw_schema: the schema text, stored verbatim.
            created_by: recorded in ``created_by``; a name of the producer grammar.
            compatibility_mode: the mode of a new subject (either spelling,
                :func:`~danube_pipeline.schemas.compatibility.normalize_mode`); ``None`` or ``""`` =
                ``Backward`` for a new subject, the subject's own for an existing one. Given for
                an existing subject, it must be the subject's mode (change it with
                :meth:`set_compatibility_mode`).

        Returns:
            The registered (or already existing) version.

        Raises:
            InvalidNameError: ``subject`` or ``created_by`` breaks its grammar
                (``docs/etcd-layout.md``, "Name grammar").
            InvalidSchemaError: an unknown schema type, or the schema is too large, too deep,
                or does not parse.
            MalformedRequestError: an unknown ``compatibility_mode``, or one that differs from
                the existing subject's.
            IncompatibleSchemaError: the schema's type differs from the subject's, or the schema
                breaks the subject's compatibility mode (the first incompatibility found: its
                field, rule and the version it conflicts with).
            MetadataStoreError: if etcd cannot be reached.
        """
        validate_subject(subject)
        validate_part("created_by", created_by)
        mode = normalize_mode(compatibility_mode) if compatibility_mode else None
        parsed = await parse_in_thread(schema_type, raw_schema, subject=subject)
        metadata_key = keys.schema_metadata(subject)
        while True:
            now = int(time.time())
            current = await self._store.get(metadata_key)
            if current is None:
                registered = await self._create_subject(subject, parsed, created_by, mode or DEFAULT_MODE, now)
                if registered is not None:
                    return registered
                continue
            meta = SchemaMetadata.from_json(current.value)
            for existing in meta.versions:
                if existing.fingerprint == parsed.fingerprint and existing.schema_type == parsed.schema_type:
                    return _registered(subject, meta.id, existing)
            subject_mode = normalize_mode(meta.compatibility_mode or DEFAULT_MODE)
            if mode is not None and mode != subject_mode:
                raise MalformedRequestError(
                    f"subject {subject!r} has compatibility mode {subject_mode}, the request asks for {mode}: "
                    "change the subject's mode first (SetCompatibilityMode)"
                )
            await self._check(subject, subject_mode, parsed, meta)
            version = _new_version(meta.latest_version + 1, parsed, created_by, now)
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

    async def _check(self, subject: str, mode: str, parsed: ParsedSchema, meta: SchemaMetadata) -> None:
        versions = sorted(meta.versions, key=lambda v: v.version)
        needed = versions if mode.endswith("Transitive") else versions[-1:]
        previous = [await parse_in_thread(v.schema_type, v.raw_schema, subject=subject) for v in needed]
        incompatible = check_compatibility(mode, parsed, previous, versions=[v.version for v in needed])
        if incompatible:
            first = incompatible[0]
            more = f" (and {len(incompatible) - 1} more)" if len(incompatible) > 1 else ""
            raise IncompatibleSchemaError(subject, mode, first.version, first.path, first.rule, first.message + more)

    async def _create_subject(
        self, subject: str, parsed: ParsedSchema, created_by: str, mode: str, now: int
    ) -> RegisteredSchema | None:
        counter = await self._store.get(keys.SCHEMA_NEXT_ID)
        # The counter is an int this class wrote (§4.1); a list or object there fails in int().
        schema_id = 1 if counter is None else int(counter.value)  # type: ignore[arg-type]
        version = _new_version(1, parsed, created_by, now)
        meta = SchemaMetadata(
            compatibility_mode=mode,
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

    async def _update_metadata(
        self, subject: str, change: Callable[[SchemaMetadata], SchemaMetadata | None]
    ) -> SchemaMetadata:
        """Apply ``change(meta) -> SchemaMetadata | None`` (``None``: nothing to write) with
        compare-and-put on the metadata key, retried until it holds."""
        metadata_key = keys.schema_metadata(subject)
        while True:
            current = await self._store.get(metadata_key)
            if current is None:
                raise SchemaNotFoundError(f"subject {subject!r}")
            meta = SchemaMetadata.from_json(current.value)
            updated = change(meta)
            if updated is None:
                return meta
            if await self._store.compare_and_put(metadata_key, updated, expected_mod_revision=current.mod_revision):
                return updated

    async def set_compatibility_mode(self, subject: str, mode: str) -> str:
        """Set the subject's ``compatibility_mode`` (§4.2); checked at its next registration.
        Versions already registered are not re-checked.

        Args:
            subject: an existing subject.
            mode: either spelling (:func:`~danube_pipeline.schemas.compatibility.normalize_mode`).

        Returns:
            The mode stored (Danube spelling, e.g. ``"FullTransitive"``).

        Raises:
            InvalidNameError: ``subject`` breaks its grammar.
            MalformedRequestError: an unknown mode.
            SchemaNotFoundError: the subject is not registered.
            MetadataStoreError: if etcd cannot be reached.
        """
        validate_subject(subject)
        canonical = normalize_mode(mode)

        def change(meta: SchemaMetadata) -> SchemaMetadata | None:
            if meta.compatibility_mode == canonical:
                return None
            return dataclasses.replace(meta, compatibility_mode=canonical, updated_at=int(time.time()))

        await self._update_metadata(subject, change)
        return canonical

    async def add_topic(self, subject: str, topic: str) -> bool:
        """Record that a producer with the subject's schema publishes to ``topic``: append it to
        ``topics_using`` (§4.2) unless listed already.

        Args:
            subject: the subject.
            topic: ``/{ns}/{topic}``.

        Returns:
            True if this call added it, false if it was listed.

        Raises:
            SchemaNotFoundError: the subject is not registered.
            MetadataStoreError: if etcd cannot be reached.
        """
        if self._cache is not None:  # most producers find their topic listed already
            raw = self._cache.get(keys.schema_metadata(subject))
            if isinstance(raw, dict) and topic in (raw.get("topics_using") or []):
                return False
        added = False

        def change(meta: SchemaMetadata) -> SchemaMetadata | None:
            nonlocal added
            added = topic not in meta.topics_using
            return dataclasses.replace(meta, topics_using=[*meta.topics_using, topic]) if added else None

        await self._update_metadata(subject, change)
        return added

    async def remove_topic(self, subject: str, topic: str) -> bool:
        """Take ``topic`` out of the subject's ``topics_using`` (§4.2), e.g. once it is deleted.

        Returns:
            True if it was listed.

        Raises:
            MetadataStoreError: if etcd cannot be reached.
        """
        removed = False

        def change(meta: SchemaMetadata) -> SchemaMetadata | None:
            nonlocal removed
            removed = topic in meta.topics_using
            return dataclasses.replace(meta, topics_using=[t for t in meta.topics_using if t != topic]) if removed else None

        try:
            await self._update_metadata(subject, change)
        except SchemaNotFoundError:
            return False
        return removed


def _new_version(number: int, parsed: ParsedSchema, created_by: str, now: int) -> SchemaVersion:
    return SchemaVersion(
        created_at=now,
        created_by=created_by,
        version=number,
        fingerprint=parsed.fingerprint,
        is_deprecated=False,
        schema_def={
            parsed.schema_type: AvroSchemaDef(fingerprint=parsed.fingerprint, raw_schema=parsed.raw_schema).to_json()
        },
        tags=[],
    )
