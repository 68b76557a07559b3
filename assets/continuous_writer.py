"""The continuous writer: every topic's sealed WAL segments into its Iceberg table within seconds.

``make dev`` runs it beside Dagster (``python -m assets.continuous_writer``). It does what a
``tiering_job`` run does, without the run: for each topic (discovered in etcd with
:func:`danube_pipeline.lake.tiering.list_topic_roots`, ``docs/etcd-layout.md`` §3.1) it

1. seals the topic's active WAL segment through the broker's admin API
   (``SealActiveSegment``) once the segment has held records for ``commit_interval_s``
   seconds or holds ``commit_max_records`` records: the time and size thresholds of a commit.
   A broker with a shorter ``--segment-max-age-s`` or ``--segment-max-bytes`` seals first on
   its own;
2. tiers the sealed segments (:func:`~danube_pipeline.lake.tiering.tier_sealed_segments`: objects
   plus completed descriptors, §5.1, §5.2) and appends the new objects to the topic's table
   (:func:`~danube_pipeline.lake.tiering.commit_objects_to_table`: one snapshot per object, exactly
   once);
3. records each step that changed something as a runless ``AssetMaterialization`` of
   ``segment_objects`` or ``iceberg_table`` for the topic's partition, in the Dagster instance
   of ``DAGSTER_HOME`` (``DagsterInstance.report_runless_asset_event``), with the same
   metadata as the assets' runs (rows, bytes, offsets, snapshot id), so the UI shows every
   commit (:mod:`assets.writer_reporting`). Reports are written on a thread of their own,
   in order, so the next pass does not wait for Dagster's event storage;
4. with ``--metrics-listen host:port``, serves Prometheus metrics at ``/metrics``: export lag
   per topic in records and seconds, commits, rows and bytes committed, commit latency, data
   files per commit, dead-letter rows (:mod:`assets.writer_metrics`).

A record therefore waits at most about ``commit_interval_s + poll_interval_s`` plus one tiering
pass before it is queryable (``benchmarks/freshness.py`` measures it): the interval counts from
the previous seal, so a pass slower than it does not add the interval again. After each commit
the table step's upkeep merges small data files and expires snapshots
(:mod:`danube_pipeline.lake.iceberg.upkeep`), so one commit a second leaves a bounded number of
both.

It coexists with the sensor path (``sealed_segments_sensor`` → ``tiering_job``): both steps
are idempotent. A completed descriptor or a committed end offset makes the other writer skip
what is done, and an Iceberg commit that loses the catalog's compare-and-swap to the other
writer is retried on the refreshed table, which skips the offsets already committed
(:func:`danube_pipeline.lake.iceberg.append_rows`; Iceberg spec, "Optimistic Concurrency"). A
pass that fails (broker, etcd, catalog) is logged and retried with a backoff; it never
stops the other topics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dagster import DagsterInstance
from pyiceberg.catalog import Catalog
from pyiceberg.exceptions import CommitFailedException
from sqlalchemy.exc import SQLAlchemyError

from assets.resources import IcebergCatalogResource, ObjectStoreResource
from assets.writer_metrics import MetricsServer, TopicProgress, WriterMetrics, parse_listen
from assets.writer_reporting import DagsterReporter
from danube_pipeline import logs, settings
from danube_pipeline.aio import wait_set
from danube_pipeline.errors import DanubeError, TopicNotFoundError
from danube_pipeline.names import TopicName
from danube_pipeline.storage.identity import check_store_identity
from danube_pipeline.storage.objectstore import ObjectStore
from danube_pipeline.schemas.registry import SchemaRegistry
from danube_pipeline.lake.tiering import (
    TableReport,
    TieringReport,
    commit_objects_to_table,
    list_topic_roots,
    tier_sealed_segments,
)

if TYPE_CHECKING:
    from danube_pipeline.client.admin import AdminClient
    from danube_pipeline.client.types import SegmentInfo
    from danube_pipeline.metadata.store import MetadataStore

__all__ = [
    "DEFAULT_COMMIT_INTERVAL_S",
    "ContinuousWriter",
    "DagsterReporter",
    "TopicPass",
    "WriterConfig",
    "WriterConfigError",
    "main",
]

log = logging.getLogger("assets.continuous_writer")


DEFAULT_COMMIT_INTERVAL_S = 5.0
"""Seconds a record may wait in the active WAL segment before the writer seals it."""
DEFAULT_COMMIT_MAX_RECORDS = 100_000
"""Records in the active WAL segment at which the writer seals it without waiting."""
DEFAULT_POLL_INTERVAL_S = 1.0
"""Seconds between two passes over the topics."""

#: Failures of one topic's pass that are logged and retried (broker, etcd, catalog, object store).
RETRIED_ERRORS: tuple[type[BaseException], ...] = (DanubeError, CommitFailedException, SQLAlchemyError, OSError)


class WriterConfigError(DanubeError, ValueError):
    """A :class:`WriterConfig` value out of range.

    Attributes:
        name: the option, e.g. ``commit_interval_s``.
        value: the value given.
        reason: what it must be.
    """

    def __init__(self, name: str, value: object, reason: str) -> None:
        self.name = name
        self.value = value
        self.reason = reason
        super().__init__(f"continuous writer option {name}={value!r}: {reason}")


@dataclass(frozen=True, slots=True)
class WriterConfig:
    """When the writer seals, tiers and commits.

    Attributes:
        commit_interval_s: seal a topic's active WAL segment once the writer has seen it hold
            records for this many seconds (the time threshold of a commit).
        commit_max_records: seal it as soon as it holds this many records (the size
            threshold).
        poll_interval_s: seconds between two passes over the topics.
        topic_refresh_interval_s: seconds between two reads of the topic list from etcd.
        full_pass_interval_s: seconds after which a topic is tiered and committed even though
            the broker lists no new sealed segment (segments an earlier owner kept, a pass that
            stopped short).
        max_backoff_s: the longest wait before retrying a topic whose pass failed or stalled
            (doubling from ``poll_interval_s``).

    Raises:
        WriterConfigError: a value is not positive, or ``max_backoff_s`` is below
            ``poll_interval_s``.
    """

    commit_interval_s: float = DEFAULT_COMMIT_INTERVAL_S
    commit_max_records: int = DEFAULT_COMMIT_MAX_RECORDS
    poll_interval_s: float = DEFAULT_POLL_INTERVAL_S
    topic_refresh_interval_s: float = 2.0
    full_pass_interval_s: float = 60.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("commit_interval_s", "poll_interval_s", "topic_refresh_interval_s", "full_pass_interval_s"):
            value = getattr(self, name)
            if not value > 0:
                raise WriterConfigError(name, value, "must be a positive number of seconds")
        if self.commit_max_records < 1:
            raise WriterConfigError("commit_max_records", self.commit_max_records, "must be at least 1")
        if not self.max_backoff_s >= self.poll_interval_s:
            raise WriterConfigError("max_backoff_s", self.max_backoff_s, "must be at least poll_interval_s")


@dataclass(frozen=True, slots=True)
class TopicPass:
    """What one pass did for one topic.

    Attributes:
        topic: the topic.
        sealed_end_offset: the end offset of the segment the writer sealed, ``None`` when it
            sealed none.
        tiering: the tiering step's report, ``None`` when the step did not run (nothing new
            was sealed).
        table: the table step's report, ``None`` when the step did not run.
    """

    topic: TopicName
    sealed_end_offset: int | None = None
    tiering: TieringReport | None = None
    table: TableReport | None = None


@dataclass
class _TopicState:
    active_start: int | None = None
    """First offset of the active segment when the writer last looked."""
    pending_since: float | None = None
    """Monotonic time the writer first saw records in that active segment, or sealed the segment
    before it (its records arrived after that seal)."""
    committed_end_offset: int | None = None
    """The table's committed end offset for the topic after the writer's last table step."""
    last_full_pass: float | None = None
    next_offset: int | None = None
    """``DescribeTopic.next_offset`` at the writer's last look; with the two below, the lag gauges."""
    sealed: list[SegmentInfo] = field(default_factory=list)
    last_commit_ms: int | None = None
    failures: int = 0
    retry_at: float = 0.0


