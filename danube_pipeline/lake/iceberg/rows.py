"""Records to the rows of a topic's table, in any schema format, with their dead letters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.schema import Schema

from danube_pipeline.lake.iceberg.arrow import assemble, metadata_data
from danube_pipeline.lake.iceberg.avro_batch import AvroBatchDecoder
from danube_pipeline.lake.iceberg.dead_letter import DeadLetter, DeadLetterReason
from danube_pipeline.lake.iceberg.evolution import is_identity, value_converter
from danube_pipeline.lake.iceberg.schema import KEY_COLUMN, PAYLOAD_COLUMN, RAW_PAYLOAD_COLUMN, RESERVED_COLUMNS
from danube_pipeline.lake.iceberg.writer import (
    PayloadDecodeError,
    ValueDoesNotFitError,
    WriterSchema,
)
from danube_pipeline.format.records import Record
from danube_pipeline.lake.segment_columns import RecordColumns, schema_keys

__all__ = ["BoundWriter", "TableRows", "table_rows"]


@dataclass(frozen=True, slots=True)
class BoundWriter:
    """A writer schema version as one table takes it.

    Attributes:
        description: names it in errors, e.g. ``"schema id 3 version 2 (Avro)"``.
        writer: the writer schema, or ``None`` when its records cannot be rows.
        error: why its records go to the dead-letter table (the whole ``_error`` text), when
            ``writer`` is ``None`` or the table cannot take it.
        column_for: the writer's column names that the table calls otherwise (renames),
            ``{writer name: table name}``.
    """

    description: str
    writer: WriterSchema | None = None
    error: str | None = None
    column_for: Mapping[str, str] = field(default_factory=dict)


@dataclass
class TableRows:
    """What :func:`table_rows` made of a run of records.

    Attributes:
        rows: the rows for the table, in offset order, one per record that is not a dead letter.
        dead_letters: the other records, in offset order, each with its error.
    """

    rows: pa.Table
    dead_letters: list[DeadLetter]


_ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, TypeError, ValueError)


class _Fitter:
    """A bound writer's columns, each with the table column it lands in and its converter."""

    def __init__(self, bound: BoundWriter, columns: Mapping[str, Any], arrow_schema: pa.Schema) -> None:
        self.error = bound.error
        self.description = bound.description
        self.writer = bound.writer
        self.parts: list[tuple[str, str, Any]] = []
        self.direct = False  # a decoded payload is already the row: same names, nothing to convert
        self.batch: AvroBatchDecoder | None = None  # the columnar path (.avro_batch), when it applies
        self.targets: dict[str, pa.DataType] = {}
        if self.writer is None or self.error is not None:
            return
        for c in self.writer.columns:
            name = bound.column_for.get(c.name, c.name)
            target = columns.get(name)
            if target is None:
                continue  # the table does not have it (yet): not written
            conv = value_converter(c.iceberg_type, target.field_type)
            if conv is None:
                self.error = (
                    f"{DeadLetterReason.NEEDS_SCHEMA_REWRITE}: {self.description}: column {name}: "
                    f"{c.iceberg_type} does not fit {target.field_type}"
                )
                return
            self.parts.append((c.name, name, conv))
        self.direct = len(self.parts) == len(self.writer.columns) and all(
            source == target and is_identity(conv) for source, target, conv in self.parts
        )
        batch = self.writer.batch
        if batch is not None and all(is_identity(conv) for _, _, conv in self.parts):
            # Identity converters only: equal types or Iceberg promotions, which an Arrow cast
            # makes exactly (int to long, float to double).
            self.batch = batch
            self.targets = {target: arrow_schema.field(target).type for _, target, _ in self.parts}

    def decode(self, record: Record, columns: Mapping[str, Any], required: Sequence[str]) -> dict[str, Any] | str:
        """One record's row, or the ``_error`` of its dead letter (the per-record path)."""
        assert self.writer is not None
        try:
            decoded = self.writer.decode(record.payload)
        except ValueDoesNotFitError as exc:
            return f"{DeadLetterReason.VALUE_DOES_NOT_FIT}: {exc} ({self.description})"
        except PayloadDecodeError as exc:
            return f"{DeadLetterReason.CORRUPT_PAYLOAD}: does not decode with {self.description}: {exc}"
        row: dict[str, Any] = decoded if self.direct else {}
        for source, target, conv in () if self.direct else self.parts:
            value = decoded.get(source)
            if value is not None:
                try:
                    value = conv(value)
                except Exception as exc:  # noqa: BLE001 - any conversion failure is a misfit
                    return _misfit(target, columns[target].field_type, exc)
            row[target] = value
        missing = [name for name in required if row.get(name) is None]
        if missing:
            return _misfit(missing[0], columns[missing[0]].field_type, "null in a required column")
        return row

    def decode_batch(self, records: RecordColumns, required: Sequence[str]) -> dict[str, pa.Array] | None:
        """The table columns of ``records`` decoded as one batch (:mod:`.avro_batch`), or
        ``None`` when they must be decoded one by one (a payload or value the batch path
        leaves to the per-record path, or a required column that would hold a null)."""
        if self.batch is None:
            return None
        decoded = self.batch.decode_array(records.payload)
        if decoded is None:
            return None
        out: dict[str, pa.Array] = {}
        try:
            for source, target, _ in self.parts:
                array = decoded[source]
                wanted = self.targets[target]
                out[target] = array if array.type == wanted else array.cast(wanted)
        except _ARROW_ERRORS:
            return None
        if any(name not in out or out[name].null_count for name in required):
            return None
        return out


