"""The Iceberg side of tiered storage: one table per topic and an exactly-once append.

A topic ``/{ns}/{topic}`` maps to the Iceberg table ``(ns, topic)`` (Iceberg namespace = Danube
namespace) in the shared SQL catalog that pyiceberg and Spark's ``JdbcCatalog`` both use (see
:mod:`danube_pipeline.spark`). Each table has the message metadata columns::

    _offset long (required) | _publish_time timestamptz (µs) | _producer_id long (u64 bits)
    | _producer_name string | _schema_id long | _schema_version int | _attributes map<string,string>

followed by one typed column per field of the topic's Avro record schema, or a single
``_payload`` binary column when the topic has no schema.

Exactly-once (seed ``003`` §II "Atomic Commits"): every append commits one snapshot whose
summary carries ``danube.topic``, ``danube.start-offset``, ``danube.end-offset`` and
``danube.object-id``. The committed end offset is read back from the newest ancestor snapshot
that carries ``danube.end-offset`` (compaction snapshots do not), so replaying an object
appends nothing, and a commit that loses the catalog's compare-and-swap is retried after a
refresh with what is still missing. pyiceberg 0.12's own commit retry is switched off for
these appends: it would rebase the same rows onto the new head and commit them twice.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as _dt
import decimal
import io
import json
import logging
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import fastavro
import pyarrow as pa
from pyiceberg.catalog import Catalog
from pyiceberg.catalog.sql import SqlCatalog
from pyiceberg.exceptions import CommitFailedException, NoSuchTableError
from pyiceberg.io.pyarrow import schema_to_pyarrow
from pyiceberg.schema import Schema
from pyiceberg.table import Table, TableProperties
from pyiceberg.table.snapshots import ancestors_of
from pyiceberg.types import (
    BinaryType,
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IcebergType,
    IntegerType,
    LongType,
    MapType,
    NestedField,
    StringType,
    TimestampType,
    TimestamptzType,
    TimeType,
)

from danube_pipeline import settings
from danube_pipeline.errors import InvalidSchemaError, OffsetRangeError, SchemaMismatchError
from danube_pipeline.names import TopicName
from danube_pipeline.records import Record

__all__ = [
    "AppendResult",
    "METADATA_COLUMNS",
    "PAYLOAD_COLUMN",
    "SUMMARY_END_OFFSET",
    "SUMMARY_OBJECT_ID",
    "SUMMARY_START_OFFSET",
    "SUMMARY_TOPIC",
    "append_records",
    "arrow_table_for_records",
    "committed_end_offset",
    "data_file_count",
    "ensure_table",
    "iceberg_schema_for_avro",
    "load_catalog",
    "read_offsets",
    "rows",
    "table_identifier",
]

log = logging.getLogger(__name__)

SUMMARY_TOPIC = "danube.topic"
SUMMARY_START_OFFSET = "danube.start-offset"
SUMMARY_END_OFFSET = "danube.end-offset"
SUMMARY_OBJECT_ID = "danube.object-id"

METADATA_COLUMNS = (
    "_offset",
    "_publish_time",
    "_producer_id",
    "_producer_name",
    "_schema_id",
    "_schema_version",
    "_attributes",
)
PAYLOAD_COLUMN = "_payload"
VALUE_COLUMN = "value"
"""Column name used when the topic's Avro schema is not a record (e.g. a bare ``"string"``)."""

DEFAULT_COMMIT_ATTEMPTS = 5


# --------------------------------------------------------------------------- catalog


def load_catalog(
    *,
    name: str | None = None,
    uri: str | None = None,
    warehouse: str | None = None,
) -> SqlCatalog:
    """Open the shared pyiceberg ``SqlCatalog`` (creating the SQLite file's directory).

    Args:
        name: catalog name; Spark uses the same one (``spark.sql.catalog.<name>``). Defaults to
            ``settings.catalog_name()``.
        uri: SQLAlchemy URI, e.g. ``sqlite:////abs/catalog.db``. Defaults to
            ``settings.catalog_uri()``.
        warehouse: warehouse URL, e.g. ``file:///abs/warehouse``. Defaults to
            ``settings.warehouse_url()``.
    """
    name = name or settings.catalog_name()
    uri = uri or settings.catalog_uri()
    warehouse = warehouse or settings.warehouse_url()
    if uri.startswith("sqlite:///"):
        db_path = uri[len("sqlite:///") :].split("?", 1)[0]
        if db_path and db_path != ":memory:":
            Path(db_path).parent.mkdir(parents=True, exist_ok=True)
            _use_sqlite_wal(db_path)
    parsed = urlparse(warehouse)
    if parsed.scheme in ("", "file"):
        Path(parsed.path or warehouse).mkdir(parents=True, exist_ok=True)
    return SqlCatalog(name, uri=uri, warehouse=warehouse)


