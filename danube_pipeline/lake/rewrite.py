"""Schema-evolved rewrites: the changes Iceberg cannot make in place, applied by rewriting data
files in Spark, one atomic snapshot per table partition.

Iceberg evolves a schema in place only where old data files stay readable under the new
schema (Iceberg spec, "Schema Evolution": int→long, float→double, widening a decimal's
precision, required→optional, adding, dropping and renaming columns) and keeps each file in
the partition spec it was written with (spec, "Partition Evolution"). A type change such as
int→string or long→decimal(20,2), a field split (``route`` ``"JFK-LAX"`` into ``origin`` and
``dest``) and moving old files into a new partition spec need the data rewritten. This module
does that, declaratively, so a run can stop anywhere and the next one finishes the job.

The rewrite spec
================
An operator declares a rewrite in the table property :data:`REWRITE_PROPERTY`
(``danube.rewrite``) as JSON (:meth:`RewriteSpec.from_json` gives every rule)::

    {
      "version": 2,
      "columns": {
        "flight": {"type": "string", "expr": "CAST(flight AS STRING)"},
        "origin": {"type": "string", "expr": "split(route, '-')[0]"},
        "dest":   {"type": "string", "expr": "split(route, '-')[1]"}
      },
      "drop": ["route"],
      "where": "_schema_version < 2",
      "partition_spec": [{"source": "_publish_time", "transform": "day"}]
    }

* ``version``: the rewrite's own number (not the registry's schema version), above the
  previous rewrite's. Every snapshot a rewrite commits carries it in its summary
  (:data:`SUMMARY_REWRITE_VERSION`), every row it writes in :data:`REWRITE_VERSION_COLUMN`.
* ``columns``: target column → Iceberg type (``string``, ``long``, ``decimal(20, 2)``, …;
  primitives) and a Spark SQL expression giving its value from the row's columns *as they
  were before this rewrite* (default ``CAST(<name> AS <type>)``). A rewrite only fills a
  target that is null: a value already there (written by tiering in the new shape after
  staging, or by an earlier run) is never overwritten, so no row is converted twice.
* ``drop``: columns removed when the rewrite is finalized (e.g. the field that was split).
* ``where``: Spark SQL predicate over the same pre-rewrite columns choosing the rows to
  convert (default ``true``); for rows of the new shape that reached the table *before* the
  rewrite was staged and whose targets are legitimately null (``_schema_version >= 2``).
* ``partition_spec``: the target partition spec, a list of ``{"source", "transform",
  "name"?}`` with Iceberg transforms (``identity``, ``year``, ``month``, ``day``, ``hour``,
  ``bucket[N]``, ``truncate[W]``); omitted keeps the current spec.

How a rewrite runs
==================
1. **Stage** (:func:`stage_rewrite`, one pyiceberg metadata commit, no snapshot): add
   ``_rewrite_version``; add each missing target column; promote in place what Iceberg can
   promote; for a type it cannot promote, make the old column optional and rename it
   ``{name}__pre_v{version}`` (its field id, and so every old file's values, go with it) and
   add ``{name}`` with the new type and a new field id; make the ``drop`` columns optional;
   evolve the partition spec; record :class:`RewriteState` in :data:`REWRITE_STATE_PROPERTY`.
   From here on, appends write the target shape (tiering converts older writers' values into
   the widened column, :mod:`danube_pipeline.lake.iceberg.evolution`) and the target spec.
2. **Rewrite, partition by partition** (:func:`rewrite_table`): the data files of the
   requested UTC day (their ``_publish_time`` bounds touch it), grouped by (partition spec,
   partition), that sit in an older spec or hold a row with a fillable target, are read,
   converted, written as new data files in the current schema and spec, verified, and swapped
   in with Iceberg's ``RewriteFiles`` in one ``replace`` snapshot per partition, whose summary
   carries ``danube.rewrite-version``. Verified means, read back from the new files through
   Iceberg before the commit: the same row count (also in the files' metadata), the same
   order-free checksum (:func:`danube_pipeline.lake.spark.row_checksum`) of every column the
   rewrite does not write, the rewritten columns' checksum equal to the converted rows', and
   no row whose old value of a type-changed column is set but whose new value is null (a
   ``CAST`` that overflowed). On a mismatch nothing is committed, the new files are deleted
   and :class:`RewriteVerificationError` says what differs. A partition with nothing left to
   do is skipped (files whose ``_rewrite_version`` metrics show every row written by this
   version are not even read), so a re-run commits nothing.
3. **Finalize** (:func:`finalize_rewrite`, one metadata commit): when no file of the whole
   table needs work any more, the ``__pre_v`` and ``drop`` columns are dropped and the state
   is marked finished; later runs of that version do nothing at all.

Why one ``RewriteFiles`` commit per partition: it names the exact files it replaces, so rows
appended by tiering meanwhile are never touched (an overwrite by filter would delete them);
it fails ("Missing required files to delete") when compaction or retention replaced one of
those files since they were read, instead of committing their rows twice; and with
``validateFromSnapshot`` it fails when delete files were added against them
(:class:`RewriteConflictError`; the next run starts from the new files). The snapshot is a
``replace`` (Iceberg spec, "Snapshots": files rewritten without changing the table's rows):
the verification proves the rows are the same, only their representation and layout change.
The files are written through the Spark rewrite plumbing ``rewrite_data_files`` uses
(``ScanTaskSetManager``, ``FileRewriteCoordinator``; Iceberg Spark docs, "Procedures"), so they
carry the table's field ids, metrics and partition values as any Iceberg Spark write does.

Readers during a rewrite see, for a changed type, the new column null in rows not yet
converted and the old values under ``{name}__pre_v{version}``; ``COALESCE(flight,
CAST(flight__pre_v2 AS STRING))`` reads both. A table that is not partitioned has one
partition: the run for a day rewrites its files whose ``_publish_time`` bounds touch that day
(a file spanning two days is rewritten, whole, by the first of them).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter, ValidationError
from pyiceberg.exceptions import CommitFailedException
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

from danube_pipeline.errors import DanubeError
from danube_pipeline.names import TopicName
from danube_pipeline.lake.spark import RowChecksum, checksum_of, load_java_table, row_hash, spark_table_name

if TYPE_CHECKING:
    from pyiceberg.catalog import Catalog
    from pyiceberg.table import Table
    from pyspark.sql import Column, DataFrame, SparkSession

__all__ = [
    "PUBLISH_TIME_COLUMN",
    "REWRITE_PROPERTY",
    "REWRITE_STATE_PROPERTY",
    "REWRITE_VERSION_COLUMN",
    "SUMMARY_REWRITE_GROUP",
    "SUMMARY_REWRITE_PARTITION",
    "SUMMARY_REWRITE_VERSION",
    "ColumnRewrite",
    "DataFileStats",
    "PartitionField",
    "RewriteConflictError",
    "RewriteError",
    "RewriteReport",
    "RewriteSpec",
    "RewriteSpecError",
    "RewriteState",
    "RewriteStateError",
    "RewriteUnit",
    "RewriteVerificationError",
    "UnitResult",
    "day_bounds_us",
    "finalize_rewrite",
    "read_rewrite_spec",
    "read_rewrite_state",
    "retired_name",
    "rewrite_table",
    "rewrite_units",
    "set_rewrite_spec",
    "spark_sql_type",
    "stage_rewrite",
]

log = logging.getLogger(__name__)

REWRITE_PROPERTY = "danube.rewrite"
"""Table property holding the declared :class:`RewriteSpec` as JSON (set by an operator)."""
REWRITE_STATE_PROPERTY = "danube.rewrite-state"
"""Table property holding :class:`RewriteState` as JSON (kept by this module)."""
SUMMARY_REWRITE_VERSION = "danube.rewrite-version"
"""Snapshot summary property of every rewrite commit: the spec's ``version``."""
SUMMARY_REWRITE_PARTITION = "danube.rewrite-partition"
"""Snapshot summary property of every rewrite commit: the partition (``day=2026-11-20``, or
``unpartitioned``) and the spec id it was read from, ``{partition}@spec-{id}``."""
SUMMARY_REWRITE_GROUP = "danube.rewrite-group"
"""Snapshot summary property of every rewrite commit: a UUID naming the commit."""
REWRITE_VERSION_COLUMN = "_rewrite_version"
"""Optional int column added at staging: the version of the last rewrite that wrote the row
(every row of a rewritten file: converted, already in shape, or left alone by ``where``); null
in rows no rewrite has written. Compaction keeps it, so a file whose metrics show it set to the
version everywhere is known done without being read."""
PUBLISH_TIME_COLUMN = "_publish_time"
RETIRED_SUFFIX = "__pre_v"
SPLIT_SIZE_BYTES = 512 * 1024 * 1024
"""Bytes of input per Spark read task of a rewrite (``split-size``): a partition up to this
size becomes one task and, per output partition, one new file."""
_CURRENT = "__danube_current__"
_CONVERT = "__danube_convert__"
_WORK = "__danube_work__"
_US_PER_DAY = 86_400_000_000