def table_rows(
    records: Sequence[Record],
    iceberg_schema: Schema,
    writers: Mapping[tuple[int, int], BoundWriter],
    *,
    partition: int | None = None,
    raw_error: str | None = None,
    raw_payload: bool = False,
) -> TableRows:
    """Decode ``records`` into the rows of a table of ``iceberg_schema``, setting aside every
    record that cannot be a row.

    A table with a ``_payload`` column takes every record's payload as is. Otherwise each
    record is decoded with its writer schema (``writers[(schema_id, schema_version)]``) and
    each value converted to its column's type
    (:func:`~danube_pipeline.lake.iceberg.evolution.value_converter`). A record is a dead letter
    (:class:`~danube_pipeline.lake.iceberg.dead_letter.DeadLetter`) when it has no schema
    (``raw_error``), its writer is unknown or carries an error, its payload does not decode
    (``corrupt payload: ...``), or a value does not fit its column or a required column would
    be null (``value does not fit: ...``: found by the decoder, by the conversion to the
    column's type, or by pyarrow when a whole column does not convert, then value by value).

    The records of each Avro writer version whose columns land unconverted (equal types or
    Iceberg promotions) are first decoded together into Arrow columns
    (:mod:`~danube_pipeline.lake.iceberg.avro_batch`); when that batch is refused, its records take
    the per-record path, which finds the bad ones. Both give the same rows.

    With ``raw_payload`` and a ``_raw_payload`` column in ``iceberg_schema``, each row also
    carries its record's payload exactly as stored, and with a ``_key`` column its routing key
    (``docs/etcd-layout.md`` §3.9); otherwise those columns are null.

    Args:
        records: the records, in offset order.
        iceberg_schema: the table's schema, as evolved for these writers.
        writers: per ``(schema_id, schema_version)`` of the records.
        partition: the partition index written to ``_partition``, or ``None``.
        raw_error: the ``_error`` of records without a schema (schema id 0) on a table with a
            schema; ignored for a ``_payload`` table.
        raw_payload: fill ``_raw_payload`` (the layout's ``raw_payload``).

    Returns:
        The :class:`TableRows`.
    """
    arrow_schema = schema_to_pyarrow(iceberg_schema, include_field_ids=False)
    names = {f.name for f in iceberg_schema.fields}
    records = RecordColumns.from_records(records)
    if PAYLOAD_COLUMN in names:
        data: dict[str, Any] = dict(metadata_data(records, partition, arrow_schema))
        payload_type = arrow_schema.field(PAYLOAD_COLUMN).type
        data[PAYLOAD_COLUMN] = records.payload if records.payload.type == payload_type else records.payload.cast(payload_type)
        if raw_payload and KEY_COLUMN in names:
            data[KEY_COLUMN] = key_column(records, arrow_schema)
        return TableRows(assemble(arrow_schema, data, len(records)), [])

    columns = {f.name: f for f in iceberg_schema.fields if f.name not in RESERVED_COLUMNS}
    required = [f.name for f in columns.values() if f.required]
    fitters: dict[tuple[int, int], _Fitter] = {}
    dead: dict[int, DeadLetter] = {}
    batches: dict[tuple[int, int], Sequence[int]] = {}
    keys = schema_keys(records)
    for key in keys:  # each writer version's records, in offset order
        if len(keys) == 1:
            indices: Sequence[int] = range(len(records))
        else:
            mask = (records.schema_id == key[0]) & (records.schema_version == key[1])
            indices = np.flatnonzero(mask).tolist()
        if key[0] == 0:
            error = raw_error or f"{DeadLetterReason.RAW_MESSAGE} on a topic with a schema"
        else:
            bound = writers.get(key) or BoundWriter(
                f"schema id {key[0]} version {key[1]}",
                error=f"{DeadLetterReason.UNKNOWN_SCHEMA}: schema id {key[0]} version {key[1]}",
            )
            fitter = fitters[key] = _Fitter(bound, columns, arrow_schema)
            if fitter.error is None and fitter.writer is not None:
                batches[key] = indices
                continue
            error = fitter.error or f"{DeadLetterReason.UNKNOWN_SCHEMA}: {fitter.description}"
        dead.update((r.offset, DeadLetter(r, error)) for r in (records if len(keys) == 1 else records.take(indices)))

    payload_fields = [f for f in arrow_schema if f.name in columns]
    pieces: list[tuple[Sequence[int], dict[str, pa.Array]]] = []
    good: list[int] = []  # records decoded one by one, then turned into arrays below
    rows: list[dict[str, Any]] = []
    for key, indices in batches.items():
        fitter = fitters[key]
        run = records if len(indices) == len(records) else records.take(indices)
        arrays_of_batch = fitter.decode_batch(run, required)
        if arrays_of_batch is not None:
            pieces.append((indices, arrays_of_batch))
            continue
        for i in indices:
            outcome = fitter.decode(records[i], columns, required)
            if isinstance(outcome, str):
                dead[records[i].offset] = DeadLetter(records[i], outcome)
            else:
                good.append(i)
                rows.append(outcome)
    if batches and len(batches) > 1 and rows:
        order = sorted(range(len(good)), key=good.__getitem__)
        good = [good[j] for j in order]
        rows = [rows[j] for j in order]

    while rows:
        arrays: dict[str, pa.Array] = {}
        bad: dict[int, str] = {}
        for f in payload_fields:
            values = [row.get(f.name) for row in rows]
            try:
                arrays[f.name] = pa.array(values, type=f.type)
            except _ARROW_ERRORS:
                for j, v in enumerate(values):
                    try:
                        pa.array([v], type=f.type)
                    except _ARROW_ERRORS as exc:
                        bad.setdefault(j, _misfit(f.name, columns[f.name].field_type, exc))
                if not bad:
                    raise
        if not bad:
            pieces.append((good, arrays))
            break
        for j in bad:
            r = records[good[j]]
            dead[r.offset] = DeadLetter(r, bad[j])
        good = [g for j, g in enumerate(good) if j not in bad]
        rows = [row for j, row in enumerate(rows) if j not in bad]

    indices, payload = _combine(pieces, payload_fields)
    kept = records.take(indices) if len(indices) != len(records) else records
    columns_data: dict[str, Any] = {**metadata_data(kept, partition, arrow_schema), **payload}
    if raw_payload and RAW_PAYLOAD_COLUMN in names:
        raw_type = arrow_schema.field(RAW_PAYLOAD_COLUMN).type
        columns_data[RAW_PAYLOAD_COLUMN] = kept.payload if kept.payload.type == raw_type else kept.payload.cast(raw_type)
    if raw_payload and KEY_COLUMN in names:
        columns_data[KEY_COLUMN] = key_column(kept, arrow_schema)
    return TableRows(assemble(arrow_schema, columns_data, len(kept)), [dead[o] for o in sorted(dead)])


