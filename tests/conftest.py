"""Shared fixtures: a real etcd (one per session) and real broker processes.

* ``etcd`` (session): an :class:`~danube_pipeline.dev.localcluster.EtcdServer` on free ports.
* ``etcd_endpoints`` (function): ``etcd.endpoints`` after deleting every key, so each test
  starts from empty metadata.
* ``start_broker`` (function): ``start_broker(data_dir=None, **kwargs) -> BrokerProcess``;
  every broker started is stopped at teardown.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer, etcdctl_binary

# ``postgres`` (session) and ``postgres_url`` (a new database): a real PostgreSQL server.
pytest_plugins = ["postgres_server"]


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd server for the whole session, in its own temporary data directory."""
    root = tmp_path_factory.mktemp("etcd")
    server = EtcdServer(root / "data", log_path=root / "etcd.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _wipe(etcd: EtcdServer) -> None:
    if not etcd.running:
        etcd.start()
    subprocess.run(
        [etcdctl_binary(), f"--endpoints={etcd.client_url}", "del", "", "--from-key"],
        check=True,
        capture_output=True,
        timeout=30,
        env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
    )


@pytest.fixture
def etcd_endpoints(etcd: EtcdServer) -> list[str]:
    """``["127.0.0.1:PORT"]`` of the session etcd, emptied of every key first."""
    _wipe(etcd)
    return etcd.endpoints


@pytest.fixture
def start_broker(
    etcd_endpoints: list[str], tmp_path: Path
) -> Iterator[Callable[..., BrokerProcess]]:
    """Factory starting brokers against the session etcd; all are stopped at teardown.

    ``start_broker(data_dir=None, **kwargs)``: ``data_dir`` defaults to ``tmp_path / "broker"``
    (``tmp_path / "broker-2"``, ... for further brokers); ``kwargs`` go to
    :class:`~danube_pipeline.dev.localcluster.BrokerProcess`.
    """
    started: list[BrokerProcess] = []

    def factory(data_dir: Path | None = None, **kwargs: Any) -> BrokerProcess:
        if data_dir is None:
            data_dir = tmp_path / ("broker" if not started else f"broker-{len(started) + 1}")
        kwargs.setdefault("etcd_endpoints", etcd_endpoints)
        broker = BrokerProcess(data_dir=data_dir, **kwargs)
        started.append(broker)
        broker.start()
        return broker

    try:
        yield factory
    finally:
        for broker in reversed(started):
            broker.stop()