# --------------------------------------------------------------------------- errors


class RewriteError(DanubeError):
    """Root of the schema-rewrite errors."""


class RewriteSpecError(RewriteError, ValueError):
    """The declared rewrite spec (table property ``danube.rewrite``) is invalid.

    Attributes:
        table: the table's identifier, ``ns.topic``.
        reason: what is wrong, naming the field.
    """

    def __init__(self, table: str, reason: str) -> None:
        self.table = table
        self.reason = reason
        super().__init__(f"{table}: invalid {REWRITE_PROPERTY}: {reason}")


class RewriteStateError(RewriteError):
    """The declared spec conflicts with the rewrite already staged on the table (an older
    version, an unfinished previous version, or the same version edited after staging).

    Attributes:
        table: the table's identifier.
        staged_version: the version recorded in ``danube.rewrite-state``.
        declared_version: the version of ``danube.rewrite``.
        reason: what conflicts and what to do.
    """

    def __init__(self, table: str, staged_version: int, declared_version: int, reason: str) -> None:
        self.table = table
        self.staged_version = staged_version
        self.declared_version = declared_version
        self.reason = reason
        super().__init__(
            f"{table}: declared rewrite version {declared_version} vs staged version "
            f"{staged_version}: {reason}"
        )


class RewriteVerificationError(RewriteError):
    """A partition's rewritten files do not hold the rows its old files held; nothing was
    committed and the new files were deleted.

    Attributes:
        table: the table's identifier.
        partition: the partition (``{partition}@spec-{id}``).
        what: ``rows``, ``rows in the new files' metadata``, ``untouched checksum``,
            ``rewritten checksum`` or ``values of {column}`` (old values set, new ones null).
        before: the value over the old files (for ``rewritten checksum``, over the rows as
            converted; for ``values of``, rows whose retired column is set).
        after: the value read back from the new files (for ``values of``, those rows whose
            new column is set too).
    """

    def __init__(self, table: str, partition: str, what: str, before: int, after: int) -> None:
        self.table = table
        self.partition = partition
        self.what = what
        self.before = before
        self.after = after
        super().__init__(
            f"{table} partition {partition}: {what} differs after the rewrite "
            f"({before} before, {after} after); nothing was committed"
        )


class RewriteConflictError(RewriteError):
    """A partition changed while it was being rewritten (compaction, retention or another
    rewrite replaced one of its files, or added delete files against them); nothing was
    committed. Running again rewrites it from its new files.

    Attributes:
        table: the table's identifier.
        partition: ``{partition}@spec-{id}``.
        cause: the Iceberg exception's message.
    """

    retriable = True

    def __init__(self, table: str, partition: str, cause: str) -> None:
        self.table = table
        self.partition = partition
        self.cause = cause
        super().__init__(f"{table} partition {partition} changed during its rewrite; nothing committed: {cause}")


# --------------------------------------------------------------------------- the spec

_PROMOTIONS: dict[type[IcebergType], type[IcebergType]] = {IntegerType: LongType, FloatType: DoubleType}


