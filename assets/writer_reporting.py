"""The continuous writer's commits as runless materializations in a Dagster instance, with
the same metadata as the assets' runs (:mod:`assets.metadata`), so the UI shows every commit."""

from __future__ import annotations

import datetime as dt
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from dagster import AssetKey, AssetMaterialization, DagsterInstance

from assets.metadata import iceberg_table_metadata, segment_objects_metadata
from assets.partitions import DAYS_PARTITIONS_NAME, TOPICS_PARTITIONS_NAME, days_from
from danube_pipeline.lake.tiering import TableReport
from danube_pipeline.storage.objectstore import ObjectStore

if TYPE_CHECKING:
    from assets.continuous_writer import TopicPass

__all__ = ["ICEBERG_TABLE_KEY", "SEGMENT_OBJECTS_KEY", "WRITER_TAG", "DagsterReporter"]

log = logging.getLogger("assets.continuous_writer")  # the writer's lines keep one logger name

SEGMENT_OBJECTS_KEY = AssetKey("segment_objects")
"""The asset key of ``assets.assets.segment_objects``."""
ICEBERG_TABLE_KEY = AssetKey("iceberg_table")
"""The asset key of ``assets.assets.iceberg_table``."""
WRITER_TAG = "danube/writer"
"""Tag of every materialization the writer reports (value ``continuous``); runs of the
``tiering_job`` do not carry it."""


class DagsterReporter:
    """Records the writer's commits as runless materializations in a Dagster instance.

    Each report adds the topic's ``topics`` partition first when it is missing (as
    ``topic_partitions_sensor`` would a little later), so the event lands on a partition the
    UI lists, and the ``days`` partitions from its oldest record's publish day through today,
    so the maintenance jobs can be run on the days that hold the commit's rows. A failure to report is logged and dropped: the data is committed either way, and
    the next materialization carries the table's totals.

    The writer hands its passes to :meth:`submit`, which reports them in order on one
    background thread: a report is a write to the instance's event storage (SQLite under
    ``make dev``, tens of milliseconds on a busy machine) and must not hold up the next
    seal and commit. :meth:`close` waits for the reports submitted.
    """

    def __init__(self, instance: DagsterInstance, *, catalog_name: str, objects: ObjectStore) -> None:
        """Args:
        instance: the Dagster instance (``DagsterInstance.get()`` reads ``DAGSTER_HOME``).
        catalog_name: the Iceberg catalog's name, shown in the ``table`` entry.
        objects: the object store, shown in the ``object_store`` entry.
        """
        self.instance = instance
        self.catalog_name = catalog_name
        self.objects = objects
        self._partitions: set[str] = set()
        self._days: set[str] = set()
        self._thread: ThreadPoolExecutor | None = None

    def prepare(self) -> None:
        """Open the instance's event storage now (creating its tables on a fresh instance), so
        that a Dagster webserver and daemon started afterwards find it initialised."""
        self._partitions = set(self.instance.get_dynamic_partitions(TOPICS_PARTITIONS_NAME))
        self._days = set(self.instance.get_dynamic_partitions(DAYS_PARTITIONS_NAME))

    def submit(self, result: TopicPass) -> Future[list[AssetMaterialization]]:
        """Report ``result`` (as :meth:`report`) on the reporting thread, after the passes
        submitted before it.

        Returns:
            The future of :meth:`report`'s list (it never raises: failures are logged).

        Raises:
            RuntimeError: after :meth:`close`.
        """
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dagster-report")
        return self._thread.submit(self.report, result)

    def close(self) -> None:
        """Wait for every submitted report to be recorded, then stop the reporting thread."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    def report(self, result: TopicPass) -> list[AssetMaterialization]:
        """Report the steps of ``result`` that changed something.

        Args:
            result: one topic's pass.

        Returns:
            The materializations recorded: ``segment_objects`` when objects were written,
            ``iceberg_table`` when snapshots were committed, dead letters written or the
            table's schema or layout changed.
        """
        events: list[AssetMaterialization] = []
        key = result.topic.partition_key
        tags = {WRITER_TAG: "continuous"}
        if result.tiering is not None and result.tiering.objects_written:
            events.append(
                AssetMaterialization(
                    asset_key=SEGMENT_OBJECTS_KEY,
                    partition=key,
                    description="Sealed segments tiered by the continuous writer.",
                    metadata=segment_objects_metadata(result.tiering, self.objects, result.topic),
                    tags=tags,
                )
            )
        table = result.table
        if table is not None and (
            table.objects_appended or table.dead_letter_records or table.schema_changes or table.layout_changes
        ):
            events.append(
                AssetMaterialization(
                    asset_key=ICEBERG_TABLE_KEY,
                    partition=key,
                    description="Segment objects committed by the continuous writer.",
                    metadata=iceberg_table_metadata(table, self.catalog_name),
                    tags=tags,
                )
            )
        if not events:
            return []
        try:
            if key not in self._partitions:
                self.instance.add_dynamic_partitions(TOPICS_PARTITIONS_NAME, [key])
                self._partitions.add(key)
            days = _days_of(table)
            if days - self._days:
                self.instance.add_dynamic_partitions(DAYS_PARTITIONS_NAME, sorted(days - self._days))
                self._days |= days
            for event in events:
                self.instance.report_runless_asset_event(event)
        except Exception:
            log.exception("%s: could not record %d materializations in Dagster", result.topic.path, len(events))
            return []
        return events


def _days_of(table: TableReport | None) -> set[str]:
    """The ``days`` partition keys of a commit: the UTC days from its oldest record's publish
    time through today (none when it appended nothing)."""
    if table is None or table.oldest_publish_time_us is None:
        return set()
    first = dt.datetime.fromtimestamp(table.oldest_publish_time_us / 1_000_000, dt.UTC).date()
    return set(days_from(first, dt.datetime.now(dt.UTC).date()))
