"""Writer schemas bound to a topic's table: create or evolve the table, dead-letter, remap.

Both writers of a topic's table take this one path, so that they write the same columns, rows
and dead letters by construction: tiering per segment object
(:func:`~danube_pipeline.lake.iceberg.commit.commit_object`) and a bulk load for all of its
objects at once (:mod:`danube_pipeline.lake.bulk`).

1. :func:`ensure_table_for_writers`: a missing table is created from the first writer schema
   of the records (in ``(schema_id, version)`` order), or with ``_payload`` when no record has
   a schema.
2. :func:`bind_writers`: the table is evolved in place for each writer schema, oldest first
   (:mod:`.evolution`); a version whose change cannot be made in place gets the dead-letter
   error ``needs schema_rewrite``, the others go on. Then each writer's renamed fields are
   mapped to the names the table follows.
3. :func:`raw_message_error`: the ``_error`` of a record without a schema on a table with one.

With the layout's ``raw_payload`` on (``docs/etcd-layout.md`` §3.9), a table with typed columns
is created with ``_raw_payload`` and ``_key``, and an existing one gains them in step 2
(:func:`ensure_raw_payload_columns`); the rows then carry each payload's exact bytes and the
routing key (:func:`~danube_pipeline.lake.iceberg.rows.table_rows`). A ``_payload`` table gets
``_key`` only: its ``_payload`` already holds the exact bytes.

A table created here records the incarnation of the topic it is for
(:data:`TOPIC_INCARNATION_PROPERTY`; :mod:`danube_pipeline.lake.tiering.incarnation`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pyiceberg.catalog import Catalog
from pyiceberg.table import Table
from pyiceberg.types import BinaryType, IcebergType

from danube_pipeline.errors import SchemaEvolutionError
from danube_pipeline.lake.iceberg.catalog import ensure_table_for_schema
from danube_pipeline.lake.iceberg.dead_letter import DeadLetterReason
from danube_pipeline.lake.iceberg.evolution import (
    SCHEMA_ID_PROPERTY,
    SCHEMA_SUBJECT_PROPERTY,
    SCHEMA_VERSION_PROPERTY,
    SchemaChange,
    add_optional_columns,
    evolve_table,
)
from danube_pipeline.lake.iceberg.rows import BoundWriter
from danube_pipeline.lake.iceberg.schema import (
    KEY_COLUMN,
    KEY_DOC,
    PAYLOAD_COLUMN,
    RAW_PAYLOAD_COLUMN,
    RESERVED_COLUMNS,
    PayloadColumn,
    key_type,
    schema_from_columns,
)
from danube_pipeline.lake.iceberg.writer import WriterSchema, renamed_columns
from danube_pipeline.metadata.values import TableLayout
from danube_pipeline.names import TopicName

__all__ = [
    "TOPIC_INCARNATION_PROPERTY",
    "RegisteredWriter",
    "WriterBinding",
    "bind_writers",
    "ensure_raw_payload_columns",
    "ensure_table_for_writers",
    "raw_message_error",
    "recorded_schema",
    "supersedes",
]

log = logging.getLogger(__name__)

TOPIC_INCARNATION_PROPERTY = "danube.topic-incarnation"
"""Table property: the incarnation of the topic whose rows the table holds, the etcd
``create_revision`` of the topic's root key (decimal; :mod:`danube_pipeline.lake.tiering.incarnation`)."""


@dataclass(frozen=True, slots=True)
class RegisteredWriter:
    """What the registry answered for one ``(schema_id, schema_version)`` of the records.

    Attributes:
        schema_id: the registry's schema id.
        version: the version within the subject (0 when the record carried none).
        subject: the subject, when the registry knows the id.
        schema_type: ``"Avro"``, ``"JsonSchema"`` or ``"Protobuf"``, when known.
        writer: the parsed writer schema, or ``None`` when ``error`` says why not.
        error: the dead-letter ``_error`` of its records (``unknown schema: ...``,
            ``unreadable schema: ...``), or ``None``.
        raw_schema: the registered schema text ``writer`` was parsed from, when it was (what a
            Spark task parses again: parsed schemas do not pickle).
    """

    schema_id: int
    version: int
    subject: str | None = None
    schema_type: str | None = None
    writer: WriterSchema | None = None
    error: str | None = None
    raw_schema: str | None = None

    @property
    def description(self) -> str:
        """``"schema id 3 version 2 (Avro)"``, as errors name it."""
        kind = f" ({self.schema_type})" if self.schema_type else ""
        return f"schema id {self.schema_id} version {self.version}{kind}"


@dataclass
class WriterBinding:
    """What :func:`bind_writers` made of the writer schemas.

    Attributes:
        bound: per ``(schema_id, schema_version)``, in the order given: the writer with its
            column renames, or the ``_error`` of its records. Empty for a ``_payload`` table.
        recorded: the writer the table's columns follow afterwards, ``None`` when none does.
        changes: the in-place changes made to the table, in order.
    """

    bound: dict[tuple[int, int], BoundWriter] = field(default_factory=dict)
    recorded: RegisteredWriter | None = None
    changes: list[SchemaChange] = field(default_factory=list)


