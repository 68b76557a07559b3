"""Records to Arrow: the rows :func:`~danube_pipeline.lake.iceberg.append.append_records` appends.

:func:`arrow_table_for_records` decodes Avro payloads and fails on the first that does not
decode; :func:`~danube_pipeline.lake.iceberg.rows.table_rows` (what tiering uses) decodes payloads of
any format and sets aside the records that cannot be rows.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import fastavro
import numpy as np
import pyarrow as pa
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.schema import Schema

from danube_pipeline.errors import SchemaMismatchError
from danube_pipeline.lake.iceberg.schema import (
    PARTITION_COLUMN,
    PAYLOAD_COLUMN,
    as_avro_dict,
    payload_columns,
    schema_from_columns,
)
from danube_pipeline.format.records import Record
from danube_pipeline.lake.segment_columns import RecordColumns

__all__ = ["arrow_table_for_records", "assemble", "metadata_data"]


class _ParsedSchemas:
    """fastavro-parsed schemas, parsed once each."""

    def __init__(self) -> None:
        self._cache: dict[int, Any] = {}

    def get(self, schema: Mapping[str, Any]) -> Any:
        key = id(schema)
        parsed = self._cache.get(key)
        if parsed is None:
            parsed = fastavro.parse_schema(dict(schema))
            self._cache[key] = parsed
        return parsed


def arrow_table_for_records(
    records: Sequence[Record],
    avro_schema: Mapping[str, Any] | str | None,
    *,
    writer_schemas: Mapping[tuple[int, int], Mapping[str, Any] | str] | None = None,
    iceberg_schema: Schema | None = None,
    partition: int | None = None,
) -> pa.Table:
    """Build the Arrow table that :func:`append_records` appends.

    Each payload is decoded once with ``fastavro.schemaless_reader``, using the schema the
    record was written with when ``writer_schemas`` has its ``(schema_id, schema_version)``
    and ``avro_schema`` otherwise. Columns are filled by field name from the table schema
    (``avro_schema``), so a field the writer schema lacks is null. A record without a schema
    (schema id 0) is never decoded with ``avro_schema``: it is refused.

    Args:
        records: the records, in offset order.
        avro_schema: the table's Avro schema (the latest version), or ``None`` for ``_payload``.
        writer_schemas: Avro schema per ``(schema_id, schema_version)`` found in ``records``.
        iceberg_schema: the target table's schema; defaults to
            :func:`iceberg_schema_for_avro` of ``avro_schema``. Columns of the table that the
            Avro schema does not produce are filled with nulls.
        partition: the partition index every record comes from, written to ``_partition``
            (a partitioned topic's table, ``docs/etcd-layout.md`` §3.1); ``None`` for a plain
            topic.

    Returns:
        A ``pyarrow.Table`` whose schema matches the Iceberg schema (required columns
        non-nullable).

    Raises:
        SchemaMismatchError: a payload does not decode with its schema, or a record without a
            schema comes with an ``avro_schema``.
    """
    table_avro = as_avro_dict(avro_schema) if avro_schema is not None else None
    columns = payload_columns(table_avro) if table_avro is not None else None
    schema = iceberg_schema or schema_from_columns(columns, partitioned=partition is not None)
    arrow_schema = schema_to_pyarrow(schema, include_field_ids=False)

    n = len(records)
    data: dict[str, Any] = dict(metadata_data(records, partition, arrow_schema))
    if columns is None:
        data[PAYLOAD_COLUMN] = [r.payload for r in records]
    else:
        assert table_avro is not None
        parsed = _ParsedSchemas()
        writers = {k: as_avro_dict(v) for k, v in (writer_schemas or {}).items()}
        default_writer = parsed.get(table_avro)
        is_record = table_avro.get("type") in ("record", "error")
        values: list[list[Any]] = [[None] * n for _ in columns]
        names = [c.name for c in columns]
        convs = [c.convert for c in columns]
        writer_cache: dict[tuple[int, int], Any] = {}
        for i, r in enumerate(records):
            if r.schema_id == 0:
                raise SchemaMismatchError(
                    str(table_avro.get("name", "?")), 0, f"offset {r.offset}: raw message (no schema)"
                )
            key = (r.schema_id, r.schema_version)
            writer = writer_cache.get(key)
            if writer is None:
                w = writers.get(key)
                writer = parsed.get(w) if w is not None else default_writer
                writer_cache[key] = writer
            try:
                decoded = fastavro.schemaless_reader(io.BytesIO(r.payload), writer, None)
            except Exception as exc:  # noqa: BLE001 - any decode failure is a mismatch
                raise SchemaMismatchError(
                    str(table_avro.get("name", "?")), r.schema_id, f"offset {r.offset}: {exc}"
                ) from exc
            if is_record:
                if not isinstance(decoded, dict):
                    raise SchemaMismatchError(
                        str(table_avro.get("name", "?")), r.schema_id, f"offset {r.offset}: not a record"
                    )
                for j, name in enumerate(names):
                    v = decoded.get(name)
                    values[j][i] = None if v is None else convs[j](v)
            else:
                values[0][i] = None if decoded is None else convs[0](decoded)
        for name, col in zip(names, values, strict=True):
            data[name] = col
    return assemble(arrow_schema, data, n)


def metadata_data(records: Sequence[Record], partition: int | None, arrow_schema: pa.Schema) -> dict[str, pa.Array]:
    """The metadata columns (``_offset``... ``_attributes``, and ``_partition``) of ``records``,
    as arrays of the types ``arrow_schema`` gives them.

    Taken from the records' columns (:class:`~danube_pipeline.lake.segment_columns.RecordColumns`,
    made from any other sequence first) without a Python object per record. A u64 producer id
    (``docs/etcd-layout.md`` §3.3) becomes the int64 with the same bits, since Iceberg's
    ``long`` is signed; ``value & (2**64 - 1)`` reverses it.

    Args:
        records: the records, in row order.
        partition: the partition index for ``_partition``, or ``None`` (no such column).
        arrow_schema: the table's Arrow schema (pyiceberg's ``schema_to_pyarrow``).

    Returns:
        ``{column name: array}`` of ``len(records)`` values each.

    Raises:
        pyarrow.ArrowInvalid: a schema id beyond the int64 range, or a version beyond int32.
    """
    columns = RecordColumns.from_records(records)
    n = len(columns)

    def typed(name: str, array: pa.Array) -> pa.Array:
        wanted = arrow_schema.field(name).type
        return array if array.type == wanted else array.cast(wanted)

    data: dict[str, pa.Array] = {
        "_offset": pa.array(columns.offset, type=pa.int64()),
        "_publish_time": typed("_publish_time", pa.array(columns.publish_time_us).view(pa.timestamp("us"))),
        "_producer_id": pa.array(columns.producer_id.view(np.int64)),
        "_producer_name": typed("_producer_name", columns.producer_name),
        "_schema_id": pa.array(columns.schema_id, type=pa.int64()),
        "_schema_version": pa.array(columns.schema_version, type=pa.int32()),
        "_attributes": typed("_attributes", columns.attributes),
    }
    if partition is not None:
        data[PARTITION_COLUMN] = pa.array(np.full(n, partition, dtype=np.int32))
    return data


def assemble(arrow_schema: pa.Schema, data: Mapping[str, Any], n: int) -> pa.Table:
    """The table of ``arrow_schema`` from lists (or arrays) by column name; a column without
    data is all null."""
    arrays = []
    for f in arrow_schema:
        values_for_field = data.get(f.name)
        if values_for_field is None:
            arrays.append(pa.nulls(n, type=f.type))
        elif isinstance(values_for_field, pa.Array):
            arrays.append(values_for_field)
        else:
            arrays.append(pa.array(values_for_field, type=f.type))
    return pa.Table.from_arrays(arrays, schema=arrow_schema)