def _can_promote(source: IcebergType, target: IcebergType) -> bool:
    """Iceberg spec, "Schema Evolution": int→long, float→double, decimal(P, S)→decimal(P', S)
    with P' > P (same scale) are the promotions that keep old files readable."""
    if isinstance(source, DecimalType) and isinstance(target, DecimalType):
        return source.scale == target.scale and target.precision > source.precision
    return _PROMOTIONS.get(type(source)) is type(target)


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
    """A declared rewrite (table property ``danube.rewrite``; format in the module docstring).

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
        (at least one column or a ``partition_spec``), names top-level and not starting with
        ``__danube``; ``type`` an Iceberg primitive type string; ``drop`` names not among
        ``columns``; ``where`` a string; ``partition_spec`` a list of ``{"source",
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
            if not name or "." in name or name.startswith("__danube") or name == REWRITE_VERSION_COLUMN:
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


def _table_label(table: Table) -> str:
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
    return RewriteSpec.from_json(text, table=_table_label(table))


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
    parsed = spec if isinstance(spec, RewriteSpec) else RewriteSpec.from_json(spec, table=_table_label(table))
    with table.transaction() as tx:
        tx.set_properties({REWRITE_PROPERTY: parsed.to_json()})
    return parsed


# --------------------------------------------------------------------------- staging


@dataclass(frozen=True, slots=True)
class RewriteState:
    """What staging did, kept in the table property ``danube.rewrite-state``.

    Attributes:
        version: the staged spec's version.
        digest: :meth:`RewriteSpec.digest` of the staged spec.
        retired: target column → the name its pre-rewrite column now has
            (``{"flight": "flight__pre_v2"}``).
        finalized: the rewrite is complete and the retired and dropped columns are gone.
    """

    version: int
    digest: str
    retired: Mapping[str, str] = field(default_factory=dict)
    finalized: bool = False

    def to_json(self) -> str:
        """The state as the property's JSON."""
        return json.dumps(
            {"version": self.version, "digest": self.digest, "retired": dict(self.retired), "finalized": self.finalized},
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> RewriteState:
        """Parse the property's JSON.

        Raises:
            ValueError: not the JSON :meth:`to_json` writes.
        """
        raw = json.loads(text)
        return cls(int(raw["version"]), str(raw["digest"]), dict(raw.get("retired", {})), bool(raw.get("finalized")))


def read_rewrite_state(table: Table) -> RewriteState | None:
    """The staged rewrite's state (``danube.rewrite-state``), or ``None`` if none was staged.

    Raises:
        ValueError: the property holds something this module did not write.
    """
    text = table.properties.get(REWRITE_STATE_PROPERTY)
    return RewriteState.from_json(text) if text else None


def retired_name(column: str, version: int) -> str:
    """The name a column whose type cannot be promoted takes at staging: ``{column}__pre_v{version}``."""
    return f"{column}{RETIRED_SUFFIX}{version}"


def _check_against_state(table: Table, spec: RewriteSpec, state: RewriteState | None) -> None:
    if state is None:
        return
    label = _table_label(table)
    if spec.version < state.version:
        raise RewriteStateError(label, state.version, spec.version, "the declared spec is older than the staged one")
    if spec.version == state.version and spec.digest() != state.digest:
        raise RewriteStateError(
            label, state.version, spec.version, "the spec was edited after staging; declare it with a new version"
        )
    if spec.version > state.version and not state.finalized:
        raise RewriteStateError(
            label, state.version, spec.version, f"rewrite version {state.version} is not finished; run it to the end first"
        )


def stage_rewrite(table: Table, spec: RewriteSpec, *, max_attempts: int = 5) -> RewriteState:
    """Evolve the table's schema and partition spec to the spec's target shape, in place, in
    one metadata commit (no snapshot); a no-op when this version is already staged.

    See the module docstring, step 1, for what changes. New columns are optional; a column
    whose type changes this way loses nothing: its values stay in the data files under the
    retired name until :func:`finalize_rewrite`.

    Args:
        table: the topic's table (reloaded on a commit conflict).
        spec: the declared spec.
        max_attempts: commit attempts on ``CommitFailedException`` (pyiceberg does not retry).

    Returns:
        The staged :class:`RewriteState`.

    Raises:
        RewriteStateError: the spec conflicts with what is staged.
        RewriteSpecError: the spec names a missing ``drop`` or partition source column, drops a
            partition source, changes the type of a partition source column, or a retired
            name is taken.
        CommitFailedException: still conflicting after ``max_attempts`` attempts.
    """
    label = _table_label(table)
    for attempt in range(1, max_attempts + 1):
        state = read_rewrite_state(table)
        _check_against_state(table, spec, state)
        if state is not None and state.version == spec.version:
            return state
        schema = table.schema()
        names = {f.name: f for f in schema.fields}
        source_ids = {f.source_id for s in table.specs().values() for f in s.fields}
        added: list[ColumnRewrite] = []
        promoted: list[ColumnRewrite] = []
        retired: dict[str, str] = {}
        for column in spec.columns:
            current = names.get(column.name)
            if current is None:
                added.append(column)
            elif current.field_type == column.type:
                continue
            elif _can_promote(current.field_type, column.type):
                promoted.append(column)
            else:
                if current.field_id in source_ids:
                    raise RewriteSpecError(label, f"columns.{column.name}: a partition source column cannot change type")
                new_name = retired_name(column.name, spec.version)
                if new_name in names:
                    raise RewriteSpecError(label, f"columns.{column.name}: {new_name} already exists")
                retired[column.name] = new_name
        partition_sources = {f.source for f in spec.partition_spec or ()}
        for name in spec.drop:
            if name not in names:
                raise RewriteSpecError(label, f"drop: no column {name!r}")
            current_sources = {f.source_id for f in table.spec().fields}
            if name in partition_sources or (spec.partition_spec is None and names[name].field_id in current_sources):
                raise RewriteSpecError(label, f"drop: {name!r} is a source of the partition spec")
        new_state = RewriteState(spec.version, spec.digest(), retired)
        try:
            with table.transaction() as tx:
                with tx.update_schema() as update:
                    if REWRITE_VERSION_COLUMN not in names:
                        update.add_column(
                            REWRITE_VERSION_COLUMN, IntegerType(), doc="version of the last danube.rewrite that wrote the row"
                        )
                    for column in added:
                        update.add_column(column.name, column.type)
                    for column in promoted:
                        update.update_column(column.name, field_type=column.type)
                    for old in [*retired, *spec.drop]:
                        if names[old].required:
                            update.make_column_optional(old)
                    for old, new_name in retired.items():
                        update.rename_column(old, new_name)
                if retired:
                    # a second schema update: pyiceberg checks new names against the schema the
                    # update started from, where the renamed columns still hold them
                    with tx.update_schema() as update:
                        for old in retired:
                            target = spec.column(old)
                            assert target is not None
                            update.add_column(old, target.type)
                if spec.partition_spec is not None:
                    _stage_partition_spec(tx, spec.partition_spec, label)
                tx.set_properties({REWRITE_STATE_PROPERTY: new_state.to_json()})
        except CommitFailedException:
            if attempt == max_attempts:
                raise
            time.sleep(0.05 * attempt)
            table.refresh()
            continue
        table.refresh()
        log.info("%s: staged rewrite version %d (retired %s)", label, spec.version, retired or "nothing")
        return new_state
    raise AssertionError("unreachable")  # pragma: no cover


def _stage_partition_spec(tx: Any, fields: Sequence[PartitionField], label: str) -> None:
    """Evolve the partition spec inside the transaction ``tx`` to ``fields`` (nothing if equal)."""
    schema = tx.table_metadata.schema()
    names = {f.name: f for f in schema.fields}
    wanted: dict[tuple[int, str], PartitionField] = {}
    for f in fields:
        if f.source not in names:
            raise RewriteSpecError(label, f"partition_spec: no source column {f.source!r}")
        wanted[(names[f.source].field_id, f.transform)] = f
    current = {(f.source_id, str(f.transform)): f for f in tx.table_metadata.spec().fields if str(f.transform) != "void"}
    if set(current) == set(wanted):
        return
    with tx.update_spec() as update:
        for key, existing in current.items():
            if key not in wanted:
                update.remove_field(existing.name)
        for key, target in wanted.items():
            if key not in current:
                update.add_field(target.source, target.parsed_transform(), target.name)


def finalize_rewrite(table: Table, spec: RewriteSpec, *, max_attempts: int = 5) -> RewriteState:
    """Drop the retired (``__pre_v``) and ``drop`` columns and mark the rewrite finished, in one
    metadata commit (no snapshot). Call it only when no file needs rewriting any more
    (:func:`rewrite_table` checks).

    Old snapshots keep their schema, so time travel still reads the dropped columns until
    those snapshots expire.

    Args:
        table: the topic's table.
        spec: the staged spec.
        max_attempts: commit attempts on ``CommitFailedException``.

    Returns:
        The finalized state.

    Raises:
        RewriteStateError: ``spec`` is not the staged version.
        CommitFailedException: still conflicting after ``max_attempts`` attempts.
    """
    label = _table_label(table)
    for attempt in range(1, max_attempts + 1):
        state = read_rewrite_state(table)
        if state is None or state.version != spec.version:
            raise RewriteStateError(label, state.version if state else 0, spec.version, "not staged")
        if state.finalized:
            return state
        names = {f.name for f in table.schema().fields}
        done = replace(state, finalized=True)
        try:
            with table.transaction() as tx:
                doomed = [n for n in [*state.retired.values(), *spec.drop] if n in names]
                if doomed:
                    with tx.update_schema() as update:
                        for name in doomed:
                            update.delete_column(name)
                tx.set_properties({REWRITE_STATE_PROPERTY: done.to_json()})
        except CommitFailedException:
            if attempt == max_attempts:
                raise
            time.sleep(0.05 * attempt)
            table.refresh()
            continue
        table.refresh()
        log.info("%s: finalized rewrite version %d", label, spec.version)
        return done
    raise AssertionError("unreachable")  # pragma: no cover


# --------------------------------------------------------------------------- planning


def day_bounds_us(day: dt.date) -> tuple[int, int]:
    """``[start, end)`` of a UTC day in microseconds since the Unix epoch (how Iceberg stores
    ``timestamptz`` and its bounds; Iceberg spec, "Binary single-value serialization")."""
    start = int(dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC).timestamp()) * 1_000_000
    return start, start + _US_PER_DAY


