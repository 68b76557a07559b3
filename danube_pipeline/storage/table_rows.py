"""A window of a topic's table as Arrow columns: the rows of :class:`TableRows`.

:class:`~danube_pipeline.storage.table_reader.TableReader` reads a window of rows from the
topic's table and its dead-letter table (only the reserved columns,
:mod:`.table_columns`); the functions here turn them into one column per field of
:class:`~danube_pipeline.format.records.Record` (:data:`ROW_SCHEMA`), merge the two tables by
offset and cut the window where an offset is missing or its bytes are not in the table
(``docs/etcd-layout.md`` §3.9, ``raw_payload``), all in Arrow: no Python object per row until a
caller asks for :meth:`TableRows.records`. :func:`bytes_stop` finds where a window cut by its
payload bytes ends before its rows are merged and copied.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from danube_pipeline.format.records import Record
from danube_pipeline.storage.table_columns import (
    ATTRIBUTES_COLUMN,
    KEY_COLUMN,
    KEY_VALUE_FIELD,
    OFFSET_COLUMN,
    PRODUCER_ID_COLUMN,
    PRODUCER_NAME_COLUMN,
    PUBLISH_TIME_COLUMN,
    SCHEMA_ID_COLUMN,
    SCHEMA_VERSION_COLUMN,
)

__all__ = ["ROW_SCHEMA", "TableRows", "bytes_stop", "contiguous_rows", "empty_rows", "holds_offset", "normalized_rows"]

ROW_SCHEMA = pa.schema([
    pa.field("offset", pa.int64(), nullable=False),
    pa.field("publish_time_us", pa.int64(), nullable=False),
    pa.field("producer_id", pa.uint64(), nullable=False),
    pa.field("producer_name", pa.large_string(), nullable=False),
    pa.field("schema_id", pa.int64(), nullable=False),
    pa.field("schema_version", pa.int64(), nullable=False),
    pa.field("attributes", pa.map_(pa.large_string(), pa.large_string())),
    pa.field("key", pa.large_string()),
    pa.field("payload", pa.large_binary(), nullable=False),
])  # fmt: skip
"""The columns of :attr:`TableRows.columns`, one row per record, the fields of
:class:`~danube_pipeline.format.records.Record`: ``attributes`` null for none, ``key`` null for
no routing key, ``producer_id`` the u64 (the table keeps it as a signed long)."""
_KNOWN = "known"
"""An extra boolean column while rows are merged: the row's bytes and key are in the table."""

@dataclass(frozen=True, slots=True)
class TableRows:
    """What :meth:`TableReader.read_rows` found: a :class:`TableRead` as Arrow columns.

    Attributes:
        columns: the records at ``from_offset`` and after, ascending and contiguous, dead
            letters merged in, one row each (:data:`ROW_SCHEMA`).
        snapshot_id: as :attr:`~danube_pipeline.storage.table_reader.TableRead.snapshot_id`.
        next_offset: as :attr:`~danube_pipeline.storage.table_reader.TableRead.next_offset`.
        complete: as :attr:`~danube_pipeline.storage.table_reader.TableRead.complete`.
        at_limit: the read stopped at its ``max_records`` or ``max_bytes``, not at the end of
            what the table holds: a next read from ``next_offset`` may find more at once.
    """

    columns: pa.Table
    snapshot_id: int | None
    next_offset: int
    complete: bool
    at_limit: bool = False

    def records(self) -> list[Record]:
        """The rows as :class:`~danube_pipeline.format.records.Record` values (one Python
        object per row: for callers that need them one by one)."""
        c = {name: self.columns.column(name).to_pylist() for name in ROW_SCHEMA.names}
        return [
            Record(
                offset=offset,
                publish_time_us=publish,
                producer_id=producer_id,
                producer_name=name,
                schema_id=schema_id,
                schema_version=version,
                payload=payload,
                attributes=dict(attributes) if attributes else {},
                key=key,
            )
            for offset, publish, producer_id, name, schema_id, version, attributes, key, payload in zip(
                *(c[name] for name in ROW_SCHEMA.names), strict=True
            )
        ]


def empty_rows() -> pa.Table:
    """No rows, in the columns of :func:`normalized_rows`."""
    return ROW_SCHEMA.append(pa.field(_KNOWN, pa.bool_(), nullable=False)).empty_table()


def _filled(arrow: pa.Table, name: str, type_: pa.DataType, default: object) -> pa.Array:
    """Column ``name`` of ``arrow`` cast to ``type_`` with nulls as ``default`` (all
    ``default`` when the table has no such column)."""
    n = arrow.num_rows
    if name not in arrow.column_names:
        return pc.fill_null(pa.nulls(n, type_), pa.scalar(default, type_))
    column = arrow.column(name).combine_chunks()
    if pa.types.is_timestamp(column.type):
        column = column.cast(pa.int64())
    return pc.fill_null(pc.cast(column, type_, safe=type_ != pa.uint64()), pa.scalar(default, type_))


