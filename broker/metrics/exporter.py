"""The ``/metrics`` endpoint: prometheus_client's own HTTP server on its own thread, and the
address rules of ``metrics_listen``.

The server answers every path with the exposition (``/metrics`` is what the registration
advertises). It is plain HTTP without authentication, so a non-loopback address is refused
unless the broker runs with ``--insecure``
(:func:`broker.config_file.metrics_exposure`, checked in ``broker/__main__.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import disable_created_metrics, start_http_server

from broker.config import BrokerConfig
from broker.metrics.collector import BrokerCollector
from broker.metrics.families import BrokerMetrics, install, uninstall

if TYPE_CHECKING:
    from broker.core import Broker

log = logging.getLogger(__name__)


def split_metrics_listen(address: str) -> tuple[str, int]:
    """``host:port`` of ``metrics_listen`` as ``(host, port)``; port 0 binds any free port.

    Raises:
        ValueError: not ``host:port`` with a port from 0 to 65535.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"metrics_listen must be host:port, got {address!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


class MetricsEndpoint:
    """A started ``/metrics`` server for one broker's registry.

    Args:
        metrics: the broker's metrics (their registry is served).
        address: ``host:port`` to bind; port 0 binds any free port.
        advertised_host: the host put in :attr:`url` for a wildcard bind (default
            ``127.0.0.1``).

    Attributes:
        port: the bound port.
        url: ``http://host:port/metrics``, the registration's ``prom_exporter``.

    Raises:
        OSError: the address cannot be bound.
        ValueError: ``address`` is not ``host:port``.
    """

    def __init__(self, metrics: BrokerMetrics, address: str, *, advertised_host: str = "127.0.0.1") -> None:
        host, port = split_metrics_listen(address)
        # no ``*_created`` series: as many series again, which no dashboard reads
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self._server: WSGIServer
        self._thread: threading.Thread
        self._server, self._thread = start_http_server(port, addr=host, registry=metrics.registry)
        self.port = int(self._server.server_port)
        shown = advertised_host if host in ("0.0.0.0", "::", "") else host
        if ":" in shown:
            shown = f"[{shown}]"
        self.url = f"http://{shown}:{self.port}/metrics"
        log.info("metrics served at %s", self.url)

    def close(self) -> None:
        """Stop serving (idempotent)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class BrokerMetricsEndpoint(MetricsEndpoint):
    """A broker's metrics, installed for the process (:func:`broker.metrics.install`), with
    their scrape-time collector, served until :meth:`close` (which uninstalls them).

    Args:
        metrics: the broker's metrics.
        address: ``metrics_listen``.
        advertised_host: see :class:`MetricsEndpoint`.
        broker, is_leader, rebalancer: see :class:`~broker.metrics.collector.BrokerCollector`.

    Raises:
        OSError: the address cannot be bound (nothing is installed then).
        ValueError: ``address`` is not ``host:port``.
    """

    def __init__(
        self,
        metrics: BrokerMetrics,
        address: str,
        *,
        advertised_host: str,
        broker: Callable[[], Broker | None],
        is_leader: Callable[[], bool],
        rebalancer: Callable[[], Any],
    ) -> None:
        metrics.registry.register(BrokerCollector(metrics, broker, is_leader=is_leader, rebalancer=rebalancer))
        super().__init__(metrics, address, advertised_host=advertised_host)
        self.metrics = metrics
        install(metrics)

    def close(self) -> None:
        """Stop serving and uninstall the metrics (idempotent)."""
        uninstall(self.metrics)
        super().close()


def start_metrics(
    config: BrokerConfig,
    broker_id: int,
    *,
    broker: Callable[[], Broker | None],
    is_leader: Callable[[], bool] = lambda: False,
    rebalancer: Callable[[], Any] = lambda: None,
) -> BrokerMetricsEndpoint | None:
    """Start the broker's metrics when ``config.metrics_listen`` is set; call it before any
    topic is loaded (topics bind their children when they are created).

    Args:
        config: the broker's configuration (``metrics_listen``, ``metrics_per_topic``,
            ``advertised_addr``).
        broker_id: the ``broker`` label.
        broker, is_leader, rebalancer: what the scrape reads
            (:class:`~broker.metrics.collector.BrokerCollector`).

    Returns:
        The started endpoint (its ``url`` is the registration's ``prom_exporter``), or
        ``None`` when metrics are off.

    Raises:
        OSError: ``metrics_listen`` cannot be bound.
    """
    if config.metrics_listen is None:
        return None
    advertised_host = "127.0.0.1"
    if config.advertised_addr:
        advertised_host = config.advertised_addr.rpartition(":")[0].strip("[]") or advertised_host
    return BrokerMetricsEndpoint(
        BrokerMetrics(broker_id, per_topic=config.metrics_per_topic), config.metrics_listen,
        advertised_host=advertised_host, broker=broker, is_leader=is_leader, rebalancer=rebalancer,
    )
