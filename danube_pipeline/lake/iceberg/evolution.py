"""Evolving a topic's table in place as new schema versions arrive (Iceberg spec, "Schema
Evolution").

Tiering compares the table's schema with each writer schema of the records it appends
(:class:`~danube_pipeline.lake.iceberg.writer.WriterSchema`) and changes the table with pyiceberg's
``update_schema()``, keeping every Iceberg field id (so files already written read the same):

=====================================  ======================================================
the writer schema ...                  the table
=====================================  ======================================================
adds a field                           gains an optional column (``add_column``). Iceberg v2
                                       cannot add a required column, so it is optional even
                                       when the field is not; rows written before, and rows of
                                       any version without the field, read ``null`` (not the
                                       Avro ``default``: ``null`` means "the writer did not
                                       have this field")
lacks a column the table has           makes it optional (``make_column_optional``); rows
(a field removed)                      keep their values, rows of versions without the field
                                       are ``null``
``int`` where the table has ``long``   nothing: the values fit (and likewise ``float`` in
(an older writer)                      ``double``, a narrower ``decimal``)
``long`` where the table has ``int``   promotes the column (``update_column``): ``int`` to
                                       ``long``, ``float`` to ``double``, ``decimal(P, S)`` to
                                       ``decimal(P', S)``, ``P' > P``
makes a required field optional        makes the column optional
renames a field (Avro ``aliases``,     renames the column (``rename_column``, same field id)
Protobuf field number)
=====================================  ======================================================

Anything else is not an in-place change: a type change such as ``int`` to ``string`` or
``long`` to ``decimal``, a struct that becomes a primitive. :func:`incompatible_changes` lists
them; the ``schema_rewrite`` asset rewrites the table's data files for them. Until it has, the
records of that writer version go to the dead-letter table with the error
``needs schema_rewrite: ...`` (:mod:`.dead_letter`), so tiering never stops on them.

Once a rewrite has widened a column beyond Iceberg's promotions, older writers' values are
converted when written (:func:`value_converter`): ``int``/``long`` to ``decimal`` (a value
that does not fit the precision is dead-lettered) and ``int``/``long``/``decimal``/``boolean``
to ``string`` (decimal text; ``true``/``false``).

The table remembers which registered version its columns follow, in the table properties
``danube.schema-id``, ``danube.schema-version`` and ``danube.schema-subject``, set in the same
commit as each evolution; renames are found between that version and a newer one.
"""

from __future__ import annotations

import dataclasses
import decimal
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyiceberg.exceptions import CommitFailedException, ValidationError
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.table.update.schema import UpdateSchema
from pyiceberg.types import (
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
)

from danube_pipeline.errors import SchemaEvolutionError
from danube_pipeline.lake.iceberg.schema import RESERVED_COLUMNS

__all__ = [
    "SCHEMA_ID_PROPERTY",
    "SCHEMA_SUBJECT_PROPERTY",
    "SCHEMA_VERSION_PROPERTY",
    "EvolutionPlan",
    "SchemaChange",
    "add_optional_columns",
    "evolve_table",
    "incompatible_changes",
    "is_identity",
    "is_promotion",
    "plan_evolution",
    "same_type",
    "value_converter",
]

log = logging.getLogger(__name__)

SCHEMA_ID_PROPERTY = "danube.schema-id"
"""Table property: the registry schema id whose version the payload columns follow."""
SCHEMA_VERSION_PROPERTY = "danube.schema-version"
"""Table property: that version (decimal)."""
SCHEMA_SUBJECT_PROPERTY = "danube.schema-subject"
"""Table property: that schema's subject."""

DEFAULT_EVOLVE_ATTEMPTS = 5

Converter = Callable[[Any], Any]


def _identity(value: Any) -> Any:
    return value


# --------------------------------------------------------------------------- types