def recorded_schema(table: Table) -> tuple[int, int] | None:
    """The ``(schema_id, version)`` the table's payload columns follow (its
    ``danube.schema-id`` and ``danube.schema-version`` properties), or ``None``.

    Args:
        table: a topic's table.

    Returns:
        The pair, or ``None`` for a table without them (a ``_payload`` table, or one created
        before they existed).
    """
    sid = table.properties.get(SCHEMA_ID_PROPERTY)
    version = table.properties.get(SCHEMA_VERSION_PROPERTY)
    if sid is None or version is None:
        return None
    return int(sid), int(version)


def supersedes(w: RegisteredWriter, recorded: RegisteredWriter | None) -> bool:
    """Whether the table should follow ``w`` from now on.

    Args:
        w: a writer the table takes.
        recorded: the writer the table follows now, or ``None``.

    Returns:
        ``True`` when the table follows none, or ``w`` is a later version of the schema it
        follows (records of another schema id only add their columns).
    """
    return recorded is None or (w.schema_id == recorded.schema_id and w.version > recorded.version)


def raw_message_error(recorded: RegisteredWriter | None) -> str:
    """The ``_error`` of a record without a schema on a table that has one.

    Args:
        recorded: the writer the table follows when the record is decoded, or ``None``.

    Returns:
        ``raw message (no schema) on a topic with schema id 3 (subject s, version 2)``, or
        ``... on a topic with a schema`` without ``recorded``.
    """
    return f"{DeadLetterReason.RAW_MESSAGE} on a topic with " + (
        f"schema id {recorded.schema_id} (subject {recorded.subject}, version {recorded.version})"
        if recorded is not None
        else "a schema"
    )


def _schema_properties(w: RegisteredWriter) -> dict[str, str]:
    properties = {SCHEMA_ID_PROPERTY: str(w.schema_id), SCHEMA_VERSION_PROPERTY: str(w.version)}
    if w.subject:
        properties[SCHEMA_SUBJECT_PROPERTY] = w.subject
    return properties


def _renamed(columns: Sequence[PayloadColumn], names: Mapping[str, str]) -> list[PayloadColumn]:
    return [
        PayloadColumn(names.get(c.name, c.name), c.iceberg_type, c.required, c.convert, c.doc) for c in columns
    ]


def _column_map(w: RegisteredWriter, recorded: RegisteredWriter | None) -> dict[str, str]:
    """``{w's name: table name}`` for a writer no newer than ``recorded`` (the table follows
    ``recorded``'s names)."""
    if w.writer is None or recorded is None or recorded.writer is None or recorded.schema_id != w.schema_id:
        return {}
    if recorded.version <= w.version:
        return {}
    return renamed_columns(w.writer, recorded.writer)


def ensure_table_for_writers(
    catalog: Catalog,
    table_topic: TopicName,
    keys: Sequence[tuple[int, int]],
    writers: Mapping[tuple[int, int], RegisteredWriter],
    *,
    partitioned: bool,
    layout: TableLayout,
    incarnation: int | None = None,
) -> Table:
    """Create the topic's table for the records' writer schemas (step 1 of the module docstring).

    Args:
        catalog: the shared catalog.
        table_topic: the topic whose table it is (the partitioned topic, for a partition).
        keys: the records' ``(schema_id, schema_version)`` pairs with a schema, sorted.
        writers: the registry's answer per pair (a pair may be missing).
        partitioned: whether the table gets the ``_partition`` column.
        layout: the partitioning of the table (``docs/etcd-layout.md`` §3.9).
        incarnation: the topic's incarnation, recorded in a table created here
            (:data:`TOPIC_INCARNATION_PROPERTY`); ``None`` records none.

    Returns:
        The table: with the first parsed writer schema's columns and its
        ``danube.schema-*`` properties; with no payload column when no writer parsed; with
        ``_payload`` when ``keys`` is empty. Unless it has ``_payload``, it ends in
        ``_raw_payload`` when ``layout.raw_payload`` is on.

    Raises:
        CommitFailedException: the catalog kept refusing the creation.
    """
    born = {TOPIC_INCARNATION_PROPERTY: str(incarnation)} if incarnation is not None else {}
    if not keys:
        return ensure_table_for_schema(
            catalog, table_topic, schema_from_columns(None, partitioned=partitioned), properties=born, layout=layout
        )
    usable = [writers[k] for k in keys if k in writers and writers[k].writer is not None]
    first = usable[0] if usable else None
    columns = list(first.writer.columns) if first is not None and first.writer is not None else []
    return ensure_table_for_schema(
        catalog,
        table_topic,
        schema_from_columns(columns, partitioned=partitioned, raw_payload=layout.raw_payload),
        properties={**born, **(_schema_properties(first) if first is not None else {})},
        layout=layout,
    )


