"""Dagster partitions: one dynamic partition per Danube topic.

Keys are :attr:`danube_pipeline.names.TopicName.partition_key` (``"{namespace}.{topic}"``):
Dagster partition keys must not contain ``/``. ``topic_partitions_sensor`` adds them from etcd.
"""

from __future__ import annotations

from dagster import DynamicPartitionsDefinition

TOPICS_PARTITIONS_NAME = "topics"

topics_partitions = DynamicPartitionsDefinition(name=TOPICS_PARTITIONS_NAME)
"""Partition key ``"ns.topic"`` per topic (``TopicName.from_partition_key`` parses it)."""