@dataclass(frozen=True, slots=True)
class DataFileStats:
    """One live data file, from the table's manifests (Iceberg spec, "Manifests": ``data_file``).

    Attributes:
        path: the file's location.
        spec_id: the partition spec it was written with.
        partition: its partition as a path (``_publish_time_day=2026-11-20``; ``""`` when
            unpartitioned).
        record_count: rows.
        size_bytes: file size in bytes.
        publish_time_min_us: lower bound of ``_publish_time`` (µs since the epoch), or
            ``None`` when the file has no bound (no metrics, or only nulls).
        publish_time_max_us: upper bound of ``_publish_time``, or ``None``.
        marker_min: lower bound of ``_rewrite_version``, or ``None``.
        marker_nulls: null count of ``_rewrite_version``, or ``None`` when not recorded (the
            file predates the column).
        marker_values: value count of ``_rewrite_version``, or ``None`` when not recorded.
    """

    path: str
    spec_id: int
    partition: str
    record_count: int
    size_bytes: int
    publish_time_min_us: int | None = None
    publish_time_max_us: int | None = None
    marker_min: int | None = None
    marker_nulls: int | None = None
    marker_values: int | None = None

    def touches(self, start_us: int, end_us: int) -> bool:
        """Whether the file may hold rows published in ``[start_us, end_us)``. A file without
        ``_publish_time`` bounds touches every day (so some run picks it up)."""
        if self.publish_time_min_us is None or self.publish_time_max_us is None:
            return True
        return self.publish_time_min_us < end_us and self.publish_time_max_us >= start_us

    def all_converted(self, version: int) -> bool:
        """Whether every row carries ``_rewrite_version >= version``, from the file's metrics."""
        return (
            self.marker_values == self.record_count
            and self.marker_nulls == 0
            and self.marker_min is not None
            and self.marker_min >= version
        )


@dataclass(frozen=True, slots=True)
class RewriteUnit:
    """The files of one partition (of one partition spec) that one commit rewrites.

    Attributes:
        spec_id: the spec the files were written with.
        partition: the partition path (``""`` when unpartitioned).
        files: the files, in path order.
    """

    spec_id: int
    partition: str
    files: tuple[DataFileStats, ...]

    @property
    def label(self) -> str:
        """``{partition}@spec-{id}`` (``unpartitioned@spec-0``)."""
        return f"{self.partition or 'unpartitioned'}@spec-{self.spec_id}"

    @property
    def rows(self) -> int:
        return sum(f.record_count for f in self.files)


def rewrite_units(files: Iterable[DataFileStats], *, day: dt.date | None = None) -> list[RewriteUnit]:
    """Group files into per-partition units, keeping only those touching ``day``.

    Args:
        files: live data files.
        day: a UTC day, or ``None`` for every file.

    Returns:
        Units ordered by (spec id, partition); each file in exactly one.
    """
    groups: dict[tuple[int, str], list[DataFileStats]] = {}
    bounds = day_bounds_us(day) if day is not None else None
    for f in files:
        if bounds is not None and not f.touches(*bounds):
            continue
        groups.setdefault((f.spec_id, f.partition), []).append(f)
    return [
        RewriteUnit(spec_id, partition, tuple(sorted(group, key=lambda f: f.path)))
        for (spec_id, partition), group in sorted(groups.items())
    ]


