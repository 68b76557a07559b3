"""The table ready for a bulk load's writer schemas: step 2 of :mod:`danube_pipeline.lake.bulk`.

On the driver, for every ``(schema_id, schema_version)`` of the load at once, the table is
created or evolved in place and each writer bound to it through the path tiering takes per
object (:mod:`danube_pipeline.lake.iceberg.binding`), so both write the same columns, rows and
dead letters. The bound writers then travel to the Spark tasks as
:class:`~danube_pipeline.lake.bulk.tasks.WriterRecipe` (their text, parsed again there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pyiceberg.catalog import Catalog
from pyiceberg.table import Table

from danube_pipeline.lake import iceberg
from danube_pipeline.lake.bulk.tasks import WriterRecipe
from danube_pipeline.lake.iceberg.rows import BoundWriter
from danube_pipeline.metadata.values import TableLayout
from danube_pipeline.names import TopicName

__all__ = ["PreparedTable", "prepare_table", "raw_errors"]


@dataclass
class PreparedTable:
    """What :func:`prepare_table` did.

    Attributes:
        table: the table afterwards, loaded again.
        created: whether it was created here.
        recipes: each writer of the load as the Spark tasks rebuild it, in
            ``(schema_id, schema_version)`` order (none for a ``_payload`` table).
        bound: the same writers bound on the driver, per ``(schema_id, schema_version)``.
        changes: the in-place schema changes made, as text.
    """

    table: Table
    created: bool
    recipes: tuple[WriterRecipe, ...]
    bound: Mapping[tuple[int, int], BoundWriter]
    changes: list[str]


def _recipe(key: tuple[int, int], w: iceberg.RegisteredWriter, bound: BoundWriter) -> WriterRecipe:
    if bound.writer is None:
        return WriterRecipe(key, bound.description, error=bound.error)
    return WriterRecipe(
        key, bound.description, None, w.schema_type, w.raw_schema, w.subject, bound.column_for
    )


def prepare_table(
    catalog: Catalog,
    table_topic: TopicName,
    table: Table | None,
    writers: Mapping[tuple[int, int], iceberg.RegisteredWriter],
    recorded: iceberg.RegisteredWriter | None,
    *,
    partitioned: bool,
    layout: TableLayout,
    where: str,
) -> PreparedTable:
    """Create or evolve the table for ``writers`` and bind each one to it: steps 1 and 3 of
    :mod:`danube_pipeline.lake.iceberg.commit`, for every writer of the load at once.

    Args:
        catalog: the shared catalog.
        table_topic: the topic whose table it is (the partitioned topic, for a partition).
        table: the table as loaded, or ``None`` when it does not exist yet.
        writers: the registry's answer per ``(schema_id, schema_version)`` of the load's
            records with a schema (:func:`~danube_pipeline.lake.schema_lookup.registered_writer`).
        recorded: the writer the table's columns follow, when it is not among ``writers``.
        partitioned: whether the table has the ``_partition`` column.
        layout: the partitioning of the table if it is created here (``docs/etcd-layout.md`` §3.9).
        where: names the load in the warning logged for a ``needs schema_rewrite`` version.

    Returns:
        A :class:`PreparedTable`.

    Raises:
        CommitFailedException: a creation or evolution commit kept conflicting.
    """
    keys = sorted(writers)
    created = False
    if table is None:
        table = iceberg.ensure_table_for_writers(
            catalog, table_topic, keys, writers, partitioned=partitioned, layout=layout
        )
        created = True
    binding = iceberg.bind_writers(
        table, keys, writers, recorded=recorded, partitioned=partitioned, where=where, raw_payload=layout.raw_payload
    )
    recipes = tuple(_recipe(key, writers[key], b) for key, b in binding.bound.items())
    changes = [str(c) for c in binding.changes]
    return PreparedTable(catalog.load_table(table.name()), created, recipes, binding.bound, changes)


def raw_errors(
    keys_by_object: Mapping[str, Sequence[tuple[int, int]]],
    order: Sequence[str],
    writers: Mapping[tuple[int, int], iceberg.RegisteredWriter],
    bound: Mapping[tuple[int, int], BoundWriter],
    recorded: iceberg.RegisteredWriter | None,
) -> dict[str, str]:
    """Each object's raw-message ``_error``, naming the schema the table followed once tiering
    had evolved it for that object (so both paths write the same dead letters).

    Args:
        keys_by_object: each object's ``(schema_id, schema_version)`` pairs with a schema.
        order: the object ids, in offset order.
        writers: the registry's answer per pair; empty for a ``_payload`` table, whose records
            keep their bytes whatever their schema (no pair then changes the schema named).
        bound: :attr:`PreparedTable.bound`.
        recorded: the writer the table followed before the load, or ``None``.

    Returns:
        ``{object_id: _error}`` (:func:`~danube_pipeline.lake.iceberg.binding.raw_message_error`).
    """
    out: dict[str, str] = {}
    for object_id in order:
        for key in sorted(keys_by_object.get(object_id, ())):
            w = writers.get(key)
            if w is None:
                continue
            ok = w.writer is not None and bound.get(key) is not None and bound[key].error is None
            if ok and iceberg.supersedes(w, recorded):
                recorded = w
        out[object_id] = iceberg.raw_message_error(recorded)
    return out
