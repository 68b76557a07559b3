"""The Prometheus of ``make dev METRICS=1`` (:mod:`danube_pipeline.dev.prometheus`): the shipped
rules and the generated configuration pass ``promtool``; a real Prometheus discovers a real
broker through etcd, scrapes its rates and subscription lag, and fires ``DanubeBrokerDown``
when the broker is SIGKILLed (with a test copy of the rules whose ``for`` is 1 s instead of
30 s); ``DevStack(metrics=True)`` (``danube-pipeline dev --metrics``) wires it up, and every
metric the rules name is one a broker or the continuous writer serves.

Debian's ``prometheus`` package provides ``prometheus`` and ``promtool``
(``scripts/install-system-deps.sh``). Without it the tests skip when not run as root (nothing
can install it), and fail as root (CI installs it).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import eventually, eventually_sync
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess, free_port
from danube_pipeline.dev.prometheus import (
    BROKERS_JOB,
    PROMETHEUS_BIN_ENV,
    PROMETHEUS_LISTEN_ENV,
    PrometheusServer,
    prometheus_binary,
    promtool_binary,
    shipped_rules,
    target_group,
    write_targets,
)
from danube_pipeline.lake.freshness import DEFAULT_FRESHNESS_LIMIT_S

TOPIC = "/default/prom_rates"
SCRAPE_INTERVAL_S = 1.0


def _installed(find: Callable[[], str]) -> str:
    """``find()``'s binary; skip when it is missing and this is not root, else fail."""
    try:
        return find()
    except FileNotFoundError as exc:
        if os.geteuid() != 0:
            pytest.skip(f"{exc}; not root, so scripts/install-system-deps.sh cannot install it here")
        raise


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_installed(promtool_binary), *args], capture_output=True, text=True, timeout=60)


def _rules() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(shipped_rules().read_text())
    return data


