"""Avro schemas to Iceberg schemas: the columns of a topic's table.

Each table has the message metadata columns (field ids 1-9 here; the catalog renumbers a new
table's ids, top-level columns first, Iceberg spec "Schemas and Data Types")::

    _offset long (required) | _publish_time timestamptz (µs) | _producer_id long (u64 bits)
    | _producer_name string | _schema_id long | _schema_version int | _attributes map<string,string>

followed by one typed column per field of the topic's Avro record schema, or a single
``_payload`` binary column when the topic has no schema. JSON Schema and Protobuf schemas map to
columns in :mod:`.json_schema` and :mod:`.protobuf_schema`; all three share
:class:`PayloadColumn` and :func:`schema_from_columns` here.

The table of a partitioned topic (``docs/etcd-layout.md`` §3.1) has one more metadata column,
``_partition int`` (field id 10, before the payload columns): the index ``i`` of the partition
``{topic}-part-{i}`` a row came from, so ``(_partition, _offset)`` identifies a row. A plain
topic's table has no ``_partition`` column.

A table with typed columns has ``_raw_payload binary`` (optional) when its layout's
``raw_payload`` is on (``docs/etcd-layout.md`` §3.9): each record's payload exactly as
published, written beside the typed columns; both kinds of table then also have ``_key`` (the routing key,
``struct<value: string>``; :data:`KEY_COLUMN`). The reserved names are defined in
:mod:`danube_pipeline.storage.table_columns` (which the table reader imports too) and
re-exported here.
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import itertools
import json
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyiceberg.schema import Schema
from pyiceberg.types import (
    BinaryType,
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IcebergType,
    IntegerType,
    ListType,
    LongType,
    MapType,
    NestedField,
    StringType,
    StructType,
    TimestampType,
    TimestamptzType,
    TimeType,
)

from danube_pipeline.errors import InvalidSchemaError
from danube_pipeline.storage.table_columns import (
    METADATA_COLUMNS,
    PARTITION_COLUMN,
    PAYLOAD_COLUMN,
    KEY_COLUMN,
    KEY_VALUE_FIELD,
    RAW_PAYLOAD_COLUMN,
    RESERVED_COLUMNS,
    REWRITE_VERSION_COLUMN,
)

__all__ = [
    "KEY_COLUMN",
    "METADATA_COLUMNS",
    "PARTITION_COLUMN",
    "PAYLOAD_COLUMN",
    "RAW_PAYLOAD_COLUMN",
    "RESERVED_COLUMNS",
    "REWRITE_VERSION_COLUMN",
    "VALUE_COLUMN",
    "PayloadColumn",
    "iceberg_schema_for_avro",
    "key_type",
    "payload_columns",
    "renumber_nested",
    "schema_from_columns",
    "widen_avro_schema",
]

VALUE_COLUMN = "value"
"""Column name used when the topic's Avro schema is not a record (e.g. a bare ``"string"``)."""


Converter = Callable[[Any], Any]


def _identity(value: Any) -> Any:
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, _dt.datetime | _dt.date | _dt.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal | uuid.UUID):
        return str(value)
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def _to_json(value: Any) -> Any:
    if value is None:
        return None
    return json.dumps(value, default=_json_default, separators=(",", ":"), ensure_ascii=False)


def _to_str(value: Any) -> Any:
    return None if value is None else str(value)


@dataclass(frozen=True, slots=True)
class PayloadColumn:
    """One payload column of a topic's table, as one schema (version) defines it.

    Attributes:
        name: the column name (the schema's top-level field name).
        iceberg_type: its Iceberg type; nested field ids in it are placeholders
            (:func:`schema_from_columns` renumbers them).
        required: ``True`` when every record of the schema has a value.
        convert: turns a decoded value (never ``None``) into the value pyarrow takes for
            ``iceberg_type``.
        doc: the field's documentation, if the schema has one.
    """

    name: str
    iceberg_type: IcebergType
    required: bool
    convert: Converter
    doc: str | None = None


