"""Asset checks on the tiering assets, partitioned by topic like the assets they check.

A run that materializes ``segment_objects`` or ``iceberg_table`` also runs that asset's checks
(an asset selection includes its checks), after the asset's step. Each check compares two
independent accounts of the same data and records both numbers as metadata, so a failed check
says what disagrees:

``segment_objects``
    * ``descriptors_contiguous``: each completed descriptor starts right after the previous
      one ends (``docs/etcd-layout.md`` §5.1).
    * ``objects_exist_with_recorded_size``: every completed descriptor's object is in the
      object store with the size the descriptor records.

``iceberg_table``
    * ``offsets_match_descriptors``: the table's committed end offset (its
      ``danube.committed-end-offset`` property) is the last completed descriptor's end offset.
    * ``row_count_matches_descriptors``: the table holds as many rows as the completed
      descriptors cover from the table's first offset on (``end_offset - start_offset + 1``
      each, the first one cut at the table's first offset: retention deletes the table's
      oldest rows before it deletes a descriptor, and keeps a descriptor until all its records
      expired), less the records from that offset on that went to the dead-letter table
      ``{topic}__dlq`` (:mod:`danube_pipeline.lake.iceberg.dead_letter`).
    * ``no_duplicate_offsets``: no ``_offset`` is held by two rows of the table and its
      dead-letter table together.
    * ``fresh``: every record the broker took more than ``DANUBE_FRESHNESS_LIMIT_S`` seconds
      ago (default 120) is queryable in the table (:mod:`danube_pipeline.lake.freshness`; severity
      WARN). ``freshness_sensor`` measures it every minute and runs it (``freshness_check_job``)
      when a topic turns stale or fresh again, so a table whose tiering stopped is reported.

For a partition ``{topic}-part-{i}`` of a partitioned topic (``docs/etcd-layout.md`` §3.1) the
``iceberg_table`` checks look at the partition's rows (``_partition = i``) of the partitioned
topic's table and at its own committed end offset (``danube.committed-end-offset.part-{i}``).

The continuous writer (:mod:`assets.continuous_writer`) commits without a run, so no check
follows its commits by itself: ``commit_checks_sensor`` requests a ``commit_checks_job`` run
(every check but ``fresh``) for each topic the writer committed to since its last tick.

    * ``complete``: the same count per UTC day of the rows' ``_publish_time``
      (:mod:`danube_pipeline.lake.completeness`): each day's rows and dead letters against the
      offsets the descriptors cover between its first and last offset, and the total. It is
      **blocking**: when it fails (severity ERROR), the assets downstream of ``iceberg_table`` in
      the same run (compaction, retention, schema rewrites of the days) do not run on a table
      that lost or doubled rows.

The other checks are not blocking: a failure is reported (severity ERROR) without stopping the
assets downstream.
"""

import asyncio
import time
import warnings
from collections.abc import Callable
from typing import Any

from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSeverity,
    AssetsDefinition,
    MetadataValue,
    PreviewWarning,
    asset_check,
)
from pyiceberg.table import Table

from assets.assets import iceberg_table, segment_objects
from assets.partitions import topics_partitions
from assets.resources import BrokerResource, EtcdResource, IcebergCatalogResource, ObjectStoreResource
from danube_pipeline.lake import iceberg
from danube_pipeline.lake.completeness import Completeness, table_completeness
from danube_pipeline.lake.freshness import Freshness, freshness_limit_s, table_freshness
from danube_pipeline.lake.tiering.incarnation import holds_incarnation, topic_incarnation
from danube_pipeline.metadata.descriptors import read_descriptors
from danube_pipeline.metadata.values import ObjectDescriptor
from danube_pipeline.names import TopicName
from danube_pipeline.partitions import partition_of
from danube_pipeline.lake.tiering import (
    completed_descriptors,
    descriptor_gaps,
    descriptor_record_count,
    object_mismatches,
)

MAX_LISTED_ITEMS = 20
"""Gaps, objects or offsets named in a check's metadata, at most (the counts are complete)."""