def _rule(rules: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [r for group in rules["groups"] for r in group["rules"] if r.get("alert") == name]
    assert len(found) == 1, f"{len(found)} rules named {name}"
    return found[0]


# ------------------------------------------------------------------ the shipped files


@pytest.mark.integration
def test_shipped_rules_pass_promtool_and_name_every_required_alert() -> None:
    done = _promtool("check", "rules", str(shipped_rules()))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 9 rules found" in done.stdout
    rules = _rules()
    names = {r["alert"] for group in rules["groups"] for r in group["rules"]}
    assert names == {"DanubeUnavailableRange", "DanubeSegmentQuarantined", "DanubeExportLagOverFreshnessLimit",
                     "DanubeWalDiskNearlyFull", "DanubeNoLeader", "DanubeBrokerDown",
                     "DanubeSubscriptionBacklogGrowing", "DanubeTopicUnderMinIsr", "DanubeTopicUnderReplicated"}
    # the export-lag threshold is the `fresh` check's default limit
    threshold = re.search(r">\s*(\d+)\s*$", _rule(rules, "DanubeExportLagOverFreshnessLimit")["expr"].strip())
    assert threshold is not None and float(threshold.group(1)) == DEFAULT_FRESHNESS_LIMIT_S
    assert _rule(rules, "DanubeSubscriptionBacklogGrowing")["for"] == "10m"


@pytest.mark.integration
def test_generated_config_passes_promtool(tmp_path: Path) -> None:
    server = PrometheusServer(tmp_path / "prometheus", etcd_endpoints=["127.0.0.1:1"], writer_target="127.0.0.1:9641")
    config = server.write_config()
    done = _promtool("check", "config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout and "1 rule files found" in done.stdout
    assert json.loads((tmp_path / "prometheus" / "targets" / "writer.json").read_text()) == [
        {"targets": ["127.0.0.1:9641"], "labels": {}}
    ]


@pytest.mark.unit
def test_target_groups_and_atomic_target_files(tmp_path: Path) -> None:
    assert target_group("http://127.0.0.1:9400/metrics", {"broker": "7"}) == {
        "targets": ["127.0.0.1:9400"], "labels": {"broker": "7"}}
    assert target_group("https://h:1/m") == {"targets": ["h:1"], "labels": {"__scheme__": "https",
                                                                            "__metrics_path__": "/m"}}
    with pytest.raises(ValueError, match="not a metrics URL"):
        target_group("http:///metrics")
    path = tmp_path / "targets" / "brokers.json"
    assert write_targets(path, [target_group("127.0.0.1:9400")]) is True
    assert write_targets(path, [target_group("127.0.0.1:9400")]) is False  # unchanged: not rewritten
    assert json.loads(path.read_text()) == [{"targets": ["127.0.0.1:9400"], "labels": {}}]
    assert [p.name for p in path.parent.iterdir()] == ["brokers.json"]  # no temporary file left


@pytest.mark.unit
def test_a_missing_binary_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROMETHEUS_BIN_ENV, str(tmp_path / "no-prometheus"))
    with pytest.raises(FileNotFoundError, match="install Debian's `prometheus` package"):
        prometheus_binary()
    with pytest.raises(FileNotFoundError):  # before writing anything
        PrometheusServer(tmp_path / "prometheus", etcd_endpoints=["127.0.0.1:1"]).start()
    assert not (tmp_path / "prometheus").exists()


# ------------------------------------------------------------------ a real Prometheus


@pytest.fixture
def metrics_broker(start_broker: Callable[..., BrokerProcess]) -> BrokerProcess:
    """A broker serving ``/metrics`` on a free loopback port."""
    return start_broker(extra_args=["--metrics-listen", f"127.0.0.1:{free_port()}"])


def _prometheus(tmp_path: Path, etcd_endpoints: list[str], **kwargs: Any) -> Iterator[PrometheusServer]:
    _installed(prometheus_binary)
    server = PrometheusServer(tmp_path / "prometheus", etcd_endpoints=etcd_endpoints,
                              listen=f"127.0.0.1:{free_port()}", scrape_interval_s=SCRAPE_INTERVAL_S, **kwargs)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def prometheus(tmp_path: Path, etcd_endpoints: list[str]) -> Iterator[PrometheusServer]:
    """Prometheus on a free port scraping every second, with the shipped rules."""
    yield from _prometheus(tmp_path, etcd_endpoints)


def _value(prometheus: PrometheusServer, expr: str) -> float | None:
    result = prometheus.query(expr)
    assert len(result) <= 1, result
    return result[0][1] if result else None


async def _scraped(prometheus: PrometheusServer, broker: BrokerProcess) -> None:
    up = f'up{{job="{BROKERS_JOB}", broker="{broker.broker_id}"}}'
    await eventually(lambda: _value(prometheus, up) == 1.0, timeout_s=20, interval_s=0.2,
                     what=f"{up} == 1 (target discovered from etcd and scraped)")


@pytest.mark.integration
@pytest.mark.asyncio
async def test_prometheus_scrapes_rates_and_lag_of_a_broker_found_in_etcd(
    metrics_broker: BrokerProcess, prometheus: PrometheusServer
) -> None:
    await _scraped(prometheus, metrics_broker)
    topic = f'topic="{TOPIC}"'
    async with DanubeClient([metrics_broker.address]) as client:
        async with client.producer(TOPIC, producer_name="p") as producer:
            for _ in range(10):
                producer.send_nowait(b"x" * 100)
            await producer.flush()
            # a first sample of the topic's counter, so that the next 40 messages make a rate
            await eventually(lambda: _value(prometheus, f"sum(danube_topic_messages_in_total{{{topic}}})") == 10.0,
                             timeout_s=15, interval_s=0.2, what="10 messages in scraped")
            for _ in range(40):
                producer.send_nowait(b"x" * 100)
            await producer.flush()
        async with client.consumer(TOPIC, subscription="prom", initial_position=InitialPosition.EARLIEST) as consumer:
            for _ in range(20):
                await consumer.ack(await consumer.receive(timeout_ms=5_000))

    def scraped_all() -> bool:
        return _value(prometheus, f"sum(danube_topic_messages_in_total{{{topic}}})") == 50.0

    await eventually(scraped_all, timeout_s=15, interval_s=0.2, what="50 messages in scraped")
    rate = _value(prometheus, f"sum(rate(danube_topic_messages_in_total{{{topic}}}[1m]))")
    assert rate is not None and rate > 0
    lag = f'danube_subscription_lag_messages{{{topic}, subscription="prom"}}'
    await eventually(lambda: _value(prometheus, lag) == 30.0, timeout_s=15, interval_s=0.2,
                     what=f"{lag} == 30 after 20 of 50 acked")
    (labels, _), = prometheus.query(lag)
    assert labels["broker"] == str(metrics_broker.broker_id) and labels["job"] == BROKERS_JOB
    assert not [a for a in prometheus.alerts() if a["state"] == "firing"]  # a healthy broker fires nothing


@pytest.fixture
def quick_rules(tmp_path: Path) -> Path:
    """The shipped rules, with ``DanubeBrokerDown`` pending for 1 s instead of 30 s."""
    rules = _rules()
    _rule(rules, "DanubeBrokerDown")["for"] = "1s"
    path = tmp_path / "alerts-quick.yml"
    path.write_text(yaml.safe_dump(rules))
    return path


@pytest.mark.integration
@pytest.mark.asyncio
async def test_broker_down_fires_when_a_broker_is_killed(
    metrics_broker: BrokerProcess, tmp_path: Path, etcd_endpoints: list[str], quick_rules: Path
) -> None:
    for prometheus in _prometheus(tmp_path, etcd_endpoints, rules_files=[quick_rules]):
        await _scraped(prometheus, metrics_broker)
        await asyncio.sleep(2 * SCRAPE_INTERVAL_S)  # rules evaluated on a running broker: nothing fires
        assert [a["labels"]["alertname"] for a in prometheus.alerts()] == []
        broker_id = str(metrics_broker.broker_id)
        metrics_broker.kill()

        def down_firing() -> bool:
            return any(a["labels"]["alertname"] == "DanubeBrokerDown" and a["labels"].get("broker") == broker_id
                       and a["state"] == "firing" for a in prometheus.alerts())

        await eventually(down_firing, timeout_s=20, interval_s=0.2, what="DanubeBrokerDown firing")


def _names(families: Iterable[Metric]) -> set[str]:
    names = set()
    for family in families:
        names |= {family.name, f"{family.name}_total"} | {sample.name for sample in family.samples}
    return names


@pytest.mark.integration
def test_dev_stack_with_metrics_scrapes_its_brokers_whose_metrics_the_rules_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``danube-pipeline dev --metrics`` (``make dev METRICS=1``): the brokers start with
    ``--metrics-listen``, Prometheus finds them in etcd and scrapes them. The rules name only
    metrics that such a broker or the continuous writer serve (a misspelt name would make its
    alert silently never fire)."""
    _installed(prometheus_binary)
    from assets.writer_metrics import WriterMetrics
    from danube_pipeline.dev import stack

    metrics_port = free_port()
    monkeypatch.setattr(stack, "DEV_BROKER_METRICS_PORT", metrics_port)  # not 9400: a dev stack may run beside
    monkeypatch.setenv(PROMETHEUS_LISTEN_ENV, f"127.0.0.1:{free_port()}")
    dev_stack = stack.DevStack(tmp_path / "dev", dagster_home=None, brokers=1, writer=False, ui=False, metrics=True)
    dev_stack.start()
    try:
        prometheus = dev_stack.prometheus
        assert prometheus is not None and prometheus.running
        assert prometheus.banner().startswith(f"prometheus {prometheus.url}")
        broker = dev_stack.brokers[0]
        assert broker.extra_args[-2:] == ["--metrics-listen", f"127.0.0.1:{metrics_port}"]
        eventually_sync(lambda: {labels["job"]: v for labels, v in prometheus.query("up")} == {BROKERS_JOB: 1.0},
                        timeout_s=20, interval_s=0.2, what="the broker scraped")
        assert _value(prometheus, f'danube_broker_topics_owned{{broker="{broker.broker_id}"}}') == 0.0
        assert dev_stack.exited() == []
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            served = _names(text_string_to_metric_families(response.read().decode()))
    finally:
        dev_stack.stop()
    assert not prometheus.running
    served |= _names(WriterMetrics().registry.collect())
    exprs = [r["expr"] for group in _rules()["groups"] for r in group["rules"]]
    named = {name for expr in exprs for name in re.findall(r"\b(danube_[a-z_]+)\b", expr)}
    assert len(named) >= 8 and named <= served, sorted(named - served)