def same_type(a: IcebergType, b: IcebergType) -> bool:
    """Whether two types are the same, ignoring field ids and docs (nested fields by name,
    order and requiredness)."""
    if isinstance(a, StructType) and isinstance(b, StructType):
        return len(a.fields) == len(b.fields) and all(
            x.name == y.name and x.required == y.required and same_type(x.field_type, y.field_type)
            for x, y in zip(a.fields, b.fields, strict=True)
        )
    if isinstance(a, ListType) and isinstance(b, ListType):
        return a.element_required == b.element_required and same_type(a.element_type, b.element_type)
    if isinstance(a, MapType) and isinstance(b, MapType):
        return (
            a.value_required == b.value_required
            and same_type(a.key_type, b.key_type)
            and same_type(a.value_type, b.value_type)
        )
    if a.is_primitive and b.is_primitive:
        return a == b
    return False


def is_promotion(old: IcebergType, new: IcebergType) -> bool:
    """Whether a column of type ``old`` may become ``new`` in place (Iceberg spec, "Schema
    Evolution", v1/v2 type promotions): ``int`` to ``long``, ``float`` to ``double``,
    ``decimal(P, S)`` to ``decimal(P', S)`` with ``P' > P``.

    Args:
        old: the column's type.
        new: the wanted type.

    Returns:
        ``True`` for those three promotions only (not for equal types).
    """
    if isinstance(old, IntegerType) and isinstance(new, LongType):
        return True
    if isinstance(old, FloatType) and isinstance(new, DoubleType):
        return True
    return (
        isinstance(old, DecimalType)
        and isinstance(new, DecimalType)
        and new.scale == old.scale
        and new.precision > old.precision
    )


def _to_string(value: Any) -> Any:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _to_decimal(value: Any) -> Any:
    return decimal.Decimal(value)


def value_converter(source: IcebergType, target: IcebergType) -> Converter | None:
    """How a value of ``source`` type (a writer's field) is written to a column of ``target``
    type, or ``None`` when it cannot be.

    Identity for equal types and for Iceberg's promotions in that direction (``int`` into
    ``long``...); ``int``/``long`` into ``decimal``; ``int``/``long``/``decimal``/``boolean``
    into ``string``. Structs match fields by name (a field the target lacks is dropped), lists
    and maps convert their elements.

    Args:
        source: the writer's type.
        target: the column's type.

    Returns:
        A function of one non-null value, or ``None``.
    """
    if same_type(source, target) or (source.is_primitive and is_promotion(source, target)):
        return _identity
    if source.is_primitive and target.is_primitive:
        if isinstance(target, StringType) and isinstance(source, IntegerType | LongType | DecimalType | BooleanType):
            return _to_string
        if isinstance(target, DecimalType) and isinstance(source, IntegerType | LongType):
            return _to_decimal
        return None
    if isinstance(source, StructType) and isinstance(target, StructType):
        by_name = {f.name: f for f in source.fields}
        parts: list[tuple[str, Converter]] = []
        for t in target.fields:
            s = by_name.get(t.name)
            if s is None:
                continue
            conv = value_converter(s.field_type, t.field_type)
            if conv is None:
                return None
            parts.append((t.name, conv))
        if all(c is _identity for _, c in parts):
            return _identity
        return lambda v: {n: None if v.get(n) is None else c(v.get(n)) for n, c in parts}
    if isinstance(source, ListType) and isinstance(target, ListType):
        conv = value_converter(source.element_type, target.element_type)
        if conv is None:
            return None
        if conv is _identity:
            return _identity
        element = conv
        return lambda v: [None if x is None else element(x) for x in v]
    if isinstance(source, MapType) and isinstance(target, MapType):
        key = value_converter(source.key_type, target.key_type)
        val = value_converter(source.value_type, target.value_type)
        if key is None or val is None:
            return None
        if key is _identity and val is _identity:
            return _identity
        k_conv, v_conv = key, val
        return lambda v: [(k_conv(k), None if x is None else v_conv(x)) for k, x in _items(v)]
    return None


def is_identity(converter: Converter) -> bool:
    """Whether a :func:`value_converter` result leaves values as they are."""
    return converter is _identity