def _use_sqlite_wal(db_path: str) -> None:
    """Put the SQLite catalog in WAL journal mode (persistent, stored in the file).

    Spark's ``JdbcCatalog`` (xerial sqlite-jdbc) keeps pooled connections that can hold a
    shared lock between statements; in the default rollback-journal mode that blocks
    pyiceberg's next commit with "database is locked". In WAL mode readers never block the
    writer.
    """
    with contextlib.closing(sqlite3.connect(db_path, timeout=30)) as conn:
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        if str(mode).lower() != "wal":
            conn.execute("PRAGMA journal_mode=WAL")


def table_identifier(topic: TopicName) -> tuple[str, str]:
    """``(namespace, topic)``: the Iceberg identifier of a topic's table."""
    return (topic.namespace, topic.topic)


# --------------------------------------------------------------------------- Avro → Iceberg


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
class _Column:
    """One payload column: its Avro field name, Iceberg type and value converter."""

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


def _payload_columns(avro_schema: Mapping[str, Any]) -> list[_Column]:
    named: dict[str, Any] = {}
    _register_names(dict(avro_schema), named)
    if avro_schema.get("type") in ("record", "error"):
        columns = []
        for f in avro_schema.get("fields", []):
            name = f["name"]
            if name in METADATA_COLUMNS or name == PAYLOAD_COLUMN:
                raise InvalidSchemaError(
                    str(avro_schema.get("name", "?")),
                    f"field {name!r} collides with a Danube metadata column",
                )
            t, nullable, conv = _map_type(f["type"], named)
            columns.append(_Column(name, t, not nullable, conv, f.get("doc")))
        return columns
    t, nullable, conv = _map_type(dict(avro_schema) if "type" in avro_schema else avro_schema, named)
    return [_Column(VALUE_COLUMN, t, not nullable, conv)]


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


def _schema_from_columns(columns: Sequence[_Column] | None) -> Schema:
    fields = _metadata_fields()
    next_id = 10
    if columns is None:
        fields.append(NestedField(next_id, PAYLOAD_COLUMN, BinaryType(), required=False, doc="raw payload"))
    else:
        for c in columns:
            fields.append(NestedField(next_id, c.name, c.iceberg_type, required=c.required, doc=c.doc))
            next_id += 1
    return Schema(*fields)


