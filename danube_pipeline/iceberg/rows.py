"""Records to the rows of a topic's table, in any schema format, with their dead letters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.schema import Schema

from danube_pipeline.iceberg.arrow import assemble, metadata_data
from danube_pipeline.iceberg.dead_letter import DeadLetter, DeadLetterReason
from danube_pipeline.iceberg.evolution import is_identity, value_converter
from danube_pipeline.iceberg.schema import PAYLOAD_COLUMN, RESERVED_COLUMNS
from danube_pipeline.iceberg.writer import PayloadDecodeError, ValueDoesNotFitError, WriterSchema
from danube_pipeline.records import Record

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

    def __init__(self, bound: BoundWriter, columns: Mapping[str, Any]) -> None:
        self.error = bound.error
        self.description = bound.description
        self.writer = bound.writer
        self.parts: list[tuple[str, str, Any]] = []
        self.direct = False  # a decoded payload is already the row: same names, nothing to convert
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


def table_rows(
    records: Sequence[Record],
    iceberg_schema: Schema,
    writers: Mapping[tuple[int, int], BoundWriter],
    *,
    partition: int | None = None,
    raw_error: str | None = None,
) -> TableRows:
    """Decode ``records`` into the rows of a table of ``iceberg_schema``, setting aside every
    record that cannot be a row.

    A table with a ``_payload`` column takes every record's payload as is. Otherwise each
    record is decoded with its writer schema (``writers[(schema_id, schema_version)]``) and
    each value converted to its column's type
    (:func:`~danube_pipeline.iceberg.evolution.value_converter`). A record is a dead letter
    (:class:`~danube_pipeline.iceberg.dead_letter.DeadLetter`) when it has no schema
    (``raw_error``), its writer is unknown or carries an error, its payload does not decode
    (``corrupt payload: ...``), or a value does not fit its column or a required column would
    be null (``value does not fit: ...``: found by the decoder, by the conversion to the
    column's type, or by pyarrow when a whole column does not convert, then value by value).

    Args:
        records: the records, in offset order.
        iceberg_schema: the table's schema, as evolved for these writers.
        writers: per ``(schema_id, schema_version)`` of the records.
        partition: the partition index written to ``_partition``, or ``None``.
        raw_error: the ``_error`` of records without a schema (schema id 0) on a table with a
            schema; ignored for a ``_payload`` table.

    Returns:
        The :class:`TableRows`.
    """
    arrow_schema = schema_to_pyarrow(iceberg_schema, include_field_ids=False)
    names = {f.name for f in iceberg_schema.fields}
    if PAYLOAD_COLUMN in names:
        data = metadata_data(records, partition)
        data[PAYLOAD_COLUMN] = [r.payload for r in records]
        return TableRows(assemble(arrow_schema, data, len(records)), [])

    columns = {f.name: f for f in iceberg_schema.fields if f.name not in RESERVED_COLUMNS}
    required = [f.name for f in columns.values() if f.required]
    fitters: dict[tuple[int, int], _Fitter] = {}
    dead: dict[int, DeadLetter] = {}
    good: list[Record] = []
    rows: list[dict[str, Any]] = []
    for r in records:
        if r.schema_id == 0:
            dead[r.offset] = DeadLetter(r, raw_error or f"{DeadLetterReason.RAW_MESSAGE} on a topic with a schema")
            continue
        key = (r.schema_id, r.schema_version)
        fitter = fitters.get(key)
        if fitter is None:
            bound = writers.get(key) or BoundWriter(
                f"schema id {key[0]} version {key[1]}",
                error=f"{DeadLetterReason.UNKNOWN_SCHEMA}: schema id {key[0]} version {key[1]}",
            )
            fitter = fitters[key] = _Fitter(bound, columns)
        if fitter.error is not None or fitter.writer is None:
            dead[r.offset] = DeadLetter(r, fitter.error or f"{DeadLetterReason.UNKNOWN_SCHEMA}: {fitter.description}")
            continue
        try:
            decoded = fitter.writer.decode(r.payload)
        except ValueDoesNotFitError as exc:
            dead[r.offset] = DeadLetter(r, f"{DeadLetterReason.VALUE_DOES_NOT_FIT}: {exc} ({fitter.description})")
            continue
        except PayloadDecodeError as exc:
            dead[r.offset] = DeadLetter(
                r, f"{DeadLetterReason.CORRUPT_PAYLOAD}: does not decode with {fitter.description}: {exc}"
            )
            continue
        row: dict[str, Any] = decoded if fitter.direct else {}
        error = None
        for source, target, conv in () if fitter.direct else fitter.parts:
            value = decoded.get(source)
            if value is not None:
                try:
                    value = conv(value)
                except Exception as exc:  # noqa: BLE001 - any conversion failure is a misfit
                    error = _misfit(target, columns[target].field_type, exc)
                    break
            row[target] = value
        if error is None:
            missing = [name for name in required if row.get(name) is None]
            if missing:
                error = _misfit(missing[0], columns[missing[0]].field_type, "null in a required column")
        if error is not None:
            dead[r.offset] = DeadLetter(r, error)
            continue
        good.append(r)
        rows.append(row)

    payload_fields = [f for f in arrow_schema if f.name in columns]
    while True:
        arrays: dict[str, pa.Array] = {}
        bad: dict[int, str] = {}
        for f in payload_fields:
            values = [row.get(f.name) for row in rows]
            try:
                arrays[f.name] = pa.array(values, type=f.type)
            except _ARROW_ERRORS:
                for i, v in enumerate(values):
                    try:
                        pa.array([v], type=f.type)
                    except _ARROW_ERRORS as exc:
                        bad.setdefault(i, _misfit(f.name, columns[f.name].field_type, exc))
                if not bad:
                    raise
        if not bad:
            break
        for i in bad:
            dead[good[i].offset] = DeadLetter(good[i], bad[i])
        good = [r for i, r in enumerate(good) if i not in bad]
        rows = [row for i, row in enumerate(rows) if i not in bad]
    columns_data: dict[str, Any] = {**metadata_data(good, partition), **arrays}
    return TableRows(assemble(arrow_schema, columns_data, len(good)), [dead[o] for o in sorted(dead)])


def _misfit(column: str, column_type: Any, detail: Any) -> str:
    return f"{DeadLetterReason.VALUE_DOES_NOT_FIT}: column {column} ({column_type}): {detail}"