# --------------------------------------------------------------------------- reports


@dataclass(frozen=True, slots=True)
class UnitResult:
    """What happened to one partition.

    Attributes:
        partition: ``{partition}@spec-{id}``.
        status: ``rewritten`` or ``skipped`` (every row converted and the files in the
            current spec already).
        files_before: data files of the partition the run looked at.
        files_after: data files that replaced them (``files_before`` when skipped).
        rows: rows in the rewritten files (all of the partition's rows when skipped).
        rows_converted: rows the expressions converted (the others kept their values).
        checksum_before: untouched-column checksum over the old files (rewritten units).
        checksum_after: the same over the new files (equal, or nothing was committed).
        snapshot_id: the ``replace`` snapshot (rewritten units).
    """

    partition: str
    status: str
    files_before: int
    files_after: int
    rows: int
    rows_converted: int = 0
    checksum_before: int | None = None
    checksum_after: int | None = None
    snapshot_id: int | None = None


@dataclass(frozen=True, slots=True)
class RewriteReport:
    """What :func:`rewrite_table` did.

    Attributes:
        table: ``ns.topic``.
        version: the spec's version (``None`` when no spec is declared).
        day: the UTC day the run was limited to (``None``: the whole table).
        staged: this run staged the schema and spec.
        finalized: this run finalized the rewrite.
        already_finalized: the version was finalized before this run (nothing to do).
        retired: target column → its retired column (``{"flight": "flight__pre_v2"}``).
        units: per-partition results, in commit order.
        snapshot_before: the current snapshot when the run started.
        snapshot_after: the current snapshot when it ended.
        table_data_files_before: live data files when the run started.
        table_data_files_after: live data files when it ended.
        remaining_files: files anywhere in the table still needing a rewrite afterwards.
    """

    table: str
    version: int | None
    day: dt.date | None
    staged: bool = False
    finalized: bool = False
    already_finalized: bool = False
    retired: Mapping[str, str] = field(default_factory=dict)
    units: tuple[UnitResult, ...] = ()
    snapshot_before: int | None = None
    snapshot_after: int | None = None
    table_data_files_before: int = 0
    table_data_files_after: int = 0
    remaining_files: int = 0

    @property
    def rewritten(self) -> list[UnitResult]:
        return [u for u in self.units if u.status == "rewritten"]

    @property
    def skipped(self) -> list[UnitResult]:
        return [u for u in self.units if u.status == "skipped"]

    @property
    def snapshot_ids(self) -> list[int]:
        return [u.snapshot_id for u in self.units if u.snapshot_id is not None]


# --------------------------------------------------------------------------- Spark side


class _JavaTable:
    """The Iceberg Java table behind a Spark catalog table, and the Spark rewrite plumbing
    (``ScanTaskSetManager``, ``FileRewriteCoordinator``) that ``rewrite_data_files`` uses."""

    def __init__(self, spark: SparkSession, name: str) -> None:
        self.spark = spark
        self.name = name
        self.jvm: Any = getattr(spark, "_jvm")  # noqa: B009 - Py4J's view of the JVM, untyped
        self.table: Any = load_java_table(spark, name)
        self.tasks: Any = self.jvm.org.apache.iceberg.spark.ScanTaskSetManager.get()
        self.coordinator: Any = self.jvm.org.apache.iceberg.spark.FileRewriteCoordinator.get()

    def refresh(self) -> None:
        self.table.refresh()

    def current_snapshot_id(self) -> int | None:
        snapshot = self.table.currentSnapshot()
        return int(snapshot.snapshotId()) if snapshot is not None else None

    def current_spec_id(self) -> int:
        return int(self.table.spec().specId())

    def plan(self, snapshot_id: int) -> dict[str, tuple[DataFileStats, Any]]:
        """Every live data file of the snapshot: path → (stats, Java ``FileScanTask``)."""
        schema = self.table.schema()
        conversions = self.jvm.org.apache.iceberg.types.Conversions
        specs = self.table.specs()

        def field_of(name: str) -> tuple[int, Any] | None:
            f = schema.findField(name)
            return (int(f.fieldId()), f.type()) if f is not None else None

        publish = field_of(PUBLISH_TIME_COLUMN)
        marker = field_of(REWRITE_VERSION_COLUMN)

        def bound(bounds: Any, column: tuple[int, Any] | None) -> int | None:
            if bounds is None or column is None or not bounds.containsKey(column[0]):
                return None
            return int(conversions.fromByteBuffer(column[1], bounds.get(column[0])))

        def count(counts: Any, column: tuple[int, Any] | None) -> int | None:
            if counts is None or column is None or not counts.containsKey(column[0]):
                return None
            return int(counts.get(column[0]))

        planned: dict[str, tuple[DataFileStats, Any]] = {}
        tasks = self.table.newScan().useSnapshot(snapshot_id).includeColumnStats().planFiles()
        try:
            iterator = tasks.iterator()
            while iterator.hasNext():
                task = iterator.next()
                f = task.file()
                spec_id = int(f.specId())
                lower, upper = f.lowerBounds(), f.upperBounds()
                stats = DataFileStats(
                    path=str(f.location()),
                    spec_id=spec_id,
                    partition=str(specs.get(spec_id).partitionToPath(f.partition())),
                    record_count=int(f.recordCount()),
                    size_bytes=int(f.fileSizeInBytes()),
                    publish_time_min_us=bound(lower, publish),
                    publish_time_max_us=bound(upper, publish),
                    marker_min=bound(lower, marker),
                    marker_nulls=count(f.nullValueCounts(), marker),
                    marker_values=count(f.valueCounts(), marker),
                )
                planned[stats.path] = (stats, task)
        finally:
            tasks.close()
        return planned

    def staged_read(self, group_id: str, tasks: Sequence[Any]) -> DataFrame:
        """A DataFrame of exactly ``tasks``' rows, in the table's current schema."""
        java_tasks = self.jvm.java.util.ArrayList()
        for task in tasks:
            java_tasks.add(task)
        self.tasks.stageTasks(self.table, group_id, java_tasks)
        return (
            self.spark.read.format("iceberg")
            .option("scan-task-set-id", group_id)
            .option("split-size", str(SPLIT_SIZE_BYTES))
            .option("file-open-cost", "0")
            .load(self.name)
        )

    def tasks_for_new_files(self, files: Sequence[Any]) -> list[Any]:
        """Scan tasks over files not (yet) in the table, read with the current schema."""
        schema_json = self.jvm.org.apache.iceberg.SchemaParser.toJson(self.table.schema())
        specs = self.table.specs()
        residuals = self.jvm.org.apache.iceberg.expressions.ResidualEvaluator.unpartitioned(
            self.jvm.org.apache.iceberg.expressions.Expressions.alwaysTrue()
        )
        gateway: Any = getattr(self.spark.sparkContext, "_gateway")  # noqa: B009
        no_deletes = gateway.new_array(self.jvm.org.apache.iceberg.DeleteFile, 0)
        out = []
        for f in files:
            spec_json = self.jvm.org.apache.iceberg.PartitionSpecParser.toJson(specs.get(f.specId()))
            out.append(self.jvm.org.apache.iceberg.BaseFileScanTask(f, no_deletes, schema_json, spec_json, residuals))
        return out

    def release(self, group_id: str) -> None:
        self.tasks.removeTasks(self.table, group_id)
        self.coordinator.clearRewrite(self.table, group_id)

    def written_files(self, group_id: str) -> list[Any]:
        return list(self.coordinator.fetchNewFiles(self.table, group_id))

    def delete_files(self, files: Iterable[Any]) -> None:
        io = self.table.io()
        for f in files:
            try:
                io.deleteFile(f.location())
            except Exception:  # best effort: an orphan is removed by remove_orphan_files later
                log.warning("%s: could not delete uncommitted file %s", self.name, f.location())

    def commit_rewrite(
        self, old: Sequence[Any], new: Sequence[Any], *, from_snapshot: int, summary: Mapping[str, str]
    ) -> None:
        """One ``RewriteFiles`` commit (a ``replace`` snapshot): ``old`` out, ``new`` in."""
        old_set, new_set = self.jvm.java.util.HashSet(), self.jvm.java.util.HashSet()
        for f in old:
            old_set.add(f)
        for f in new:
            new_set.add(f)
        update = self.table.newRewrite().validateFromSnapshot(from_snapshot).rewriteFiles(old_set, new_set)
        for key, value in summary.items():
            update = update.set(key, value)
        update.commit()

    def snapshot_with(self, key: str, value: str) -> int | None:
        """The newest snapshot whose summary has ``key = value``."""
        self.refresh()
        snapshot = self.table.currentSnapshot()
        while snapshot is not None:
            if str(snapshot.summary().get(key)) == value:
                return int(snapshot.snapshotId())
            parent = snapshot.parentId()
            snapshot = self.table.snapshot(parent) if parent is not None else None
        return None


