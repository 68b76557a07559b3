"""The continuous writer's Prometheus metrics (:mod:`assets.writer_metrics`): the export lag
computed from what a pass saw, and the counters and histograms of a real writer's commits
against a real etcd, broker, object store and Iceberg catalog, read back over HTTP."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from assets.continuous_writer import ContinuousWriter, WriterConfig, main
from assets.writer_metrics import TopicProgress, WriterMetrics, parse_listen
from danube_pipeline.client import DanubeClient
from danube_pipeline.client.types import SegmentInfo
from danube_pipeline.dev.stack import DevStack
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.lake import iceberg
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore

TOPIC = TopicName("default", "metered")
OTHER = TopicName("other", "gone")


def _value(metrics: WriterMetrics, name: str, topic: TopicName = TOPIC) -> float | None:
    return metrics.registry.get_sample_value(name, {"namespace": topic.namespace, "topic": topic.path})


@pytest.mark.unit
def test_lag_counts_records_past_the_committed_offset_and_ages_the_oldest() -> None:
    metrics = WriterMetrics()
    segment = SegmentInfo(start_offset=10, end_offset=19, size_bytes=100, record_count=10,
                          created_at_ms=1_000_000, sealed_at_ms=1_004_000)
    # committed through 9; 10..24 pending, the oldest in the segment created at 1_000_000 ms
    metrics.observe_progress(TOPIC, TopicProgress(25, [segment], 9, 999_000), now_ms=1_030_000)
    assert _value(metrics, "danube_export_lag_messages") == 15
    assert _value(metrics, "danube_export_lag_seconds") == 30.0
    # committed through 19: the rest is in the active segment, younger than the last sealing
    metrics.observe_progress(TOPIC, TopicProgress(25, [segment], 19, 1_002_000), now_ms=1_030_000)
    assert _value(metrics, "danube_export_lag_messages") == 5
    assert _value(metrics, "danube_export_lag_seconds") == 26.0
    metrics.observe_progress(TOPIC, TopicProgress(25, [segment], 24, 1_020_000), now_ms=1_030_000)
    assert _value(metrics, "danube_export_lag_messages") == 0 and _value(metrics, "danube_export_lag_seconds") == 0
    # a topic no longer listed loses its series
    metrics.observe_progress(OTHER, TopicProgress(3, [], None, None))
    assert _value(metrics, "danube_export_lag_messages", OTHER) == 3
    metrics.retain([TOPIC])
    assert _value(metrics, "danube_export_lag_messages", OTHER) is None
    assert _value(metrics, "danube_export_lag_messages") == 0


@pytest.mark.unit
def test_listen_addresses_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_listen("127.0.0.1:9641") == ("127.0.0.1", 9641)
    assert parse_listen("[::1]:0") == ("::1", 0)
    for bad in ("9641", "host:", ":9641", "host:99999", "host:http"):
        with pytest.raises(ValueError):
            parse_listen(bad)
    with pytest.raises(SystemExit) as info:
        main(["--metrics-listen", "nowhere"])
    assert info.value.code == 2 and "--metrics-listen" in capsys.readouterr().err


@pytest.mark.integration
def test_a_writer_exports_its_commits_and_lag_over_http(
    etcd_endpoints: list[str], start_broker: Callable[..., BrokerProcess], tmp_path: Path
) -> None:
    """Three records wait (lag 3), then are sealed and committed in one snapshot (lag 0,
    one commit of 3 rows and their bytes, one latency and one data-file observation), as
    ``/metrics`` shows them."""
    broker = start_broker(segment_max_age_s=600.0, extra_args=["--object-store-url", (tmp_path / "objects").as_uri()])
    objects = ObjectStore((tmp_path / "objects").as_uri())
    catalog = iceberg.load_catalog(uri=f"sqlite:///{tmp_path / 'catalog.db'}", warehouse=(tmp_path / "warehouse").as_uri())
    metrics = WriterMetrics()
    server = metrics.serve("127.0.0.1:0")
    now = [100.0]

    async def scenario() -> tuple[float | None, float | None]:
        async with await MetadataStore.connect(etcd_endpoints) as store, DanubeClient([broker.address]) as client:
            writer = ContinuousWriter(store=store, admin=client.admin, objects=objects, catalog=catalog,
                                      config=WriterConfig(commit_interval_s=5.0), metrics=metrics, clock=lambda: now[0])
            async with client.producer(TOPIC.path, producer_name="metered") as producer:
                for payload in (b"a", b"bb", b"ccc"):
                    await producer.send(payload)
            await writer.run_once()  # seen, not sealed yet
            waiting = _value(metrics, "danube_export_lag_messages"), _value(metrics, "danube_iceberg_commits_total")
            now[0] += 5.1
            [done] = await writer.run_once()
            assert done.table is not None and done.table.rows_appended == 3
            return waiting

    try:
        waiting = asyncio.run(scenario())
        with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=5) as response:
            body = response.read().decode()
    finally:
        server.close()
    assert waiting == (3, None)
    samples = {
        (s.name, s.labels.get("le")): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.labels.get("topic") == TOPIC.path and s.labels.get("namespace") == TOPIC.namespace
    }
    assert samples[("danube_export_lag_messages", None)] == 0
    assert samples[("danube_export_lag_seconds", None)] == 0
    assert samples[("danube_iceberg_commits_total", None)] == 1
    assert samples[("danube_iceberg_rows_committed_total", None)] == 3
    assert samples[("danube_iceberg_bytes_committed_total", None)] > 0
    assert samples[("danube_iceberg_commit_latency_ms_count", None)] == 1
    assert samples[("danube_iceberg_commit_latency_ms_sum", None)] > 0
    assert samples[("danube_iceberg_data_files_per_commit_count", None)] == 1
    assert samples[("danube_iceberg_data_files_per_commit_bucket", "1.0")] == 1
    assert ("danube_iceberg_dead_letter_rows_total", None) not in samples  # none dead-lettered


@pytest.mark.integration
def test_the_dev_stack_starts_a_writer_serving_metrics_and_json_logs(tmp_path: Path) -> None:
    """``DevStack(writer_metrics_listen=..., log_format="json")``: the writer serves its
    families at ``writer_metrics_addr``; the writer and the broker write JSON lines."""
    home = tmp_path / "dev"
    stack = DevStack(home, dagster_home=None, ui=False, writer_metrics_listen="127.0.0.1:0", log_format="json")
    stack.start()
    try:
        assert stack.writer is not None and stack.writer_metrics_addr is not None
        with urllib.request.urlopen(f"http://{stack.writer_metrics_addr}/metrics", timeout=5) as response:
            body = response.read().decode()
    finally:
        stack.stop()
    names = {family.name for family in text_string_to_metric_families(body)}
    assert {"danube_export_lag_messages", "danube_iceberg_commits", "danube_iceberg_commit_latency_ms"} <= names
    writer_lines = [json.loads(line) for line in stack.writer.log_path.read_text().splitlines() if line.strip()]
    assert any(f"metrics at http://{stack.writer_metrics_addr}/metrics" in line["message"] for line in writer_lines)
    broker_lines = [json.loads(line) for line in stack.brokers[0].log_path.read_text().splitlines() if line.strip()]
    assert broker_lines and all("broker" in line for line in broker_lines)