def _partitioned_check(
    asset: AssetsDefinition, name: str, *, blocking: bool = False
) -> Callable[[Callable[..., AssetCheckResult]], AssetChecksDefinition]:
    """``@asset_check`` on ``asset``, partitioned by topic like it.

    A ``partitions_def`` on an asset check is a preview feature of Dagster 1.13 that warns at
    definition time; the project pins ``dagster<1.14`` and opts in, so that one warning is
    silenced here (the test suite turns warnings into errors).
    """
    decorator = asset_check(asset=asset, partitions_def=topics_partitions, name=name, blocking=blocking)

    def define(fn: Callable[..., AssetCheckResult]) -> AssetChecksDefinition:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*partitions_def on an AssetCheckSpec", category=PreviewWarning)
            return decorator(fn)

    return define


def _topic(context: AssetCheckExecutionContext) -> TopicName:
    return TopicName.from_partition_key(context.partition_key)


def _completed(etcd: EtcdResource, topic: TopicName) -> list[ObjectDescriptor]:
    async def run() -> list[ObjectDescriptor]:
        async with await etcd.connect() as store:
            descriptors, _ = await read_descriptors(store, topic)
        return completed_descriptors(descriptors)

    return asyncio.run(run())


def _table(etcd: EtcdResource, iceberg_catalog: IcebergCatalogResource, topic: TopicName) -> tuple[Table | None, int | None]:
    """The topic's table and, for a partition of a partitioned topic, the partition's index
    (its rows are in the partitioned topic's table). A table of an earlier incarnation of the
    topic (not retired yet by tiering) counts as no table (``lake/tiering/incarnation.py``)."""

    async def run() -> tuple[TopicName, int | None, int | None, list[ObjectDescriptor]]:
        async with await etcd.connect() as store:
            part = await partition_of(store, topic)
            table_topic = part.parent if part is not None else topic
            incarnation = await topic_incarnation(store, table_topic)
            descriptors, _ = await read_descriptors(store, topic)
        return table_topic, (part.index if part is not None else None), incarnation, descriptors

    table_topic, partition, incarnation, descriptors = asyncio.run(run())
    catalog = iceberg_catalog.load()
    ident = iceberg.table_identifier(table_topic)
    table = catalog.load_table(ident) if catalog.table_exists(ident) else None
    committed = iceberg.committed_end_offset(table, partition=partition) if table is not None else None
    if table is not None and not holds_incarnation(table, incarnation, committed, descriptors):
        return None, partition
    return table, partition


# --------------------------------------------------------------------------- segment_objects


@_partitioned_check(segment_objects, "descriptors_contiguous")
def descriptors_contiguous(context: AssetCheckExecutionContext, etcd: EtcdResource) -> AssetCheckResult:
    """Each completed object descriptor starts at the previous one's end offset + 1."""
    topic = _topic(context)
    done = _completed(etcd, topic)
    gaps = descriptor_gaps(done)
    return AssetCheckResult(
        passed=not gaps,
        metadata={
            "completed_descriptors": len(done),
            "gaps": len(gaps),
            "first_gaps": MetadataValue.json(
                [
                    {
                        "object_id": g.object_id,
                        "expected_start_offset": g.expected_start_offset,
                        "start_offset": g.start_offset,
                    }
                    for g in gaps[:MAX_LISTED_ITEMS]
                ]
            ),
        },
        description=None if not gaps else f"{len(gaps)} completed descriptors do not follow the one before",
    )


@_partitioned_check(segment_objects, "objects_exist_with_recorded_size")
def objects_exist_with_recorded_size(
    context: AssetCheckExecutionContext, etcd: EtcdResource, object_store: ObjectStoreResource
) -> AssetCheckResult:
    """Every completed descriptor's object exists in the object store with the recorded size."""
    topic = _topic(context)
    done = _completed(etcd, topic)
    mismatches = object_mismatches(topic, done, object_store.checked_store(etcd))
    missing = [m for m in mismatches if m.stored_size_bytes is None]
    resized = [m for m in mismatches if m.stored_size_bytes is not None]
    return AssetCheckResult(
        passed=not mismatches,
        metadata={
            "objects_checked": len(done),
            "recorded_bytes": MetadataValue.int(sum(d.size for d in done)),
            "objects_missing": len(missing),
            "objects_wrong_size": len(resized),
            "missing_object_ids": MetadataValue.json([m.object_id for m in missing[:MAX_LISTED_ITEMS]]),
            "wrong_size_objects": MetadataValue.json(
                [
                    {
                        "object_id": m.object_id,
                        "recorded_size_bytes": m.recorded_size_bytes,
                        "stored_size_bytes": m.stored_size_bytes,
                    }
                    for m in resized[:MAX_LISTED_ITEMS]
                ]
            ),
        },
        description=None
        if not mismatches
        else f"{len(missing)} objects missing, {len(resized)} not the size their descriptor records",
    )


