"""How a topic's table is laid out: partitioned by time, sorted by offset.

Every topic table is partitioned by a time transform of ``_publish_time`` (Iceberg spec,
"Partition Transforms": ``hour``, ``day``, ``month``, ``year``), ``day`` unless the topic's
``/topics/{ns}/{topic}/table`` key (``docs/etcd-layout.md`` §3.9) names another one or
``"none"``, and sorted by ``_offset`` ascending (Iceberg spec, "Sorting"). A table created
before either existed, or whose topic changed its transform, is evolved in place (Iceberg spec,
"Partition Evolution"): the old time field is removed from the spec and the new one added, so
data files written before keep their old spec and no data is rewritten; new files use the new
spec, and Spark's ``rewrite_data_files`` (the ``compacted_table`` asset) moves old files to it
when it compacts them.

The partition field is named ``_publish_time_{transform}`` (``_publish_time_day``), so a
reader can prune with a plain filter on ``_publish_time``.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.table import Table
from pyiceberg.table.sorting import NullOrder, SortDirection, SortField, SortOrder
from pyiceberg.transforms import (
    DayTransform,
    HourTransform,
    IdentityTransform,
    MonthTransform,
    YearTransform,
)

from danube_pipeline.metadata import keys
from danube_pipeline.metadata.values import TableLayout
from danube_pipeline.names import TopicName

if TYPE_CHECKING:
    from danube_pipeline.metadata.store import MetadataStore

__all__ = [
    "DEFAULT_LAYOUT",
    "OFFSET_COLUMN",
    "PUBLISH_TIME_COLUMN",
    "DayFiles",
    "apply_layout",
    "data_files_by_day",
    "day_bounds_ms",
    "describe_spec",
    "layout_of",
    "partition_spec",
    "read_table_layout",
    "sort_order",
]

PUBLISH_TIME_COLUMN = "_publish_time"
OFFSET_COLUMN = "_offset"
DEFAULT_LAYOUT = TableLayout()
"""``day(_publish_time)``, sorted by ``_offset``: the layout of a topic without a §3.9 key."""

_TRANSFORMS: dict[str, type[HourTransform[Any] | DayTransform[Any] | MonthTransform[Any] | YearTransform[Any]]] = {
    "hour": HourTransform,
    "day": DayTransform,
    "month": MonthTransform,
    "year": YearTransform,
}
_FIRST_PARTITION_FIELD_ID = 1000  # Iceberg spec: partition field ids start at 1000


def _field_name(transform: str) -> str:
    return f"{PUBLISH_TIME_COLUMN}_{transform}"


def partition_spec(schema: Schema, layout: TableLayout = DEFAULT_LAYOUT) -> PartitionSpec:
    """The partition spec of a new table with ``schema`` and ``layout``.

    Args:
        schema: the new table's schema; it must have ``_publish_time``.
        layout: the topic's layout (§3.9).

    Returns:
        ``day(_publish_time)`` (or the layout's transform) as ``_publish_time_day``; the
        unpartitioned spec for ``"none"``.

    Raises:
        ValueError: ``schema`` has no ``_publish_time`` column.
    """
    transform = _TRANSFORMS.get(layout.partition_transform)
    if transform is None:
        return PartitionSpec()
    source = schema.find_field(PUBLISH_TIME_COLUMN)
    return PartitionSpec(
        PartitionField(
            source_id=source.field_id,
            field_id=_FIRST_PARTITION_FIELD_ID,
            transform=transform(),
            name=_field_name(layout.partition_transform),
        )
    )


def sort_order(schema: Schema) -> SortOrder:
    """``_offset`` ascending, the sort order of every topic table.

    Raises:
        ValueError: ``schema`` has no ``_offset`` column.
    """
    source = schema.find_field(OFFSET_COLUMN)
    return SortOrder(
        SortField(
            source_id=source.field_id,
            transform=IdentityTransform(),
            direction=SortDirection.ASC,
            null_order=NullOrder.NULLS_FIRST,
        )
    )


def layout_of(table: Table) -> TableLayout:
    """The layout the table's current spec has: its time transform of ``_publish_time``.

    Returns:
        The layout; ``"none"`` when the spec has no time field on ``_publish_time``.
    """
    source = table.schema().find_field(PUBLISH_TIME_COLUMN).field_id
    for f in table.spec().fields:
        if f.source_id != source:
            continue
        for name, transform in _TRANSFORMS.items():
            if isinstance(f.transform, transform):
                return TableLayout(partition_transform=name)
    return TableLayout(partition_transform="none")


def describe_spec(table: Table) -> str:
    """The table's current partition spec as text: ``"day(_publish_time)"``, fields joined by
    ``", "``, or ``"unpartitioned"``."""
    schema = table.schema()
    fields = [f"{f.transform}({schema.find_column_name(f.source_id)})" for f in table.spec().fields]
    return ", ".join(fields) if fields else "unpartitioned"


def apply_layout(table: Table, layout: TableLayout = DEFAULT_LAYOUT) -> list[str]:
    """Evolve the table's partition spec and sort order to ``layout``, in place.

    A spec with another time field on ``_publish_time`` has it removed and the new one added in
    one commit (Iceberg spec, "Partition Evolution"); data files already written keep their spec.
    Other partition fields (added by someone else) are left alone. A table not sorted by
    ``_offset`` gets that sort order. Nothing is committed when the table is already laid out.

    Args:
        table: the topic's table; refreshed in place by the commits.
        layout: the topic's layout (§3.9).

    Returns:
        What changed, e.g. ``["partition spec: day(_publish_time)", "sort order: _offset"]``;
        empty when nothing did.

    Raises:
        CommitFailedException: a concurrent commit conflicted (the caller retries).
    """
    changes: list[str] = []
    current = layout_of(table)
    if current.partition_transform != layout.partition_transform:
        source = table.schema().find_field(PUBLISH_TIME_COLUMN).field_id
        with table.update_spec() as update:
            for f in table.spec().fields:
                if f.source_id == source and not isinstance(f.transform, IdentityTransform):
                    update.remove_field(f.name)
            transform = _TRANSFORMS.get(layout.partition_transform)
            if transform is not None:
                update.add_field(PUBLISH_TIME_COLUMN, transform(), _field_name(layout.partition_transform))
        changes.append(
            "partition spec: "
            + (
                "unpartitioned"
                if layout.partition_transform == "none"
                else f"{layout.partition_transform}({PUBLISH_TIME_COLUMN})"
            )
        )
    wanted = sort_order(table.schema())
    if [(f.source_id, str(f.transform), f.direction) for f in table.sort_order().fields] != [
        (f.source_id, str(f.transform), f.direction) for f in wanted.fields
    ]:
        with table.update_sort_order() as update_order:
            update_order.asc(OFFSET_COLUMN, IdentityTransform(), NullOrder.NULLS_FIRST)
        changes.append(f"sort order: {OFFSET_COLUMN}")
    return changes


def day_bounds_ms(day: dt.date) -> tuple[int, int]:
    """``[start, end)`` of a UTC day in ms since the Unix epoch."""
    start = dt.datetime.combine(day, dt.time(), tzinfo=dt.UTC)
    return int(start.timestamp() * 1000), int((start + dt.timedelta(days=1)).timestamp() * 1000)


@dataclass(frozen=True, slots=True)
class DayFiles:
    """The live data files holding rows published on one UTC day.

    Attributes:
        day: the UTC day of ``_publish_time``.
        data_files: files with rows of that day (a file spanning days counts for each).
        rows: rows of those files (all of each file's rows).
        bytes: their size in bytes.
        older_spec_files: those written under an older partition spec than the current one.
        min_offset: the smallest ``_offset`` lower bound among them.
    """

    day: dt.date
    data_files: int
    rows: int
    bytes: int
    older_spec_files: int
    min_offset: int | None


def data_files_by_day(table: Table) -> dict[dt.date, DayFiles]:
    """The table's live data files grouped by the UTC days of ``_publish_time`` they hold,
    from the manifests' column bounds (no data file is read).

    Args:
        table: a topic table.

    Returns:
        ``{day: DayFiles}``; files without ``_publish_time`` bounds are left out.
    """
    if table.current_snapshot() is None:
        return {}
    files = table.inspect.files().to_pylist()
    spec_id = table.spec().spec_id
    acc: dict[dt.date, list[int]] = {}
    min_offsets: dict[dt.date, int] = {}
    for f in files:
        if f.get("content", 0) != 0:  # 0: data; position/equality deletes are not data files
            continue
        metrics = f.get("readable_metrics") or {}
        bounds = metrics.get(PUBLISH_TIME_COLUMN) or {}
        low, high = bounds.get("lower_bound"), bounds.get("upper_bound")
        if low is None or high is None:
            continue
        offset_low = (metrics.get(OFFSET_COLUMN) or {}).get("lower_bound")
        day = low.astimezone(dt.UTC).date()
        last = high.astimezone(dt.UTC).date()
        while day <= last:
            entry = acc.setdefault(day, [0, 0, 0, 0])
            entry[0] += 1
            entry[1] += int(f["record_count"])
            entry[2] += int(f["file_size_in_bytes"])
            entry[3] += int(f["spec_id"] != spec_id)
            if offset_low is not None:
                min_offsets[day] = min(min_offsets.get(day, offset_low), int(offset_low))
            day += dt.timedelta(days=1)
    return {
        day: DayFiles(day, n, rows, size, older, min_offsets.get(day))
        for day, (n, rows, size, older) in sorted(acc.items())
    }


async def read_table_layout(store: MetadataStore, topic: TopicName) -> TableLayout:
    """The topic's layout from ``/topics/{ns}/{topic}/table`` (§3.9).

    Args:
        store: the metadata store.
        topic: the topic whose table it is (for a partition, the partitioned topic).

    Returns:
        The stored layout, or :data:`DEFAULT_LAYOUT` when the key is missing.

    Raises:
        ValueError: the stored value is not a valid ``TableLayout`` (it names the key).
        MetadataStoreError: etcd cannot be reached.
    """
    kv = await store.get(keys.topic_table(topic))
    if kv is None:
        return DEFAULT_LAYOUT
    try:
        return TableLayout.from_json(kv.value)
    except ValueError as exc:
        raise ValueError(f"{keys.topic_table(topic)}: {exc}") from exc
