"""Dagster partitions: one dynamic partition per Danube topic, and (topic, day) for backfills.

Keys are :attr:`danube_pipeline.names.TopicName.partition_key` (``"{namespace}.{topic}"``):
Dagster partition keys must not contain ``/``. ``topic_partitions_sensor`` adds them from etcd.
"""

from __future__ import annotations

from dagster import DailyPartitionsDefinition, DynamicPartitionsDefinition, MultiPartitionsDefinition

TOPICS_PARTITIONS_NAME = "topics"

topics_partitions = DynamicPartitionsDefinition(name=TOPICS_PARTITIONS_NAME)
"""Partition key ``"ns.topic"`` per topic (``TopicName.from_partition_key`` parses it)."""

REWRITE_START_DATE = "2024-01-01"
"""The first day ``schema_rewrite`` can be backfilled for (UTC)."""

topic_days_partitions = MultiPartitionsDefinition(
    {
        "topic": topics_partitions,
        # end_offset=1: today's partition exists too, so today's rows can be rewritten
        "day": DailyPartitionsDefinition(start_date=REWRITE_START_DATE, end_offset=1),
    }
)
"""(topic, UTC day) partitions of ``schema_rewrite``: a key such as
``MultiPartitionKey({"topic": "default.flights", "day": "2026-11-20"})``, written
``2026-11-20|default.flights`` (dimensions in name order) on the command line. Backfilling a
range of days for one topic rewrites those days' table partitions."""