def _q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


@dataclass(frozen=True, slots=True)
class _Shape:
    """The column roles of the staged table, for one spec.

    Attributes:
        columns: the current schema's top-level columns, in order.
        spec: the staged spec.
        retired: target column → its retired column.
    """

    columns: tuple[str, ...]
    spec: RewriteSpec
    retired: Mapping[str, str]

    @property
    def rewritten(self) -> tuple[str, ...]:
        """Columns a rewrite may change: the targets and ``_rewrite_version``."""
        touched = {c.name for c in self.spec.columns} | {REWRITE_VERSION_COLUMN}
        return tuple(c for c in self.columns if c in touched)

    @property
    def untouched(self) -> tuple[str, ...]:
        """Every other column, the retired ones included (their values are kept)."""
        touched = set(self.rewritten)
        return tuple(c for c in self.columns if c not in touched)

    def pre_rewrite_view(self, df: DataFrame, *, extra: Sequence[str] = ()) -> DataFrame:
        """``df`` (current schema) with the columns named as before staging: a retired column
        under its old name, the target that replaced it under a private name; the ``extra``
        columns (e.g. ``_file``) pass through first."""
        from pyspark.sql import functions as F

        back = {new: old for old, new in self.retired.items()}
        cols = [F.col(_q(c)) for c in extra]
        for c in self.columns:
            if c in back:
                cols.append(F.col(_q(c)).alias(back[c]))
            elif c in self.retired:
                cols.append(F.col(_q(c)).alias(_CURRENT + c))
            else:
                cols.append(F.col(_q(c)))
        return df.select(*cols)

    def _targets(self) -> list[tuple[str, Column, Column]]:
        """``(name, current value, converted value)`` per target, over :meth:`pre_rewrite_view`."""
        from pyspark.sql import functions as F

        out = []
        for target in self.spec.columns:
            current = F.col(_q(_CURRENT + target.name)) if target.name in self.retired else F.col(_q(target.name))
            value = F.expr(f"CAST(({target.expr}) AS {spark_sql_type(target.type)})")
            out.append((target.name, current, value))
        return out

    def eligible(self) -> Column:
        """Over :meth:`pre_rewrite_view`: ``where`` holds (null counts as false)."""
        from pyspark.sql import functions as F

        return F.coalesce(F.expr(self.spec.where), F.lit(False))

    def work_condition(self) -> Column:
        """Over :meth:`pre_rewrite_view`: the row is eligible and a target column is null
        where its expression gives a value, or where (a type change) its old value is set. The
        latter keeps a conversion that loses values (a ``CAST`` that overflows to null) from
        passing for done: the rewrite then fails its check instead, and the old column is never
        dropped."""
        from functools import reduce

        from pyspark.sql import functions as F

        fillable = []
        for name, current, value in self._targets():
            has_value = value.isNotNull()
            if name in self.retired:
                has_value = has_value | F.col(_q(name)).isNotNull()  # the pre-rewrite column
            fillable.append(current.isNull() & has_value)
        if not fillable:  # a partition-spec-only rewrite converts no values
            return F.lit(False)
        return self.eligible() & reduce(lambda a, b: a | b, fillable)

    def project(self, df: DataFrame, *, work_flag: str | None = None) -> DataFrame:
        """The rows of ``df`` (current schema) in the target shape: in eligible rows each
        target column that is null gets its expression's value (a value already there, e.g.
        written by tiering in the new shape, is kept); every row gets ``_rewrite_version`` =
        the version (unless already higher); every other column is kept as it is. With
        ``work_flag``, a last boolean column of that name tells the rows that changed
        (:meth:`work_condition`)."""
        from pyspark.sql import functions as F

        pre = self.pre_rewrite_view(df).withColumn(_CONVERT, self.eligible())
        eligible = F.col(_CONVERT)
        back = {new: old for old, new in self.retired.items()}
        targets = {name: (current, value) for name, current, value in self._targets()}
        out = []
        for c in self.columns:
            if c in targets:
                current, value = targets[c]
                out.append(F.when(eligible, F.coalesce(current, value)).otherwise(current).alias(c))
            elif c == REWRITE_VERSION_COLUMN:
                marker = F.col(_q(c))
                settled = marker.isNotNull() & (marker >= F.lit(self.spec.version))
                out.append(F.when(settled, marker).otherwise(F.lit(self.spec.version)).cast("int").alias(c))
            elif c in back:
                out.append(F.col(_q(back[c])).alias(c))
            else:
                out.append(F.col(_q(c)))
        if work_flag is not None:
            out.append(self.work_condition().alias(work_flag))
        return pre.select(*out)