# --------------------------------------------------------------------------- iceberg_table


SETTLE_ATTEMPTS = 5
"""Readings a check comparing the table with the descriptors takes before it reports a
disagreement (see :func:`_settled`)."""
SETTLE_INTERVAL_S = 1.0
"""Seconds between two such readings."""


def _settled(read: Callable[[], AssetCheckResult]) -> AssetCheckResult:
    """``read()`` until it passes, at most :data:`SETTLE_ATTEMPTS` times.

    A writer completes a segment's descriptor before it commits the segment to the table
    (``docs/etcd-layout.md`` §5.1), so a check that reads both while the continuous writer is
    between the two steps sees the table one descriptor behind. That gap closes within the
    writer's pass; a disagreement that outlasts every reading is reported.
    """
    result = read()
    for _ in range(SETTLE_ATTEMPTS - 1):
        if result.passed:
            break
        time.sleep(SETTLE_INTERVAL_S)
        result = read()
    return result


@_partitioned_check(iceberg_table, "offsets_match_descriptors")
def offsets_match_descriptors(
    context: AssetCheckExecutionContext, etcd: EtcdResource, iceberg_catalog: IcebergCatalogResource
) -> AssetCheckResult:
    """The table's committed end offset is the last completed descriptor's end offset."""
    topic = _topic(context)
    return _settled(lambda: _offsets_match_descriptors(topic, etcd, iceberg_catalog))


def _offsets_match_descriptors(
    topic: TopicName, etcd: EtcdResource, iceberg_catalog: IcebergCatalogResource
) -> AssetCheckResult:
    done = _completed(etcd, topic)
    table, partition = _table(etcd, iceberg_catalog, topic)
    committed = iceberg.committed_end_offset(table, partition=partition) if table is not None else None
    descriptors_end = done[-1].end_offset if done else None
    metadata: dict[str, int] = {"completed_descriptors": len(done)}
    if committed is not None:
        metadata["committed_end_offset"] = committed
    if descriptors_end is not None:
        metadata["descriptors_end_offset"] = descriptors_end
    return AssetCheckResult(
        passed=committed == descriptors_end,
        metadata=metadata,
        description=None
        if committed == descriptors_end
        else f"table committed through offset {committed}, descriptors end at offset {descriptors_end}",
    )


@_partitioned_check(iceberg_table, "row_count_matches_descriptors")
def row_count_matches_descriptors(
    context: AssetCheckExecutionContext, etcd: EtcdResource, iceberg_catalog: IcebergCatalogResource
) -> AssetCheckResult:
    """The table holds as many rows as the completed descriptors cover from the table's first
    offset on.

    Retention deletes the table's rows below its retained
    start first and a descriptor only once all its records expired, so the table may start
    inside the first descriptor. Where it starts is the smallest ``_offset`` it holds; a table
    whose rows all expired starts after its committed end offset. Records of the dead-letter
    table from that start on count as rows (their offsets are committed without a row in the
    table). Rows missing or doubled above that start make the counts differ.
    """
    topic = _topic(context)
    return _settled(lambda: _row_count_matches_descriptors(topic, etcd, iceberg_catalog))