def _items(value: Any) -> Any:
    return value.items() if isinstance(value, dict) else value


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True, slots=True)
class SchemaChange:
    """One in-place change of a table schema.

    Attributes:
        kind: ``"add"``, ``"rename"``, ``"promote"`` or ``"make-optional"``.
        path: the column's path in the table before the change, e.g. ``("route",)`` or
            ``("position", "lat")``; for ``"add"``, the new column's path.
        field_type: the added column's type, or the promoted type.
        new_name: the new name, for ``"rename"``.
        doc: the added column's doc.
    """

    kind: str
    path: tuple[str, ...]
    field_type: IcebergType | None = None
    new_name: str | None = None
    doc: str | None = None

    def __str__(self) -> str:
        name = ".".join(self.path)
        if self.kind == "add":
            return f"add optional column {name} {self.field_type}"
        if self.kind == "rename":
            return f"rename column {name} to {self.new_name}"
        if self.kind == "promote":
            return f"promote column {name} to {self.field_type}"
        return f"make column {name} optional"


@dataclass
class EvolutionPlan:
    """What it takes for a table to hold records of a new schema.

    Attributes:
        changes: in-place changes, in the order they are applied.
        incompatible: one line per change that cannot be made in place (needs a rewrite).
    """

    changes: list[SchemaChange] = field(default_factory=list)
    incompatible: list[str] = field(default_factory=list)


def _kind(t: IcebergType) -> str:
    if isinstance(t, StructType):
        return "struct"
    if isinstance(t, ListType):
        return "list"
    if isinstance(t, MapType):
        return "map"
    return str(t)


class _Planner:
    def __init__(self, plan: EvolutionPlan) -> None:
        self.plan = plan

    def fields(
        self, path: tuple[str, ...], have: tuple[NestedField, ...], want: tuple[NestedField, ...], *, top: bool
    ) -> None:
        by_name = {f.name: f for f in have}
        wanted = {f.name for f in want}
        for f in have:
            if top and f.name in RESERVED_COLUMNS:
                continue
            if f.name not in wanted and f.required:
                self.plan.changes.append(SchemaChange("make-optional", (*path, f.name)))
        for f in want:
            if top and f.name in RESERVED_COLUMNS:
                continue
            existing = by_name.get(f.name)
            if existing is None:
                self.plan.changes.append(SchemaChange("add", (*path, f.name), f.field_type, doc=f.doc))
                continue
            self.field((*path, f.name), existing, f)

    def field(self, path: tuple[str, ...], have: NestedField, want: NestedField) -> None:
        if have.required and not want.required:
            self.plan.changes.append(SchemaChange("make-optional", path))
        self.type(path, have.field_type, want.field_type)

    def type(self, path: tuple[str, ...], have: IcebergType, want: IcebergType) -> None:
        name = ".".join(path)
        if have.is_primitive and want.is_primitive:
            if have == want:
                return
            if is_promotion(have, want):
                self.plan.changes.append(SchemaChange("promote", path, want))
            elif value_converter(want, have) is None:
                self.plan.incompatible.append(
                    f"{name}: {have} -> {want} is not an in-place change (Iceberg promotes only "
                    "int -> long, float -> double, decimal(P,S) -> decimal(P',S))"
                )
            return
        if isinstance(have, StructType) and isinstance(want, StructType):
            self.fields(path, have.fields, want.fields, top=False)
            return
        if isinstance(have, ListType) and isinstance(want, ListType):
            self.field((*path, "element"), have.element_field, want.element_field)
            return
        if isinstance(have, MapType) and isinstance(want, MapType):
            if not same_type(have.key_type, want.key_type):
                self.plan.incompatible.append(
                    f"{name}: map key {have.key_type} -> {want.key_type} is not an in-place change"
                )
                return
            self.field((*path, "value"), have.value_field, want.value_field)
            return
        self.plan.incompatible.append(f"{name}: a {_kind(have)} cannot become a {_kind(want)} in place")


