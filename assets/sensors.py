"""Sensors, on by default: discover topics in etcd, notice sealed segments that are not tiered
yet, check the continuous writer's commits, and watch the tables' freshness.

A tick that finds nothing to do returns an empty :class:`~dagster.SensorResult` (no skip
reason), so the daemon's log and the UI's tick history do not repeat "skipped: nothing new"
every few seconds; a skip reason is kept where it tells something (no topic known yet)."""

import asyncio
import datetime as dt
import json
import time

from dagster import (
    AssetKey,
    AssetRecordsFilter,
    DagsterRunStatus,
    DefaultSensorStatus,
    RunRequest,
    RunsFilter,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from assets.checks import freshness_result, measure_freshness
from assets.jobs import commit_checks_job, freshness_check_job, tiering_job
from assets.partitions import (
    DAYS_PARTITIONS_NAME,
    TOPICS_PARTITIONS_NAME,
    days_from,
    days_partitions,
    topics_partitions,
)
from assets.resources import BrokerResource, EtcdResource, IcebergCatalogResource
from danube_pipeline.errors import DanubeError
from danube_pipeline.names import TopicName
from danube_pipeline.lake.tiering import completed_descriptors, list_topic_roots, segments_needing_tiering
from danube_pipeline.metadata.descriptors import read_descriptors

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
    description=(
        "Adds a `topics` partition (ns.topic) for every topic root key /topics/{ns}/{topic} in etcd, "
        "and the `days` partitions from the first day a topic's data was tiered through today."
    ),
)
def topic_partitions_sensor(context: SensorEvaluationContext, etcd: EtcdResource) -> SensorResult:
    """Request a ``topics`` partition for every topic in etcd that has none yet, and a ``days``
    partition for every UTC day from the earliest topic's first tiered day through today.

    A topic's first day is the UTC day its oldest completed object descriptor was created
    (``created_at``, ``docs/etcd-layout.md`` §5.1): the day its oldest retained records were
    tiered, which the continuous writer does seconds after they were published. The cursor
    keeps each topic's first day (``{partition key: "YYYY-MM-DD"}``), so etcd is read again only
    for topics that had no completed descriptor yet.
    """
    first_days: dict[str, str] = json.loads(context.cursor) if context.cursor else {}

    async def run() -> list[TopicName]:
        async with await etcd.connect() as store:
            topics = await list_topic_roots(store)
            for topic in topics:
                if topic.partition_key in first_days:
                    continue
                descriptors, _ = await read_descriptors(store, topic)
                done = completed_descriptors(descriptors)
                if done:
                    oldest_s = min(d.created_at for d in done)
                    first_days[topic.partition_key] = dt.datetime.fromtimestamp(oldest_s, dt.UTC).date().isoformat()
        return topics

    topics = asyncio.run(run())
    existing = set(context.instance.get_dynamic_partitions(TOPICS_PARTITIONS_NAME))
    missing = sorted({t.partition_key for t in topics} - existing)
    requests = []
    if missing:
        context.log.info(f"adding topic partitions {missing}")
        requests.append(topics_partitions.build_add_request(missing))
    if first_days:
        today = dt.datetime.now(dt.UTC).date()
        wanted = days_from(dt.date.fromisoformat(min(first_days.values())), today)
        missing_days = sorted(set(wanted) - set(context.instance.get_dynamic_partitions(DAYS_PARTITIONS_NAME)))
        if missing_days:
            context.log.info(f"adding day partitions {missing_days[0]}..{missing_days[-1]}")
            requests.append(days_partitions.build_add_request(missing_days))
    return SensorResult(dynamic_partitions_requests=requests, cursor=json.dumps(first_days, sort_keys=True))


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
    for key in partitions:
        try:
            passed, _, _ = freshness_result(measure_freshness(TopicName.from_partition_key(key), etcd, broker, iceberg_catalog))
        except DanubeError as exc:
            context.log.warning(f"{key}: cannot measure freshness: {exc}")
            continue
        if last.get(key) is passed:
            continue
        last[key] = passed
        requests.append(
            RunRequest(
                run_key=f"{key}:{'fresh' if passed else 'stale'}:{int(time.time())}",
                tags={PARTITION_TAG: key, TOPIC_TAG: TopicName.from_partition_key(key).path},
            )
        )
    return SensorResult(run_requests=requests, cursor=json.dumps(last))


