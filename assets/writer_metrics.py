"""The continuous writer's Prometheus metrics, served at ``/metrics`` with ``--metrics-listen host:port``.

Every series carries the labels ``namespace`` and ``topic`` (the topic's path, ``/ns/topic``):

``danube_export_lag_messages`` (gauge)
    records the broker acknowledged (below ``DescribeTopic.next_offset``) that are not yet
    queryable in the topic's Iceberg table (above its committed end offset,
    ``danube.committed-end-offset``).
``danube_export_lag_seconds`` (gauge)
    the age of the oldest of them, an upper bound: the same measure as the ``fresh`` asset
    check (:func:`danube_pipeline.lake.freshness.oldest_pending_ms`); ``0`` when none is pending.
``danube_iceberg_commits_total``, ``danube_iceberg_rows_committed_total``, ``danube_iceberg_bytes_committed_total``
    Iceberg snapshots appended (one per segment object), rows appended, and bytes of segment
    objects read for them.
``danube_iceberg_commit_latency_ms`` (histogram)
    the duration of each table step that appended (one or more snapshots), in milliseconds.
``danube_iceberg_data_files_per_commit`` (histogram)
    data files each such step added to the table.
``danube_iceberg_dead_letter_rows_total``
    records the writer sent to the topic's dead-letter table ``{topic}__dlq``.

The metrics live in their own :class:`~prometheus_client.CollectorRegistry` (no process or
platform collectors), so a test can read them and two writers in one process do not collide.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from danube_pipeline.lake.freshness import oldest_pending_ms

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from danube_pipeline.client.types import SegmentInfo
    from danube_pipeline.lake.tiering import TableReport
    from danube_pipeline.names import TopicName

__all__ = ["COMMIT_LATENCY_BUCKETS_MS", "DATA_FILES_BUCKETS", "MetricsServer", "TopicProgress", "WriterMetrics",
           "parse_listen"]

LABELS = ("namespace", "topic")
COMMIT_LATENCY_BUCKETS_MS = (5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 30000.0)
"""Bucket bounds of ``danube_iceberg_commit_latency_ms``, in milliseconds."""
DATA_FILES_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
"""Bucket bounds of ``danube_iceberg_data_files_per_commit``."""


def parse_listen(address: str) -> tuple[str, int]:
    """``host:port`` (``[::1]:9641`` for IPv6) as ``(host, port)``.

    Raises:
        ValueError: not ``host:port``, or the port is not 0..65535.
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"expected host:port, got {address!r}")
    return host.removeprefix("[").removesuffix("]"), int(port_text)


@dataclass(frozen=True, slots=True)
class TopicProgress:
    """What the writer knows about one topic after a pass, for the lag gauges.

    Attributes:
        next_offset: the offset the broker gives the next record (``DescribeTopic``).
        sealed_segments: the topic's sealed WAL segments the broker listed.
        committed_end_offset: the table's committed end offset for the topic, ``None`` before
            any commit.
        last_commit_ms: the table's newest snapshot time, ms since the Unix epoch, or ``None``.
    """

    next_offset: int
    sealed_segments: Sequence[SegmentInfo]
    committed_end_offset: int | None
    last_commit_ms: int | None