def _row_count_matches_descriptors(
    topic: TopicName, etcd: EtcdResource, iceberg_catalog: IcebergCatalogResource
) -> AssetCheckResult:
    done = _completed(etcd, topic)
    table, partition = _table(etcd, iceberg_catalog, topic)
    stats = (
        iceberg.offset_stats(table, partition=partition) if table is not None else iceberg.OffsetStats(0, None, None)
    )
    table_rows = stats.rows
    start = stats.first_offset
    if start is None and table is not None:
        committed = iceberg.committed_end_offset(table, partition=partition)
        start = committed + 1 if committed is not None else None
    descriptor_records = descriptor_record_count(done, from_offset=start)
    dead_letters = iceberg.dead_letter_table_of(table) if table is not None else None
    dead_letter_rows = (
        len(iceberg.dead_letter_offsets(dead_letters, partition=partition, start_offset=start))
        if dead_letters is not None
        else 0
    )
    committed_rows = table_rows + dead_letter_rows
    return AssetCheckResult(
        passed=committed_rows == descriptor_records,
        metadata={
            "table_rows": MetadataValue.int(table_rows),
            "dead_letter_rows": MetadataValue.int(dead_letter_rows),
            "descriptor_records": MetadataValue.int(descriptor_records),
            "difference_rows": MetadataValue.int(committed_rows - descriptor_records),
            "completed_descriptors": len(done),
            **({"table_first_offset": start} if start is not None else {}),
        },
        description=None
        if committed_rows == descriptor_records
        else f"table has {table_rows} rows and {dead_letter_rows} dead letters, "
        f"descriptors cover {descriptor_records} records",
    )


@_partitioned_check(iceberg_table, "no_duplicate_offsets")
def no_duplicate_offsets(
    context: AssetCheckExecutionContext, etcd: EtcdResource, iceberg_catalog: IcebergCatalogResource
) -> AssetCheckResult:
    """No ``_offset`` is held by more than one row of the table and its dead-letter table (of
    the partition's rows, for a partition of a partitioned topic)."""
    topic = _topic(context)
    table, partition = _table(etcd, iceberg_catalog, topic)
    duplicated = (
        iceberg.duplicate_offsets(table, partition=partition, dead_letters=iceberg.dead_letter_table_of(table))
        if table is not None
        else {}
    )
    extra_rows = sum(count - 1 for count in duplicated.values())
    table_rows = iceberg.snapshot_row_count(table) if table is not None else 0
    return AssetCheckResult(
        passed=not duplicated,
        metadata={
            **({"table_rows": MetadataValue.int(table_rows)} if table_rows is not None else {}),
            "duplicated_offsets": len(duplicated),
            "duplicate_rows": MetadataValue.int(extra_rows),
            "first_duplicated_offsets": MetadataValue.json(sorted(duplicated)[:MAX_LISTED_ITEMS]),
        },
        description=None if not duplicated else f"{len(duplicated)} offsets held by more than one row",
    )


COMPLETENESS_CHECK = "complete"


@_partitioned_check(iceberg_table, COMPLETENESS_CHECK, blocking=True)
def complete(
    context: AssetCheckExecutionContext, etcd: EtcdResource, iceberg_catalog: IcebergCatalogResource
) -> AssetCheckResult:
    """Rows plus dead letters equal the offsets the completed descriptors cover, in total and
    per UTC day (:func:`danube_pipeline.lake.completeness.table_completeness`). Blocking, severity
    ERROR: the assets downstream in the same run do not run when it fails."""
    topic = _topic(context)
    return _settled(lambda: completeness_result(_completeness(topic, etcd, iceberg_catalog)))


def _completeness(topic: TopicName, etcd: EtcdResource, iceberg_catalog: IcebergCatalogResource) -> Completeness:
    done = _completed(etcd, topic)
    table, partition = _table(etcd, iceberg_catalog, topic)
    return table_completeness(table, done, partition=partition)


