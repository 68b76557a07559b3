"""Staging and finalizing a rewrite, each one pyiceberg metadata commit (no snapshot): the
table's schema and partition spec evolved to the spec's target shape, the columns retired
and dropped at the end, and :class:`RewriteState` kept in ``danube.rewrite-state``."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pyiceberg.exceptions import CommitFailedException
from pyiceberg.types import DecimalType, DoubleType, FloatType, IcebergType, IntegerType, LongType

from danube_pipeline.lake.rewrite.errors import RewriteSpecError, RewriteStateError
from danube_pipeline.lake.rewrite.properties import REWRITE_STATE_PROPERTY, REWRITE_VERSION_COLUMN
from danube_pipeline.lake.rewrite.spec import ColumnRewrite, PartitionField, RewriteSpec, table_label

if TYPE_CHECKING:
    from pyiceberg.table import Table

__all__ = [
    "RETIRED_SUFFIX",
    "RewriteState",
    "check_against_state",
    "finalize_rewrite",
    "read_rewrite_state",
    "retired_name",
    "stage_rewrite",
]

log = logging.getLogger(__name__)

RETIRED_SUFFIX = "__pre_v"

_PROMOTIONS: dict[type[IcebergType], type[IcebergType]] = {IntegerType: LongType, FloatType: DoubleType}


def _can_promote(source: IcebergType, target: IcebergType) -> bool:
    """Iceberg spec, "Schema Evolution": int→long, float→double, decimal(P, S)→decimal(P', S)
    with P' > P (same scale) are the promotions that keep old files readable."""
    if isinstance(source, DecimalType) and isinstance(target, DecimalType):
        return source.scale == target.scale and target.precision > source.precision
    return _PROMOTIONS.get(type(source)) is type(target)


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
        ValueError: the property holds something staging did not write.
    """
    text = table.properties.get(REWRITE_STATE_PROPERTY)
    return RewriteState.from_json(text) if text else None


def retired_name(column: str, version: int) -> str:
    """The name a column whose type cannot be promoted takes at staging: ``{column}__pre_v{version}``."""
    return f"{column}{RETIRED_SUFFIX}{version}"


def check_against_state(table: Table, spec: RewriteSpec, state: RewriteState | None) -> None:
    """Check the declared ``spec`` against the staged ``state`` (nothing staged: no conflict).

    Raises:
        RewriteStateError: the spec is older than the staged one, the staged version's spec
            was edited, or a newer spec comes before the staged version is finalized.
    """
    if state is None:
        return
    label = table_label(table)
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

    See :mod:`danube_pipeline.lake.rewrite`, step 1, for what changes. New columns are optional; a column
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
    label = table_label(table)
    for attempt in range(1, max_attempts + 1):
        state = read_rewrite_state(table)
        check_against_state(table, spec, state)
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
    label = table_label(table)
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