def _shape(table: Table, spec: RewriteSpec, state: RewriteState) -> _Shape:
    return _Shape(tuple(f.name for f in table.schema().fields), spec, dict(state.retired))


def _validate_expressions(spark: SparkSession, name: str, shape: _Shape) -> None:
    """Analyze the spec's expressions against the table (no rows read).

    Raises:
        RewriteSpecError: an expression or ``where`` does not analyze (unknown column, bad
            syntax, a type Spark cannot cast).
    """
    from pyspark.errors import AnalysisException, ParseException

    try:
        shape.project(spark.table(name).limit(0)).schema  # noqa: B018 - analysis only
    except (AnalysisException, ParseException) as e:
        raise RewriteSpecError(name, f"expressions do not analyze against the table: {e}") from e


def _validate_before_staging(spark: SparkSession, name: str, spec: RewriteSpec) -> None:
    """Analyze ``where`` and every expression against the table as it is before staging (the
    names they are written against), reading no rows.

    Raises:
        RewriteSpecError: one does not analyze (unknown column, bad syntax, a cast Spark
            refuses).
    """
    from pyspark.errors import AnalysisException, ParseException
    from pyspark.sql import functions as F

    df = spark.table(name).limit(0)
    for what, text in [("where", spec.where)] + [
        (f"columns.{c.name}.expr", f"CAST(({c.expr}) AS {spark_sql_type(c.type)})") for c in spec.columns
    ]:
        try:
            df.select(F.expr(text)).schema  # noqa: B018 - analysis only
        except (AnalysisException, ParseException) as e:
            raise RewriteSpecError(name, f"{what}: {text!r} does not analyze against the table: {e}") from e


def _files_needing_work(
    java: _JavaTable,
    shape: _Shape,
    planned: Mapping[str, tuple[DataFileStats, Any]],
    paths: Iterable[str],
    current_spec_id: int,
) -> set[str]:
    """The files among ``paths`` that sit in an older partition spec or hold a row a rewrite
    would change (:meth:`_Shape.work_condition`).

    Files whose metrics show every row written by this rewrite version
    (``_rewrite_version >= version``, no nulls) are settled without reading; the others are
    read once (only the columns the condition needs) and counted per ``_file``.
    """
    needing: set[str] = set()
    to_read: list[str] = []
    for path in paths:
        stats, _ = planned[path]
        if stats.spec_id != current_spec_id:
            needing.add(path)
        elif not stats.all_converted(shape.spec.version):
            to_read.append(path)
    if not to_read:
        return needing
    group_id = f"danube-rewrite-check-{uuid.uuid4()}"
    try:
        df = java.staged_read(group_id, [planned[p][1] for p in to_read])
        pre = shape.pre_rewrite_view(df, extra=["_file"])
        rows = pre.where(shape.work_condition()).groupBy("_file").count().collect()
    finally:
        java.release(group_id)
    needing.update(str(r["_file"]) for r in rows if int(r["count"]) > 0)
    return needing


def _java_error(error: Exception) -> str | None:
    """The Java exception class name inside a Py4J error, or ``None``."""
    java_exception = getattr(error, "java_exception", None)
    if java_exception is None:
        return None
    return str(java_exception.getClass().getName())


_CONFLICTS = (
    "org.apache.iceberg.exceptions.ValidationException",
    "org.apache.iceberg.exceptions.CommitFailedException",
)


def _rewrite_unit(
    java: _JavaTable,
    shape: _Shape,
    planned: Mapping[str, tuple[DataFileStats, Any]],
    unit: RewriteUnit,
    *,
    from_snapshot: int,
    label: str,
) -> UnitResult:
    """Rewrite one unit's files, verify the new files, commit one ``replace`` snapshot.

    Four Spark jobs: the old rows' count and untouched-column checksum; the converted rows'
    rewritten-column checksum, conversion count and kept old values; the write; the new files'
    count and both checksums, read back through Iceberg.

    Raises:
        RewriteVerificationError: a check failed; nothing was committed and the new files (if
            any were written) were deleted.
        RewriteConflictError: the commit's validation failed; the new files were deleted.
    """
    from pyspark.sql import functions as F

    untouched, rewritten = shape.untouched, shape.rewritten
    group_id = f"danube-rewrite-{uuid.uuid4()}"
    old_tasks = [planned[f.path][1] for f in unit.files]
    old_files = [t.file() for t in old_tasks]
    try:
        source = java.staged_read(group_id, old_tasks)
        row = source.agg(F.count(F.lit(1)), checksum_of(row_hash(source, untouched))).collect()[0]
        before = RowChecksum(int(row[0]), int(row[1]))

        projected = shape.project(source, work_flag=_WORK)
        checks = [checksum_of(row_hash(projected, rewritten)), F.count_if(F.col(_WORK))]
        for column, old in shape.retired.items():  # old value set, new one null: a lossy CAST
            old_set = F.col(_q(old)).isNotNull()
            checks += [F.count_if(old_set), F.count_if(old_set & F.col(_q(column)).isNotNull())]
        row = projected.agg(*checks).collect()[0]
        expected, converted = int(row[0]), int(row[1])
        for i, column in enumerate(shape.retired):
            had, has = int(row[2 + 2 * i]), int(row[3 + 2 * i])
            if had != has:  # before anything is written
                raise RewriteVerificationError(label, unit.label, f"values of {column}", had, has)
        (
            projected.drop(_WORK)
            .write.format("iceberg")
            .option("rewritten-file-scan-task-set-id", group_id)
            .option("fanout-enabled", "true")
            .option("distribution-mode", "none")
            .mode("append")
            .save(java.name)
        )
        new_files = java.written_files(group_id)
    finally:
        java.release(group_id)

    check_id = group_id + "-check"
    after, after_rewritten = RowChecksum(0, 0), 0
    try:
        if new_files:
            written = java.staged_read(check_id, java.tasks_for_new_files(new_files))
            written = written.select(*[F.col(_q(c)) for c in shape.columns])
            row = written.agg(
                F.count(F.lit(1)), checksum_of(row_hash(written, untouched)), checksum_of(row_hash(written, rewritten))
            ).collect()[0]
            after, after_rewritten = RowChecksum(int(row[0]), int(row[1])), int(row[2])
    finally:
        java.release(check_id)
    metadata_rows = sum(int(f.recordCount()) for f in new_files)
    mismatches = [
        ("rows", before.rows, after.rows),
        ("rows in the new files' metadata", before.rows, metadata_rows),
        ("untouched checksum", before.checksum, after.checksum),
        ("rewritten checksum", expected, after_rewritten),
    ]
    for what, was, now in mismatches:
        if was != now:
            java.delete_files(new_files)
            raise RewriteVerificationError(label, unit.label, what, was, now)

    summary = {
        SUMMARY_REWRITE_VERSION: str(shape.spec.version),
        SUMMARY_REWRITE_PARTITION: unit.label,
        SUMMARY_REWRITE_GROUP: group_id,
    }
    try:
        java.commit_rewrite(old_files, new_files, from_snapshot=from_snapshot, summary=summary)
    except Exception as e:
        if _java_error(e) in _CONFLICTS:
            java.delete_files(new_files)
            raise RewriteConflictError(label, unit.label, str(getattr(e, "java_exception", e))) from e
        raise  # the commit's outcome may be unknown (CommitStateUnknownException): keep the files
    snapshot_id = java.snapshot_with(SUMMARY_REWRITE_GROUP, group_id)
    log.info(
        "%s %s: %d files (%d rows, %d converted) rewritten into %d in snapshot %s",
        label, unit.label, len(old_files), before.rows, converted, len(new_files), snapshot_id,
    )
    return UnitResult(
        partition=unit.label,
        status="rewritten",
        files_before=len(old_files),
        files_after=len(new_files),
        rows=before.rows,
        rows_converted=converted,
        checksum_before=before.checksum,
        checksum_after=after.checksum,
        snapshot_id=snapshot_id,
    )


