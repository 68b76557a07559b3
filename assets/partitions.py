"""Dagster partitions: one dynamic partition per Danube topic, and (topic, UTC day) for the
maintenance assets.

Topic keys are :attr:`danube_pipeline.names.TopicName.partition_key` (``"{namespace}.{topic}"``):
Dagster partition keys must not contain ``/``. Day keys are ISO dates (``"2026-11-20"``).
``topic_partitions_sensor`` adds both: a topic's key when its root key appears in etcd, and the
days from the first day a topic's data was tiered through today (the maintenance schedules add
any other day they request). So the UI lists the days that can hold data, not every day since
a fixed date.

A (topic, day) partition is a cell of a cross product: every topic shows every known day, so a
topic created after the others shows their earlier days as "Missing" (Dagster's
``MultiPartitionsDefinition`` has no per-dimension-value ranges).
"""

from __future__ import annotations

import datetime as dt

from dagster import DynamicPartitionsDefinition, MultiPartitionKey, MultiPartitionsDefinition

TOPICS_PARTITIONS_NAME = "topics"
DAYS_PARTITIONS_NAME = "days"

topics_partitions = DynamicPartitionsDefinition(name=TOPICS_PARTITIONS_NAME)
"""Partition key ``"ns.topic"`` per topic (``TopicName.from_partition_key`` parses it)."""

days_partitions = DynamicPartitionsDefinition(name=DAYS_PARTITIONS_NAME)
"""UTC days (``"2026-11-20"``) that can hold a topic's rows: added by ``topic_partitions_sensor``
from the first day a topic's data was tiered through today, and by the maintenance schedules
for the days they request."""

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


def days_from(first: dt.date, today: dt.date) -> list[str]:
    """The day keys from ``first`` through ``today`` (none when ``first`` is later)."""
    return [(first + dt.timedelta(days=n)).isoformat() for n in range((today - first).days + 1)]