def completeness_result(found: Completeness) -> AssetCheckResult:
    """The ``complete`` check's result for one count: the totals, and each day's counts (the
    failed days first, at most :data:`MAX_LISTED_ITEMS`)."""
    failed = [d for d in found.days if not d.passed]
    listed = (failed + [d for d in found.days if d.passed])[:MAX_LISTED_ITEMS]
    committed = found.rows + found.dead_letters
    description = None
    if not found.passed:
        description = (
            f"{found.rows} rows and {found.dead_letters} dead letters, descriptors cover {found.covered} offsets"
            + (f"; {len(failed)} days do not add up: " + ", ".join(d.day.isoformat() for d in failed[:5]) if failed else "")
        )
    return AssetCheckResult(
        passed=found.passed,
        severity=AssetCheckSeverity.ERROR,
        metadata={
            "table_rows": MetadataValue.int(found.rows),
            "dead_letter_rows": MetadataValue.int(found.dead_letters),
            "descriptor_records": MetadataValue.int(found.covered),
            "missing_rows": MetadataValue.int(found.covered - committed),
            "days": len(found.days),
            "days_failed": len(failed),
            "by_day": MetadataValue.json(
                [
                    {
                        "day": d.day.isoformat(), "rows": d.rows, "dead_letters": d.dead_letters,
                        "first_offset": d.first_offset, "last_offset": d.last_offset, "covered": d.covered,
                    }
                    for d in listed
                ]
            ),
            **({"start_offset": found.start_offset} if found.start_offset is not None else {}),
        },
        description=description,
    )


FRESHNESS_CHECK = "fresh"


def measure_freshness(
    topic: TopicName, etcd: EtcdResource, broker: BrokerResource, iceberg_catalog: IcebergCatalogResource
) -> Freshness:
    """:func:`danube_pipeline.lake.freshness.table_freshness` of the topic with the resources."""
    catalog = iceberg_catalog.load()

    async def run() -> Freshness:
        async with await etcd.connect() as store, broker.client() as client:
            return await table_freshness(
                topic, store=store, admin=client.admin, catalog=catalog, limit_s=freshness_limit_s()
            )

    return asyncio.run(run())


def freshness_result(freshness: Freshness) -> tuple[bool, dict[str, Any], str | None]:
    """``(passed, metadata, description)`` of the ``fresh`` check for one measurement."""
    metadata: dict[str, Any] = {
        "lag_s": MetadataValue.float(round(freshness.lag_s, 3)),
        # text, not a number: a constant is no series to plot
        "limit": MetadataValue.text(f"{freshness.limit_s:g} s"),
        "pending_records": MetadataValue.int(freshness.pending_records),
        "next_offset": freshness.next_offset,
        "tiered": freshness.tiered,
    }
    if freshness.committed_end_offset is not None:
        metadata["committed_end_offset"] = freshness.committed_end_offset
    if freshness.last_commit_ms is not None:
        # a timestamp the UI shows as a date, not an epoch number on a plot's y-axis
        metadata["last_commit"] = MetadataValue.timestamp(freshness.last_commit_ms / 1000)
    description = (
        None
        if freshness.passed
        else f"{freshness.pending_records} records not queryable yet, the oldest up to "
        f"{freshness.lag_s:.0f} s old (limit {freshness.limit_s:.0f} s)"
    )
    return freshness.passed, metadata, description


@_partitioned_check(iceberg_table, FRESHNESS_CHECK)
def fresh(
    context: AssetCheckExecutionContext,
    etcd: EtcdResource,
    broker: BrokerResource,
    iceberg_catalog: IcebergCatalogResource,
) -> AssetCheckResult:
    """Every record the broker took more than DANUBE_FRESHNESS_LIMIT_S seconds ago (default 120)
    is queryable in the table. A stale table is a warning, not an error."""
    passed, metadata, description = freshness_result(measure_freshness(_topic(context), etcd, broker, iceberg_catalog))
    return AssetCheckResult(passed=passed, metadata=metadata, description=description, severity=AssetCheckSeverity.WARN)


commit_checks: list[AssetChecksDefinition] = [
    descriptors_contiguous,
    objects_exist_with_recorded_size,
    offsets_match_descriptors,
    row_count_matches_descriptors,
    no_duplicate_offsets,
    complete,
]
"""The exactly-once checks and ``complete``: every check but ``fresh``, run after each commit
(``commit_checks_job``)."""

tiering_checks: list[AssetChecksDefinition] = [*commit_checks, fresh]
"""The asset checks :mod:`assets.definitions` registers."""
