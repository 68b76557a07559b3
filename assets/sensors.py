"""Sensors: discover topics in etcd, and notice sealed segments that are not tiered yet."""

import asyncio

from dagster import (
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from assets.jobs import tiering_job
from assets.partitions import TOPICS_PARTITIONS_NAME, topics_partitions
from assets.resources import BrokerResource, EtcdResource
from assets.tiering import list_topic_roots, segments_needing_tiering
from danube_pipeline.errors import DanubeError
from danube_pipeline.names import TopicName


@sensor(
    name="topic_partitions_sensor",
    minimum_interval_seconds=30,
    default_status=DefaultSensorStatus.RUNNING,
    description="Adds a `topics` partition (ns.topic) for every topic root key /topics/{ns}/{topic} in etcd.",
)
def topic_partitions_sensor(context: SensorEvaluationContext, etcd: EtcdResource) -> SensorResult | SkipReason:
    async def run() -> list[TopicName]:
        async with await etcd.connect() as store:
            return await list_topic_roots(store)

    topics = asyncio.run(run())
    existing = set(context.instance.get_dynamic_partitions(TOPICS_PARTITIONS_NAME))
    missing = sorted({t.partition_key for t in topics} - existing)
    if not missing:
        return SkipReason(f"all {len(topics)} topics already have a partition")
    context.log.info(f"adding topic partitions {missing}")
    return SensorResult(dynamic_partitions_requests=[topics_partitions.build_add_request(missing)])


@sensor(
    name="sealed_segments_sensor",
    job=tiering_job,
    minimum_interval_seconds=30,
    default_status=DefaultSensorStatus.RUNNING,
    description=(
        "Requests a tiering_job run for a topic when the broker lists a sealed segment that has "
        "no completed descriptor in etcd (run key: partition:last sealed end offset)."
    ),
)
def sealed_segments_sensor(
    context: SensorEvaluationContext, etcd: EtcdResource, broker: BrokerResource
) -> SensorResult | SkipReason:
    partitions = context.instance.get_dynamic_partitions(TOPICS_PARTITIONS_NAME)
    if not partitions:
        return SkipReason("no topic partitions yet")

    async def run() -> list[RunRequest]:
        requests: list[RunRequest] = []
        async with await etcd.connect() as store, broker.client() as client:
            for key in partitions:
                topic = TopicName.from_partition_key(key)
                try:
                    pending = await segments_needing_tiering(topic, store=store, admin=client.admin)
                except DanubeError as exc:
                    context.log.warning(f"{topic.path}: cannot list sealed segments: {exc}")
                    continue
                if pending:
                    last_end = max(s.end_offset for s in pending)
                    requests.append(
                        RunRequest(
                            run_key=f"{key}:{last_end}",
                            partition_key=key,
                            tags={"danube/topic": topic.path, "danube/untiered_segments": str(len(pending))},
                        )
                    )
        return requests

    requests = asyncio.run(run())
    if not requests:
        return SkipReason(f"every sealed segment of {len(partitions)} topics is tiered")
    return SensorResult(run_requests=requests)
