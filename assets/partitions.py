"""Dagster partitions: one dynamic partition per Danube topic, and (topic, UTC day) for the
maintenance assets.

Keys are :attr:`danube_pipeline.names.TopicName.partition_key` (``"{namespace}.{topic}"``):
Dagster partition keys must not contain ``/``. ``topic_partitions_sensor`` adds them from etcd.
"""

from __future__ import annotations

import datetime as dt

from dagster import DailyPartitionsDefinition, DynamicPartitionsDefinition, MultiPartitionKey, MultiPartitionsDefinition

TOPICS_PARTITIONS_NAME = "topics"

topics_partitions = DynamicPartitionsDefinition(name=TOPICS_PARTITIONS_NAME)
"""Partition key ``"ns.topic"`` per topic (``TopicName.from_partition_key`` parses it)."""

FIRST_DAY = "2024-01-01"
"""The first UTC day of the (topic, day) partitions: the first day a maintenance asset can be
backfilled for."""

days_partitions = DailyPartitionsDefinition(start_date=FIRST_DAY, end_offset=1)
"""UTC days from :data:`FIRST_DAY` through today (``end_offset=1``: today's partition exists
too, so today's rows can be compacted or rewritten)."""

topic_days_partitions = MultiPartitionsDefinition({"topic": topics_partitions, "day": days_partitions})
"""(topic, UTC day) partitions of ``compacted_table``, ``retention`` and ``schema_rewrite``:
a key such as ``MultiPartitionKey({"topic": "default.flights", "day": "2026-11-20"})``, written
``2026-11-20|default.flights`` (dimensions in name order) on the command line. The day is the
UTC day of the rows' ``_publish_time``, which the tables are partitioned by
(:mod:`danube_pipeline.lake.iceberg.layout`): a run reads and rewrites only that day's table
partitions. Backfilling a range of days for one topic runs one run per day."""


def topic_day_key(topic_key: str, day: dt.date) -> MultiPartitionKey:
    """The (topic, day) partition key of ``topic_key`` (``"ns.topic"``) on ``day``."""
    return MultiPartitionKey({"topic": topic_key, "day": day.isoformat()})


def in_day_range(day: dt.date, today: dt.date) -> bool:
    """Whether ``day`` is a partition of :data:`days_partitions` (from :data:`FIRST_DAY`
    through ``today``, UTC)."""
    return dt.date.fromisoformat(FIRST_DAY) <= day <= today
