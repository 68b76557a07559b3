"""What a topic's Iceberg table records about the offsets it holds: the table property
``danube.committed-end-offset`` and the ``danube.*`` fields of its append snapshots' summaries.

Defined here, under ``storage/`` (shared by the ``[broker]`` and ``[pipeline]`` extras), because
the commit path writes them (``danube_pipeline.lake.iceberg.append``, which re-exports these
names) and the table reader reads them (:mod:`.table_reader`, which the broker may import).

Every append of the commit path is one commit that adds a snapshot and sets the table property
to the last offset the table (with its dead-letter table) now holds. Table properties live in
the table metadata itself (Iceberg spec, "Table Metadata", ``properties``), so they survive
what maintenance does to snapshots: Spark's ``rewrite_data_files`` (a ``replace`` snapshot
without our summary), row-level ``DELETE`` and ``expire_snapshots``. The append's snapshot
summary (Iceberg spec, "Snapshots", ``summary``) carries ``danube.end-offset`` too, and
``danube.partition`` for partition ``i`` of a partitioned topic (``docs/etcd-layout.md`` §3.1),
whose appends set ``danube.committed-end-offset.part-{i}`` instead.
"""

from __future__ import annotations

from pyiceberg.table import Table
from pyiceberg.table.snapshots import ancestors_of

__all__ = [
    "COMMITTED_END_OFFSET_PROPERTY",
    "SUMMARY_END_OFFSET",
    "SUMMARY_PARTITION",
    "committed_end_offset",
    "committed_end_offset_property",
]

SUMMARY_END_OFFSET = "danube.end-offset"
"""Summary field of an append: the last offset of the appended range (decimal, inclusive)."""
SUMMARY_PARTITION = "danube.partition"
"""Summary field of an append for partition ``i`` of a partitioned topic: ``i`` (decimal)."""

COMMITTED_END_OFFSET_PROPERTY = "danube.committed-end-offset"
"""Table property: the last offset appended to the table (decimal string, inclusive).

Written in the same commit as every append; never lowered. It is a high-water mark, not a row
count: retention may delete the rows below it (the rows stay deleted, and the offsets are
never appended again)."""


def committed_end_offset_property(partition: int | None = None) -> str:
    """The table property holding the committed end offset: ``danube.committed-end-offset``
    for a plain topic's table, ``danube.committed-end-offset.part-{i}`` for partition ``i`` of
    a partitioned topic's (module docstring)."""
    if partition is None:
        return COMMITTED_END_OFFSET_PROPERTY
    return f"{COMMITTED_END_OFFSET_PROPERTY}.part-{partition}"


def committed_end_offset(table: Table, *, partition: int | None = None) -> int | None:
    """The last offset committed to ``table`` by the commit path (for partition ``partition``
    of a partitioned topic's table, when given).

    Reads the table property ``danube.committed-end-offset`` (``...-offset.part-{i}`` for a
    partition), which every append sets in its own commit and which compaction, row deletes
    and snapshot expiry leave alone. A table written before that property existed has none;
    then the current snapshot's ancestry is walked, newest first, to the first snapshot whose
    summary carries ``danube.end-offset`` (compaction snapshots written by Spark do not) and
    the same ``danube.partition`` (none, without ``partition``).

    Args:
        table: a topic's table, as loaded (call ``table.refresh()`` for the catalog's latest).
        partition: the partition index, for a partitioned topic's table; ``None`` for a plain
            topic's.

    Returns:
        The inclusive end offset, or ``None`` if nothing was appended yet (or, for a table
        without the property, if no snapshot carrying the summary is left).

    Raises:
        ValueError: the property is set but is not an integer.
    """
    value = table.metadata.properties.get(committed_end_offset_property(partition))
    if value is not None:
        return int(value)
    return _summary_end_offset(table, partition)


def _summary_end_offset(table: Table, partition: int | None) -> int | None:
    """``danube.end-offset`` of the newest ancestor snapshot whose summary has it, for the
    same partition."""
    wanted = None if partition is None else str(partition)
    for snapshot in ancestors_of(table.current_snapshot(), table.metadata):
        summary = snapshot.summary
        if summary is None or summary[SUMMARY_PARTITION] != wanted:
            continue
        value = summary[SUMMARY_END_OFFSET]
        if value is not None:
            return int(value)
    return None