def plan_evolution(
    table_schema: Schema, new_schema: Schema, *, renames: Mapping[str, str] | None = None
) -> EvolutionPlan:
    """The in-place changes that let ``table_schema`` hold records of ``new_schema``, and those
    that cannot be made in place (module docstring for the rules).

    Columns are matched by name (nested fields too), after ``renames``; the metadata columns
    (``_offset``... ``_partition``, ``_payload``) are left out.

    Args:
        table_schema: the table's current schema.
        new_schema: the schema the records need, e.g.
            ``WriterSchema.iceberg_schema()`` of a new version.
        renames: top-level columns the new schema renamed, ``{table name: new name}``
            (:func:`~danube_pipeline.lake.iceberg.writer.renamed_columns`).

    Returns:
        The :class:`EvolutionPlan`.
    """
    plan = EvolutionPlan()
    have = list(table_schema.fields)
    names = {f.name for f in have}
    wanted = {f.name for f in new_schema.fields}
    before: dict[str, str] = {}
    for old, new in (renames or {}).items():
        if old in names and new not in names and new in wanted and old not in RESERVED_COLUMNS:
            plan.changes.append(SchemaChange("rename", (old,), new_name=new))
            have = [_renamed(f, new) if f.name == old else f for f in have]
            before[new] = old
    renamed = len(plan.changes)
    _Planner(plan).fields((), tuple(have), new_schema.fields, top=True)
    # pyiceberg finds every column of one update by its name before the update
    plan.changes[renamed:] = [
        dataclasses.replace(c, path=(before.get(c.path[0], c.path[0]), *c.path[1:])) for c in plan.changes[renamed:]
    ]
    return plan


def _renamed(f: NestedField, name: str) -> NestedField:
    return NestedField(f.field_id, name, f.field_type, required=f.required, doc=f.doc)


def incompatible_changes(
    table_schema: Schema, new_iceberg_schema: Schema, *, renames: Mapping[str, str] | None = None
) -> list[str]:
    """The changes ``new_iceberg_schema`` needs that Iceberg cannot make in place: what a
    rewrite of the table's data files (the ``schema_rewrite`` asset) has to do first.

    Args:
        table_schema: the table's current schema (``table.schema()``).
        new_iceberg_schema: the schema records of the new version need, e.g.
            ``iceberg_schema_for_avro(v2)``, ``iceberg_schema_for_json_schema(...)``,
            ``iceberg_schema_for_protobuf(...)`` (the metadata columns are ignored).
        renames: top-level columns the new version renamed, ``{table name: new name}``.

    Returns:
        One line per change, e.g. ``"flight: int -> string is not an in-place change ..."``;
        empty when the table can take the new schema in place (:func:`evolve_table`). A column
        already wider than the new type (``long`` for ``int``, ``string`` for ``int`` after a
        rewrite) is not listed: the new values fit it.
    """
    return plan_evolution(table_schema, new_iceberg_schema, renames=renames).incompatible


# --------------------------------------------------------------------------- applying


def _apply(update: UpdateSchema, change: SchemaChange) -> None:
    if change.kind == "add":
        assert change.field_type is not None
        update.add_column(change.path, change.field_type, doc=change.doc, required=False)
    elif change.kind == "rename":
        assert change.new_name is not None
        update.rename_column(change.path, change.new_name)
    elif change.kind == "promote":
        update.update_column(change.path, field_type=change.field_type)
    else:
        update.make_column_optional(change.path)


