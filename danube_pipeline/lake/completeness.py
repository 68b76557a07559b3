"""Is every offset the descriptors cover in the topic's table, per UTC day? The ``complete`` check.

A topic's offsets reach Iceberg exactly once, each as a row of its table or of its dead-letter
table ``{topic}__dlq`` (:mod:`danube_pipeline.lake.iceberg.dead_letter`). So from the table's
first offset on (retention deletes the oldest rows first, ``docs/etcd-layout.md`` §5.1), the
rows plus the dead letters equal the records the completed descriptors cover.

The same count is made for each UTC day of ``_publish_time``: the day's rows and dead letters
against the offsets the descriptors cover between the day's first and last offset. A day whose
count falls short lost rows inside it; one over it holds an offset twice. Offsets missing right
at the boundary of two days belong to neither, and show in the total.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.table import Table

from danube_pipeline.lake import iceberg
from danube_pipeline.lake.tiering import completed_descriptors
from danube_pipeline.metadata.values import ObjectDescriptor

__all__ = ["Completeness", "DayCompleteness", "table_completeness"]


@dataclass(frozen=True, slots=True)
class DayCompleteness:
    """One UTC day of a topic's rows.

    Attributes:
        day: the UTC day of ``_publish_time``.
        rows: rows of the table published that day.
        dead_letters: rows of the dead-letter table published that day.
        first_offset: the day's smallest offset (of either table).
        last_offset: the day's largest offset.
        covered: offsets the completed descriptors cover from ``first_offset`` to ``last_offset``.
    """

    day: dt.date
    rows: int
    dead_letters: int
    first_offset: int
    last_offset: int
    covered: int

    @property
    def passed(self) -> bool:
        """``rows + dead_letters == covered``."""
        return self.rows + self.dead_letters == self.covered


@dataclass(frozen=True, slots=True)
class Completeness:
    """The table against the descriptors, in total and per day.

    Attributes:
        start_offset: the first offset counted (the table's smallest, or its committed end
            offset + 1 when retention emptied it), ``None`` without any commit.
        rows: rows of the table from ``start_offset`` on.
        dead_letters: rows of the dead-letter table from ``start_offset`` on.
        covered: offsets the completed descriptors cover from ``start_offset`` on.
        days: the per-day counts, oldest first.
    """

    start_offset: int | None
    rows: int
    dead_letters: int
    covered: int
    days: list[DayCompleteness] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """The total and every day add up."""
        return self.rows + self.dead_letters == self.covered and all(d.passed for d in self.days)


def _covered(descriptors: Sequence[ObjectDescriptor], first: int, last: int) -> int:
    return sum(max(0, min(d.end_offset, last) - max(d.start_offset, first) + 1) for d in descriptors)


def _scan(table: Table, partition: int | None, start: int) -> pa.Table:
    """``_offset`` and ``_publish_time`` of the rows from ``start`` on (of one partition)."""
    row_filter = f"_offset >= {int(start)}"
    if partition is not None:
        row_filter += f" AND {iceberg.PARTITION_COLUMN} = {int(partition)}"
    return table.scan(row_filter=row_filter, selected_fields=("_offset", "_publish_time")).to_arrow()


def _by_day(rows: pa.Table) -> Iterable[tuple[dt.date, int, int, int]]:
    """``(day, rows, first offset, last offset)`` per UTC day of ``_publish_time`` (rows without
    one count in the total only)."""
    rows = rows.filter(pc.is_valid(rows.column("_publish_time")))
    if rows.num_rows == 0:
        return []
    days = pc.cast(pc.cast(rows.column("_publish_time"), pa.timestamp("us", tz="UTC")), pa.date32())
    grouped = pa.table({"day": days, "offset": rows.column("_offset")}).group_by("day").aggregate(
        [("offset", "count"), ("offset", "min"), ("offset", "max")]
    )
    return zip(
        grouped.column("day").to_pylist(),
        grouped.column("offset_count").to_pylist(),
        grouped.column("offset_min").to_pylist(),
        grouped.column("offset_max").to_pylist(),
        strict=True,
    )


def table_completeness(
    table: Table | None, descriptors: Sequence[ObjectDescriptor], *, partition: int | None = None
) -> Completeness:
    """Count the table's rows and dead letters against the descriptors (module docstring).

    Reads the ``_offset`` and ``_publish_time`` columns of both tables from the first offset on
    (16 bytes per row in memory).

    Args:
        table: the topic's table (of its incarnation), ``None`` when it has none yet.
        descriptors: the topic's object descriptors (incomplete ones are ignored).
        partition: for a partition ``{topic}-part-{i}``, ``i``: only its rows of the
            partitioned topic's table are counted.

    Returns:
        The :class:`Completeness`; without a table, everything the descriptors cover counts
        as missing.
    """
    done = completed_descriptors(descriptors)
    if table is None:
        return Completeness(None, 0, 0, sum(d.end_offset - d.start_offset + 1 for d in done))
    stats = iceberg.offset_stats(table, partition=partition)
    start = stats.first_offset
    if start is None:
        committed = iceberg.committed_end_offset(table, partition=partition)
        start = committed + 1 if committed is not None else 0
    rows = _scan(table, partition, start)
    dead_table = iceberg.dead_letter_table_of(table)
    dead = _scan(dead_table, partition, start) if dead_table is not None else pa.table(
        {"_offset": pa.array([], pa.int64()), "_publish_time": pa.array([], pa.timestamp("us", tz="UTC"))}
    )
    per_day: dict[dt.date, list[int]] = {}
    for source, tally in ((rows, 0), (dead, 1)):
        for day, count, low, high in _by_day(source):
            entry = per_day.setdefault(day, [0, 0, low, high])
            entry[tally] += count
            entry[2], entry[3] = min(entry[2], low), max(entry[3], high)
    days = [
        DayCompleteness(day, n_rows, n_dead, low, high, _covered(done, low, high))
        for day, (n_rows, n_dead, low, high) in sorted(per_day.items())
    ]
    covered = sum(max(0, d.end_offset - max(d.start_offset, start) + 1) for d in done)
    return Completeness(start, rows.num_rows, dead.num_rows, covered, days)
