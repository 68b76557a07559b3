"""The declared rewrite: :class:`RewriteSpec` parsed from and written to the table property
``danube.rewrite``, its columns and partition fields, and the Spark SQL type of each Iceberg
primitive."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError
from pyiceberg.transforms import Transform, UnknownTransform, VoidTransform, parse_transform
from pyiceberg.types import (
    BinaryType,
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    FixedType,
    FloatType,
    IcebergType,
    IntegerType,
    LongType,
    PrimitiveType,
    StringType,
    TimestampType,
    TimestamptzType,
)

from danube_pipeline.lake.rewrite.errors import RewriteSpecError
from danube_pipeline.lake.rewrite.properties import REWRITE_PROPERTY
from danube_pipeline.storage.table_columns import RESERVED_COLUMNS

if TYPE_CHECKING:
    from pyiceberg.table import Table

__all__ = [
    "ColumnRewrite",
    "PartitionField",
    "RewriteSpec",
    "read_rewrite_spec",
    "set_rewrite_spec",
    "spark_sql_type",
    "table_label",
]


def spark_sql_type(iceberg_type: IcebergType) -> str:
    """The Spark SQL type Iceberg's Spark integration reads an Iceberg primitive type as
    (Iceberg Spark docs, "Spark type to Iceberg type").

    Args:
        iceberg_type: a primitive Iceberg type.

    Returns:
        E.g. ``STRING``, ``BIGINT``, ``DECIMAL(20,2)``, ``TIMESTAMP`` (for ``timestamptz``).

    Raises:
        ValueError: the type has no Spark equivalent here (``time``, ``uuid``, nested types).
    """
    simple: dict[type[IcebergType], str] = {
        BooleanType: "BOOLEAN",
        IntegerType: "INT",
        LongType: "BIGINT",
        FloatType: "FLOAT",
        DoubleType: "DOUBLE",
        DateType: "DATE",
        TimestamptzType: "TIMESTAMP",
        TimestampType: "TIMESTAMP_NTZ",
        StringType: "STRING",
        BinaryType: "BINARY",
        FixedType: "BINARY",
    }
    if isinstance(iceberg_type, DecimalType):
        return f"DECIMAL({iceberg_type.precision},{iceberg_type.scale})"
    for cls, name in simple.items():
        if isinstance(iceberg_type, cls):
            return name
    raise ValueError(f"no Spark type for Iceberg type {iceberg_type}")


@dataclass(frozen=True, slots=True)
class ColumnRewrite:
    """One target column of a :class:`RewriteSpec`.

    Attributes:
        name: the column's name in the target schema (top-level).
        type: its Iceberg type (a primitive).
        expr: Spark SQL expression over the pre-rewrite columns giving its value.
    """

    name: str
    type: PrimitiveType
    expr: str


@dataclass(frozen=True, slots=True)
class PartitionField:
    """One field of the target partition spec (Iceberg spec, "Partitioning").

    Attributes:
        source: the source column's name.
        transform: the transform as the spec writes it (``day``, ``bucket[16]``, …).
        name: the partition field's name; default ``{source}_{transform}`` as Iceberg names it
            (``_publish_time_day``), ``{source}`` for ``identity``, ``{source}_bucket_{N}``
            and ``{source}_trunc_{W}``.
    """

    source: str
    transform: str
    name: str

    def parsed_transform(self) -> Transform[Any, Any]:
        """The pyiceberg transform of :attr:`transform`."""
        return parse_transform(self.transform)


def _default_partition_name(source: str, transform: Transform[Any, Any]) -> str:
    text = str(transform)
    if text == "identity":
        return source
    if text.startswith("bucket["):
        return f"{source}_bucket_{text[7:-1]}"
    if text.startswith("truncate["):
        return f"{source}_trunc_{text[9:-1]}"
    return f"{source}_{text}"


@dataclass(frozen=True, slots=True)
class RewriteSpec:
    """A declared rewrite (table property ``danube.rewrite``; format in :mod:`danube_pipeline.lake.rewrite`).

    Attributes:
        version: the rewrite's number (≥ 1), recorded in snapshot summaries and in
            ``_rewrite_version``.
        columns: the target columns, in declaration order.
        drop: columns dropped when the rewrite is finalized.
        where: Spark SQL predicate choosing the rows to convert.
        partition_spec: the target partition fields, or ``None`` to keep the current spec.
    """

    version: int
    columns: tuple[ColumnRewrite, ...]
    drop: tuple[str, ...] = ()
    where: str = "true"
    partition_spec: tuple[PartitionField, ...] | None = None

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any], *, table: str = "?") -> RewriteSpec:
        """Parse and check a spec.

        Rules: ``version`` an int ≥ 1; ``columns`` an object of ``{name: {"type", "expr"?}}``
        (at least one column or a ``partition_spec``), names top-level, not starting with
        ``__danube`` and not Danube's own (:data:`~danube_pipeline.storage.table_columns.RESERVED_COLUMNS`:
        ``_offset``... ``_raw_payload``, ``_rewrite_version``, which a rewrite carries unchanged); ``type`` an Iceberg primitive type string; ``drop`` names not among
        ``columns`` nor Danube's own; ``where`` a string; ``partition_spec`` a list of ``{"source",
        "transform", "name"?}`` with transforms pyiceberg parses. Unknown keys are refused.

        Args:
            text: the JSON text or the parsed object.
            table: the table's identifier, for error messages.

        Returns:
            The spec.

        Raises:
            RewriteSpecError: a rule above is broken; the message names the field.
        """
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as e:
            raise RewriteSpecError(table, f"not JSON: {e}") from e
        if not isinstance(raw, dict):
            raise RewriteSpecError(table, "must be a JSON object")
        unknown = set(raw) - {"version", "columns", "drop", "where", "partition_spec"}
        if unknown:
            raise RewriteSpecError(table, f"unknown keys {sorted(unknown)}")
        version = raw.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise RewriteSpecError(table, f"version must be an integer ≥ 1, got {version!r}")
        raw_columns = raw.get("columns", {})
        if not isinstance(raw_columns, dict):
            raise RewriteSpecError(table, "columns must be an object {name: {type, expr}}")
        columns = []
        for name, body in raw_columns.items():
            if not name or "." in name or name.startswith("__danube") or name in RESERVED_COLUMNS:
                raise RewriteSpecError(table, f"columns.{name}: not a usable top-level column name")
            if not isinstance(body, dict) or set(body) - {"type", "expr"} or "type" not in body:
                raise RewriteSpecError(table, f"columns.{name}: must be {{\"type\": ..., \"expr\": ...}}")
            try:
                column_type = TypeAdapter(IcebergType).validate_python(body["type"])
            except ValidationError as e:
                raise RewriteSpecError(table, f"columns.{name}.type: {body['type']!r} is not an Iceberg type") from e
            if not isinstance(column_type, PrimitiveType):
                raise RewriteSpecError(table, f"columns.{name}.type: only primitive types, got {column_type}")
            try:
                spark_type = spark_sql_type(column_type)
            except ValueError as e:
                raise RewriteSpecError(table, f"columns.{name}.type: {e}") from e
            expr = body.get("expr", f"CAST(`{name}` AS {spark_type})")
            if not isinstance(expr, str) or not expr.strip():
                raise RewriteSpecError(table, f"columns.{name}.expr: must be a non-empty string")
            columns.append(ColumnRewrite(name, column_type, expr))
        drop = raw.get("drop", [])
        if not isinstance(drop, list) or not all(isinstance(d, str) and d for d in drop):
            raise RewriteSpecError(table, "drop must be a list of column names")
        reserved = sorted(set(drop) & RESERVED_COLUMNS)
        if reserved:
            raise RewriteSpecError(table, f"drop: {reserved} are Danube's own columns")
        clash = sorted(set(drop) & {c.name for c in columns})
        if clash:
            raise RewriteSpecError(table, f"drop: {clash} are also target columns")
        where = raw.get("where", "true")
        if not isinstance(where, str) or not where.strip():
            raise RewriteSpecError(table, "where must be a non-empty Spark SQL predicate")
        partition_spec: tuple[PartitionField, ...] | None = None
        if "partition_spec" in raw and raw["partition_spec"] is not None:
            fields = raw["partition_spec"]
            if not isinstance(fields, list):
                raise RewriteSpecError(table, "partition_spec must be a list of {source, transform, name?}")
            parsed = []
            for i, f in enumerate(fields):
                if not isinstance(f, dict) or set(f) - {"source", "transform", "name"} or not {"source", "transform"} <= set(f):
                    raise RewriteSpecError(table, f"partition_spec[{i}]: must be {{\"source\", \"transform\", \"name\"?}}")
                try:
                    transform = parse_transform(f["transform"])
                except Exception as e:  # pyiceberg raises ValueError or its own parse errors
                    raise RewriteSpecError(table, f"partition_spec[{i}].transform: {f['transform']!r}: {e}") from e
                if isinstance(transform, UnknownTransform | VoidTransform):
                    raise RewriteSpecError(
                        table,
                        f"partition_spec[{i}].transform: {f['transform']!r} is not one of identity, year, "
                        "month, day, hour, bucket[N], truncate[W]",
                    )
                name = f.get("name") or _default_partition_name(f["source"], transform)
                parsed.append(PartitionField(f["source"], str(transform), name))
            partition_spec = tuple(parsed)
        if not columns and partition_spec is None:
            raise RewriteSpecError(table, "nothing to do: no columns and no partition_spec")
        return cls(version, tuple(columns), tuple(drop), where, partition_spec)

    def to_json(self) -> str:
        """The spec as ``danube.rewrite`` JSON (what :meth:`from_json` reads back)."""
        body: dict[str, Any] = {
            "version": self.version,
            "columns": {c.name: {"type": str(c.type), "expr": c.expr} for c in self.columns},
        }
        if self.drop:
            body["drop"] = list(self.drop)
        if self.where != "true":
            body["where"] = self.where
        if self.partition_spec is not None:
            body["partition_spec"] = [
                {"source": f.source, "transform": f.transform, "name": f.name} for f in self.partition_spec
            ]
        return json.dumps(body, separators=(",", ":"))

    def digest(self) -> str:
        """A short hash of the spec's content (16 hex digits), to notice an edited spec."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def column(self, name: str) -> ColumnRewrite | None:
        """The target column ``name``, or ``None``."""
        return next((c for c in self.columns if c.name == name), None)