def evolve_table(
    table: Table,
    new_schema: Schema,
    *,
    renames: Mapping[str, str] | None = None,
    properties: Mapping[str, str] | None = None,
    max_attempts: int = DEFAULT_EVOLVE_ATTEMPTS,
    retry_backoff_s: float = 0.05,
) -> list[SchemaChange]:
    """Change ``table`` in place so that it holds records of ``new_schema`` (module docstring).

    The changes and ``properties`` are one commit (a pyiceberg ``Transaction``), which the
    catalog accepts only if the table's schema is still the one read
    (``AssertCurrentSchemaId``); a commit that loses is planned again after a refresh.

    Args:
        table: the topic's table; refreshed afterwards.
        new_schema: the schema the records need.
        renames: top-level renames, ``{table name: new name}``.
        properties: table properties to set in the same commit (e.g. ``danube.schema-version``);
            a commit is made for them even without a schema change, unless they are already set.
        max_attempts: commit attempts on ``CommitFailedException``.
        retry_backoff_s: sleep before the n-th retry is ``n * retry_backoff_s`` seconds.

    Returns:
        The changes made (empty when the table already fits).

    Raises:
        SchemaEvolutionError: some change cannot be made in place
            (:func:`incompatible_changes`), or pyiceberg refused one; nothing was changed.
        CommitFailedException: still conflicting after ``max_attempts`` attempts.
    """
    where = ".".join(table.name())
    for attempt in range(1, max_attempts + 1):
        plan = plan_evolution(table.schema(), new_schema, renames=renames)
        if plan.incompatible:
            raise SchemaEvolutionError(where, plan.incompatible)
        wanted_properties = {k: v for k, v in (properties or {}).items() if table.properties.get(k) != v}
        if not plan.changes and not wanted_properties:
            return []
        try:
            with table.transaction() as transaction:
                if plan.changes:
                    with transaction.update_schema() as update:
                        for change in plan.changes:
                            _apply(update, change)
                if wanted_properties:
                    transaction.set_properties(wanted_properties)
        except CommitFailedException:
            if attempt == max_attempts:
                raise
            log.warning("%s: schema change conflicted (attempt %d), retrying", where, attempt)
            time.sleep(retry_backoff_s * attempt)
            table.refresh()
            continue
        except (ValueError, ValidationError) as exc:  # pyiceberg refused a change
            raise SchemaEvolutionError(where, [f"{type(exc).__name__}: {exc}"]) from exc
        table.refresh()
        if plan.changes:
            log.info("%s: schema evolved in place: %s", where, "; ".join(str(c) for c in plan.changes))
        return plan.changes
    raise AssertionError("unreachable")  # pragma: no cover


def add_optional_columns(
    table: Table,
    columns: Sequence[tuple[str, IcebergType, str]],
    *,
    max_attempts: int = DEFAULT_EVOLVE_ATTEMPTS,
    retry_backoff_s: float = 0.05,
) -> list[SchemaChange]:
    """Add the optional top-level ``columns`` the table lacks, in one schema commit (Iceberg
    spec, "Schema Evolution": rows written before read ``null`` there). pyiceberg assigns the
    field ids, nested ones included. A commit that loses to another writer is tried again after
    a refresh (the other writer may have added them).

    Args:
        table: the table; refreshed afterwards.
        columns: ``(name, type, doc)`` of each column wanted.
        max_attempts: commit attempts on ``CommitFailedException``.
        retry_backoff_s: sleep before the n-th retry is ``n * retry_backoff_s`` seconds.

    Returns:
        An ``add`` :class:`SchemaChange` per column added, ``[]`` when the table had them all.

    Raises:
        CommitFailedException: still conflicting after ``max_attempts`` attempts.
    """
    for attempt in range(1, max_attempts + 1):
        names = {f.name for f in table.schema().fields}
        missing = [c for c in columns if c[0] not in names]
        if not missing:
            return []
        try:
            with table.update_schema() as update:
                for name, field_type, doc in missing:
                    update.add_column(name, field_type, doc=doc, required=False)
        except CommitFailedException:
            if attempt == max_attempts:
                raise
            time.sleep(retry_backoff_s * attempt)
            table.refresh()
            continue
        table.refresh()
        changes = [SchemaChange("add", (name,), field_type, doc=doc) for name, field_type, doc in missing]
        for change in changes:
            log.info("%s: %s", ".".join(table.name()), change)
        return changes
    raise AssertionError("unreachable")  # pragma: no cover