class MetricsServer:
    """The ``/metrics`` HTTP server (prometheus_client's, in a daemon thread).

    Attributes:
        address: ``host:port`` it listens on (the bound port when 0 was asked for).
    """

    def __init__(self, server: WSGIServer, host: str) -> None:
        self._server = server
        port = server.server_port
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def close(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()


class WriterMetrics:
    """The continuous writer's metrics (module docstring).

    Args:
        registry: where the metrics are registered; a new registry when ``None``.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True) if registry is None else registry
        r = self.registry
        self.lag_messages = Gauge("danube_export_lag_messages",
                                  "Acknowledged records not yet queryable in the topic's Iceberg table",
                                  LABELS, registry=r)
        self.lag_seconds = Gauge("danube_export_lag_seconds",
                                 "Age of the oldest record not yet queryable in Iceberg, in seconds (upper bound)",
                                 LABELS, registry=r)
        self.commits = Counter("danube_iceberg_commits", "Iceberg snapshots appended", LABELS, registry=r)
        self.rows = Counter("danube_iceberg_rows_committed", "Rows appended to Iceberg tables", LABELS, registry=r)
        self.bytes = Counter("danube_iceberg_bytes_committed",
                             "Bytes of segment objects appended to Iceberg tables", LABELS, registry=r)
        self.commit_latency_ms = Histogram("danube_iceberg_commit_latency_ms",
                                           "Duration of a table step that appended, in milliseconds",
                                           LABELS, buckets=COMMIT_LATENCY_BUCKETS_MS, registry=r)
        self.data_files = Histogram("danube_iceberg_data_files_per_commit",
                                    "Data files a table step added to the table", LABELS,
                                    buckets=DATA_FILES_BUCKETS, registry=r)
        self.dead_letters = Counter("danube_iceberg_dead_letter_rows",
                                    "Records sent to the dead-letter table", LABELS, registry=r)
        self._topics: set[TopicName] = set()

    def observe_progress(self, topic: TopicName, progress: TopicProgress, *, now_ms: int | None = None) -> None:
        """Set the topic's lag gauges.

        Args:
            topic: the topic.
            progress: what the pass saw.
            now_ms: the time to measure the age at, ms since the Unix epoch; default now.
        """
        now = int(time.time() * 1000) if now_ms is None else now_ms
        first_pending = 0 if progress.committed_end_offset is None else progress.committed_end_offset + 1
        pending = max(0, progress.next_offset - first_pending)
        lag_s = 0.0
        if pending:
            since = oldest_pending_ms(first_pending, progress.sealed_segments, progress.last_commit_ms)
            lag_s = max(0.0, (now - since) / 1000) if since is not None else 0.0
        labels = (topic.namespace, topic.path)
        self.lag_messages.labels(*labels).set(pending)
        self.lag_seconds.labels(*labels).set(lag_s)
        self._topics.add(topic)

    def observe_table_step(self, topic: TopicName, report: TableReport, *, duration_ms: float) -> None:
        """Count what one table step (:func:`~danube_pipeline.lake.tiering.commit_objects_to_table`)
        committed.

        Args:
            topic: the topic.
            report: the step's report.
            duration_ms: how long the step took, in milliseconds.
        """
        labels = (topic.namespace, topic.path)
        if report.dead_letter_records:
            self.dead_letters.labels(*labels).inc(report.dead_letter_records)
        if not report.objects_appended:
            return
        self.commits.labels(*labels).inc(report.objects_appended)
        self.rows.labels(*labels).inc(report.rows_appended)
        self.bytes.labels(*labels).inc(report.bytes_read)
        self.commit_latency_ms.labels(*labels).observe(duration_ms)
        self.data_files.labels(*labels).observe(max(0, report.data_files - report.data_files_before))
        self._topics.add(topic)

    def retain(self, topics: Sequence[TopicName]) -> None:
        """Drop the series of topics no longer listed (deleted), so they stop being exported."""
        for gone in self._topics - set(topics):
            labels = (gone.namespace, gone.path)
            for metric in (self.lag_messages, self.lag_seconds, self.commits, self.rows, self.bytes,
                           self.commit_latency_ms, self.data_files, self.dead_letters):
                try:
                    metric.remove(*labels)
                except KeyError:
                    pass
            self._topics.discard(gone)

    def serve(self, address: str) -> MetricsServer:
        """Serve ``/metrics`` on ``address`` in a daemon thread.

        Args:
            address: ``host:port``; port 0 picks a free port (see :attr:`MetricsServer.address`).

        Returns:
            The running server.

        Raises:
            ValueError: ``address`` is not ``host:port``.
            OSError: the address cannot be bound.
        """
        host, port = parse_listen(address)
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return MetricsServer(server, host)
