"""JSON Schema to Iceberg types, and JSON payloads to table rows.

A JSON Schema whose root is an object with ``properties`` gives one column per property, in
property order; any other root gives one ``value`` column. Types map as follows (JSON Schema
draft 2020-12, "Validation" §6.1.1 ``type``, §7.3 ``format``):

==============================================  ==================  ==========================
JSON Schema                                     Iceberg             row value from the payload
==============================================  ==================  ==========================
``"type": "string"``                            ``string``          the string
``"type": "string", "format": "date-time"``     ``timestamptz``     RFC 3339 with an offset,
                                                                    stored in UTC
``"type": "string", "format": "date"``          ``date``            ``YYYY-MM-DD``
``"type": "string", "contentEncoding":          ``binary``          the decoded bytes
"base64"``
``"type": "integer"``                           ``long``            an integer (``2.0`` is
                                                                    one), in the int64 range
``"type": "number"``                            ``double``          any number
``"type": "boolean"``                           ``boolean``         ``true`` / ``false``
``"type": "object"`` with ``properties``        ``struct``          one field per property
``"type": "object"`` with only a schema in      ``map<string, T>``  the object's members
``additionalProperties``
``"type": "array"`` with ``items``              ``list<T>``         the array (elements
                                                                    optional)
``enum`` of strings                             ``string``          the string
a ``$ref`` to ``#/$defs/...`` or                the referenced      (a reference back into
``#/definitions/...``                           schema's type       itself: ``string``, JSON)
anything else (several types, ``oneOf`` with    ``string``          the value's JSON text
several branches, an object without
``properties``)
==============================================  ==================  ==========================

**Nullability.** A property is an optional column unless it is listed in ``required`` and its
type does not allow null (``"type": ["integer", "null"]``, or ``anyOf``/``oneOf`` with a
``{"type": "null"}`` branch). A required property missing from a payload, or null where null
is not allowed, or a value of another type, makes the payload not fit
(:class:`~danube_pipeline.lake.iceberg.writer.ValueDoesNotFitError`): its record goes to the
dead-letter table (:mod:`.dead_letter`) as ``value does not fit``; a payload that is not JSON
as ``corrupt payload``. Properties the schema does not name are ignored.
``"integer"`` is always ``long``: JSON integers have no width, and a column that started as
``int`` could never take a larger value in place.
"""

from __future__ import annotations

import base64
import binascii
import datetime as _dt
import itertools
import json
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pyiceberg.schema import Schema
from pyiceberg.types import (
    BinaryType,
    BooleanType,
    DateType,
    DoubleType,
    IcebergType,
    ListType,
    LongType,
    MapType,
    NestedField,
    StringType,
    StructType,
    TimestamptzType,
)

from danube_pipeline.errors import InvalidSchemaError
from danube_pipeline.lake.iceberg.schema import RESERVED_COLUMNS, VALUE_COLUMN, PayloadColumn, schema_from_columns
from danube_pipeline.lake.iceberg.writer import JSON_SCHEMA, PayloadDecodeError, ValueDoesNotFitError, WriterSchema

__all__ = [
    "iceberg_schema_for_json_schema",
    "json_payload_to_row",
    "json_schema_columns",
    "json_schema_writer",
]

_LONG_MIN, _LONG_MAX = -(1 << 63), (1 << 63) - 1

Convert = Callable[[Any, str], Any]
"""A JSON value (not ``None``) and its path (for messages) to the row value; raises
:class:`PayloadDecodeError` when the value does not fit."""


def _misfit(path: str, expected: str, value: Any) -> ValueDoesNotFitError:
    shown = json.dumps(value)[:80] if not isinstance(value, bytes) else repr(value[:40])
    return ValueDoesNotFitError(f"{path or 'the payload'}: expected {expected}, got {shown}")


def _as_json(value: Any, path: str) -> Any:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _as_string(value: Any, path: str) -> Any:
    if not isinstance(value, str):
        raise _misfit(path, "a string", value)
    return value