def iceberg_schema_for_avro(avro_schema: Mapping[str, Any] | str | None) -> Schema:
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

    Returns:
        The metadata columns (field ids 1-9) followed by the payload columns.

    Raises:
        InvalidSchemaError: the schema is malformed or a field collides with a metadata column.
    """
    if avro_schema is None:
        return _schema_from_columns(None)
    return _schema_from_columns(_payload_columns(_as_dict(avro_schema)))


def _as_dict(avro_schema: Mapping[str, Any] | str) -> dict[str, Any]:
    if isinstance(avro_schema, str):
        try:
            parsed = json.loads(avro_schema)
        except ValueError:
            parsed = avro_schema  # a bare primitive name such as "string"
        return parsed if isinstance(parsed, dict) else {"type": parsed}
    return dict(avro_schema)


# --------------------------------------------------------------------------- records → Arrow


_U64_SIGN = 1 << 63


def _as_signed64(value: int) -> int:
    """A u64 (Danube producer ids are random u64s, seed ``000`` §3.3) as the int64 with the
    same 64 bits, since Iceberg's ``long`` is signed. ``value & (2**64 - 1)`` reverses it."""
    return value - (1 << 64) if value >= _U64_SIGN else value


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
) -> pa.Table:
    """Build the Arrow table that :func:`append_records` appends.

    Each payload is decoded once with ``fastavro.schemaless_reader``, using the schema the
    record was written with when ``writer_schemas`` has its ``(schema_id, schema_version)``
    and ``avro_schema`` otherwise. Columns are filled by field name from the table schema
    (``avro_schema``), so a field the writer schema lacks is null.

    Args:
        records: the records, in offset order.
        avro_schema: the table's Avro schema (the latest version), or ``None`` for ``_payload``.
        writer_schemas: Avro schema per ``(schema_id, schema_version)`` found in ``records``.
        iceberg_schema: the target table's schema; defaults to
            :func:`iceberg_schema_for_avro` of ``avro_schema``. Columns of the table that the
            Avro schema does not produce are filled with nulls.

    Returns:
        A ``pyarrow.Table`` whose schema matches the Iceberg schema (required columns
        non-nullable).

    Raises:
        SchemaMismatchError: a payload does not decode with its schema.
    """
    table_avro = _as_dict(avro_schema) if avro_schema is not None else None
    columns = _payload_columns(table_avro) if table_avro is not None else None
    schema = iceberg_schema or _schema_from_columns(columns)
    arrow_schema = schema_to_pyarrow(schema, include_field_ids=False)

    n = len(records)
    data: dict[str, list[Any]] = {
        "_offset": [r.offset for r in records],
        "_publish_time": [r.publish_time_us for r in records],
        "_producer_id": [_as_signed64(r.producer_id) for r in records],
        "_producer_name": [r.producer_name for r in records],
        "_schema_id": [r.schema_id for r in records],
        "_schema_version": [r.schema_version for r in records],
        "_attributes": [list(r.attributes.items()) for r in records],
    }
    if columns is None:
        data[PAYLOAD_COLUMN] = [r.payload for r in records]
    else:
        assert table_avro is not None
        parsed = _ParsedSchemas()
        writers = {k: _as_dict(v) for k, v in (writer_schemas or {}).items()}
        default_writer = parsed.get(table_avro)
        is_record = table_avro.get("type") in ("record", "error")
        values: list[list[Any]] = [[None] * n for _ in columns]
        names = [c.name for c in columns]
        convs = [c.convert for c in columns]
        writer_cache: dict[tuple[int, int], Any] = {}
        for i, r in enumerate(records):
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

    arrays = []
    for f in arrow_schema:
        values_for_field = data.get(f.name)
        if values_for_field is None:
            arrays.append(pa.nulls(n, type=f.type))
        else:
            arrays.append(pa.array(values_for_field, type=f.type))
    return pa.Table.from_arrays(arrays, schema=arrow_schema)


# --------------------------------------------------------------------------- tables


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


def ensure_table(
    catalog: Catalog,
    topic: TopicName,
    avro_schema: Mapping[str, Any] | str | None,
) -> Table:
    """Load the topic's table, creating its namespace and the table when missing.

    When the table exists and ``avro_schema`` has columns it lacks, they are added
    (``update_schema().union_by_name``), so a newer schema version can be appended.
    """
    identifier = table_identifier(topic)
    wanted = iceberg_schema_for_avro(avro_schema)
    try:
        table = catalog.load_table(identifier)
    except NoSuchTableError:
        catalog.create_namespace_if_not_exists(topic.namespace)
        return catalog.create_table_if_not_exists(
            identifier,
            schema=wanted,
            properties={"danube.topic": topic.path, "format-version": "2"},
        )
    have = {f.name for f in table.schema().fields}
    if any(f.name not in have for f in wanted.fields):
        with table.update_schema() as update:
            update.union_by_name(wanted)
        table.refresh()
    return table


def committed_end_offset(table: Table) -> int | None:
    """The last offset committed to ``table`` by :func:`append_records`.

    Walks the current snapshot's ancestry, newest first, to the first snapshot whose summary
    carries ``danube.end-offset`` (compaction snapshots written by Spark do not).

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


def data_file_count(table: Table) -> int:
    """Number of live data files in the current snapshot."""
    if table.current_snapshot() is None:
        return 0
    return int(table.inspect.files().num_rows)


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


def read_offsets(table: Table) -> list[int]:
    """Every ``_offset`` in the table's current snapshot, sorted (for checks and tests)."""
    arrow = table.scan(selected_fields=("_offset",)).to_arrow()
    return sorted(arrow.column("_offset").to_pylist())


def rows(table: Table) -> int:
    """Row count of the table's current snapshot."""
    return int(table.scan(selected_fields=("_offset",)).to_arrow().num_rows)