def _combine(
    pieces: Sequence[tuple[Sequence[int], Mapping[str, pa.Array]]], fields: Sequence[pa.Field]
) -> tuple[Sequence[int], dict[str, pa.Array]]:
    """The pieces' rows as one set of columns in record order: ``(record indices, columns)``;
    a column a piece lacks is null there."""
    if len(pieces) == 1:
        indices, arrays = pieces[0]
        n = len(indices)
        return indices, {f.name: arrays[f.name] if f.name in arrays else pa.nulls(n, type=f.type) for f in fields}
    indices = [i for piece_indices, _ in pieces for i in piece_indices]
    order = pa.array(np.argsort(np.asarray(indices, dtype=np.int64), kind="stable"))
    out: dict[str, pa.Array] = {}
    for f in fields:
        parts = [arrays.get(f.name, pa.nulls(len(piece_indices), type=f.type)) for piece_indices, arrays in pieces]
        out[f.name] = pa.concat_arrays(parts).take(order) if parts else pa.nulls(0, type=f.type)
    return sorted(indices), out


def _misfit(column: str, column_type: Any, detail: Any) -> str:
    return f"{DeadLetterReason.VALUE_DOES_NOT_FIT}: column {column} ({column_type}): {detail}"


def key_column(records: RecordColumns, arrow_schema: pa.Schema) -> pa.Array:
    """``_key`` of ``records`` (``docs/etcd-layout.md`` §3.9): a struct that is never null, whose
    ``value`` is the routing key or null for a record without one.

    Args:
        records: the rows' records.
        arrow_schema: the table's Arrow schema (gives the struct's type).

    Returns:
        The column, ``len(records)`` values.
    """
    struct_type = arrow_schema.field(KEY_COLUMN).type
    value_type = struct_type.field(0).type
    keys = records.key if records.key.type == value_type else records.key.cast(value_type)
    return pa.StructArray.from_arrays([keys], fields=[struct_type.field(0)])
