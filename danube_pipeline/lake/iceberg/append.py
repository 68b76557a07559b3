"""The exactly-once append of records to a topic's Iceberg table.

Every append is one commit (one pyiceberg ``Transaction``) that both adds a snapshot and sets
the table property ``danube.committed-end-offset`` to the last offset the table now holds. The
snapshot's summary also carries ``danube.topic``, ``danube.start-offset``,
``danube.end-offset`` and ``danube.object-id`` (the Iceberg spec's snapshot summary,
"Snapshots"), for people reading the history.

The committed end offset is read back from the table property (the names and
:func:`committed_end_offset` live in :mod:`danube_pipeline.storage.table_properties`, which
the table reader shares; re-exported here). Table properties live in the
table metadata itself (Iceberg spec, "Table Metadata", ``properties``), so they survive what
maintenance does to snapshots: Spark's ``rewrite_data_files`` (a ``replace`` snapshot without
our summary), row-level ``DELETE`` (an ``overwrite``/``delete`` snapshot without it) and
``expire_snapshots`` (which removes the snapshots that carried it). Only tables written before
the property existed fall back to the newest ancestor snapshot whose summary carries
``danube.end-offset``. So replaying an object appends nothing, even after maintenance.

**Partitioned topics** (``docs/etcd-layout.md`` §3.1). The partitions ``{topic}-part-{i}`` of a
partitioned topic all append to the topic's one table, each with its own offsets: an append
for partition ``i`` writes ``_partition = i`` in every row, sets the property
``danube.committed-end-offset.part-{i}`` instead, and adds ``danube.partition = i`` to the
summary. Exactly-once then holds per partition, as above; two partitions appending at once
conflict only on the commit, and the loser retries with its own partition's property.

**Dead letters** (:mod:`.dead_letter`). Records tiering cannot turn into rows go to the table
``{topic}__dlq`` first; the append of the rest (:func:`append_rows`) then commits the whole
range all the same, with ``danube.dead-letter-records`` in its summary. So every offset of the
range is committed exactly once: as a row of the table or as a row of its dead-letter table.

A commit succeeds only if the table's ``main`` branch still points at the snapshot the writer
read (the append's ``AssertRefSnapshotId`` requirement, checked by the catalog; Iceberg spec,
"Optimistic Concurrency"), and the property is read from that same metadata. A commit that
loses is retried after a refresh with what is still missing. pyiceberg 0.12's own commit
retry is switched off for these appends: it would rebase the same rows onto the new head and
commit them twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import Table, TableProperties

from danube_pipeline.errors import OffsetRangeError
from danube_pipeline.lake.iceberg.arrow import arrow_table_for_records
from danube_pipeline.lake.iceberg.data_files import MetadataCachingTransaction, append_table
from danube_pipeline.format.records import Record
from danube_pipeline.lake.segment_columns import RecordColumns
from danube_pipeline.storage.table_properties import (
    COMMITTED_END_OFFSET_PROPERTY,
    SUMMARY_END_OFFSET,
    SUMMARY_PARTITION,
    committed_end_offset,
    committed_end_offset_property,
)

__all__ = [
    "COMMITTED_END_OFFSET_PROPERTY",
    "SUMMARY_DEAD_LETTER_RECORDS",
    "SUMMARY_END_OFFSET",
    "SUMMARY_OBJECT_ID",
    "SUMMARY_PARTITION",
    "SUMMARY_START_OFFSET",
    "SUMMARY_TOPIC",
    "AppendResult",
    "append_records",
    "append_rows",
    "committed_end_offset",
    "committed_end_offset_property",
    "pending_records",
    "without_commit_retries",
]

log = logging.getLogger(__name__)

SUMMARY_TOPIC = "danube.topic"
SUMMARY_START_OFFSET = "danube.start-offset"
SUMMARY_OBJECT_ID = "danube.object-id"
SUMMARY_DEAD_LETTER_RECORDS = "danube.dead-letter-records"
"""Summary field: records of the appended range that went to the dead-letter table instead
(:func:`append_rows`; in the dead-letter table's own snapshots, the rows that snapshot adds)."""

DEFAULT_COMMIT_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class AppendResult:
    """What :func:`append_records` did.

    Attributes:
        snapshot_id: the new snapshot, or ``None`` if nothing was appended.
        rows_appended: rows in the new snapshot (0 when everything was already committed).
        committed_end_offset: the table's committed end offset afterwards (``None`` if empty).
        skipped: records dropped because they were already committed.
        attempts: commit attempts made (1 unless the catalog's compare-and-swap failed).
        dead_lettered: records of the appended range that went to the dead-letter table
            (committed without a row, :func:`append_rows`).
    """

    snapshot_id: int | None
    rows_appended: int
    committed_end_offset: int | None
    skipped: int
    attempts: int
    dead_lettered: int = 0


def without_commit_retries(table: Table) -> Table:
    """A handle on ``table`` whose commits are not retried by pyiceberg itself.

    pyiceberg 0.12 retries a conflicting snapshot commit by rebasing the same data files onto
    the new head (``commit.retry.num-retries``, default 4): for an append that another writer
    already made, that commits the rows twice. The handle carries ``commit.retry.num-retries=0``
    in its in-memory metadata only; the catalog applies the commit to the table's stored
    metadata, so the stored properties (which Spark's own retries read) are unchanged.

    Args:
        table: the table as loaded.

    Returns:
        A new handle on the same metadata location whose commits fail with
        ``CommitFailedException`` on a conflict instead of being rebased.
    """
    properties = {**table.metadata.properties, TableProperties.COMMIT_NUM_RETRIES: "0"}
    metadata = table.metadata.model_copy(update={"properties": properties})
    return Table(
        table.name(),
        metadata=metadata,
        metadata_location=table.metadata_location,
        io=table.io,
        catalog=table.catalog,
        config=table.config,
    )


def _check_contiguous(records: Sequence[Record], where: str) -> None:
    if not records:
        return
    if isinstance(records, RecordColumns) and records.is_contiguous():
        return
    first = records[0].offset
    for i, r in enumerate(records):
        if r.offset != first + i:
            raise OffsetRangeError(first + i, r.offset, where)


def pending_records(
    table: Table,
    records: Sequence[Record],
    *,
    where: str,
    first_offset: int | None = None,
    partition: int | None = None,
) -> tuple[int | None, Sequence[Record]]:
    """The records of ``records`` not yet committed to ``table``, checked for gaps.

    Args:
        table: the topic's table, as loaded.
        records: contiguous records in offset order.
        where: names the records in errors (``/ns/topic data-{start}-{end}.dnb1``).
        first_offset: as in :func:`append_records`.
        partition: as in :func:`append_records`.

    Returns:
        ``(committed end offset, records above it)``.

    Raises:
        OffsetRangeError: ``records`` are not contiguous, or the first record not yet committed
            is not where it must be (:func:`append_records`).
    """
    _check_contiguous(records, where)
    committed = committed_end_offset(table, partition=partition)
    if committed is None:
        if records and first_offset is not None and records[0].offset != first_offset:
            raise OffsetRangeError(first_offset, records[0].offset, where)
        return None, records
    skip = 0 if not records else max(0, min(len(records), committed + 1 - records[0].offset))
    pending = records[skip:]
    expected = committed + 1 if first_offset is None else max(committed + 1, first_offset)
    if pending and pending[0].offset != expected:
        raise OffsetRangeError(expected, pending[0].offset, where)
    return committed, pending


RowBuilder = Callable[[Sequence[Record]], pa.Table]
"""The pending records (a suffix of the records given) to the rows to append for them."""


def append_rows(
    table: Table,
    records: Sequence[Record],
    build_rows: RowBuilder,
    object_id: str,
    *,
    topic: str | None = None,
    dead_lettered: AbstractSet[int] = frozenset(),
    first_offset: int | None = None,
    partition: int | None = None,
    max_attempts: int = DEFAULT_COMMIT_ATTEMPTS,
    retry_backoff_s: float = 0.05,
) -> AppendResult:
    """Append the rows of ``records`` exactly once, accounting for those dead-lettered.

    As :func:`append_records`, with the rows built by ``build_rows`` from the records not yet
    committed. Records whose offsets are in ``dead_lettered`` have no row (they went to the
    dead-letter table, :mod:`.dead_letter`) but are committed all the same: the committed end
    offset moves over them, and the snapshot summary's ``danube.dead-letter-records`` counts
    them. An object whose records all went to the dead-letter table still gets its snapshot
    (with no data file), so its offsets are committed in the same way.

    Args:
        table: the topic's table.
        records: contiguous records in offset order, dead-lettered ones included.
        build_rows: the pending records to their rows (none for the dead-lettered ones).
        object_id: the segment object the records come from, recorded in the summary.
        topic: ``/ns/topic`` for the summary; defaults to the table identifier's last two parts.
        dead_lettered: offsets of records that went to the dead-letter table.
        first_offset: as in :func:`append_records`.
        partition: as in :func:`append_records`.
        max_attempts: commit attempts on ``CommitFailedException`` (refresh, recompute, retry).
        retry_backoff_s: sleep before the n-th retry is ``n * retry_backoff_s`` seconds.

    Returns:
        An :class:`AppendResult`.

    Raises:
        OffsetRangeError: as :func:`append_records`.
        CommitFailedException: the commit still failed after ``max_attempts`` attempts.
        Whatever ``build_rows`` raises.
    """
    if topic is None:
        ident = table.name()
        topic = "/" + "/".join(ident[-2:])
    where = f"{topic} {object_id}"
    for attempt in range(1, max_attempts + 1):
        committed, pending = pending_records(
            table, records, where=where, first_offset=first_offset, partition=partition
        )
        skipped = len(records) - len(pending)
        if not pending:
            return AppendResult(None, 0, committed, skipped, attempt)
        df = build_rows(pending)
        start, end = pending[0].offset, pending[-1].offset
        letters = sum(1 for o in dead_lettered if start <= o <= end)
        properties = {
            SUMMARY_TOPIC: topic,
            SUMMARY_START_OFFSET: str(start),
            SUMMARY_END_OFFSET: str(end),
            SUMMARY_OBJECT_ID: object_id,
            SUMMARY_DEAD_LETTER_RECORDS: str(letters),
        }
        if partition is not None:
            properties[SUMMARY_PARTITION] = str(partition)
        handle = without_commit_retries(table)
        try:
            # One commit: the snapshot and the property, on top of the snapshot read above.
            with MetadataCachingTransaction(handle) as transaction:
                transaction.set_properties({committed_end_offset_property(partition): str(end)})
                append_table(transaction, df, handle.io, properties)
        except CommitFailedException:
            if attempt == max_attempts:
                raise
            log.warning("%s: commit of offsets %d-%d conflicted (attempt %d), retrying", where, start, end, attempt)
            time.sleep(retry_backoff_s * attempt)
            table.refresh()
            continue
        snapshot = handle.current_snapshot()
        table.refresh()
        return AppendResult(
            snapshot.snapshot_id if snapshot else None, df.num_rows, end, skipped, attempt, dead_lettered=letters
        )
    raise AssertionError("unreachable")  # pragma: no cover


def append_records(
    table: Table,
    records: Sequence[Record],
    avro_schema: Mapping[str, Any] | str | None,
    object_id: str,
    *,
    topic: str | None = None,
    writer_schemas: Mapping[tuple[int, int], Mapping[str, Any] | str] | None = None,
    first_offset: int | None = None,
    partition: int | None = None,
    max_attempts: int = DEFAULT_COMMIT_ATTEMPTS,
    retry_backoff_s: float = 0.05,
) -> AppendResult:
    """Append ``records`` exactly once: what is already committed is dropped, gaps are refused.

    Args:
        table: the topic's table (see :func:`ensure_table`).
        records: contiguous records in offset order, e.g. one segment object's.
        avro_schema: the table's Avro schema, or ``None`` (``_payload`` column).
        object_id: the segment object the records come from (``data-{start}-{end}.dnb1``),
            recorded in the snapshot summary.
        topic: ``/ns/topic`` for the summary; defaults to the table identifier's last two parts.
        writer_schemas: Avro schema per ``(schema_id, schema_version)`` present in ``records``.
        first_offset: the first offset the topic's storage still holds (its first completed
            object descriptor's start, ``docs/etcd-layout.md`` §5.1), or ``None``. The first
            record not yet committed must carry ``first_offset`` when nothing was committed
            yet, and ``max(committed_end_offset + 1, first_offset)`` otherwise: when retention
            deleted the objects right above the committed end offset before they reached the
            table (they had expired), the append resumes at ``first_offset``. ``None`` accepts
            any start on an empty table (a topic whose oldest segments were never tiered) and
            no jump on a non-empty one.
        partition: for partition ``i`` of a partitioned topic, ``i``: the rows get
            ``_partition = i`` and the offsets are the partition's own, committed in
            ``danube.committed-end-offset.part-{i}`` (module docstring). ``None`` for a plain
            topic.
        max_attempts: commit attempts on ``CommitFailedException`` (refresh, recompute, retry).
        retry_backoff_s: sleep before the n-th retry is ``n * retry_backoff_s`` seconds.

    Returns:
        An :class:`AppendResult`; 0 rows appended means no snapshot was created.

    Raises:
        OffsetRangeError: ``records`` are not contiguous, or the first record not yet committed
            is not where it must be (``committed_end_offset + 1``, or ``first_offset`` as
            above): a gap.
        SchemaMismatchError: a payload does not decode with its schema (tiering sends such
            records to the dead-letter table instead: :func:`append_rows`).
        CommitFailedException: the commit still failed after ``max_attempts`` attempts.
    """

    def build(pending: Sequence[Record]) -> pa.Table:
        return arrow_table_for_records(
            pending, avro_schema, writer_schemas=writer_schemas, iceberg_schema=table.schema(), partition=partition
        )

    return append_rows(
        table,
        records,
        build,
        object_id,
        topic=topic,
        first_offset=first_offset,
        partition=partition,
        max_attempts=max_attempts,
        retry_backoff_s=retry_backoff_s,
    )
