"""What the demo (:mod:`danube_pipeline.dev.demo`) measured, and its error."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from danube_pipeline.errors import DanubeError

__all__ = ["DemoError", "DemoSummary"]


class DemoError(DanubeError):
    """A check of the demo failed (count, content, offsets, or a stage's exit status)."""

    def __init__(self, stage: str, reason: str) -> None:
        self.stage = stage
        self.reason = reason
        super().__init__(f"demo stage {stage!r} failed: {reason}")


@dataclass
class DemoSummary:
    """What the demo measured. Times in seconds, sizes in bytes.

    ``storage_before`` and ``storage_after`` map a storage tier (``WAL (local disk)``,
    ``segment objects``, ``Iceberg warehouse`` and, of it, ``  current data files``) to the
    bytes it holds before and after the ``after-commit`` object lifecycle ran
    (``docs/etcd-layout.md`` §2.1; :func:`~danube_pipeline.dev.demo_reads.storage_per_tier`).
    """

    messages_published: int = 0
    publish_started_day: dt.date | None = None
    flights_v1: int = 0
    flights_v2: int = 0
    malformed: int = 0
    payload_bytes: int = 0
    messages_consumed: int = 0
    wal_syncs: int = 0
    sealed_segments: int = 0
    objects: int = 0
    object_bytes: int = 0
    descriptors: int = 0
    snapshots: int = 0
    table_rows: int = 0
    schema_versions: int = 0
    dead_letter_rows: int = 0
    rewritten_data_files: int = 0
    data_files_before_compaction: int = 0
    data_files_after_compaction: int = 0
    wal_bytes_after_retention: int = 0
    read_from_object_storage: int = 0
    cold_read_msgs_per_s: float = 0.0
    storage_before: dict[str, int] = field(default_factory=dict)
    storage_after: dict[str, int] = field(default_factory=dict)
    objects_deleted: int = 0
    read_from_iceberg: int = 0
    iceberg_read_msgs_per_s: float = 0.0
    carrier_delays: list[tuple[str, float, int]] = field(default_factory=list)
    asset_checks: list[tuple[str, str, bool]] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=dict)

    def render(self) -> str:
        """A human-readable multi-line summary."""
        lines = [
            "",
            "Danube Pipeline demo summary",
            "----------------------------",
            f"messages published      {self.messages_published:>12,}"
            f"   ({self.flights_v1:,} flights v1, {self.flights_v2:,} flights v2, {self.malformed:,} malformed)",
            f"payload bytes           {self.payload_bytes:>12,}",
            f"messages consumed       {self.messages_consumed:>12,}",
            f"WAL fdatasyncs          {self.wal_syncs:>12,}"
            f"   ({self.messages_published / max(self.wal_syncs, 1):,.1f} messages per sync)",
            f"sealed segments         {self.sealed_segments:>12,}",
            f"objects uploaded        {self.objects:>12,}   ({self.object_bytes:,} bytes)",
            f"object descriptors      {self.descriptors:>12,}",
            f"Iceberg snapshots       {self.snapshots:>12,}",
            f"Iceberg rows            {self.table_rows:>12,}",
            f"schema versions   {self.schema_versions}",
            f"dead-letter rows   {self.dead_letter_rows:,}",
            f"rewritten data files   {self.rewritten_data_files:,}",
            f"data files before/after {self.data_files_before_compaction:>5} -> {self.data_files_after_compaction}"
            "   (Spark rewrite_data_files)",
            f"local WAL bytes after retention   {self.wal_bytes_after_retention:,}",
            f"read from object storage   {self.read_from_object_storage:,}   ({self.cold_read_msgs_per_s:,.0f} msg/s)",
            f"read from Iceberg   {self.read_from_iceberg:,}   ({self.iceberg_read_msgs_per_s:,.0f} msg/s,"
            f" after {self.objects_deleted:,} segment objects were deleted)",
            "",
            f"bytes stored per tier   {'before':>12}   {'after-commit':>12}",
            *(f"  {tier:<21} {self.storage_before.get(tier, 0):>12,}   {self.storage_after.get(tier, 0):>12,}"
              for tier in self.storage_before),
            "",
            "asset checks (the last run of segment_objects + iceberg_table, after-commit):",
            *(f"  {asset:<16} {check:<34} {'passed' if ok else 'FAILED'}" for asset, check, ok in self.asset_checks),
            "",
            "mean departure delay per carrier (Spark SQL on the Iceberg table):",
        ]
        for carrier, delay, n in self.carrier_delays:
            lines.append(f"  {carrier:<3} {delay:7.2f} min  over {n:>7,} flights")
        lines.append("")
        lines.append("stage times:")
        for stage, seconds in self.stage_seconds.items():
            lines.append(f"  {stage:<42} {seconds:8.2f} s")
        return "\n".join(lines)
