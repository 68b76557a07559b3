"""The tiering and maintenance assets.

Lineage, as the Dagster UI draws it:

* group ``tiering``, partitioned by topic (``"ns.topic"``): ``segment_objects`` (sealed WAL
  segments as objects plus etcd descriptors) → ``iceberg_table`` (one Iceberg snapshot per
  object, exactly once, into a table partitioned by ``day(_publish_time)``);
* group ``maintenance``, partitioned by topic × UTC day (:data:`assets.partitions.topic_days_partitions`),
  each reading and rewriting only that day's table partitions: ``iceberg_table`` →
  ``compacted_table`` (Spark merges the day's small files), ``retention`` (the namespace's
  retention policy on the day's rows, plus the topic's descriptors, objects and WAL) and
  ``schema_rewrite`` (the rewrite declared in ``danube.rewrite``). ``compaction_schedule`` and
  ``retention_schedule`` request the days that need it; any range of days can be backfilled.

Each materialization records metadata (rows, bytes, offsets, snapshot ids, data files before
and after) so the UI tells the story without opening logs; a value that is not known (no
descriptor, an empty table) is left out rather than written as a sentinel. The asset checks
of :mod:`assets.checks` run in the same run as their asset.
"""
import asyncio
import datetime as dt
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from dagster import (
    AssetExecutionContext,
    Backoff,
    Failure,
    FreshnessPolicy,
    MaterializeResult,
    MetadataValue,
    MultiPartitionKey,
    RetryPolicy,
    asset,
)

