"""Planning a rewrite: the live data files with the metrics that decide their work
(:class:`DataFileStats`), grouped into one :class:`RewriteUnit` per partition and spec, for
one UTC day or the whole table."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "DataFileStats",
    "RewriteUnit",
    "day_bounds_us",
    "rewrite_units",
]

_US_PER_DAY = 86_400_000_000


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
