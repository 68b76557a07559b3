"""The exactly-once append of records to a topic's Iceberg table.

Every append commits one snapshot whose summary carries ``danube.topic``,
``danube.start-offset``, ``danube.end-offset`` and ``danube.object-id`` (the Iceberg spec's
snapshot summary, "Snapshots"). The committed end offset is read back from the newest ancestor
snapshot that carries ``danube.end-offset`` (compaction snapshots do not), so replaying an
object appends nothing, and a commit that loses the catalog's compare-and-swap is retried after
a refresh with what is still missing. pyiceberg 0.12's own commit retry is switched off for
these appends: it would rebase the same rows onto the new head and commit them twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyiceberg.exceptions import CommitFailedException
from pyiceberg.table import Table, TableProperties
from pyiceberg.table.snapshots import ancestors_of

from danube_pipeline.errors import OffsetRangeError
from danube_pipeline.iceberg.arrow import arrow_table_for_records
from danube_pipeline.records import Record

__all__ = [
    "AppendResult",
    "SUMMARY_END_OFFSET",
    "SUMMARY_OBJECT_ID",
    "SUMMARY_START_OFFSET",
    "SUMMARY_TOPIC",
    "append_records",
    "committed_end_offset",
]

log = logging.getLogger(__name__)

SUMMARY_TOPIC = "danube.topic"
SUMMARY_START_OFFSET = "danube.start-offset"
SUMMARY_END_OFFSET = "danube.end-offset"
SUMMARY_OBJECT_ID = "danube.object-id"

DEFAULT_COMMIT_ATTEMPTS = 5


def committed_end_offset(table: Table) -> int | None:
    """The last offset committed to ``table`` by :func:`append_records`.

    Walks the current snapshot's ancestry, newest first, to the first snapshot whose summary
    carries ``danube.end-offset`` (compaction snapshots written by Spark do not).

    Args:
        table: a topic's table.

    Returns:
        The inclusive end offset, or ``None`` if nothing was appended yet.
    """
    for snapshot in ancestors_of(table.current_snapshot(), table.metadata):
        summary = snapshot.summary
        if summary is None:
            continue
        value = summary[SUMMARY_END_OFFSET]
        if value is not None:
            return int(value)
    return None


@dataclass(frozen=True, slots=True)
class AppendResult:
    """What :func:`append_records` did.

    Attributes:
        snapshot_id: the new snapshot, or ``None`` if nothing was appended.
        rows_appended: rows in the new snapshot (0 when everything was already committed).
        committed_end_offset: the table's committed end offset afterwards (``None`` if empty).
        skipped: records dropped because they were already committed.
        attempts: commit attempts made (1 unless the catalog's compare-and-swap failed).
    """

    snapshot_id: int | None
    rows_appended: int
    committed_end_offset: int | None
    skipped: int
    attempts: int


def _without_commit_retries(table: Table) -> Table:
    """A handle on ``table`` whose commits are not retried by pyiceberg itself.

    pyiceberg 0.12 retries a conflicting snapshot commit by rebasing the same data files onto
    the new head (``commit.retry.num-retries``, default 4): for an append that another writer
    already made, that commits the rows twice. The handle carries ``commit.retry.num-retries=0``
    in its in-memory metadata only; the catalog applies the commit to the table's stored
    metadata, so the stored properties (which Spark's own retries read) are unchanged.
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
    first = records[0].offset
    for i, r in enumerate(records):
        if r.offset != first + i:
            raise OffsetRangeError(first + i, r.offset, where)


def append_records(
    table: Table,
    records: Sequence[Record],
    avro_schema: Mapping[str, Any] | str | None,
    object_id: str,
    *,
    topic: str | None = None,
    writer_schemas: Mapping[tuple[int, int], Mapping[str, Any] | str] | None = None,
    first_offset: int | None = None,
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
        first_offset: when the table is still empty, the offset the first record must carry;
            ``None`` accepts any start (a topic whose oldest segments were never tiered).
        max_attempts: commit attempts on ``CommitFailedException`` (refresh, recompute, retry).
        retry_backoff_s: sleep before the n-th retry is ``n * retry_backoff_s`` seconds.

    Returns:
        An :class:`AppendResult`; 0 rows appended means no snapshot was created.

    Raises:
        OffsetRangeError: ``records`` are not contiguous, or the first record not yet committed
            is not ``committed_end_offset + 1`` (a gap).
        SchemaMismatchError: a payload does not decode with its schema.
        CommitFailedException: the commit still failed after ``max_attempts`` attempts.
    """
    if topic is None:
        ident = table.name()
        topic = "/" + "/".join(ident[-2:])
    where = f"{topic} {object_id}"
    _check_contiguous(records, where)
    for attempt in range(1, max_attempts + 1):
        committed = committed_end_offset(table)
        if committed is None:
            pending: Sequence[Record] = records
            if pending and first_offset is not None and pending[0].offset != first_offset:
                raise OffsetRangeError(first_offset, pending[0].offset, where)
        else:
            skip = 0 if not records else max(0, min(len(records), committed + 1 - records[0].offset))
            pending = records[skip:]
            if pending and pending[0].offset != committed + 1:
                raise OffsetRangeError(committed + 1, pending[0].offset, where)
        skipped = len(records) - len(pending)
        if not pending:
            return AppendResult(None, 0, committed, skipped, attempt)
        df = arrow_table_for_records(pending, avro_schema, writer_schemas=writer_schemas, iceberg_schema=table.schema())
        start, end = pending[0].offset, pending[-1].offset
        properties = {
            SUMMARY_TOPIC: topic,
            SUMMARY_START_OFFSET: str(start),
            SUMMARY_END_OFFSET: str(end),
            SUMMARY_OBJECT_ID: object_id,
        }
        handle = _without_commit_retries(table)
        try:
            handle.append(df, snapshot_properties=properties)
        except CommitFailedException:
            if attempt == max_attempts:
                raise
            log.warning("%s: commit of offsets %d-%d conflicted (attempt %d), retrying", where, start, end, attempt)
            time.sleep(retry_backoff_s * attempt)
            table.refresh()
            continue
        snapshot = handle.current_snapshot()
        table.refresh()
        return AppendResult(snapshot.snapshot_id if snapshot else None, len(pending), end, skipped, attempt)
    raise AssertionError("unreachable")  # pragma: no cover