_PRIMITIVES: dict[str, IcebergType] = {
    "int": IntegerType(),
    "long": LongType(),
    "float": FloatType(),
    "double": DoubleType(),
    "boolean": BooleanType(),
    "string": StringType(),
    "bytes": BinaryType(),
}


def _register_names(schema: Any, named: dict[str, Any], namespace: str = "") -> None:
    """Collect named types (record, enum, fixed) so later references by name resolve."""
    if isinstance(schema, list):
        for branch in schema:
            _register_names(branch, named, namespace)
        return
    if not isinstance(schema, dict):
        return
    kind = schema.get("type")
    if kind in ("record", "error", "enum", "fixed"):
        name = schema.get("name", "")
        ns = schema.get("namespace", namespace)
        named[name] = schema
        if ns and "." not in name:
            named[f"{ns}.{name}"] = schema
        if kind in ("record", "error"):
            for f in schema.get("fields", []):
                _register_names(f.get("type"), named, ns)
    elif kind == "array":
        _register_names(schema.get("items"), named, namespace)
    elif kind == "map":
        _register_names(schema.get("values"), named, namespace)
    elif isinstance(kind, dict | list):
        _register_names(kind, named, namespace)


def _map_type(avro: Any, named: Mapping[str, Any]) -> tuple[IcebergType, bool, Converter]:
    """Map one Avro type to ``(iceberg type, nullable, converter)``.

    The converter turns what ``fastavro.schemaless_reader`` returns into what pyarrow accepts
    for the Iceberg type.
    """
    if isinstance(avro, list):  # union
        non_null = [b for b in avro if b != "null" and not (isinstance(b, dict) and b.get("type") == "null")]
        nullable = len(non_null) < len(avro)
        if len(non_null) == 1:
            t, inner_nullable, conv = _map_type(non_null[0], named)
            return t, nullable or inner_nullable, conv
        return StringType(), True, _to_json
    if isinstance(avro, str):
        if avro in _PRIMITIVES:
            return _PRIMITIVES[avro], False, _identity
        if avro == "null":
            return StringType(), True, _to_json
        if avro in named:
            return _map_type(named[avro], named)
        return StringType(), False, _to_json
    if isinstance(avro, dict):
        kind = avro.get("type")
        logical = avro.get("logicalType")
        if isinstance(kind, dict | list):
            return _map_type(kind, named)
        if logical == "timestamp-millis" and kind == "long":
            return TimestamptzType(), False, _identity
        if logical == "timestamp-micros" and kind == "long":
            return TimestamptzType(), False, _identity
        if logical in ("local-timestamp-millis", "local-timestamp-micros") and kind == "long":
            return TimestampType(), False, _identity
        if logical == "date" and kind == "int":
            return DateType(), False, _identity
        if logical in ("time-millis", "time-micros") and kind in ("int", "long"):
            return TimeType(), False, _identity
        if logical == "decimal" and kind in ("bytes", "fixed"):
            precision = int(avro.get("precision", 38))
            scale = int(avro.get("scale", 0))
            if 0 < precision <= 38:
                return DecimalType(precision, scale), False, _identity
            return StringType(), False, _to_str
        if logical == "uuid" and kind == "string":
            return StringType(), False, _to_str
        if kind == "enum":
            return StringType(), False, _identity
        if kind == "fixed":
            return BinaryType(), False, _identity
        if isinstance(kind, str) and kind in _PRIMITIVES:
            return _PRIMITIVES[kind], False, _identity
        return StringType(), False, _to_json
    raise InvalidSchemaError("?", f"unsupported Avro type {avro!r}")


def payload_columns(avro_schema: Mapping[str, Any]) -> list[PayloadColumn]:
    """The payload columns of a topic's table.

    Args:
        avro_schema: the topic's Avro schema (parsed JSON).

    Returns:
        One column per field of a record schema, in field order, or one ``value`` column
        for any other schema.

    Raises:
        InvalidSchemaError: a field collides with a metadata column, or a type is unsupported.
    """
    named: dict[str, Any] = {}
    _register_names(dict(avro_schema), named)
    if avro_schema.get("type") in ("record", "error"):
        columns = []
        for f in avro_schema.get("fields", []):
            name = f["name"]
            if name in RESERVED_COLUMNS:
                raise InvalidSchemaError(
                    str(avro_schema.get("name", "?")),
                    f"field {name!r} collides with a Danube metadata column",
                )
            t, nullable, conv = _map_type(f["type"], named)
            columns.append(PayloadColumn(name, t, not nullable, conv, f.get("doc")))
        return columns
    t, nullable, conv = _map_type(dict(avro_schema) if "type" in avro_schema else avro_schema, named)
    return [PayloadColumn(VALUE_COLUMN, t, not nullable, conv)]


