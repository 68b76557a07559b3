"""Sensors: discover topics in etcd, and notice sealed segments that are not tiered yet."""

import asyncio

from dagster import (
    DagsterRunStatus,
    DefaultSensorStatus,
    RunRequest,
    RunsFilter,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from assets.jobs import tiering_job
from assets.partitions import TOPICS_PARTITIONS_NAME, topics_partitions
from assets.resources import BrokerResource, EtcdResource
from danube_pipeline.tiering import list_topic_roots, segments_needing_tiering
from danube_pipeline.errors import DanubeError
from danube_pipeline.names import TopicName

#: Tags of every run the sealed-segment sensor requests.
TOPIC_TAG = "danube/topic"
SEALED_END_TAG = "danube/sealed_end"
#: Runs the sensor requests for one (topic, last sealed end offset) after the first fails.
MAX_TIERING_RETRIES = 5
_FINISHED = (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)


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
        "no completed descriptor in etcd (run key: partition:last sealed end offset). After a "
        f"run ends with segments still untiered it asks again, up to {MAX_TIERING_RETRIES} times "
        "(run key suffix :retry-N)."
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
                if not pending:
                    continue
                last_end = max(s.end_offset for s in pending)
                run_key = _run_key(context, topic, last_end)
                if run_key is not None:
                    requests.append(
                        RunRequest(
                            run_key=run_key,
                            partition_key=key,
                            tags={
                                TOPIC_TAG: topic.path,
                                SEALED_END_TAG: str(last_end),
                                "danube/untiered_segments": str(len(pending)),
                            },
                        )
                    )
        return requests

    requests = asyncio.run(run())
    if not requests:
        return SkipReason(f"every sealed segment of {len(partitions)} topics is tiered")
    return SensorResult(run_requests=requests)


def _run_key(context: SensorEvaluationContext, topic: TopicName, last_end: int) -> str | None:
    """The run key to request for ``topic`` whose sealed segments up to ``last_end`` are not all
    tiered, or ``None`` to wait.

    The first request is ``{partition}:{last_end}``. Dagster never launches a run key twice, so
    once runs with these tags have finished and segments are still untiered (the run failed,
    was cancelled, or succeeded while a descriptor was lost), the next request is
    ``{partition}:{last_end}:retry-{N}`` with N the number of finished runs, up to
    :data:`MAX_TIERING_RETRIES`. While such a run is queued or running, wait for it.
    """
    runs = context.instance.get_runs(
        filters=RunsFilter(tags={TOPIC_TAG: topic.path, SEALED_END_TAG: str(last_end)})
    )
    if any(run.status not in _FINISHED for run in runs):
        return None
    attempts = len(runs)
    base = f"{topic.partition_key}:{last_end}"
    if attempts == 0:
        return base
    if attempts > MAX_TIERING_RETRIES:
        context.log.warning(
            f"{topic.path}: {attempts} tiering runs up to offset {last_end} ended with segments "
            "untiered; not retrying again. Fix the cause, then re-execute from the UI."
        )
        return None
    return f"{base}:retry-{attempts}"