def rewrite_table(
    spark: SparkSession,
    catalog: Catalog,
    topic: TopicName,
    *,
    catalog_name: str | None = None,
    day: dt.date | None = None,
    after_unit: Callable[[UnitResult], None] | None = None,
) -> RewriteReport:
    """Apply the rewrite declared on the topic's table, for one UTC day or the whole table.

    Stages the spec if needed (:func:`stage_rewrite`), rewrites each partition with files
    touching ``day`` that still needs it in one ``replace`` snapshot, verified (module
    docstring), then finalizes (:func:`finalize_rewrite`) when nothing in the whole table needs
    work any more. Re-running is a no-op: done partitions are skipped and commit nothing.

    Args:
        spark: a session from :func:`danube_pipeline.lake.spark.build_spark_session` on the
            table's catalog.
        catalog: the pyiceberg catalog (same catalog database).
        topic: the topic whose table it is.
        catalog_name: the Spark catalog name; default ``settings.catalog_name()``.
        day: only files whose ``_publish_time`` bounds touch this UTC day (a day-partitioned
            table: that day's partition); ``None`` for every file.
        after_unit: called after each partition's commit (or skip) with its result, before
            the next partition; an exception it raises stops the run there (what a crash
            would do).

    Returns:
        A :class:`RewriteReport`; ``version`` is ``None`` when no rewrite is declared.

    Raises:
        NoSuchTableError: the table does not exist.
        RewriteSpecError: the declared spec is invalid or its expressions do not analyze.
        RewriteStateError: the spec conflicts with the staged rewrite.
        RewriteVerificationError: a partition's new files differ; earlier partitions stay
            committed, this one is not.
        RewriteConflictError: a partition changed during its rewrite; run again.
    """
    ident = (topic.namespace, topic.topic)
    label = ".".join(ident)
    table = catalog.load_table(ident)
    spec = read_rewrite_spec(table)
    if spec is None:
        return RewriteReport(label, None, day)
    state = read_rewrite_state(table)
    _check_against_state(table, spec, state)
    if state is not None and state.version == spec.version and state.finalized:
        return RewriteReport(label, spec.version, day, already_finalized=True, retired=dict(state.retired))
    name = spark_table_name(topic, catalog_name)
    staged = False
    if state is None or state.version != spec.version:
        _validate_before_staging(spark, name, spec)
        state = stage_rewrite(table, spec)
        staged = True
    shape = _shape(table, spec, state)
    _validate_expressions(spark, name, shape)

    java = _JavaTable(spark, name)
    snapshot_before = java.current_snapshot_id()
    results: list[UnitResult] = []
    files_before = 0
    if snapshot_before is not None:
        planned = java.plan(snapshot_before)
        files_before = len(planned)
        current_spec = java.current_spec_id()
        for unit in rewrite_units((stats for stats, _ in planned.values()), day=day):
            needing = _files_needing_work(java, shape, planned, [f.path for f in unit.files], current_spec)
            if not needing:
                result = UnitResult(unit.label, "skipped", len(unit.files), len(unit.files), unit.rows)
            else:
                work = RewriteUnit(unit.spec_id, unit.partition, tuple(f for f in unit.files if f.path in needing))
                result = _rewrite_unit(java, shape, planned, work, from_snapshot=snapshot_before, label=label)
            results.append(result)
            if after_unit is not None:
                after_unit(result)

    java.refresh()
    snapshot_after = java.current_snapshot_id()
    remaining: set[str] = set()
    files_after = 0
    if snapshot_after is not None:
        planned_after = java.plan(snapshot_after)
        files_after = len(planned_after)
        remaining = _files_needing_work(java, shape, planned_after, list(planned_after), java.current_spec_id())
    finalized = False
    if not remaining:
        table.refresh()
        finalize_rewrite(table, spec)
        finalized = True
    return RewriteReport(
        table=label,
        version=spec.version,
        day=day,
        staged=staged,
        finalized=finalized,
        retired=dict(state.retired),
        units=tuple(results),
        snapshot_before=snapshot_before,
        snapshot_after=snapshot_after,
        table_data_files_before=files_before,
        table_data_files_after=files_after,
        remaining_files=len(remaining),
    )