def _metadata_fields() -> list[NestedField]:
    return [
        NestedField(1, "_offset", LongType(), required=True, doc="Danube offset in the topic"),
        NestedField(2, "_publish_time", TimestamptzType(), required=False, doc="publish time (µs, UTC)"),
        NestedField(3, "_producer_id", LongType(), required=False, doc="u64 producer id, stored as the int64 with the same bits"),
        NestedField(4, "_producer_name", StringType(), required=False),
        NestedField(5, "_schema_id", LongType(), required=False, doc="0 = no schema"),
        NestedField(6, "_schema_version", IntegerType(), required=False),
        NestedField(
            7,
            "_attributes",
            MapType(key_id=8, key_type=StringType(), value_id=9, value_type=StringType(), value_required=False),
            required=False,
        ),
    ]


def schema_from_columns(
    columns: Sequence[PayloadColumn] | None, *, partitioned: bool = False, raw_payload: bool = False
) -> Schema:
    """The Iceberg schema: the metadata columns (field ids 1-9), ``_partition`` (field id 10)
    when ``partitioned``, then the payload columns, then ``_raw_payload`` and ``_key`` when
    asked for.

    Args:
        columns: the payload columns (field ids from 10 on, 11 when partitioned), or ``None``
            for ``_payload``.
        partitioned: the table of a partitioned topic (``docs/etcd-layout.md`` §3.1).
        raw_payload: add the optional binary column ``_raw_payload`` after the payload columns
            (not with ``columns=None``, whose ``_payload`` already holds the exact bytes), then
            the optional ``_key struct<value: string>`` (the layout's ``raw_payload``,
            ``docs/etcd-layout.md`` §3.9).

    Returns:
        The schema.
    """
    fields = _metadata_fields()
    next_id = 10
    raw = raw_payload and columns is not None
    nested_ids = itertools.count(
        10 + (1 if partitioned else 0) + (len(columns) if columns else 1) + (1 if raw else 0)
        + (1 if raw_payload else 0)
    )
    if partitioned:
        fields.append(
            NestedField(
                next_id, PARTITION_COLUMN, IntegerType(), required=False,
                doc="index i of the partition {topic}-part-{i} the row came from",
            )
        )
        next_id += 1
    if columns is None:
        fields.append(NestedField(next_id, PAYLOAD_COLUMN, BinaryType(), required=False, doc="raw payload"))
    else:
        for c in columns:
            fields.append(
                NestedField(next_id, c.name, renumber_nested(c.iceberg_type, nested_ids), required=c.required, doc=c.doc)
            )
            next_id += 1
    if raw:
        fields.append(
            NestedField(next_id, RAW_PAYLOAD_COLUMN, BinaryType(), required=False, doc="the payload exactly as published")
        )
        next_id += 1
    if raw_payload:
        fields.append(NestedField(next_id, KEY_COLUMN, key_type(next(nested_ids)), required=False, doc=KEY_DOC))
    return Schema(*fields)


KEY_DOC = "the routing key; null: written before the column (key unknown)"


def key_type(value_id: int) -> StructType:
    """``_key``'s type, ``struct<value: string>`` (``value`` null: no key), its field id ``value_id``."""
    return StructType(NestedField(value_id, KEY_VALUE_FIELD, StringType(), required=False))


