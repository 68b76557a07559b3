"""One segment object's records into the topic's table: evolve, decode, dead-letter, append.

:func:`commit_object` is what tiering does per object, once the registry has answered for
every ``(schema_id, schema_version)`` of its records (:class:`RegisteredWriter`):

1. Create the table when it does not exist: from the first writer schema of the records (in
   ``(schema_id, version)`` order), or with ``_payload`` when no record has a schema. A table
   created with ``_payload`` keeps taking every record's payload as is, schema or not
   (:func:`~danube_pipeline.lake.iceberg.binding.ensure_table_for_writers`).
2. Check the offsets (:func:`~danube_pipeline.lake.iceberg.append.pending_records`): a gap raises
   before anything is written.
3. Evolve the table in place for each writer schema of the records not yet committed, oldest
   first (:mod:`.evolution`); a version whose change cannot be made in place has its records
   dead-lettered (``needs schema_rewrite``), the others go on
   (:func:`~danube_pipeline.lake.iceberg.binding.bind_writers`, the path bulk loads take too).
   With the layout's ``raw_payload`` on, the table first gains ``_raw_payload`` (and the
   dead-letter table ``_producer_id`` and ``_attributes``), filled from then on.
4. Decode every record with its own writer schema into the table's columns
   (:func:`~danube_pipeline.lake.iceberg.rows.table_rows`), setting aside the dead letters.
5. Append the dead letters to ``{topic}__dlq``
   (:func:`~danube_pipeline.lake.iceberg.dead_letter.commit_dead_letters`), then the rows to
   the table, whose committed end offset covers both (:mod:`.dead_letter` for why this order
   is exactly once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.catalog import Catalog
from pyiceberg.table import Table

from danube_pipeline.format.records import Record
from danube_pipeline.lake.iceberg.append import AppendResult, append_rows, pending_records
from danube_pipeline.lake.iceberg.binding import (
    RegisteredWriter,
    bind_writers,
    ensure_table_for_writers,
    raw_message_error,
)
from danube_pipeline.lake.iceberg.dead_letter import commit_dead_letters
from danube_pipeline.lake.iceberg.evolution import SchemaChange
from danube_pipeline.lake.iceberg.layout import DEFAULT_LAYOUT
from danube_pipeline.lake.iceberg.rows import table_rows
from danube_pipeline.lake.segment_columns import schema_keys
from danube_pipeline.metadata.values import TableLayout
from danube_pipeline.names import TopicName

__all__ = ["ObjectCommit", "commit_object"]


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
    incarnation: int | None = None,
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
        recorded: the version the table's columns follow (:func:`~.binding.recorded_schema`), as the
            registry answered for it; ``None`` when the table has none or it is among
            ``writers``.
        first_offset: as :func:`~danube_pipeline.lake.iceberg.append.append_records`.
        partition: the partition index, for a partition of a partitioned topic.
        layout: the table layout (``docs/etcd-layout.md`` §3.9): its partitioning if the table
            is created here (:mod:`~danube_pipeline.lake.iceberg.layout`), and whether rows keep
            their exact payload bytes (``raw_payload``).
        incarnation: the topic's incarnation, recorded in the table if it is created here
            (:data:`~danube_pipeline.lake.iceberg.binding.TOPIC_INCARNATION_PROPERTY`).

    Returns:
        An :class:`ObjectCommit`.

    Raises:
        OffsetRangeError: the records leave a gap after what the table has committed.
        CommitFailedException: a commit kept conflicting.
        InvalidNameError: a table named like the dead-letter table is not one.
    """
    partitioned = partition is not None
    if table is None:
        keys = [k for k in schema_keys(records) if k[0] != 0]
        table = ensure_table_for_writers(
            catalog, table_topic, keys, writers, partitioned=partitioned, layout=layout, incarnation=incarnation
        )
        created = True
    else:
        created = False
    where = f"{topic} {object_id}"
    committed, pending = pending_records(table, records, where=where, first_offset=first_offset, partition=partition)
    if not pending:
        return ObjectCommit(table, AppendResult(None, 0, committed, len(records), 0), created=created)

    pending_keys = [k for k in schema_keys(pending) if k[0] != 0]
    binding = bind_writers(
        table, pending_keys, writers, recorded=recorded, partitioned=partitioned, where=where,
        raw_payload=layout.raw_payload,
    )
    raw_error = raw_message_error(binding.recorded)
    decoded = table_rows(
        pending, table.schema(), binding.bound, partition=partition, raw_error=raw_error, raw_payload=layout.raw_payload
    )
    start, end = pending[0].offset, pending[-1].offset
    letters = commit_dead_letters(
        catalog, table_topic, decoded.dead_letters, object_id, topic=topic, start_offset=start, end_offset=end,
        partition=partition, raw_payload=layout.raw_payload,
    )
    dead = letters.offsets
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
    return ObjectCommit(table, result_append, letters.rows_appended, dead, binding.changes, created)
