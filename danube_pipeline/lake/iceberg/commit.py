"""One segment object's records into the topic's table: evolve, decode, dead-letter, append.

:func:`commit_object` is what tiering does per object, once the registry has answered for
every ``(schema_id, schema_version)`` of its records (:class:`RegisteredWriter`):

1. Create the table when it does not exist: from the first writer schema of the records (in
   ``(schema_id, version)`` order), or with ``_payload`` when no record has a schema. A table
   created with ``_payload`` keeps taking every record's payload as is, schema or not.
2. Check the offsets (:func:`~danube_pipeline.lake.iceberg.append.pending_records`): a gap raises
   before anything is written.
3. Evolve the table in place for each writer schema of the records not yet committed, oldest
   first (:mod:`.evolution`); a version whose change cannot be made in place has its records
   dead-lettered (``needs schema_rewrite``), the others go on.
4. Decode every record with its own writer schema into the table's columns
   (:func:`~danube_pipeline.lake.iceberg.rows.table_rows`), setting aside the dead letters.
5. Append the dead letters to ``{topic}__dlq``, then the rows to the table, whose committed
   end offset covers both (:mod:`.dead_letter` for why this order is exactly once).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.table import Table

from danube_pipeline.errors import SchemaEvolutionError
from danube_pipeline.lake.iceberg.append import AppendResult, append_rows, committed_end_offset, pending_records
from danube_pipeline.lake.iceberg.catalog import ensure_table_for_schema
from danube_pipeline.lake.iceberg.layout import DEFAULT_LAYOUT
from danube_pipeline.lake.iceberg.dead_letter import (
    DeadLetterReason,
    append_dead_letters,
    dead_letter_offsets,
    ensure_dead_letter_table,
    load_dead_letter_table,
)
from danube_pipeline.lake.iceberg.evolution import (
    SCHEMA_ID_PROPERTY,
    SCHEMA_SUBJECT_PROPERTY,
    SCHEMA_VERSION_PROPERTY,
    SchemaChange,
    evolve_table,
)
from danube_pipeline.lake.iceberg.rows import BoundWriter, table_rows
from danube_pipeline.lake.iceberg.schema import PAYLOAD_COLUMN, RESERVED_COLUMNS, PayloadColumn, schema_from_columns
from danube_pipeline.lake.iceberg.writer import WriterSchema, renamed_columns
from danube_pipeline.metadata.values import TableLayout
from danube_pipeline.names import TopicName
from danube_pipeline.format.records import Record
from danube_pipeline.lake.segment_columns import schema_keys

__all__ = ["ObjectCommit", "RegisteredWriter", "commit_object", "recorded_schema"]

log = logging.getLogger(__name__)


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
    """

    schema_id: int
    version: int
    subject: str | None = None
    schema_type: str | None = None
    writer: WriterSchema | None = None
    error: str | None = None

    @property
    def description(self) -> str:
        """``"schema id 3 version 2 (Avro)"``, as errors name it."""
        kind = f" ({self.schema_type})" if self.schema_type else ""
        return f"schema id {self.schema_id} version {self.version}{kind}"


@dataclass
class ObjectCommit:
    """What :func:`commit_object` did.

    Attributes:
        table: the topic's table afterwards.
        append: the append to the table (``rows_appended == 0`` and no snapshot when the
            object was already committed).
        dead_letters_appended: rows this call added to the dead-letter table.
        dead_lettered: offsets of the object committed as dead letters (appended now or by an
            earlier try).
        schema_changes: the in-place changes made to the table.
        created: whether this call created the table.
    """

    table: Table
    append: AppendResult
    dead_letters_appended: int = 0
    dead_lettered: frozenset[int] = frozenset()
    schema_changes: list[SchemaChange] = field(default_factory=list)
    created: bool = False


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


def _is_newer(w: RegisteredWriter, recorded: RegisteredWriter | None) -> bool:
    """Whether the table should follow ``w`` from now on: a later version of the schema it
    follows (records of another schema id only add their columns)."""
    return recorded is None or (w.schema_id == recorded.schema_id and w.version > recorded.version)


