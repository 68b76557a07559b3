"""Schedules: hourly compaction of every topic table."""

from collections.abc import Iterator

from dagster import RunRequest, ScheduleEvaluationContext, SkipReason, schedule

from assets.jobs import compaction_job
from assets.partitions import TOPICS_PARTITIONS_NAME


@schedule(
    name="compaction_schedule",
    job=compaction_job,
    cron_schedule="0 * * * *",
    description="Every hour, one compaction_job run per topic partition.",
)
def compaction_schedule(context: ScheduleEvaluationContext) -> Iterator[RunRequest | SkipReason]:
    """One ``compaction_job`` run per topic partition, keyed by the partition within the tick."""
    partitions = context.instance.get_dynamic_partitions(TOPICS_PARTITIONS_NAME)
    if not partitions:
        yield SkipReason("no topic partitions yet")
        return
    for key in partitions:
        # schedule run keys are scoped to one tick: one compaction per topic per hour
        yield RunRequest(run_key=key, partition_key=key)