#: The assets the continuous writer reports runless materializations of.
COMMITTED_ASSET_KEYS = (AssetKey("segment_objects"), AssetKey("iceberg_table"))
#: Materialization records read per asset and page by ``commit_checks_sensor``.
COMMIT_PAGE_SIZE = 500
#: Run states in which a ``commit_checks_job`` run still has its checks ahead of it.
UNFINISHED_RUN_STATUSES = [
    DagsterRunStatus.QUEUED,
    DagsterRunStatus.NOT_STARTED,
    DagsterRunStatus.STARTING,
    DagsterRunStatus.STARTED,
]


def _new_runless_commits(context: SensorEvaluationContext, after: int | None) -> tuple[dict[str, int], int | None]:
    """``({partition key: newest storage id}, newest storage id seen)`` of the runless
    materializations of :data:`COMMITTED_ASSET_KEYS` after storage id ``after``."""
    newest = after
    committed: dict[str, int] = {}
    for asset_key in COMMITTED_ASSET_KEYS:
        page_cursor: str | None = None
        while True:
            result = context.instance.fetch_materializations(
                AssetRecordsFilter(asset_key=asset_key, after_storage_id=after),
                limit=COMMIT_PAGE_SIZE,
                cursor=page_cursor,
                ascending=True,
            )
            for record in result.records:
                newest = max(newest or 0, record.storage_id)
                if record.run_id or record.partition_key is None:
                    continue  # a run's materialization: its run ran the checks
                committed[record.partition_key] = max(committed.get(record.partition_key, 0), record.storage_id)
            if not result.has_more:
                break
            page_cursor = result.cursor
    return committed, newest


@sensor(
    name="commit_checks_sensor",
    job=commit_checks_job,
    minimum_interval_seconds=120,
    default_status=DefaultSensorStatus.RUNNING,
    description=(
        "Every two minutes, requests a commit_checks_job run (the exactly-once checks of "
        "segment_objects and iceberg_table) for each topic the continuous writer committed to "
        "since the last tick: its runless materializations run no check. A topic whose previous "
        "check run has not finished waits for it. Runs of tiering_job check their own commits."
    ),
)
def commit_checks_sensor(context: SensorEvaluationContext) -> SensorResult:
    """One ``commit_checks_job`` run per topic partition with a runless materialization of
    ``segment_objects`` or ``iceberg_table`` after the cursor.

    The cursor holds the highest event storage id read (``after_storage_id``) and the topics
    still owed a run (``pending``: partition key → storage id of the newest commit), those whose
    previous run is queued or running, so the queue holds at most one check run per topic. The
    run key is ``{partition}:{storage id of its newest commit}``.
    """
    state = json.loads(context.cursor) if context.cursor else {}
    pending: dict[str, int] = dict(state.get("pending", {}))
    committed, newest = _new_runless_commits(context, state.get("after_storage_id"))
    for key, storage_id in committed.items():
        pending[key] = max(pending.get(key, 0), storage_id)
    busy: set[str] = set()
    if pending:
        unfinished = context.instance.get_runs(
            filters=RunsFilter(job_name=commit_checks_job.name, statuses=UNFINISHED_RUN_STATUSES)
        )
        busy = {run.tags.get(PARTITION_TAG, "") for run in unfinished}
    requests = [
        RunRequest(
            run_key=f"{key}:{storage_id}",
            tags={PARTITION_TAG: key, TOPIC_TAG: TopicName.from_partition_key(key).path},
        )
        for key, storage_id in sorted(pending.items())
        if key not in busy
    ]
    waiting = {key: storage_id for key, storage_id in pending.items() if key in busy}
    cursor = json.dumps({"after_storage_id": newest, "pending": waiting}) if newest is not None else None
    return SensorResult(run_requests=requests, cursor=cursor)