def commit_object(
    catalog: Catalog,
    table_topic: TopicName,
    table: Table | None,
    records: Sequence[Record],
    writers: Mapping[tuple[int, int], RegisteredWriter],
    object_id: str,
    *,
    topic: str,
    recorded: RegisteredWriter | None = None,
    first_offset: int | None = None,
    partition: int | None = None,
    layout: TableLayout = DEFAULT_LAYOUT,
) -> ObjectCommit:
    """Commit one object's records to the topic's table, exactly once (module docstring).

    Args:
        catalog: the shared catalog.
        table_topic: the topic whose table it is (the partitioned topic, for a partition).
        table: the table as loaded, or ``None`` when it does not exist yet.
        records: the object's records, contiguous, in offset order.
        writers: per ``(schema_id, schema_version)`` of the records with a schema.
        object_id: ``data-{start}-{end}.dnb1``.
        topic: ``/ns/topic`` of the records (the partition's name, for a partition).
        recorded: the version the table's columns follow (:func:`recorded_schema`), as the
            registry answered for it; ``None`` when the table has none or it is among
            ``writers``.
        first_offset: as :func:`~danube_pipeline.lake.iceberg.append.append_records`.
        partition: the partition index, for a partition of a partitioned topic.
        layout: the partitioning of the table if it is created here (``docs/etcd-layout.md``
            §3.9; :mod:`~danube_pipeline.lake.iceberg.layout`).

    Returns:
        An :class:`ObjectCommit`.

    Raises:
        OffsetRangeError: the records leave a gap after what the table has committed.
        CommitFailedException: a commit kept conflicting.
        InvalidNameError: a table named like the dead-letter table is not one.
    """
    partitioned = partition is not None
    keys = [k for k in schema_keys(records) if k[0] != 0]
    usable = [writers[k] for k in keys if k in writers and writers[k].writer is not None]
    created = False
    if table is None:
        if keys:
            first = usable[0] if usable else None
            columns = list(first.writer.columns) if first is not None and first.writer is not None else []
            table = ensure_table_for_schema(
                catalog,
                table_topic,
                schema_from_columns(columns, partitioned=partitioned),
                properties=_schema_properties(first) if first is not None else None,
                layout=layout,
            )
        else:
            table = ensure_table_for_schema(
                catalog, table_topic, schema_from_columns(None, partitioned=partitioned), layout=layout
            )
        created = True
    where = f"{topic} {object_id}"
    committed, pending = pending_records(table, records, where=where, first_offset=first_offset, partition=partition)
    if not pending:
        return ObjectCommit(table, AppendResult(None, 0, committed, len(records), 0), created=created)

    payload_table = PAYLOAD_COLUMN in {f.name for f in table.schema().fields}
    ids = recorded_schema(table)
    if recorded is None and ids is not None and ids in writers:
        recorded = writers[ids]
    changes: list[SchemaChange] = []
    bound: dict[tuple[int, int], BoundWriter] = {}
    pending_keys = [k for k in schema_keys(pending) if k[0] != 0]
    if not payload_table:
        for key in pending_keys:
            w = writers.get(key) or RegisteredWriter(
                key[0], key[1], error=f"{DeadLetterReason.UNKNOWN_SCHEMA}: schema id {key[0]} version {key[1]}"
            )
            if w.writer is None:
                error = w.error or f"{DeadLetterReason.UNKNOWN_SCHEMA}: {w.description}"
                bound[key] = BoundWriter(w.description, error=error)
                continue
            newer = _is_newer(w, recorded)
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
                changes += evolve_table(
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

    raw_error = f"{DeadLetterReason.RAW_MESSAGE} on a topic with " + (
        f"schema id {recorded.schema_id} (subject {recorded.subject}, version {recorded.version})"
        if recorded is not None
        else "a schema"
    )
    decoded = table_rows(pending, table.schema(), bound, partition=partition, raw_error=raw_error)
    start, end = pending[0].offset, pending[-1].offset
    appended = 0
    dead: frozenset[int] = frozenset()
    if decoded.dead_letters:
        dlq = ensure_dead_letter_table(catalog, table_topic, partitioned=partitioned)
        result = append_dead_letters(
            dlq, decoded.dead_letters, object_id, topic=topic, start_offset=start, end_offset=end, partition=partition
        )
        appended, dead = result.rows_appended, result.offsets
    else:
        existing = load_dead_letter_table(catalog, table_topic)
        dlq_committed = committed_end_offset(existing, partition=partition) if existing is not None else None
        if existing is not None and dlq_committed is not None and dlq_committed >= start:
            # An earlier try of this object dead-lettered records that now decode: they stay there.
            dead = frozenset(dead_letter_offsets(existing, partition=partition, start_offset=start, end_offset=end))
    rows = decoded.rows
    if dead and rows.num_rows:
        rows = rows.filter(pc.invert(pc.is_in(rows.column("_offset"), value_set=pa.array(sorted(dead), pa.int64()))))

    def build(still_pending: Sequence[Record]) -> pa.Table:
        if not still_pending or still_pending[0].offset == start:
            return rows
        return rows.filter(pc.greater_equal(rows.column("_offset"), still_pending[0].offset))

    result_append = append_rows(
        table,
        records,
        build,
        object_id,
        topic=topic,
        dead_lettered=dead,
        first_offset=first_offset,
        partition=partition,
    )
    return ObjectCommit(table, result_append, appended, dead, changes, created)
