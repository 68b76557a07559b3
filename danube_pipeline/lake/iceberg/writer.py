"""The schema a record was written with, in any of the registry's formats, as a table sees it.

A :class:`WriterSchema` is one registered schema version reduced to what tiering needs: the
table columns it defines (:class:`~danube_pipeline.lake.iceberg.schema.PayloadColumn`), a decoder
from payload bytes to ``{column: value}``, and what tells a renamed field from a new one:

* **Avro**: a field's ``aliases`` (Avro spec, "Aliases"): a field of the newer version whose
  aliases name a field of the older version is that field, renamed.
* **Protobuf**: the field number: a field of the newer version with the number of a field of
  the older version is that field, whatever its name.
* **JSON Schema** has neither: a field with a new name is a new field.

Only top-level fields are matched this way; fields inside a struct are matched by name.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import fastavro
from pyiceberg.schema import Schema

from danube_pipeline.lake.iceberg.avro_batch import AvroBatchDecoder, batch_decoder
from danube_pipeline.lake.iceberg.schema import (
    VALUE_COLUMN,
    PayloadColumn,
    as_avro_dict,
    payload_columns,
    schema_from_columns,
)

__all__ = [
    "AVRO",
    "JSON_SCHEMA",
    "PROTOBUF",
    "PayloadDecodeError",
    "ValueDoesNotFitError",
    "WriterSchema",
    "avro_writer",
    "renamed_columns",
    "writer_for_parsed",
]

AVRO = "Avro"
JSON_SCHEMA = "JsonSchema"
PROTOBUF = "Protobuf"


class PayloadDecodeError(ValueError):
    """A payload does not decode with its writer schema (its record goes to the dead-letter
    table, :mod:`.dead_letter`, as ``corrupt payload``)."""


class ValueDoesNotFitError(PayloadDecodeError):
    """A payload decodes, but a value in it does not fit its column: a JSON string where the
    schema says integer, a required property missing (dead-lettered as ``value does not
    fit``)."""


Decoder = Callable[[bytes], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class WriterSchema:
    """One schema version as the topic's table sees it.

    Attributes:
        schema_type: ``"Avro"``, ``"JsonSchema"`` or ``"Protobuf"``.
        columns: the table columns the schema defines, in field order.
        decode: payload bytes to ``{column name: value}`` (values as pyarrow takes them for the
            column's type; a column left out is null). Raises :class:`PayloadDecodeError`.
        aliases: Avro only: column name to the field's ``aliases``.
        field_numbers: Protobuf only: column name to the field number.
        batch: Avro only: the columnar decoder of runs of payloads
            (:mod:`~danube_pipeline.lake.iceberg.avro_batch`), when the schema's types allow it;
            it gives the same values as :attr:`decode`, or refuses the run.
    """

    schema_type: str
    columns: tuple[PayloadColumn, ...]
    decode: Decoder
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    field_numbers: Mapping[str, int] = field(default_factory=dict)
    batch: AvroBatchDecoder | None = None

    def iceberg_schema(self, *, partitioned: bool = False) -> Schema:
        """The table schema of a topic written with this schema alone: the metadata columns,
        then :attr:`columns` (:func:`~danube_pipeline.lake.iceberg.schema.schema_from_columns`)."""
        return schema_from_columns(self.columns, partitioned=partitioned)


def avro_writer(avro_schema: Mapping[str, Any] | str) -> WriterSchema:
    """The :class:`WriterSchema` of an Avro schema.

    Payloads are decoded with ``fastavro.schemaless_reader`` and this schema as the writer's
    schema; a payload with bytes left over after the datum is refused (Avro spec, "Binary
    Encoding": a datum is exactly its encoding, so leftover bytes mean another schema wrote it).
    Runs of payloads are decoded into Arrow columns by
    :func:`~danube_pipeline.lake.iceberg.avro_batch.batch_decoder` when the schema's types allow it.

    Args:
        avro_schema: parsed JSON, JSON text, or a bare primitive name.

    Returns:
        The writer schema; a record's fields become columns, any other schema one ``value``
        column (:func:`~danube_pipeline.lake.iceberg.schema.payload_columns`).

    Raises:
        InvalidSchemaError: the schema cannot be mapped.
        SchemaParseException (fastavro): the schema is not valid Avro.
    """
    schema = as_avro_dict(avro_schema)
    columns = tuple(payload_columns(schema))
    parsed = fastavro.parse_schema(schema)
    is_record = schema.get("type") in ("record", "error")
    converters = [(c.name, c.convert) for c in columns]

    def decode(payload: bytes) -> dict[str, Any]:
        buf = io.BytesIO(payload)
        try:
            datum = fastavro.schemaless_reader(buf, parsed, None)
        except Exception as exc:  # noqa: BLE001 - fastavro raises many unrelated types
            raise PayloadDecodeError(f"{type(exc).__name__}: {exc}") from exc
        left = len(payload) - buf.tell()
        if left:
            raise PayloadDecodeError(f"{left} bytes left over after the Avro datum")
        if not is_record:
            return {VALUE_COLUMN: None if datum is None else converters[0][1](datum)}
        if not isinstance(datum, dict):
            raise PayloadDecodeError("not a record")
        out: dict[str, Any] = {}
        for name, convert in converters:
            value = datum.get(name)
            out[name] = None if value is None else convert(value)
        return out

    aliases = {
        f["name"]: tuple(str(a) for a in f.get("aliases", ()))
        for f in schema.get("fields", ())
        if is_record and f.get("aliases")
    }
    return WriterSchema(AVRO, columns, decode, aliases=aliases, batch=batch_decoder(schema))


def renamed_columns(
    old: WriterSchema | None, new: WriterSchema, *, old_names: Sequence[str] | None = None
) -> dict[str, str]:
    """The top-level fields ``new`` renamed: ``{old name: new name}``.

    Avro: a field of ``new`` whose ``aliases`` hold the name of a field of ``old`` (or, without
    ``old``, one of ``old_names``) that ``new`` no longer has. Protobuf: a field of ``new``
    whose number a field of ``old`` with another name has. JSON Schema, or two different
    formats: none.

    Args:
        old: the older version, or ``None`` when only its column names are known.
        new: the newer version.
        old_names: the older columns' names, used when ``old`` is ``None`` (Avro only).

    Returns:
        The renames; empty when there are none.
    """
    new_names = {c.name for c in new.columns}
    if old is not None and old.schema_type != new.schema_type:
        return {}
    if new.schema_type == PROTOBUF:
        if old is None:
            return {}
        by_number = {n: name for name, n in old.field_numbers.items()}
        return {
            by_number[number]: name
            for name, number in new.field_numbers.items()
            if number in by_number and by_number[number] != name and by_number[number] not in new_names
        }
    if new.schema_type == AVRO:
        before = {c.name for c in old.columns} if old is not None else set(old_names or ())
        renames: dict[str, str] = {}
        for name, aliases in new.aliases.items():
            if name in before:
                continue
            for alias in aliases:
                if alias in before and alias not in new_names and alias not in renames:
                    renames[alias] = name
                    break
        return renames
    return {}


def writer_for_parsed(parsed: Any) -> WriterSchema:
    """The :class:`WriterSchema` of a parsed registry schema.

    Args:
        parsed: what ``danube_pipeline.schemas.formats.parse_schema`` returns (or any object
            with the same attributes): ``schema_type`` and, by type, ``avro`` (the schema
            JSON), ``json_schema`` (a dict) or ``message_descriptor`` (a protobuf
            ``Descriptor``).

    Returns:
        The writer schema.

    Raises:
        InvalidSchemaError: the schema cannot be mapped to Iceberg types.
        ValueError: the schema type is none of the three.
    """
    schema_type = parsed.schema_type
    if schema_type == AVRO:
        avro = parsed.avro
        return avro_writer(avro if isinstance(avro, dict | str) else {"type": avro})
    if schema_type == JSON_SCHEMA:
        from danube_pipeline.lake.iceberg.json_schema import json_schema_writer

        return json_schema_writer(parsed.json_schema)
    if schema_type == PROTOBUF:
        from danube_pipeline.lake.iceberg.protobuf_schema import protobuf_writer

        return protobuf_writer(parsed.message_descriptor)
    raise ValueError(f"unknown schema type {schema_type!r}")
