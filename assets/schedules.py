"""Schedules: hourly compaction and hourly retention of every topic (retention at half past,
so the two Spark jobs of a topic do not start together)."""

from collections.abc import Iterator

from dagster import RunRequest, ScheduleEvaluationContext, SkipReason, schedule

from assets.jobs import compaction_job, retention_job
from assets.partitions import TOPICS_PARTITIONS_NAME


@schedule(
    name="compaction_schedule",
    job=compaction_job,
    cron_schedule="0 * * * *",
    description="Every hour, one compaction_job run per topic partition.",
)
def compaction_schedule(context: ScheduleEvaluationContext) -> Iterator[RunRequest | SkipReason]:
    """One ``compaction_job`` run per topic partition, keyed by the partition within the tick."""
    yield from _one_run_per_topic(context)


@schedule(
    name="retention_schedule",
    job=retention_job,
    cron_schedule="30 * * * *",
    description=(
        "Every hour at half past, one retention_job run per topic partition: records expire at "
        "most an hour after their namespace's retention_time_minutes."
    ),
)
def retention_schedule(context: ScheduleEvaluationContext) -> Iterator[RunRequest | SkipReason]:
    """One ``retention_job`` run per topic partition, keyed by the partition within the tick."""
    yield from _one_run_per_topic(context)


def _one_run_per_topic(context: ScheduleEvaluationContext) -> Iterator[RunRequest | SkipReason]:
    """One run request per ``topics`` partition; run keys are scoped to one tick, so each topic
    runs once per tick."""
    partitions = context.instance.get_dynamic_partitions(TOPICS_PARTITIONS_NAME)
    if not partitions:
        yield SkipReason("no topic partitions yet")
        return
    for key in partitions:
        yield RunRequest(run_key=key, partition_key=key)
