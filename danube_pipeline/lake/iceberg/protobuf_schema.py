"""Protobuf message types to Iceberg types, and Protobuf payloads to table rows.

Each field of the record's message type is a column, in field order. Types map as follows
(Protocol Buffers Language Guide, "Scalar Value Types"):

===========================================  ========================  ============================
Protobuf field                               Iceberg                   row value
===========================================  ========================  ============================
``int32``, ``sint32``, ``sfixed32``          ``int``
``int64``, ``sint64``, ``sfixed64``          ``long``
``uint32``, ``fixed32``                      ``long``                  (0 to 2^32-1 does not fit
                                                                       ``int``)
``uint64``, ``fixed64``                      ``decimal(20, 0)``        exact (2^64-1 does not fit
                                                                       ``long``)
``float``                                    ``float``
``double``                                   ``double``
``bool``                                     ``boolean``
``string``                                   ``string``
``bytes``                                    ``binary``
an ``enum``                                  ``string``                the value's name (an
                                                                       unknown number: its digits)
a message                                    ``struct``                one field per field
``repeated T``                               ``list<T>``               (elements required)
``map<K, V>``                                ``map<K, V>``             (values required)
``google.protobuf.Timestamp``                ``timestamptz``           µs, UTC
``google.protobuf.{Int32,Int64,UInt32,       the wrapped type,         ``null`` when unset
UInt64,Float,Double,Bool,String,Bytes}Value``  optional
a message that contains itself               ``string``                the message as JSON
===========================================  ========================  ============================

``uint64`` becomes ``decimal(20, 0)`` rather than ``long``: a ``long`` would have to store
values from 2^63 on as negative numbers (as ``_producer_id`` does), which sorts, sums and
compares wrongly in SQL; ``decimal(20, 0)`` holds every ``uint64`` exactly.

**Nullability.** A field with presence (a message field, a proto3 ``optional`` field, a member
of a ``oneof``, a proto2 ``optional`` field) is an optional column, ``null`` when unset. A
proto3 scalar without presence is a required column (an unset one reads as its zero value, as
in Protobuf itself); ``repeated`` and ``map`` fields are required too (unset is empty).

**Renames.** A column is identified by its field number across versions
(:func:`~danube_pipeline.lake.iceberg.writer.renamed_columns`): a field that keeps its number and
changes its name is the same Iceberg column, renamed.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from google.protobuf import json_format, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from pyiceberg.schema import Schema
from pyiceberg.types import (
    BinaryType,
    BooleanType,
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
    TimestamptzType,
)

from danube_pipeline.errors import InvalidSchemaError
from danube_pipeline.lake.iceberg.schema import RESERVED_COLUMNS, PayloadColumn, schema_from_columns
from danube_pipeline.lake.iceberg.writer import PROTOBUF, PayloadDecodeError, WriterSchema

__all__ = [
    "iceberg_schema_for_protobuf",
    "protobuf_columns",
    "protobuf_payload_to_row",
    "protobuf_writer",
]

TIMESTAMP = "google.protobuf.Timestamp"
_WRAPPERS: dict[str, IcebergType] = {
    "google.protobuf.DoubleValue": DoubleType(),
    "google.protobuf.FloatValue": FloatType(),
    "google.protobuf.Int64Value": LongType(),
    "google.protobuf.UInt64Value": DecimalType(20, 0),
    "google.protobuf.Int32Value": IntegerType(),
    "google.protobuf.UInt32Value": LongType(),
    "google.protobuf.BoolValue": BooleanType(),
    "google.protobuf.StringValue": StringType(),
    "google.protobuf.BytesValue": BinaryType(),
}

_F = FieldDescriptor
_SCALARS: dict[int, IcebergType] = {
    _F.TYPE_INT32: IntegerType(),
    _F.TYPE_SINT32: IntegerType(),
    _F.TYPE_SFIXED32: IntegerType(),
    _F.TYPE_INT64: LongType(),
    _F.TYPE_SINT64: LongType(),
    _F.TYPE_SFIXED64: LongType(),
    _F.TYPE_UINT32: LongType(),
    _F.TYPE_FIXED32: LongType(),
    _F.TYPE_UINT64: DecimalType(20, 0),
    _F.TYPE_FIXED64: DecimalType(20, 0),
    _F.TYPE_FLOAT: FloatType(),
    _F.TYPE_DOUBLE: DoubleType(),
    _F.TYPE_BOOL: BooleanType(),
    _F.TYPE_STRING: StringType(),
    _F.TYPE_BYTES: BinaryType(),
    _F.TYPE_ENUM: StringType(),
}
_UNSIGNED_64 = (_F.TYPE_UINT64, _F.TYPE_FIXED64)

Convert = Callable[[Any], Any]


def _identity(value: Any) -> Any:
    return value


def _to_decimal(value: Any) -> Any:
    return decimal.Decimal(value)


def _enum_name(field: FieldDescriptor) -> Convert:
    names = {v.number: v.name for v in field.enum_type.values}

    def convert(value: Any) -> Any:
        return names.get(value, str(value))

    return convert


def _timestamp(value: Any) -> Any:
    return value.ToDatetime(tzinfo=_dt.UTC)


def _as_json(value: Any) -> Any:
    return json_format.MessageToJson(value, indent=None, preserving_proto_field_name=True)


class _Mapper:
    def __init__(self) -> None:
        self.ids: Iterator[int] = itertools.count(1)

    def scalar(self, field: FieldDescriptor, stack: tuple[str, ...]) -> tuple[IcebergType, Convert]:
        """The element type of ``field`` (its type ignoring ``repeated``) and its converter."""
        if field.type in (_F.TYPE_MESSAGE, _F.TYPE_GROUP):
            return self.message(field.message_type, stack)
        if field.type == _F.TYPE_ENUM:
            return StringType(), _enum_name(field)
        if field.type in _UNSIGNED_64:
            return DecimalType(20, 0), _to_decimal
        t = _SCALARS.get(field.type)
        if t is None:
            raise InvalidSchemaError("?", f"field {field.full_name}: unsupported protobuf type {field.type}")
        return t, _identity

    def message(self, descriptor: Descriptor, stack: tuple[str, ...]) -> tuple[IcebergType, Convert]:
        name = descriptor.full_name
        if name == TIMESTAMP:
            return TimestamptzType(), _timestamp
        if name in _WRAPPERS:
            inner = descriptor.fields_by_name["value"]
            t, conv = self.scalar(inner, stack)
            return t, lambda v: conv(v.value)
        if name in stack:  # recursive: no finite Iceberg type
            return StringType(), _as_json
        fields = self.fields(descriptor, (*stack, name))
        struct = StructType(*(f for f, _, _ in fields))
        return struct, _message_converter(fields)

    def field(self, field: FieldDescriptor, stack: tuple[str, ...]) -> tuple[NestedField, Convert, bool]:
        """``(the field as a NestedField, a converter of the message holding it, has presence)``."""
        name = field.name
        if field.is_repeated and field.type == _F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            entry = field.message_type
            key_t, key_conv = self.scalar(entry.fields_by_name["key"], stack)
            value_t, value_conv = self.scalar(entry.fields_by_name["value"], stack)
            t: IcebergType = MapType(next(self.ids), key_t, next(self.ids), value_t, value_required=True)
            return NestedField(next(self.ids), name, t, required=True), _map_getter(name, key_conv, value_conv), False
        element_t, conv = self.scalar(field, stack)
        if field.is_repeated:
            t = ListType(next(self.ids), element_t, element_required=True)
            return NestedField(next(self.ids), name, t, required=True), _list_getter(name, conv), False
        presence = field.has_presence or field.type == _F.TYPE_MESSAGE
        return (
            NestedField(next(self.ids), name, element_t, required=not presence),
            _getter(name, conv, presence),
            presence,
        )

    def fields(self, descriptor: Descriptor, stack: tuple[str, ...]) -> list[tuple[NestedField, Convert, bool]]:
        return [self.field(f, stack) for f in descriptor.fields]


def _getter(name: str, conv: Convert, presence: bool) -> Convert:
    if presence:
        def get(message: Any) -> Any:
            return conv(getattr(message, name)) if message.HasField(name) else None
    else:
        def get(message: Any) -> Any:
            return conv(getattr(message, name))
    return get


def _list_getter(name: str, conv: Convert) -> Convert:
    if conv is _identity:
        return lambda message: list(getattr(message, name))
    return lambda message: [conv(v) for v in getattr(message, name)]


def _map_getter(name: str, key_conv: Convert, value_conv: Convert) -> Convert:
    return lambda message: [(key_conv(k), value_conv(v)) for k, v in getattr(message, name).items()]


def _message_converter(fields: list[tuple[NestedField, Convert, bool]]) -> Convert:
    getters = [(f.name, get) for f, get, _ in fields]

    def convert(message: Any) -> Any:
        return {name: get(message) for name, get in getters}

    return convert


def _top_level(descriptor: Descriptor) -> list[tuple[NestedField, Convert, bool]]:
    if not isinstance(descriptor, Descriptor):
        raise InvalidSchemaError("?", f"expected a protobuf message Descriptor, got {type(descriptor).__name__}")
    fields = _Mapper().fields(descriptor, (descriptor.full_name,))
    for f, _, _ in fields:
        if f.name in RESERVED_COLUMNS:
            raise InvalidSchemaError(descriptor.full_name, f"field {f.name!r} collides with a Danube metadata column")
    return fields


def protobuf_columns(descriptor: Descriptor) -> list[PayloadColumn]:
    """The payload columns of a Protobuf message type (the table in the module docstring).

    Args:
        descriptor: the record's message type.

    Returns:
        One column per field, in field order.

    Raises:
        InvalidSchemaError: a field collides with a metadata column or has an unsupported type.
    """
    return [PayloadColumn(f.name, f.field_type, f.required, _identity) for f, _, _ in _top_level(descriptor)]


def iceberg_schema_for_protobuf(descriptor: Descriptor, *, partitioned: bool = False) -> Schema:
    """The Iceberg schema of a topic whose records are messages of type ``descriptor``.

    Args:
        descriptor: the record's message type.
        partitioned: the table of a partitioned topic (with ``_partition``).

    Returns:
        The metadata columns, then :func:`protobuf_columns`.

    Raises:
        InvalidSchemaError: as :func:`protobuf_columns`.
    """
    return schema_from_columns(protobuf_columns(descriptor), partitioned=partitioned)


def protobuf_writer(descriptor: Descriptor) -> WriterSchema:
    """The :class:`~danube_pipeline.lake.iceberg.writer.WriterSchema` of a message type: its columns,
    its field numbers, and a decoder that parses a payload with the message class
    ``google.protobuf.message_factory.GetMessageClass(descriptor)`` builds.

    Raises:
        InvalidSchemaError: as :func:`protobuf_columns`.
    """
    fields = _top_level(descriptor)
    message_class = message_factory.GetMessageClass(descriptor)
    getters = [(f.name, get) for f, get, _ in fields]

    def decode(payload: bytes) -> dict[str, Any]:
        try:
            message: Message = message_class.FromString(payload)
        except (DecodeError, RuntimeWarning, ValueError) as exc:
            raise PayloadDecodeError(f"{type(exc).__name__}: {exc}") from exc
        try:
            return {name: get(message) for name, get in getters}
        except (ValueError, OverflowError) as exc:  # e.g. a Timestamp out of range
            raise PayloadDecodeError(f"{type(exc).__name__}: {exc}") from exc

    columns = tuple(PayloadColumn(f.name, f.field_type, f.required, _identity) for f, _, _ in fields)
    numbers = {f.name: f.number for f in descriptor.fields}
    return WriterSchema(PROTOBUF, columns, decode, field_numbers=numbers)


def protobuf_payload_to_row(descriptor: Descriptor, payload: bytes) -> dict[str, Any]:
    """Decode one Protobuf payload into ``{column: value}`` for the table of ``descriptor``.

    Args:
        descriptor: the message type the payload was written with.
        payload: the serialized message.

    Returns:
        The row's payload columns (module docstring for the values).

    Raises:
        PayloadDecodeError: the bytes do not parse as that message.
        InvalidSchemaError: as :func:`protobuf_columns`.
    """
    return protobuf_writer(descriptor).decode(payload)
