"""Schedules, on by default: hourly compaction and hourly retention of the (topic, day)
partitions that need it (the day being written is kept small by tiering's own size-tiered
merging, :data:`TODAY_COMPACTION_MIN_FILES`) (retention at half past, so the two Spark jobs of a topic do not start
together).

Each tick reads the tables' manifests (no data file) to find the days with work, and requests
one run per (topic, day); the run key is the partition key, scoped to the tick. A day that is
not a ``days`` partition yet (rows loaded in bulk from days before the topic's first tiered
day) is added by the tick before it is requested. A partition of a partitioned topic
(``docs/etcd-layout.md`` §3.1) shares its table with partition 0, whose runs do its
maintenance; only the topics themselves are requested.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Iterator

from dagster import DefaultScheduleStatus, RunRequest, ScheduleEvaluationContext, SkipReason, schedule

from assets.jobs import compaction_job, retention_job
from assets.partitions import DAYS_PARTITIONS_NAME, TOPICS_PARTITIONS_NAME, topic_day_key
from assets.resources import EtcdResource, IcebergCatalogResource, ObjectStoreResource
from danube_pipeline.lake import iceberg
from danube_pipeline.lake.iceberg.layout import data_files_by_day
from danube_pipeline.names import TopicName
from danube_pipeline.partitions import partition_of
from danube_pipeline.lake.retention import days_with_expired_rows

COMPACTION_MIN_FILES = 2
"""A day before today is compacted when it has at least this many data files (or one written
under an older partition spec)."""

TODAY_COMPACTION_MIN_FILES = 40
"""Today is compacted by Spark only past this many data files (or with a file of an older
spec). Every tiering pass merges today's small files itself, size-tiered
(:mod:`danube_pipeline.lake.iceberg.small_files`: fewer than ten per size class, about 30 at
most), so a day being written stays below it; a Spark rewrite of it would race those merges
(its commit fails when a file it rewrites was merged meanwhile). Once the day is over, the
next hourly run rewrites it into files of the target size."""


def _today(context: ScheduleEvaluationContext) -> dt.date:
    moment = context.scheduled_execution_time or dt.datetime.now(dt.UTC)
    return moment.astimezone(dt.UTC).date()


def _add_days(context: ScheduleEvaluationContext, days: set[dt.date]) -> None:
    """Add the ``days`` partitions a tick is about to request that do not exist yet (a day
    before the first one ``topic_partitions_sensor`` knows, such as rows loaded in bulk from
    earlier days): a run request for an unknown partition would fail."""
    known = set(context.instance.get_dynamic_partitions(DAYS_PARTITIONS_NAME))
    missing = sorted({d.isoformat() for d in days} - known)
    if missing:
        context.instance.add_dynamic_partitions(DAYS_PARTITIONS_NAME, missing)


def _topics(context: ScheduleEvaluationContext, etcd: EtcdResource) -> list[tuple[str, TopicName]]:
    """``(partition key, table topic)`` of every topic partition whose runs maintain a table."""
    keys = context.instance.get_dynamic_partitions(TOPICS_PARTITIONS_NAME)

    async def run() -> list[tuple[str, TopicName]]:
        out: list[tuple[str, TopicName]] = []
        async with await etcd.connect() as store:
            for key in keys:
                topic = TopicName.from_partition_key(key)
                part = await partition_of(store, topic)
                if part is None:
                    out.append((key, topic))
                elif part.index == 0:
                    out.append((key, part.parent))
        return out

    return asyncio.run(run())


@schedule(
    name="compaction_schedule",
    job=compaction_job,
    cron_schedule="0 * * * *",
    default_status=DefaultScheduleStatus.RUNNING,
    description=(
        f"Every hour, one compaction_job run per (topic, day) whose table partitions hold "
        f"{COMPACTION_MIN_FILES} data files or more ({TODAY_COMPACTION_MIN_FILES} today, whose small files "
        f"tiering merges as it commits), or a file of an older partition spec."
    ),
)
def compaction_schedule(
    context: ScheduleEvaluationContext, etcd: EtcdResource, iceberg_catalog: IcebergCatalogResource
) -> Iterator[RunRequest | SkipReason]:
    """One ``compaction_job`` run per (topic, day) with files to merge."""
    today = _today(context)
    catalog = iceberg_catalog.load()
    wanted: list[tuple[str, dt.date]] = []
    for key, table_topic in _topics(context, etcd):
        ident = iceberg.table_identifier(table_topic)
        if not catalog.table_exists(ident):
            continue
        for day, files in data_files_by_day(catalog.load_table(ident)).items():
            least = COMPACTION_MIN_FILES if day < today else TODAY_COMPACTION_MIN_FILES
            if day <= today and (files.data_files >= least or files.older_spec_files):
                wanted.append((key, day))
    _add_days(context, {day for _, day in wanted})
    for key, day in wanted:
        partition_key = topic_day_key(key, day)
        yield RunRequest(run_key=str(partition_key), partition_key=partition_key)
    if not wanted:
        yield SkipReason("no table partition has small files to merge")


@schedule(
    name="retention_schedule",
    job=retention_job,
    cron_schedule="30 * * * *",
    default_status=DefaultScheduleStatus.RUNNING,
    description=(
        "Every hour at half past, one retention_job run per (topic, day) holding expired rows "
        "(records expire at most an hour after their namespace's retention_time_minutes), and "
        "one for today when only descriptors expired."
    ),
)
def retention_schedule(
    context: ScheduleEvaluationContext,
    etcd: EtcdResource,
    object_store: ObjectStoreResource,
    iceberg_catalog: IcebergCatalogResource,
) -> Iterator[RunRequest | SkipReason]:
    """One ``retention_job`` run per (topic, day) with rows below the retained start
    (:func:`danube_pipeline.lake.retention.days_with_expired_rows`)."""
    today = _today(context)
    catalog = iceberg_catalog.load()
    objects = object_store.checked_store(etcd)
    keys = context.instance.get_dynamic_partitions(TOPICS_PARTITIONS_NAME)

    async def run() -> list[tuple[str, list[dt.date], bool]]:
        out = []
        async with await etcd.connect() as store:
            for key in keys:
                days, descriptors_expired = await days_with_expired_rows(
                    TopicName.from_partition_key(key), store=store, objects=objects, catalog=catalog
                )
                out.append((key, days, descriptors_expired))
        return out

    wanted: list[tuple[str, dt.date]] = []
    for key, days, descriptors_expired in asyncio.run(run()):
        expired = [d for d in days if d <= today]
        if not expired and descriptors_expired:
            expired = [today]
        wanted += [(key, day) for day in expired]
    _add_days(context, {day for _, day in wanted})
    for key, day in wanted:
        partition_key = topic_day_key(key, day)
        yield RunRequest(run_key=str(partition_key), partition_key=partition_key)
    if not wanted:
        yield SkipReason("nothing expired")