def _as_long(value: Any, path: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _misfit(path, "an integer", value)
    if isinstance(value, float):
        if not value.is_integer():
            raise _misfit(path, "an integer", value)
        value = int(value)
    if not _LONG_MIN <= value <= _LONG_MAX:
        raise _misfit(path, "an integer in the int64 range", value)
    return value


def _as_double(value: Any, path: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _misfit(path, "a number", value)
    result = float(value)
    if math.isinf(result):
        raise _misfit(path, "a number in the double range", value)
    return result


def _as_boolean(value: Any, path: str) -> Any:
    if not isinstance(value, bool):
        raise _misfit(path, "a boolean", value)
    return value


def _as_timestamptz(value: Any, path: str) -> Any:
    if not isinstance(value, str):
        raise _misfit(path, "an RFC 3339 date-time string", value)
    try:
        parsed = _dt.datetime.fromisoformat(value)
    except ValueError as exc:
        raise _misfit(path, "an RFC 3339 date-time string", value) from exc
    if parsed.tzinfo is None:
        raise _misfit(path, "a date-time with a UTC offset (RFC 3339)", value)
    return parsed.astimezone(_dt.UTC)


def _as_date(value: Any, path: str) -> Any:
    if not isinstance(value, str):
        raise _misfit(path, "a YYYY-MM-DD date string", value)
    try:
        return _dt.date.fromisoformat(value)
    except ValueError as exc:
        raise _misfit(path, "a YYYY-MM-DD date string", value) from exc


def _as_base64(value: Any, path: str) -> Any:
    if not isinstance(value, str):
        raise _misfit(path, "a base64 string", value)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise _misfit(path, "a base64 string", value) from exc


class _Mapper:
    """Walks one JSON Schema document, resolving local ``$ref``."""

    def __init__(self, root: Mapping[str, Any]) -> None:
        self.root = root
        self.ids: Iterator[int] = itertools.count(1)

    def resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            raise InvalidSchemaError("?", f"only local $ref are supported, not {ref!r}")
        node: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, Mapping) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise InvalidSchemaError("?", f"$ref {ref!r} does not resolve")
        return node

    def map(self, schema: Any, refs: tuple[str, ...] = ()) -> tuple[IcebergType, bool, Convert]:
        """``(iceberg type, nullable, converter)`` of one schema node."""
        if schema is True or schema == {}:
            return StringType(), True, _as_json
        if not isinstance(schema, Mapping):
            return StringType(), True, _as_json
        ref = schema.get("$ref")
        if isinstance(ref, str):
            if ref in refs:  # recursive: no finite Iceberg type
                return StringType(), True, _as_json
            return self.map(self.resolve(ref), (*refs, ref))
        for key in ("anyOf", "oneOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and "type" not in schema:
                nulls = [b for b in branches if isinstance(b, Mapping) and b.get("type") == "null"]
                rest = [b for b in branches if b not in nulls]
                if len(rest) == 1:
                    t, nullable, conv = self.map(rest[0], refs)
                    return t, nullable or bool(nulls), conv
                return StringType(), True, _as_json
        kind = schema.get("type")
        if kind is None:
            if "enum" in schema and all(isinstance(v, str) or v is None for v in schema["enum"]):
                return StringType(), any(v is None for v in schema["enum"]), _as_string
            if "const" in schema and isinstance(schema["const"], str):
                return StringType(), False, _as_string
            if "properties" in schema:
                kind = "object"
            else:
                return StringType(), True, _as_json
        nullable = False
        if isinstance(kind, list):
            nullable = "null" in kind
            kinds = [k for k in kind if k != "null"]
            if sorted(kinds) == ["integer", "number"]:
                kinds = ["number"]
            if len(kinds) != 1:
                return StringType(), True, _as_json
            kind = kinds[0]
        t, conv = self._typed(kind, schema, refs)
        return t, nullable or kind == "null", conv

    def _typed(self, kind: Any, schema: Mapping[str, Any], refs: tuple[str, ...]) -> tuple[IcebergType, Convert]:
        if kind == "string":
            fmt = schema.get("format")
            if fmt == "date-time":
                return TimestamptzType(), _as_timestamptz
            if fmt == "date":
                return DateType(), _as_date
            if schema.get("contentEncoding") == "base64":
                return BinaryType(), _as_base64
            return StringType(), _as_string
        if kind == "integer":
            return LongType(), _as_long
        if kind == "number":
            return DoubleType(), _as_double
        if kind == "boolean":
            return BooleanType(), _as_boolean
        if kind == "array":
            items = schema.get("items")
            if not isinstance(items, Mapping):
                return StringType(), _as_json
            element, _, conv = self.map(items, refs)
            return ListType(next(self.ids), element, element_required=False), _list_converter(conv)
        if kind == "object":
            properties = schema.get("properties")
            if isinstance(properties, Mapping) and properties:
                return self._struct(properties, schema.get("required", ()), refs)
            extra = schema.get("additionalProperties")
            if isinstance(extra, Mapping) and extra:
                value, _, conv = self.map(extra, refs)
                return (
                    MapType(next(self.ids), StringType(), next(self.ids), value, value_required=False),
                    _map_converter(conv),
                )
            return StringType(), _as_json
        return StringType(), _as_json  # "null" alone, or an unknown type name

    def struct_fields(
        self, properties: Mapping[str, Any], required: Any, refs: tuple[str, ...]
    ) -> list[tuple[NestedField, Convert, bool]]:
        """``(field, converter, listed in required)`` per property."""
        needed = set(required) if isinstance(required, list) else set()
        out = []
        for name, sub in properties.items():
            t, nullable, conv = self.map(sub, refs)
            doc = sub.get("description") if isinstance(sub, Mapping) else None
            field = NestedField(
                next(self.ids), str(name), t, required=name in needed and not nullable,
                doc=doc if isinstance(doc, str) else None,
            )
            out.append((field, conv, name in needed))
        return out

    def _struct(self, properties: Mapping[str, Any], required: Any, refs: tuple[str, ...]) -> tuple[IcebergType, Convert]:
        fields = self.struct_fields(properties, required, refs)
        return StructType(*(f for f, _, _ in fields)), _struct_converter(fields)


def _list_converter(element: Convert) -> Convert:
    def convert(value: Any, path: str) -> Any:
        if not isinstance(value, list):
            raise _misfit(path, "an array", value)
        return [None if v is None else element(v, f"{path}[{i}]") for i, v in enumerate(value)]

    return convert


def _map_converter(element: Convert) -> Convert:
    def convert(value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise _misfit(path, "an object", value)
        return [(k, None if v is None else element(v, f"{path}.{k}")) for k, v in value.items()]

    return convert


def _check_field(field: NestedField, listed: bool, value: Any, present: bool, path: str) -> None:
    if listed and not present:
        raise ValueDoesNotFitError(f"{path}: required property missing")
    if value is None and field.required:
        raise ValueDoesNotFitError(f"{path}: null where the schema allows no null")


def _struct_converter(fields: list[tuple[NestedField, Convert, bool]]) -> Convert:
    def convert(value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise _misfit(path, "an object", value)
        out: dict[str, Any] = {}
        for field, conv, listed in fields:
            sub_path = f"{path}.{field.name}" if path else field.name
            v = value.get(field.name)
            _check_field(field, listed, v, field.name in value, sub_path)
            out[field.name] = None if v is None else conv(v, sub_path)
        return out

    return convert


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _columns_and_decoder(schema: Mapping[str, Any]) -> tuple[list[PayloadColumn], Callable[[bytes], dict[str, Any]]]:
    if not isinstance(schema, Mapping):
        raise InvalidSchemaError("?", "a JSON Schema must be an object")
    mapper = _Mapper(schema)
    root: Any = schema
    refs: tuple[str, ...] = ()
    while isinstance(root, Mapping) and isinstance(root.get("$ref"), str) and root["$ref"] not in refs:
        refs = (*refs, root["$ref"])
        root = mapper.resolve(root["$ref"])
    properties = root.get("properties") if isinstance(root, Mapping) else None
    is_object = (
        isinstance(properties, Mapping) and bool(properties) and root.get("type", "object") in ("object", ["object"])
    )
    if is_object:
        assert isinstance(root, Mapping) and isinstance(properties, Mapping)
        fields = mapper.struct_fields(properties, root.get("required", ()), refs)
        for f, _, _ in fields:
            if f.name in RESERVED_COLUMNS:
                raise InvalidSchemaError("?", f"property {f.name!r} collides with a Danube metadata column")
        columns = [PayloadColumn(f.name, f.field_type, f.required, _identity, f.doc) for f, _, _ in fields]
        whole = _struct_converter(fields)

        def decode(payload: bytes) -> dict[str, Any]:
            result: dict[str, Any] = whole(_loads(payload), "")
            return result

        return columns, decode
    t, nullable, conv = mapper.map(root, refs)

    def decode_value(payload: bytes) -> dict[str, Any]:
        value = _loads(payload)
        if value is None and not nullable:
            raise ValueDoesNotFitError("null where the schema allows no null")
        return {VALUE_COLUMN: None if value is None else conv(value, VALUE_COLUMN)}

    return [PayloadColumn(VALUE_COLUMN, t, not nullable, _identity)], decode_value


def _identity(value: Any) -> Any:
    return value


def _loads(payload: bytes) -> Any:
    try:
        return json.loads(payload, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise PayloadDecodeError(f"not JSON: {exc}") from exc


def json_schema_columns(schema: Mapping[str, Any]) -> list[PayloadColumn]:
    """The payload columns a JSON Schema defines (the table in the module docstring).

    Args:
        schema: the JSON Schema document (parsed JSON).

    Returns:
        One column per property of an object root, in property order; one ``value`` column for
        any other root.

    Raises:
        InvalidSchemaError: the schema is not an object, has a non-local or unresolvable
            ``$ref``, or a property collides with a metadata column.
    """
    return _columns_and_decoder(schema)[0]


def iceberg_schema_for_json_schema(schema: Mapping[str, Any], *, partitioned: bool = False) -> Schema:
    """The Iceberg schema of a topic whose records are written with the JSON Schema ``schema``.

    Args:
        schema: the JSON Schema document (parsed JSON).
        partitioned: the table of a partitioned topic (with ``_partition``).

    Returns:
        The metadata columns, then :func:`json_schema_columns`.

    Raises:
        InvalidSchemaError: as :func:`json_schema_columns`.
    """
    return schema_from_columns(json_schema_columns(schema), partitioned=partitioned)


def json_schema_writer(schema: Mapping[str, Any]) -> WriterSchema:
    """The :class:`~danube_pipeline.lake.iceberg.writer.WriterSchema` of a JSON Schema: its columns,
    and a decoder that ``json.loads`` a payload and checks every value against its column's type.

    Raises:
        InvalidSchemaError: as :func:`json_schema_columns`.
    """
    columns, decode = _columns_and_decoder(schema)
    return WriterSchema(JSON_SCHEMA, tuple(columns), decode)


def json_payload_to_row(schema: Mapping[str, Any], payload: bytes) -> dict[str, Any]:
    """Decode one JSON payload into ``{column: value}`` for the table of ``schema``.

    Args:
        schema: the JSON Schema the payload was written with.
        payload: UTF-8 JSON bytes.

    Returns:
        The row's payload columns (a column left out is null).

    Raises:
        PayloadDecodeError: not JSON; :class:`~danube_pipeline.lake.iceberg.writer.ValueDoesNotFitError`
            (a subclass) when a value does not fit its column (module docstring).
        InvalidSchemaError: as :func:`json_schema_columns`.
    """
    return json_schema_writer(schema).decode(payload)