def table_label(table: Table) -> str:
    """The table's identifier as errors and logs name it: ``ns.topic``."""
    return ".".join(table.name()[-2:])


def read_rewrite_spec(table: Table) -> RewriteSpec | None:
    """The spec declared in the table property ``danube.rewrite``.

    Args:
        table: the topic's table.

    Returns:
        The parsed spec, or ``None`` when the property is not set.

    Raises:
        RewriteSpecError: the property is set but invalid.
    """
    text = table.properties.get(REWRITE_PROPERTY)
    if text is None or not text.strip():
        return None
    return RewriteSpec.from_json(text, table=table_label(table))


def set_rewrite_spec(table: Table, spec: RewriteSpec | str | Mapping[str, Any]) -> RewriteSpec:
    """Declare a rewrite: set the table property ``danube.rewrite`` (one metadata commit).

    The same as ``ALTER TABLE {catalog}.{ns}.{topic} SET TBLPROPERTIES ('danube.rewrite' =
    '{...}')`` in Spark SQL; the spec is checked first.

    Args:
        table: the topic's table.
        spec: the spec, its JSON text or its parsed JSON.

    Returns:
        The spec as stored.

    Raises:
        RewriteSpecError: the spec is invalid.
        CommitFailedException: a concurrent commit won; retry.
    """
    parsed = spec if isinstance(spec, RewriteSpec) else RewriteSpec.from_json(spec, table=table_label(table))
    with table.transaction() as tx:
        tx.set_properties({REWRITE_PROPERTY: parsed.to_json()})
    return parsed