def renumber_nested(iceberg_type: IcebergType, ids: Iterator[int]) -> IcebergType:
    """``iceberg_type`` with fresh field ids taken from ``ids`` for every nested field (struct
    fields, list elements, map keys and values); a primitive is returned as is.

    Args:
        iceberg_type: a column's type, whose nested ids may be placeholders.
        ids: the ids to hand out, each used once.

    Returns:
        An equal type but for the ids.
    """
    if isinstance(iceberg_type, StructType):
        return StructType(
            *(
                NestedField(
                    next(ids), f.name, renumber_nested(f.field_type, ids), required=f.required, doc=f.doc
                )
                for f in iceberg_type.fields
            )
        )
    if isinstance(iceberg_type, ListType):
        return ListType(
            next(ids), renumber_nested(iceberg_type.element_type, ids), element_required=iceberg_type.element_required
        )
    if isinstance(iceberg_type, MapType):
        return MapType(
            next(ids),
            renumber_nested(iceberg_type.key_type, ids),
            next(ids),
            renumber_nested(iceberg_type.value_type, ids),
            value_required=iceberg_type.value_required,
        )
    return iceberg_type


def iceberg_schema_for_avro(avro_schema: Mapping[str, Any] | str | None, *, partitioned: bool = False) -> Schema:
    """The Iceberg schema of a topic's table.

    Args:
        avro_schema: the topic's Avro schema (parsed JSON, or its JSON text), or ``None`` for a
            topic without a schema (then the payload goes into one ``_payload`` binary column).
            A union with ``null`` becomes an optional column; ``int``, ``long``, ``float``,
            ``double``, ``boolean``, ``string`` and ``bytes`` map to their Iceberg types;
            ``timestamp-millis``/``-micros`` to ``timestamptz``, ``local-timestamp-*`` to
            ``timestamp``, ``date``, ``time-*``, ``decimal``; enums and ``uuid`` to
            ``string``, ``fixed`` to ``binary``; anything else (records, arrays, maps,
            multi-branch unions) to a ``string`` holding its JSON.
        partitioned: the table of a partitioned topic: with the ``_partition`` column.

    Returns:
        The metadata columns (field ids 1-9, and ``_partition`` when partitioned) followed by
        the payload columns.

    Raises:
        InvalidSchemaError: the schema is malformed or a field collides with a metadata column.
    """
    if avro_schema is None:
        return schema_from_columns(None, partitioned=partitioned)
    return schema_from_columns(payload_columns(as_avro_dict(avro_schema)), partitioned=partitioned)


def as_avro_dict(avro_schema: Mapping[str, Any] | str) -> dict[str, Any]:
    """An Avro schema as a dict.

    Args:
        avro_schema: parsed JSON, JSON text, or a bare primitive name such as ``"string"``.

    Returns:
        The schema as a dict; a primitive becomes ``{"type": name}``.
    """
    if isinstance(avro_schema, str):
        try:
            parsed = json.loads(avro_schema)
        except ValueError:
            parsed = avro_schema  # a bare primitive name such as "string"
        return parsed if isinstance(parsed, dict) else {"type": parsed}
    return dict(avro_schema)


def widen_avro_schema(latest: Mapping[str, Any], writers: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The table's Avro record schema for a batch written under several schema versions.

    The latest version's fields come first; every field that an older writer schema has and
    the latest lacks (a field removed later) is appended, made nullable with default null, so
    records written before the removal keep their values and newer records hold null there.
    Non-record schemas are returned unchanged.

    Args:
        latest: the subject's latest Avro schema (parsed JSON).
        writers: the Avro schemas the batch's records were written with.

    Returns:
        A new schema dict; the inputs are not modified.
    """
    if latest.get("type") not in ("record", "error"):
        return dict(latest)
    fields = [dict(f) for f in latest.get("fields", [])]
    have = {f["name"] for f in fields}
    for writer in writers:
        if writer.get("type") not in ("record", "error"):
            continue
        for f in writer.get("fields", []):
            if f["name"] in have:
                continue
            field_type = f["type"]
            if not (isinstance(field_type, list) and "null" in field_type):
                field_type = ["null", *(field_type if isinstance(field_type, list) else [field_type])]
            fields.append({**f, "type": field_type, "default": None})
            have.add(f["name"])
    return {**latest, "fields": fields}
