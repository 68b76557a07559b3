"""A real Prometheus for ``make dev METRICS=1`` (``danube-pipeline dev --metrics``).

Debian's ``prometheus`` package (``scripts/install-system-deps.sh``) runs on loopback with a
generated configuration: it scrapes every broker that registered a metrics endpoint in etcd
(``docs/etcd-layout.md`` §1.2 ``prom_exporter``; brokers started with ``--metrics-listen``) and
the continuous writer, and evaluates the shipped alert rules (``alerts.yml`` in this package:
an unavailable range, a quarantined segment, export lag over the freshness limit, WAL disk
nearly full, no leader, a broker down, a subscription backlog growing for 10 minutes).

Modules: :mod:`~danube_pipeline.dev.prometheus.server` (:class:`PrometheusServer`, the binary
and the configuration) and :mod:`~danube_pipeline.dev.prometheus.targets` (the ``file_sd``
target files, :class:`BrokerTargets` keeping the brokers' current from etcd).
"""

from danube_pipeline.dev.prometheus.server import (
    BROKERS_JOB,
    DEV_BROKER_METRICS_PORT,
    DEV_PROMETHEUS_LISTEN,
    DEV_SCRAPE_INTERVAL_S,
    PROMETHEUS_BIN_ENV,
    PROMETHEUS_LISTEN_ENV,
    WRITER_JOB,
    PrometheusServer,
    prometheus_binary,
    prometheus_config,
    promtool_binary,
    shipped_rules,
)
from danube_pipeline.dev.prometheus.targets import BrokerTargets, registered_exporters, target_group, write_targets

__all__ = [
    "BROKERS_JOB",
    "DEV_BROKER_METRICS_PORT",
    "DEV_PROMETHEUS_LISTEN",
    "DEV_SCRAPE_INTERVAL_S",
    "PROMETHEUS_BIN_ENV",
    "PROMETHEUS_LISTEN_ENV",
    "WRITER_JOB",
    "BrokerTargets",
    "PrometheusServer",
    "prometheus_binary",
    "prometheus_config",
    "promtool_binary",
    "registered_exporters",
    "shipped_rules",
    "target_group",
    "write_targets",
]
