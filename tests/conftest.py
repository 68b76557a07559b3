"""Shared fixtures: a real etcd (one per session), real broker processes and one Spark session.

* ``etcd`` (session): an :class:`~danube_pipeline.dev.localcluster.EtcdServer` on free ports.
* ``etcd_endpoints`` (function): ``etcd.endpoints`` after deleting every key, so each test
  starts from empty metadata.
* ``start_broker`` (function): ``start_broker(data_dir=None, **kwargs) -> BrokerProcess``;
  every broker started is stopped at teardown.
* ``spark_settings`` (session): the one local Spark session of the run, stopped at the end;
  ``spark_session`` (function) hands it out and ``spark_on_catalog`` (function) registers an
  Iceberg catalog on it; ``own_spark_context`` stops it for a test that needs its own.

Collection fails when a test carries none of the tier markers (:data:`TIER_MARKERS`).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from helpers import RegisterCatalog, broker_config_args

from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer, etcdctl_binary

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

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
def own_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of this test's own, to pause (SIGSTOP) or kill without disturbing the session's."""
    server = EtcdServer(tmp_path / "etcd", log_path=tmp_path / "etcd.log")
    server.start()
    try:
        yield server
    finally:
        if server.running:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


@pytest.fixture
def etcd_endpoints(etcd: EtcdServer) -> list[str]:
    """``["127.0.0.1:PORT"]`` of the session etcd, emptied of every key first."""
    _wipe(etcd)
    return etcd.endpoints


@pytest.fixture
def wal_syscalls_from_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """The WAL's commit rounds make their system calls from Python instead of the C extension
    (``broker/storage/wal/sync_thread.py``, ``native_round``), so that a test's FAKE
    ``os.fdatasync`` or ``sync_filesystem`` takes effect. In this process only."""
    from broker.storage.wal import sync_thread  # noqa: PLC0415 - broker code, imported where used

    monkeypatch.setattr(sync_thread, "native_round", None)


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


@pytest.fixture
def start_secure(start_broker: Callable[..., BrokerProcess], tmp_path: Path) -> Callable[..., BrokerProcess]:
    """``start_secure(name="broker", **settings)``: a broker in ``tmp_path / name`` whose
    configuration file holds ``settings`` (``BrokerConfig`` field names: TLS, tokens,
    authorization, etcd security); stopped at teardown like every ``start_broker`` broker."""

    def factory(name: str = "broker", **settings: Any) -> BrokerProcess:
        return start_broker(data_dir=tmp_path / name, extra_args=broker_config_args(tmp_path / f"{name}.yml", settings))

    return factory


# --------------------------------------------------------------------------- tier markers

#: The markers of ``[tool.pytest.ini_options] markers`` that say which tier a test is in.
TIER_MARKERS = frozenset({"unit", "integration", "spark", "e2e", "packaging", "fuzz"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fail collection when a test carries none of :data:`TIER_MARKERS`.

    A test file sets ``pytestmark`` or marks every test; a new file without either cannot slip
    into the suite (``-m unit`` and the other tier selections would silently skip it).

    Raises:
        pytest.UsageError: the unmarked tests, one node id a line.
    """
    unmarked = [item.nodeid for item in items if not TIER_MARKERS & {m.name for m in item.iter_markers()}]
    if unmarked:
        raise pytest.UsageError(
            f"{len(unmarked)} test(s) carry none of the tier markers {sorted(TIER_MARKERS)} "
            "(set pytestmark in the file or mark each test):\n  " + "\n  ".join(unmarked)
        )


# --------------------------------------------------------------------------- Spark
#
# One JVM and one SparkSession serve every Spark test of the run: starting Spark takes tens of
# seconds, and jars are fixed when the JVM starts. Each test registers the Iceberg catalog it
# needs on that session (``spark_on_catalog``); product code that calls
# ``build_spark_session`` (``SparkResource``) gets the same session back from Spark's
# ``getOrCreate``. Tests that truly need another SparkContext say so with ``own_spark_context``.


def _stop_spark() -> None:
    """Stop the process's live Spark session, if any (the JVM keeps running)."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()


@pytest.fixture(scope="session")
def spark_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The Spark settings of the run's one local session (``spark_conf`` on a SQLite catalog
    ``session`` in a temporary directory; both JDBC drivers are on its jars when installed).

    The session is created lazily by ``spark_session`` and stopped when the test session ends.
    """
    from danube_pipeline.lake.spark.session import spark_conf

    root = tmp_path_factory.mktemp("spark-session")
    conf = spark_conf(
        catalog_name="session", catalog_uri=f"sqlite:///{root / 'catalog.db'}", warehouse=(root / "warehouse").as_uri()
    )
    # the tests' jobs are small and many: the C1 compiler alone (and the serial collector)
    # cost the two cores less than C2's compiling
    conf["spark.driver.extraJavaOptions"] = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    try:
        yield conf
    finally:
        _stop_spark()


@pytest.fixture
def spark_session(spark_settings: dict[str, str]) -> SparkSession:
    """The run's one Spark session (``build_spark_session``: Spark's ``getOrCreate``).

    The same session every time, unless a test stopped it (``own_spark_context``): then a new
    one starts on the same JVM, with the same jars.
    """
    from danube_pipeline.lake.spark.session import build_spark_session

    return build_spark_session(spark_settings)


@pytest.fixture
def spark_on_catalog(spark_session: SparkSession) -> RegisterCatalog:
    """``spark_on_catalog(name=, uri=, warehouse=) -> SparkSession``: the run's session with
    the Iceberg catalog ``name`` set to pyiceberg's ``uri`` and ``warehouse`` (the
    ``spark.sql.catalog.<name>*`` settings of ``spark_conf``, through ``spark.conf.set``).
    """

    def register(*, name: str, uri: str, warehouse: str) -> SparkSession:
        from danube_pipeline.lake.spark.session import spark_conf

        prefix = f"spark.sql.catalog.{name}"
        wanted = {
            key: value
            for key, value in spark_conf(catalog_name=name, catalog_uri=uri, warehouse=warehouse).items()
            if key == prefix or key.startswith(prefix + ".")
        }
        if any(spark_session.conf.get(key, None) != value for key, value in wanted.items()):
            for key, value in wanted.items():
                spark_session.conf.set(key, value)
            # Spark loads a catalog once per name and keeps it (CatalogManager); another test
            # may have loaded ``name`` on another database. Dropping the loaded catalogs makes
            # the next use read these settings; the other catalogs reload from theirs.
            spark_session._jsparkSession.sessionState().catalogManager().reset()
        return spark_session

    return register


@pytest.fixture
def own_spark_context() -> None:
    """For a test that starts a SparkContext of its own (another master; product code that
    starts and stops its session, as ``make demo`` does): the run's session is stopped first,
    since a JVM holds one SparkContext. The next ``spark_session`` starts a new one.
    """
    _stop_spark()