class ContinuousWriter:
    """Seals, tiers and commits every topic in a loop (see the module docstring).

    Example::

        async with await MetadataStore.connect(endpoints) as store, DanubeClient(brokers) as client:
            writer = ContinuousWriter(store=store, admin=client.admin, objects=objects, catalog=catalog)
            await writer.run(stop_event)
    """

    def __init__(
        self,
        *,
        store: MetadataStore,
        admin: AdminClient,
        objects: ObjectStore,
        catalog: Catalog,
        config: WriterConfig | None = None,
        reporter: DagsterReporter | None = None,
        metrics: WriterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Args:
        store: the connected metadata store.
        admin: the broker admin API (``DanubeClient.admin``).
        objects: the object store segments are tiered to.
        catalog: the shared Iceberg catalog.
        config: thresholds and intervals; :class:`WriterConfig` defaults when ``None``.
        reporter: where commits are recorded as materializations; none when ``None``.
        metrics: the Prometheus metrics to update (:mod:`assets.writer_metrics`); none when ``None``.
        clock: monotonic seconds (tests pass their own).
        """
        self.store = store
        self.admin = admin
        self.objects = objects
        self.catalog = catalog
        self.config = config or WriterConfig()
        self.reporter = reporter
        self.metrics = metrics
        self.clock = clock
        self.registry = SchemaRegistry(store)
        self.topics: list[TopicName] = []
        self._topics_read_at: float | None = None
        self._state: dict[TopicName, _TopicState] = {}

    async def run(self, stop: asyncio.Event) -> None:
        """Pass over the topics every ``poll_interval_s`` until ``stop`` is set.

        A pass in progress finishes before the loop returns, so nothing is left half done
        (both steps are idempotent anyway).

        Raises:
            MetadataStoreError: the topic list could not be read from etcd at the first pass
                (later failures are logged and retried).
        """
        while not stop.is_set():
            await self.run_once()
            await wait_set(stop, self.config.poll_interval_s)

    async def run_once(self) -> list[TopicPass]:
        """One pass: refresh the topic list when due, then :meth:`step` every topic not
        waiting for a retry.

        Returns:
            The passes that ran, in topic order (failed ones are left out).

        Raises:
            MetadataStoreError: the first read of the topic list failed.
        """
        now = self.clock()
        if self._topics_read_at is None or now - self._topics_read_at >= self.config.topic_refresh_interval_s:
            try:
                self.topics = await list_topic_roots(self.store)
                self._topics_read_at = now
                if self.metrics is not None:
                    self.metrics.retain(self.topics)
            except DanubeError:
                if self._topics_read_at is None:
                    raise
                log.warning("could not refresh the topic list; keeping %d topics", len(self.topics), exc_info=True)
        done: list[TopicPass] = []
        for topic in self.topics:
            state = self._state.setdefault(topic, _TopicState())
            if self.clock() < state.retry_at:
                continue
            try:
                with logs.bind(topic=topic.path):  # the step's log lines carry the topic
                    result = await self.step(topic)
            except TopicNotFoundError:
                log.info("%s: not found on the brokers (deleted, or not loaded yet)", topic.path)
                self._back_off(state)
                continue
            except RETRIED_ERRORS as exc:
                self._back_off(state)
                log.warning("%s: pass failed (%s: %s); retrying in %.1f s", topic.path, type(exc).__name__, exc,
                            state.retry_at - self.clock())
                continue
            done.append(result)
            if self.reporter is not None:
                self.reporter.submit(result)  # recorded on the reporter's thread, in order
            if self.metrics is not None and state.next_offset is not None:
                self.metrics.observe_progress(topic, TopicProgress(
                    state.next_offset, state.sealed, state.committed_end_offset, state.last_commit_ms))
        return done

    def _back_off(self, state: _TopicState) -> None:
        state.failures += 1
        delay = min(self.config.max_backoff_s, self.config.poll_interval_s * 2 ** min(state.failures, 16))
        state.retry_at = self.clock() + delay

    async def step(self, topic: TopicName) -> TopicPass:
        """Seal, tier and commit ``topic`` when its thresholds say so.

        The active segment is sealed once it has held records for ``commit_interval_s``
        (as seen by the writer) or holds ``commit_max_records``. Tiering and the table step
        run when the broker lists a sealed segment past the table's committed end offset, at
        the topic's first pass, and every ``full_pass_interval_s``.

        Args:
            topic: the topic.

        Returns:
            What the pass did.

        Raises:
            TopicNotFoundError: the brokers do not know the topic.
            DanubeError: as :func:`~danube_pipeline.lake.tiering.tier_sealed_segments` and
                :func:`~danube_pipeline.lake.tiering.commit_objects_to_table`, or a broker or etcd
                request failed.
            CommitFailedException: an Iceberg commit kept conflicting.
        """
        state = self._state.setdefault(topic, _TopicState())
        sealed_end, sealed_now = await self._seal_if_due(topic, state)
        now = self.clock()
        full_pass_due = state.last_full_pass is None or now - state.last_full_pass >= self.config.full_pass_interval_s
        # A sealed end below the committed one: the topic was deleted and created again (its
        # table is retired by the pass, lake.tiering.incarnation).
        behind = sealed_end is not None and (
            state.committed_end_offset is None or sealed_end != state.committed_end_offset
        )
        if not (behind or full_pass_due):
            state.failures = 0
            return TopicPass(topic, sealed_now)
        tiering = await tier_sealed_segments(topic, store=self.store, admin=self.admin, objects=self.objects)
        started = time.perf_counter()
        table = await commit_objects_to_table(
            topic, store=self.store, objects=self.objects, catalog=self.catalog, registry=self.registry
        )
        if self.metrics is not None:
            self.metrics.observe_table_step(topic, table, duration_ms=(time.perf_counter() - started) * 1000)
        state.committed_end_offset, state.last_commit_ms = table.committed_end_offset, table.committed_at_ms
        state.last_full_pass = now
        if table.objects_appended:
            log.info(
                "%s: offsets %s..%s committed to %s (%d rows, %d snapshots, snapshot %s)",
                topic.path, table.first_offset, table.last_offset, table.table, table.rows_appended,
                table.objects_appended, table.snapshot_id,
            )
        stalled = sealed_end is not None and (
            table.committed_end_offset is None or table.committed_end_offset < sealed_end
        )
        if stalled and tiering.waiting_at is None and tiering.segments_expired == 0:
            log.info("%s: sealed through %d, committed through %s; retrying", topic.path, sealed_end,
                     table.committed_end_offset)
        if stalled:
            # Waiting for an unavailable range, expired segments, or a concurrent writer that
            # has not completed a descriptor yet: look again after a backoff, not every poll.
            self._back_off(state)
        else:
            state.failures = 0
        return TopicPass(topic, sealed_now, tiering, table)

    async def _seal_if_due(self, topic: TopicName, state: _TopicState) -> tuple[int | None, int | None]:
        """Seal the active segment when a threshold is reached.

        Returns:
            The end offset of the last sealed segment afterwards (``None`` when the broker
            lists none), and the end offset of the segment sealed by this call (or ``None``).
        """
        sealed = [s for s in await self.admin.list_sealed_segments(topic.path) if s.end_offset >= s.start_offset]
        description = await self.admin.describe_topic(topic.path)
        sealed_end = max((s.end_offset for s in sealed), default=None)
        state.next_offset, state.sealed = description.next_offset, sealed
        active_start = sealed_end + 1 if sealed_end is not None else description.first_local_offset
        active_records = description.next_offset - active_start
        now = self.clock()
        if active_records <= 0:
            state.active_start, state.pending_since = active_start, None
            return sealed_end, None
        if state.active_start != active_start or state.pending_since is None:
            state.active_start, state.pending_since = active_start, now
        waited = now - state.pending_since
        if waited < self.config.commit_interval_s and active_records < self.config.commit_max_records:
            return sealed_end, None
        segment = await self.admin.seal_active_segment(topic.path)
        state.pending_since = None
        if segment is None:
            return sealed_end, None
        # the next segment's records arrive from now on: they have waited since the seal at most,
        # however long this pass's tiering and commit take (a pass slower than the interval no
        # longer adds the interval again after it)
        state.active_start, state.pending_since = segment.end_offset + 1, now
        log.debug("%s: sealed %d..%d after %.1f s (%d records)", topic.path, segment.start_offset,
                  segment.end_offset, waited, segment.record_count)
        return max(segment.end_offset, sealed_end if sealed_end is not None else -1), segment.end_offset


def _write_ready_file(path: Path, metrics_addr: str | None) -> None:
    ready: dict[str, object] = {"pid": os.getpid()}
    if metrics_addr is not None:
        ready["metrics_addr"] = metrics_addr
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(ready), encoding="utf-8")
    tmp.replace(path)


async def _serve(args: argparse.Namespace, config: WriterConfig) -> None:
    from danube_pipeline.client import DanubeClient
    from danube_pipeline.metadata.store import MetadataStore

    objects = ObjectStoreResource().store()
    catalog = IcebergCatalogResource().load()
    reporter: DagsterReporter | None = None
    instance: DagsterInstance | None = None
    if not args.no_dagster:
        instance = DagsterInstance.get()
        reporter = DagsterReporter(instance, catalog_name=settings.catalog_name(), objects=objects)
        reporter.prepare()
    metrics = WriterMetrics() if args.metrics_listen else None
    server: MetricsServer | None = metrics.serve(args.metrics_listen) if metrics is not None else None
    if server is not None:
        log.info("continuous writer: metrics at http://%s/metrics", server.address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with await MetadataStore.connect(settings.etcd_endpoints()) as store, \
                DanubeClient(settings.broker_addresses()) as client:
            await check_store_identity(store, objects, who="continuous writer")
            writer = ContinuousWriter(
                store=store, admin=client.admin, objects=objects, catalog=catalog, config=config, reporter=reporter,
                metrics=metrics,
            )
            log.info(
                "continuous writer: etcd %s, brokers %s, catalog %s; sealing after %.1f s or %d records%s",
                ",".join(settings.etcd_endpoints()), ",".join(settings.broker_addresses()), settings.catalog_uri(),
                config.commit_interval_s, config.commit_max_records,
                "" if instance is None else f"; materializations in DAGSTER_HOME={os.environ.get('DAGSTER_HOME')}",
            )
            if args.ready_file:
                _write_ready_file(Path(args.ready_file), server.address if server is not None else None)
            await writer.run(stop)
    finally:
        if server is not None:
            server.close()
        if reporter is not None:
            reporter.close()  # the last passes' materializations are recorded before the exit
        if instance is not None:
            instance.dispose()


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m assets.continuous_writer``: run the writer until SIGINT or SIGTERM.

    Endpoints come from the ``DANUBE_*`` variables (:mod:`danube_pipeline.settings`), the
    Dagster instance from ``DAGSTER_HOME``.

    Returns:
        The exit status: 0 after a signal, 2 for bad options or a missing ``DAGSTER_HOME``.
    """
    parser = argparse.ArgumentParser(prog="python -m assets.continuous_writer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit-interval-s", type=_positive_float, default=DEFAULT_COMMIT_INTERVAL_S,
                        help=f"seal an active segment whose records waited this long (default {DEFAULT_COMMIT_INTERVAL_S})")
    parser.add_argument("--commit-max-records", type=_positive_int, default=DEFAULT_COMMIT_MAX_RECORDS,
                        help=f"seal an active segment holding this many records (default {DEFAULT_COMMIT_MAX_RECORDS})")
    parser.add_argument("--poll-interval-s", type=_positive_float, default=DEFAULT_POLL_INTERVAL_S,
                        help=f"seconds between passes over the topics (default {DEFAULT_POLL_INTERVAL_S})")
    parser.add_argument("--topic-refresh-interval-s", type=_positive_float, default=2.0,
                        help="seconds between reads of the topic list from etcd (default 2)")
    parser.add_argument("--no-dagster", action="store_true", help="do not record materializations in Dagster")
    parser.add_argument("--ready-file", default=None,
                        help="write {\"pid\": N} here once connected (and \"metrics_addr\" with --metrics-listen)")
    parser.add_argument("--metrics-listen", default=None, metavar="HOST:PORT",
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any free port; default off)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--log-format", default="text", choices=logs.LOG_FORMATS,
                        help="text lines, or one JSON object per line with a topic field where it applies")
    args = parser.parse_args(argv)
    if args.metrics_listen is not None:
        try:
            parse_listen(args.metrics_listen)
        except ValueError as exc:
            parser.error(f"--metrics-listen: {exc}")
    logs.configure(args.log_level, args.log_format)
    # the Dagster instance's SQL storage runs Alembic at open; its INFO lines ("Context impl
    # SQLiteImpl.", "Will assume non-transactional DDL.") say nothing to a writer's reader
    logging.getLogger("alembic").setLevel(max(logging.WARNING, logging.getLevelName(args.log_level)))
    try:
        config = WriterConfig(
            commit_interval_s=args.commit_interval_s,
            commit_max_records=args.commit_max_records,
            poll_interval_s=args.poll_interval_s,
            topic_refresh_interval_s=args.topic_refresh_interval_s,
            max_backoff_s=max(30.0, args.poll_interval_s),
        )
    except WriterConfigError as exc:
        parser.error(str(exc))
    if not args.no_dagster and not os.environ.get("DAGSTER_HOME"):
        print("error: DAGSTER_HOME is not set (the Dagster instance to record commits in); "
              "set it or pass --no-dagster", file=sys.stderr)
        return 2
    asyncio.run(_serve(args, config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