def bind_writers(
    table: Table,
    keys: Sequence[tuple[int, int]],
    writers: Mapping[tuple[int, int], RegisteredWriter],
    *,
    recorded: RegisteredWriter | None,
    partitioned: bool,
    where: str,
    raw_payload: bool = False,
) -> WriterBinding:
    """Evolve the table for each writer schema and bind it (step 2 of the module docstring).

    Args:
        table: the topic's table; evolved in place.
        keys: the ``(schema_id, schema_version)`` pairs to bind, sorted (oldest first).
        writers: the registry's answer per pair; a missing pair is an unknown schema.
        recorded: the writer the table's columns follow (:func:`recorded_schema`), as the
            registry answered for it; ``None`` when the table has none or it is among
            ``writers``.
        partitioned: whether the table has the ``_partition`` column.
        where: names the records in the warning logged for a ``needs schema_rewrite`` version.
        raw_payload: the layout's ``raw_payload`` (``docs/etcd-layout.md`` §3.9): a table
            without ``_raw_payload`` or ``_key`` gains them first
            (:func:`ensure_raw_payload_columns`).

    Returns:
        A :class:`WriterBinding`; nothing is bound on a ``_payload`` table (its records keep
        their payload as is, and it gets ``_key`` but no ``_raw_payload``).

    Raises:
        CommitFailedException: an evolution commit kept conflicting.
    """
    payload_table = PAYLOAD_COLUMN in {f.name for f in table.schema().fields}
    ids = recorded_schema(table)
    if recorded is None and ids is not None and ids in writers:
        recorded = writers[ids]
    binding = WriterBinding(recorded=recorded)
    if raw_payload:
        binding.changes += ensure_raw_payload_columns(table)
    if payload_table:
        return binding
    bound = binding.bound
    for key in keys:
        w = writers.get(key) or RegisteredWriter(
            key[0], key[1], error=f"{DeadLetterReason.UNKNOWN_SCHEMA}: schema id {key[0]} version {key[1]}"
        )
        if w.writer is None:
            error = w.error or f"{DeadLetterReason.UNKNOWN_SCHEMA}: {w.description}"
            bound[key] = BoundWriter(w.description, error=error)
            continue
        newer = supersedes(w, recorded)
        if newer and recorded is not None and recorded.writer is not None and recorded.schema_id == w.schema_id:
            table_renames = renamed_columns(recorded.writer, w.writer)
        elif newer:
            table_renames = renamed_columns(
                None, w.writer, old_names=[f.name for f in table.schema().fields if f.name not in RESERVED_COLUMNS]
            )
        else:
            table_renames = {}
        wanted = schema_from_columns(_renamed(w.writer.columns, _column_map(w, recorded)), partitioned=partitioned)
        try:
            binding.changes += evolve_table(
                table, wanted, renames=table_renames, properties=_schema_properties(w) if newer else None
            )
        except SchemaEvolutionError as exc:
            bound[key] = BoundWriter(
                w.description,
                error=f"{DeadLetterReason.NEEDS_SCHEMA_REWRITE}: {w.description}: {'; '.join(exc.changes)}",
            )
            log.warning("%s: %s", where, bound[key].error)
            continue
        if newer:
            recorded = w
        bound[key] = BoundWriter(w.description, writer=w.writer)
    # The table now follows `recorded`'s names: map each writer's renamed fields to them.
    for key, b in list(bound.items()):
        known = writers.get(key)
        if b.writer is not None and known is not None:
            bound[key] = BoundWriter(b.description, writer=b.writer, column_for=_column_map(known, recorded))
    binding.recorded = recorded
    return binding


def ensure_raw_payload_columns(table: Table) -> list[SchemaChange]:
    """Add the optional columns ``_raw_payload binary`` (not to a ``_payload`` table) and ``_key
    struct<value: string>`` where missing (``docs/etcd-layout.md`` §3.9, ``raw_payload``). Rows
    written before read ``null`` there, which is how a reader tells them from rows written since.

    Args:
        table: the topic's table; refreshed afterwards.

    Returns:
        The columns added (``[add optional column _raw_payload binary, ...]``), ``[]`` when
        both were there.

    Raises:
        CommitFailedException: the schema commit kept conflicting
            (:func:`~danube_pipeline.lake.iceberg.evolution.add_optional_columns`).
    """
    columns: list[tuple[str, IcebergType, str]] = [(KEY_COLUMN, key_type(0), KEY_DOC)]
    if PAYLOAD_COLUMN not in {f.name for f in table.schema().fields}:
        columns.insert(0, (RAW_PAYLOAD_COLUMN, BinaryType(), "the payload exactly as published"))
    return add_optional_columns(table, columns)