from assets.metadata import iceberg_table_metadata, known, segment_objects_metadata, table_metadata
from assets.partitions import topic_days_partitions, topics_partitions
from assets.resources import (
    BrokerResource,
    EtcdResource,
    IcebergCatalogResource,
    ObjectStoreResource,
    SparkResource,
)
from danube_pipeline.lake import iceberg
from danube_pipeline.lake.freshness import freshness_limit_s
from danube_pipeline.lake.iceberg.layout import data_files_by_day, describe_spec
from danube_pipeline.names import TopicName
from danube_pipeline.partitions import PartitionOf, partition_of
from danube_pipeline.lake.retention import RetentionReport, apply_retention
from danube_pipeline.lake.rewrite import (
    RewriteError,
    RewriteReport,
    read_rewrite_spec,
    rewrite_table,
)
from danube_pipeline.schemas.registry import SchemaRegistry
from danube_pipeline.lake.spark.procedures import compact_table
from danube_pipeline.lake.tiering import (
    TableReport,
    TieringReport,
    commit_objects_to_table,
    tier_sealed_segments,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

TIERING_GROUP = "tiering"

TIERING_RETRY_POLICY = RetryPolicy(max_retries=3, delay=2.0, backoff=Backoff.EXPONENTIAL)
"""Op retries of the tiering steps, inside one run: attempts 2, 3 and 4 start 2 s, 6 s and
14 s after the previous one failed (``(2**n - 1) * delay``).

Both steps are idempotent (a completed descriptor or a committed end offset makes a repeat
skip what is done), so retrying a step is always safe. Op retries ride out short outages (an
etcd leader election, a broker restart, an object store or catalog that refuses writes for a
moment) without a new run. A run that fails anyway (the retries ran out, or its process died,
which op retries cannot help) is re-executed from the failed step by the daemon's run retries:
see ``TIERING_RUN_MAX_RETRIES`` in :mod:`assets.sensors`.
"""


MIN_FRESHNESS_WINDOW_S = 60.0
"""The shortest ``fail_window`` Dagster accepts, in seconds."""
TABLE_FRESHNESS_POLICY = FreshnessPolicy.time_window(
    fail_window=dt.timedelta(seconds=max(MIN_FRESHNESS_WINDOW_S, freshness_limit_s()))
)
"""The tables' freshness policy: a topic's table is expected to be materialized (a run's or the
continuous writer's commit) within ``DANUBE_FRESHNESS_LIMIT_S`` seconds (default 120, at least
60), the limit of the ``fresh`` check, read when the code location loads. The UI shows it on the
asset; the instance evaluates it when ``freshness: {enabled: true}`` is in ``dagster.yaml``."""


def _topic(context: AssetExecutionContext) -> TopicName:
    return TopicName.from_partition_key(context.partition_key)


@asset(
    partitions_def=topics_partitions,
    group_name=TIERING_GROUP,
    kinds={"etcd", "python"},
    retry_policy=TIERING_RETRY_POLICY,
    description=(
        "Sealed WAL segments of the topic as objects topics/{ns}/{topic}/data-{start}-{end}.dnb1 "
        "in object storage, each with a completed descriptor under "
        "/danube-data/storage/topics/{ns}/{topic}/objects/ in etcd (docs/etcd-layout.md §5.1, §5.2)."
    ),
)
def segment_objects(
    context: AssetExecutionContext,
    etcd: EtcdResource,
    broker: BrokerResource,
    object_store: ObjectStoreResource,
) -> MaterializeResult[Any]:
    """Upload every sealed segment without a completed descriptor, in offset order."""
    topic = _topic(context)
    objects = object_store.checked_store(etcd)

    async def run() -> TieringReport:
        async with await etcd.connect() as store, broker.client() as client:
            return await tier_sealed_segments(topic, store=store, admin=client.admin, objects=objects)

    report = asyncio.run(run())
    context.log.info(
        f"{topic.path}: {report.objects_written} objects written ({report.bytes_written} bytes), "
        f"{report.objects_skipped} already tiered"
    )
    return MaterializeResult(metadata=segment_objects_metadata(report, objects, topic))


@asset(
    partitions_def=topics_partitions,
    group_name=TIERING_GROUP,
    deps=[segment_objects],
    kinds={"iceberg", "python"},
    retry_policy=TIERING_RETRY_POLICY,
    freshness_policy=TABLE_FRESHNESS_POLICY,
    description=(
        "The topic's Iceberg table (namespace = Danube namespace): one snapshot per segment "
        "object, exactly once (snapshot summaries carry danube.end-offset)."
    ),
)
def iceberg_table(
    context: AssetExecutionContext,
    etcd: EtcdResource,
    object_store: ObjectStoreResource,
    iceberg_catalog: IcebergCatalogResource,
) -> MaterializeResult[Any]:
    """Append every completed segment object not yet committed to the topic's table."""
    topic = _topic(context)
    objects = object_store.checked_store(etcd)
    catalog = iceberg_catalog.load()

    async def run() -> TableReport:
        async with await etcd.connect() as store:
            return await commit_objects_to_table(
                topic, store=store, objects=objects, catalog=catalog, registry=SchemaRegistry(store)
            )

    report = asyncio.run(run())
    context.log.info(
        f"{report.table}: {report.rows_appended} rows in {report.objects_appended} snapshots "
        f"({report.row_count} rows in the table), committed through offset {report.committed_end_offset}"
        + (f"; {report.objects_deleted} segment objects deleted after commit" if report.objects_deleted else "")
    )
    return MaterializeResult(metadata=iceberg_table_metadata(report, iceberg_catalog.catalog_name()))


MAINTENANCE_GROUP = "maintenance"


@asset(
    partitions_def=topic_days_partitions,
    group_name=MAINTENANCE_GROUP,
    deps=[iceberg_table],
    kinds={"spark", "iceberg"},
    description=(
        "The topic's table after Spark's rewrite_data_files (sort strategy, by _offset) merged "
        "the small per-object files of one UTC day's table partitions; other days are not touched."
    ),
)
def compacted_table(
    context: AssetExecutionContext,
    etcd: EtcdResource,
    iceberg_catalog: IcebergCatalogResource,
    spark: SparkResource,
) -> MaterializeResult[Any]:
    """``CALL {catalog}.system.rewrite_data_files(...)`` on the topic's table, limited to the
    partition's day (:func:`danube_pipeline.lake.spark.procedures.compact_table`).

    Spark starts only when the day has two data files or more, or a file written under an
    older partition spec (which is then moved into the current one). The partitions
    ``{topic}-part-{i}`` of a partitioned topic share the partitioned topic's table
    (``docs/etcd-layout.md`` §3.1): partition 0's runs compact it, the others' skip."""
    topic, day = _topic_and_day(context)

    async def partition() -> PartitionOf | None:
        async with await etcd.connect() as store:
            return await partition_of(store, topic)

    part = asyncio.run(partition())
    if part is not None:
        topic = part.parent
    ident = iceberg.table_identifier(topic)
    table_name = ".".join(ident)
    base = {"table": f"{iceberg_catalog.catalog_name()}.{table_name}", "day": day.isoformat()}
    if part is not None and part.index != 0:
        context.log.info(f"{table_name} is compacted by the runs of partition 0")
        return MaterializeResult(metadata={**base, "skipped": "compacted by partition 0's runs"})
    catalog = iceberg_catalog.load()
    if not catalog.table_exists(ident):
        context.log.info(f"{table_name} does not exist yet; nothing to compact")
        return MaterializeResult(metadata={**base, "skipped": "table does not exist"})
    table = catalog.load_table(ident)
    before = data_files_by_day(table).get(day)
    if before is None or (before.data_files < 2 and before.older_spec_files == 0):
        context.log.info(f"{table_name} {day}: {before.data_files if before else 0} data files; nothing to compact")
        return MaterializeResult(
            metadata={**base, "skipped": "fewer than 2 data files", "day_data_files": before.data_files if before else 0}
        )
    with spark.session() as session:
        result = compact_table(
            session, topic, catalog_name=spark.resolved_catalog_name(), day=day, rewrite_all=before.older_spec_files > 0
        )
    table.refresh()
    after = data_files_by_day(table).get(day)
    context.log.info(
        f"{table_name} {day}: {before.data_files} → {after.data_files if after else 0} data files "
        f"({result.rewritten_data_files} rewritten into {result.added_data_files}); "
        f"table {result.data_files_before} → {result.data_files_after}"
    )
    row_count = iceberg.snapshot_row_count(table)
    return MaterializeResult(
        metadata=table_metadata(base["table"], row_count, partition_row_count=before.rows)
        | known(
            {
                **base,
                "partition_spec": describe_spec(table),
                "day_rows": MetadataValue.int(before.rows),
                "day_data_files_before": before.data_files,
                "day_data_files_after": after.data_files if after else 0,
                "day_bytes_before": MetadataValue.int(before.bytes),
                "day_bytes_after": MetadataValue.int(after.bytes) if after else None,
                "older_spec_files_before": before.older_spec_files,
                "row_count": MetadataValue.int(row_count) if row_count is not None else None,
                "data_files_before": result.data_files_before,
                "data_files_after": result.data_files_after,
                "rewritten_data_files": result.rewritten_data_files,
                "added_data_files": result.added_data_files,
                "rewritten_bytes": MetadataValue.int(result.rewritten_bytes),
                "snapshot_id": MetadataValue.text(str(result.snapshot_id)) if result.snapshot_id else None,
                "committed_end_offset": iceberg.committed_end_offset(table),
            }
        )
    )


def _utc(epoch_ms: int | None) -> str | None:
    if epoch_ms is None:
        return None
    return dt.datetime.fromtimestamp(epoch_ms / 1000, tz=dt.UTC).isoformat(timespec="milliseconds")


@asset(
    partitions_def=topic_days_partitions,
    group_name=MAINTENANCE_GROUP,
    deps=[iceberg_table],
    kinds={"spark", "iceberg", "etcd"},
    retry_policy=TIERING_RETRY_POLICY,
    description=(
        "The topic after its namespace's retention policy (retention_time_minutes, "
        "retention_size_mb; docs/etcd-layout.md §2.1): the day's expired rows deleted from the "
        "table (Spark DELETE on that day's partitions, then expire_snapshots and "
        "remove_orphan_files), expired object descriptors and their objects deleted (the newest "
        "descriptor is always kept), and the broker asked to apply its local WAL retention."
    ),
)
def retention(
    context: AssetExecutionContext,
    etcd: EtcdResource,
    broker: BrokerResource,
    object_store: ObjectStoreResource,
    iceberg_catalog: IcebergCatalogResource,
    spark: SparkResource,
) -> MaterializeResult[Any]:
    """:func:`danube_pipeline.lake.retention.apply_retention` on the topic, its row deletion
    limited to the partition's day; Spark starts only when the table has something to delete
    or expire. The descriptor, object and WAL steps are the topic's (idempotent: a run for
    another day finds them done)."""
    topic, day = _topic_and_day(context)
    objects = object_store.checked_store(etcd)
    catalog = iceberg_catalog.load()

    with ExitStack() as stack:

        def session() -> "SparkSession":
            return stack.enter_context(spark.session())

        async def run() -> RetentionReport:
            async with await etcd.connect() as store, broker.client() as client:
                return await apply_retention(
                    topic,
                    store=store,
                    objects=objects,
                    catalog=catalog,
                    spark=session,
                    admin=client.admin,
                    catalog_name=spark.resolved_catalog_name(),
                    day=day,
                )

        report = asyncio.run(run())
    if report.policy_error is not None:
        context.log.warning(f"{topic.path}: namespace policy unreadable, no retention applied: {report.policy_error}")
    context.log.info(
        f"{topic.path} {day}: retained from offset {report.retained_start}; {report.rows_deleted} rows, "
        f"{report.snapshots_expired} snapshots, {report.orphan_files_removed} orphan files, "
        f"{report.descriptors_deleted} descriptors and {report.objects_deleted} objects deleted; "
        f"WAL step {report.wal_step}"
    )
    return MaterializeResult(
        metadata=known(
            {
                "topic": topic.path,
                "day": day.isoformat(),
                "table": f"{spark.resolved_catalog_name()}.{report.table}" if report.table else None,
                "data_files_before": report.data_files_before,
                "data_files_after": report.data_files_after,
                "snapshot_id": MetadataValue.text(str(report.snapshot_id)) if report.snapshot_id else None,
                "retention_ms": report.retention_ms,
                "retention_bytes": MetadataValue.int(report.retention_bytes),
                "policy_error": report.policy_error,
                "now": _utc(report.now_ms),
                "cutoff": _utc(report.cutoff_ms),
                "cutoff_ms": report.cutoff_ms,
                "retained_start": report.retained_start,
                "rows_deleted": MetadataValue.int(report.rows_deleted),
                "snapshots_expired": report.snapshots_expired,
                "data_files_deleted": report.data_files_deleted,
                "orphan_files_removed": report.orphan_files_removed,
                "descriptors_deleted": report.descriptors_deleted,
                "objects_deleted": report.objects_deleted,
                "deleted_object_ids": MetadataValue.json(report.deleted_object_ids),
                "first_object_offset": report.first_object_offset,
                "earliest_offset": report.earliest_offset,
                "wal_step": report.wal_step,
                "wal_deleted_segments": report.wal_deleted_segments,
                "wal_first_local_offset": report.wal_first_local_offset,
                "wal_bytes": MetadataValue.int(report.wal_bytes) if report.wal_bytes is not None else None,
            }
        )
    )


def _topic_and_day(context: AssetExecutionContext) -> tuple[TopicName, dt.date]:
    """The (topic, UTC day) of a ``topic_days_partitions`` run."""
    key = context.partition_key
    if not isinstance(key, MultiPartitionKey):
        key = topic_days_partitions.get_partition_key_from_str(key)
    dimensions = key.keys_by_dimension
    return TopicName.from_partition_key(dimensions["topic"]), dt.date.fromisoformat(dimensions["day"])


@asset(
    partitions_def=topic_days_partitions,
    group_name=MAINTENANCE_GROUP,
    deps=[iceberg_table],
    kinds={"spark", "iceberg"},
    retry_policy=TIERING_RETRY_POLICY,
    description=(
        "The topic's table after the schema rewrite declared in its table property "
        "danube.rewrite (a type change, a field split, a new partition spec) was applied to the "
        "day's data files: one verified replace snapshot per table partition, summary "
        "danube.rewrite-version. Backfill a range of days to rewrite them; re-running is a no-op."
    ),
)
def schema_rewrite(
    context: AssetExecutionContext,
    etcd: EtcdResource,
    iceberg_catalog: IcebergCatalogResource,
    spark: SparkResource,
) -> MaterializeResult[Any]:
    """:func:`danube_pipeline.lake.rewrite.rewrite_table` on the topic's table for the partition's
    day. Spark starts only when the table declares a rewrite.

    The partitions ``{topic}-part-{i}`` of a partitioned topic share one table: partition 0's
    runs rewrite it, the others' skip (as ``compacted_table`` does).

    Raises:
        Failure: the rewrite failed (its message says why); retried by the op's retry policy
            only for a conflict with a concurrent commit (``RewriteConflictError``).
    """
    topic, day = _topic_and_day(context)

    async def partition() -> PartitionOf | None:
        async with await etcd.connect() as store:
            return await partition_of(store, topic)

    part = asyncio.run(partition())
    if part is not None:
        topic = part.parent
    ident = iceberg.table_identifier(topic)
    table_name = ".".join(ident)
    base = {"table": f"{iceberg_catalog.catalog_name()}.{table_name}", "day": day.isoformat()}
    if part is not None and part.index != 0:
        context.log.info(f"{table_name} is rewritten by the runs of partition 0")
        return MaterializeResult(metadata={**base, "skipped": "rewritten by partition 0's runs"})
    catalog = iceberg_catalog.load()
    if not catalog.table_exists(ident):
        context.log.info(f"{table_name} does not exist yet; nothing to rewrite")
        return MaterializeResult(metadata={**base, "skipped": "table does not exist"})
    if read_rewrite_spec(catalog.load_table(ident)) is None:
        context.log.info(f"{table_name} declares no rewrite (table property danube.rewrite)")
        return MaterializeResult(metadata={**base, "skipped": "no rewrite declared"})
    try:
        with spark.session() as session:
            report = rewrite_table(session, catalog, topic, catalog_name=spark.resolved_catalog_name(), day=day)
    except RewriteError as e:
        # a bad spec or a failed verification fails the same way on a retry: only a conflict
        # with a concurrent commit (RewriteConflictError, retriable) is worth the op retries
        raise Failure(
            description=str(e), metadata={**base, "error": type(e).__name__}, allow_retries=e.retriable
        ) from e
    context.log.info(_rewrite_summary(report))
    return MaterializeResult(metadata={**base, **_rewrite_metadata(report)})


def _rewrite_summary(report: RewriteReport) -> str:
    if report.already_finalized:
        return f"{report.table}: rewrite version {report.version} already finished; nothing to do"
    return (
        f"{report.table} {report.day}: rewrite version {report.version}: {len(report.rewritten)} partitions "
        f"rewritten ({sum(u.files_before for u in report.rewritten)} → "
        f"{sum(u.files_after for u in report.rewritten)} data files, "
        f"{sum(u.rows for u in report.rewritten)} rows), {len(report.skipped)} already done; "
        f"{report.remaining_files} files left in the table"
        + ("; staged" if report.staged else "")
        + ("; finalized" if report.finalized else "")
    )


def _rewrite_metadata(report: RewriteReport) -> dict[str, Any]:
    """The ``schema_rewrite`` materialization's metadata (unknown values left out)."""
    rewritten = report.rewritten
    return known(
        {
            "version": report.version,
            "already_finalized": report.already_finalized or None,
            "staged": report.staged,
            "finalized": report.finalized,
            "retired_columns": MetadataValue.json(dict(report.retired)) if report.retired else None,
            "partitions_rewritten": len(rewritten),
            "partitions_skipped": len(report.skipped),
            "rows": MetadataValue.int(sum(u.rows for u in rewritten)),
            "rows_converted": MetadataValue.int(sum(u.rows_converted for u in rewritten)),
            "data_files_before": sum(u.files_before for u in rewritten),
            "data_files_after": sum(u.files_after for u in rewritten),
            "table_data_files_before": report.table_data_files_before if not report.already_finalized else None,
            "table_data_files_after": report.table_data_files_after if not report.already_finalized else None,
            "remaining_files": report.remaining_files if not report.already_finalized else None,
            "snapshot_before": MetadataValue.text(str(report.snapshot_before)) if report.snapshot_before else None,
            "snapshot_after": MetadataValue.text(str(report.snapshot_after)) if report.snapshot_after else None,
            "snapshot_ids": MetadataValue.json([str(s) for s in report.snapshot_ids]),
            "partitions": MetadataValue.json(
                [
                    {
                        "partition": u.partition,
                        "status": u.status,
                        "files_before": u.files_before,
                        "files_after": u.files_after,
                        "rows": u.rows,
                        "rows_converted": u.rows_converted,
                        **({"snapshot_id": str(u.snapshot_id)} if u.snapshot_id is not None else {}),
                    }
                    for u in report.units
                ]
            ),
            # checksums as text: they are exact sums of 64-bit hashes and exceed 2**63
            "checksums": MetadataValue.json(
                {u.partition: {"before": str(u.checksum_before), "after": str(u.checksum_after)} for u in rewritten}
            ),
        }
    )
