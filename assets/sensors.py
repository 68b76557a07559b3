"""Sensors, on by default: discover topics in etcd, notice sealed segments that are not tiered
yet, and watch the tables' freshness."""

import asyncio
import json
import time

from dagster import (
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from assets.checks import freshness_result, measure_freshness
from assets.jobs import freshness_check_job, tiering_job
from assets.partitions import TOPICS_PARTITIONS_NAME, topics_partitions
from assets.resources import BrokerResource, EtcdResource, IcebergCatalogResource
from danube_pipeline.errors import DanubeError
from danube_pipeline.names import TopicName
from danube_pipeline.lake.tiering import list_topic_roots, segments_needing_tiering

#: Tags of every run the sealed-segment sensor requests.
TOPIC_TAG = "danube/topic"
SEALED_END_TAG = "danube/sealed_end"
UNTIERED_SEGMENTS_TAG = "danube/untiered_segments"
#: Dagster's run tag for the daemon's run retries (``run_retries`` in dagster_home/dagster.yaml).
MAX_RETRIES_TAG = "dagster/max_retries"
#: Dagster's run tag naming the partition of a run (a checks-only run has no asset to take it from).
PARTITION_TAG = "dagster/partition"

TIERING_RUN_MAX_RETRIES = 2
"""Times the daemon re-executes a failed tiering run (from its failed step).

Two layers of retries, because they cover different failures:

* op retries (``TIERING_RETRY_POLICY`` on the assets) repeat a failed step inside the same
  run, after 2 s, 6 s and 14 s: enough for etcd to elect a leader or a broker to restart,
  and cheap, since nothing else of the run is repeated;
* run retries repeat a run that failed as a whole: its steps ran out of op retries, or the
  run's process died (killed, out of memory, host lost), which no op retry survives. Dagster
  launches a sensor's run key only once, so without run retries the segments of a failed
  run would wait for the next sealed segment to get a new run key.
"""


@sensor(
    name="topic_partitions_sensor",
    minimum_interval_seconds=30,
    default_status=DefaultSensorStatus.RUNNING,
    description="Adds a `topics` partition (ns.topic) for every topic root key /topics/{ns}/{topic} in etcd.",
)
def topic_partitions_sensor(context: SensorEvaluationContext, etcd: EtcdResource) -> SensorResult | SkipReason:
    """Request a ``topics`` partition for every topic in etcd that has none yet."""

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
        "no completed descriptor in etcd (run key: partition:last sealed end offset). A failed "
        f"step is retried within the run; a failed run is re-executed by the daemon up to "
        f"{TIERING_RUN_MAX_RETRIES} times (tag {MAX_RETRIES_TAG})."
    ),
)
def sealed_segments_sensor(
    context: SensorEvaluationContext, etcd: EtcdResource, broker: BrokerResource
) -> SensorResult | SkipReason:
    """Request one tiering run per topic with untiered sealed segments.

    The run key is ``{partition}:{last sealed end offset}``: Dagster launches it once, so a
    topic gets one run per newly sealed range; retries are Dagster's (see
    :data:`TIERING_RUN_MAX_RETRIES`), not new run keys.
    """
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
                requests.append(
                    RunRequest(
                        run_key=f"{key}:{last_end}",
                        partition_key=key,
                        tags={
                            TOPIC_TAG: topic.path,
                            SEALED_END_TAG: str(last_end),
                            UNTIERED_SEGMENTS_TAG: str(len(pending)),
                            MAX_RETRIES_TAG: str(TIERING_RUN_MAX_RETRIES),
                        },
                    )
                )
        return requests

    requests = asyncio.run(run())
    if not requests:
        return SkipReason(f"every sealed segment of {len(partitions)} topics is tiered")
    return SensorResult(run_requests=requests)


@sensor(
    name="freshness_sensor",
    job=freshness_check_job,
    minimum_interval_seconds=60,
    default_status=DefaultSensorStatus.RUNNING,
    description=(
        "Every minute, measures every topic table's freshness (danube_pipeline.lake.freshness: the "
        "age of the oldest record not yet queryable, against DANUBE_FRESHNESS_LIMIT_S) and, when "
        "a topic turns stale or fresh again, requests a freshness_check_job run that records the "
        "iceberg_table check `fresh` for it."
    ),
)
def freshness_sensor(
    context: SensorEvaluationContext,
    etcd: EtcdResource,
    broker: BrokerResource,
    iceberg_catalog: IcebergCatalogResource,
) -> SensorResult | SkipReason:
    """One ``freshness_check_job`` run per topic partition whose freshness changed since the
    last tick (the cursor holds ``{partition key: passed}``; a topic seen for the first time
    counts as a change). Runs are launched only on a change, so a steady state costs no run.
    """
    partitions = context.instance.get_dynamic_partitions(TOPICS_PARTITIONS_NAME)
    if not partitions:
        return SkipReason("no topic partitions yet")
    last: dict[str, bool] = json.loads(context.cursor) if context.cursor else {}
    requests: list[RunRequest] = []
    stale: list[str] = []
    for key in partitions:
        try:
            passed, _, _ = freshness_result(measure_freshness(TopicName.from_partition_key(key), etcd, broker, iceberg_catalog))
        except DanubeError as exc:
            context.log.warning(f"{key}: cannot measure freshness: {exc}")
            continue
        if not passed:
            stale.append(key)
        if last.get(key) is passed:
            continue
        last[key] = passed
        requests.append(
            RunRequest(
                run_key=f"{key}:{'fresh' if passed else 'stale'}:{int(time.time())}",
                tags={PARTITION_TAG: key, TOPIC_TAG: TopicName.from_partition_key(key).path},
            )
        )
    if not requests:
        context.update_cursor(json.dumps(last))
        return SkipReason(f"{len(partitions)} topics measured, {len(stale)} stale; no change")
    return SensorResult(run_requests=requests, cursor=json.dumps(last))