def normalized_rows(arrow: pa.Table, payload_column: str) -> pa.Table:
    """Rows read from a table (or its dead letters) in the columns of :data:`ROW_SCHEMA` and
    ``known``: ``False`` for a row written while ``raw_payload`` was off (no ``_key``, or no
    payload bytes), whose other fields are then not to be trusted."""
    n = arrow.num_rows
    if n == 0:
        return empty_rows()
    names = arrow.column_names
    if KEY_COLUMN in names:
        key_struct = arrow.column(KEY_COLUMN).combine_chunks()
        key = pc.cast(pc.struct_field(key_struct, KEY_VALUE_FIELD), pa.large_string())
        key_known = key_struct.is_valid()
    else:
        key = pa.nulls(n, pa.large_string())
        key_known = pc.fill_null(pa.nulls(n, pa.bool_()), False)
    if payload_column in names:  # in its chunks: a window's rows are copied once, when framed
        raw_payload = pc.cast(arrow.column(payload_column), pa.large_binary())
    else:
        raw_payload = pa.nulls(n, pa.large_binary())
    known = pc.and_(key_known, raw_payload.is_valid())
    if ATTRIBUTES_COLUMN in names:
        attributes = pc.cast(arrow.column(ATTRIBUTES_COLUMN).combine_chunks(), ROW_SCHEMA.field("attributes").type)
    else:
        attributes = pa.nulls(n, ROW_SCHEMA.field("attributes").type)
    return pa.Table.from_arrays(
        [
            _filled(arrow, OFFSET_COLUMN, pa.int64(), 0),
            _filled(arrow, PUBLISH_TIME_COLUMN, pa.int64(), 0),
            _filled(arrow, PRODUCER_ID_COLUMN, pa.uint64(), 0),  # the signed long as the u64
            _filled(arrow, PRODUCER_NAME_COLUMN, pa.large_string(), ""),
            _filled(arrow, SCHEMA_ID_COLUMN, pa.int64(), 0),
            _filled(arrow, SCHEMA_VERSION_COLUMN, pa.int64(), 0),
            attributes,
            key,
            pc.fill_null(raw_payload, pa.scalar(b"", pa.large_binary())),
            known,
        ],
        schema=ROW_SCHEMA.append(pa.field(_KNOWN, pa.bool_(), nullable=False)),
    )


def holds_offset(rows: pa.Table, offset: int) -> bool:
    """Whether ``rows`` (:func:`normalized_rows`) hold ``offset``."""
    return rows.num_rows > 0 and pc.any(pc.equal(rows.column("offset"), offset)).as_py() is True


def contiguous_rows(rows: pa.Table, from_offset: int) -> tuple[pa.Table, int]:
    """The rows (dead letters first, then the table's, :func:`normalized_rows`) sorted by offset,
    each offset once (the first row found: committed once, a second row of an offset is not
    served twice), cut at the first offset from ``from_offset`` on that is missing or not
    known; in :data:`ROW_SCHEMA` (without ``known``), with the count of rows kept."""
    if rows.num_rows == 0:
        return rows.drop_columns([_KNOWN]), 0
    offsets = rows.column("offset")
    n = rows.num_rows
    if n > 1 and pc.all(pc.greater(offsets.slice(1), offsets.slice(0, n - 1))).as_py():
        pass  # ascending, each offset once: as read from one data file (no copy)
    elif n > 1:
        rows = rows.take(pc.sort_indices(offsets))  # a stable sort
        offsets = rows.column("offset")
        repeated = pc.equal(offsets.slice(1), offsets.slice(0, n - 1))
        if pc.any(repeated).as_py():
            rows = rows.filter(pa.concat_arrays([pa.array([True]), pc.invert(repeated.combine_chunks())]))
            offsets = rows.column("offset")
    # offsets are unique and at least from_offset: the rows up to i are contiguous from it
    # exactly when offsets[i] == from_offset + i, so the run ends where that first fails
    values = offsets.combine_chunks()  # a binary search: no Python object per row
    run = bisect.bisect_right(range(len(values)), 0, key=lambda i: values[i].as_py() - from_offset - i)
    unknown = pc.index(rows.column(_KNOWN).slice(0, run), False).as_py() if run else -1
    count = run if unknown < 0 else unknown
    return rows.slice(0, count).drop_columns([_KNOWN]), count


def bytes_stop(pieces: list[tuple[pa.Table, bool]], payload: str, last: int, max_bytes: int) -> int:
    """The offset at which the rows of ``pieces`` (each ``(rows, contiguous)``: rows as read
    from one data file, in the table's reserved columns, and whether their offsets run
    ``o, o + 1, ...``; in the order of their lowest offsets), taken in offset order, pass
    ``max_bytes`` of payload (column ``payload``), so the caller copies no more: a read cut at
    ``max_bytes`` serves no row after it, since the rows of the window (dead letters merged
    in, offsets missing from the table too) reach at least as many bytes by then. ``last``
    when they do not pass it, or when the offsets do not ascend piece after piece
    (overlapping data files after a compaction: the read then cuts after merging)."""
    previous = -1
    for rows, contiguous in pieces:
        offsets = rows.column(OFFSET_COLUMN)
        n = rows.num_rows
        if offsets[0].as_py() <= previous or payload not in rows.column_names:
            return last
        if not contiguous and n > 1 and not pc.all(pc.greater(offsets.slice(1), offsets.slice(0, n - 1))).as_py():
            return last
        previous = offsets[n - 1].as_py()
    total = 0
    for rows, _ in pieces:
        lengths = pc.fill_null(pc.binary_length(rows.column(payload)), 0).combine_chunks()
        size: int = pc.sum(lengths).as_py() or 0
        if total + size > max_bytes:
            over = pc.greater(pc.cumulative_sum(lengths), max_bytes - total)
            return min(last, int(rows.column(OFFSET_COLUMN)[pc.index(over, True).as_py()].as_py()))
        total += size
    return last
