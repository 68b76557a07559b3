"""The stack ``danube-pipeline dev`` runs (:class:`DevStack`): etcd, the brokers, the continuous
writer, Prometheus and the Dagster UI and daemon, each started and stopped by pid, and the
``env.sh`` file that points a shell at it.

``benchmarks/freshness.py`` and the tests start the same stack without the command line.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from danube_pipeline import settings
from danube_pipeline.dev.localcluster import (
    DEV_COMMIT_INTERVAL_S,
    DEV_SEGMENT_MAX_AGE_S,
    BrokerProcess,
    ContinuousWriterProcess,
    EtcdServer,
    EtcdTls,
    broker_data_dir,
    die_with_parent,
    stop_process_group,
)
from danube_pipeline.dev.drain import drain_and_wait
from danube_pipeline.dev.localcluster.processes import DEV_POLL_INTERVAL_S
from danube_pipeline.dev.prometheus import DEV_BROKER_METRICS_PORT, PrometheusServer
from danube_pipeline.dev.etcd_auth import enable_etcd_auth, refuse_secured_etcd
from danube_pipeline.dev.secure import (
    ADMIN,
    APP,
    PIPELINE,
    DevSecurity,
)
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.connection import EtcdSecurity
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import NamespacePolicy


DEV_NAMESPACE = "default"
"""The namespace whose policy ``make dev BROKERS=N`` sets to replicate (:func:`dev_replication`)."""

DRAIN_TIMEOUT_S = 120.0
"""How long a stop waits for tiering to copy what a drained broker released (seconds)."""

DEV_WRITER_METRICS_LISTEN = "127.0.0.1:9641"  # a fixed loopback address a Prometheus configuration can name
DAGSTER_STORAGE_ENV = "DANUBE_DAGSTER_STORAGE"
"""Where ``dagster_home/dagster.yaml`` puts the instance's run, event and schedule storage."""


def dagster_home(explicit: str | None = None) -> Path:
    """The Dagster instance configuration directory: ``explicit``, else ``$DAGSTER_HOME``, else
    ``./dagster_home`` (the repository's, when run from its root as the Makefile does).

    Raises:
        FileNotFoundError: the directory has no ``dagster.yaml``.
    """
    path = Path(explicit or os.environ.get("DAGSTER_HOME") or "dagster_home").resolve()
    if not (path / "dagster.yaml").is_file():
        raise FileNotFoundError(
            f"no dagster.yaml in {path}: run from the repository root or set DAGSTER_HOME"
        )
    return path


def dg_binary() -> str:
    """The ``dg`` command of ``dagster-dg-cli`` beside this interpreter, else on ``PATH``.

    Raises:
        FileNotFoundError: ``dagster-dg-cli`` is not installed (``pip install 'danube-pipeline[pipeline]'``).
    """
    found = shutil.which("dg", path=str(Path(sys.executable).parent)) or shutil.which("dg")
    if found is None:
        raise FileNotFoundError("the `dg` command is missing: pip install 'danube-pipeline[pipeline]'")
    return found


ENV_FILE = "env.sh"
"""The file in a ``dev`` state directory holding the ``export`` lines of its running stack."""


def write_env_file(home: Path, exports: dict[str, str]) -> Path:
    """Write ``home/env.sh``: one ``export NAME=value`` line per variable, shell-quoted, so
    ``eval "$(danube-pipeline env)"`` or ``. .danube/dev/env.sh`` points a shell at the stack.

    Raises:
        OSError: the file cannot be written.
    """
    path = home / ENV_FILE
    home.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"export {name}={shlex.quote(value)}\n" for name, value in sorted(exports.items())))
    return path


def read_env_file(home: Path) -> dict[str, str]:
    """The variables :func:`write_env_file` wrote in ``home``.

    Raises:
        FileNotFoundError: ``home`` holds no ``env.sh`` (no ``dev`` ever started there); the
            message says so.
    """
    path = home / ENV_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {ENV_FILE} in {home}: start `make dev` (or danube-pipeline dev --home {home}) first")
    exports = {}
    for line in path.read_text().splitlines():
        name, _, quoted = line.removeprefix("export ").partition("=")
        (value,) = shlex.split(quoted) or [""]
        exports[name] = value
    return exports


def dev_replication(brokers: int) -> tuple[int, int]:
    """``(replication_factor, min_insync_replicas)`` of the ``default`` namespace in a dev
    stack of ``brokers`` brokers (``docs/etcd-layout.md`` §2.1): 3 and 2 from three brokers up
    (Kafka's usual production setting: one broker may fail without stopping producers), 2 and 1
    with two, 1 and 1 (no replication) with one."""
    factor = min(max(brokers, 1), 3)
    return factor, max(1, factor - 1)


async def set_dev_replication(
    etcd_endpoints: list[str], brokers: int, *, etcd_security: EtcdSecurity | None = None
) -> dict[str, int] | None:
    """Set the ``default`` namespace's replication (:func:`dev_replication`) the way
    ``danube-admin namespaces set-policy --replication-factor N --min-insync-replicas M`` does;
    nothing when the stored policy already has it (one broker and no stored replication: nothing
    is written). One broker after a stack of three sets 1 and 1 again: producers would be
    refused otherwise (``NotEnoughReplicasError``).

    Returns:
        The fields written, ``None`` when nothing was.

    Raises:
        AdminError: the policy changed while it was being written, or is unreadable.
        MetadataStoreError: etcd cannot be reached.
    """
    from danube_pipeline.admin.namespaces import update_namespace_policy

    factor, min_insync = dev_replication(brokers)
    changes: dict[str, int | str] = {"replication_factor": factor, "min_insync_replicas": min_insync}
    async with await MetadataStore.connect(etcd_endpoints, security=etcd_security) as store:
        stored = await store.get(keys.namespace_policy(DEV_NAMESPACE))
        try:
            current = NamespacePolicy.from_json(stored.value) if stored is not None else NamespacePolicy()
        except ValueError:
            current = NamespacePolicy()
        if (current.replication_factor, current.min_insync_replicas) == (factor, min_insync):
            return None
        await update_namespace_policy(store, DEV_NAMESPACE, changes)
    return {"replication_factor": factor, "min_insync_replicas": min_insync}


class DevStack:
    """What ``make dev`` runs: etcd, N brokers, the continuous writer and the Dagster UI and
    daemon (``dg dev``), with every ``DANUBE_*`` variable pointing at ``home``.

    ``danube-pipeline dev`` and ``benchmarks/freshness.py`` both start it, so the benchmark
    measures the ``make dev`` defaults. :meth:`stop` stops every process it started, by pid:
    Dagster (SIGINT, as Ctrl-C), the writer, the brokers (last first), then etcd.
    """

    def __init__(
        self,
        home: Path,
        *,
        dagster_home: Path | None,
        brokers: int = 1,
        host: str = "127.0.0.1",
        etcd_host: str | None = None,
        etcd_port: int | None = None,
        broker_port: int = 0,
        dagster_port: int = 3000,
        segment_max_age_s: float = DEV_SEGMENT_MAX_AGE_S,
        writer: bool = True,
        commit_interval_s: float = DEV_COMMIT_INTERVAL_S,
        ui: bool = True,
        secure: bool = False,
        writer_metrics_listen: str | None = None,
        log_format: str = "text",
        metrics: bool = False,
        replicate: bool = False,
    ) -> None:
        """Args:
        home: the state directory (etcd, WALs, objects, catalog, Dagster storage); kept.
        dagster_home: the Dagster instance configuration (:func:`dagster_home`); ``None``
            starts no Dagster, and the writer then records no materializations.
        brokers: how many brokers, on consecutive ports from ``broker_port`` (``0``: free ones).
        host: interface the brokers (and etcd, unless ``etcd_host`` is given) listen on.
        etcd_host: interface etcd listens on; ``host`` when ``None``.
        etcd_port: etcd's client port; a free one when ``None``.
        broker_port: port of the first broker.
        dagster_port: the Dagster UI's port.
        segment_max_age_s: the brokers' ``--segment-max-age-s``.
        writer: start the continuous writer (:mod:`assets.continuous_writer`).
        commit_interval_s: the writer's ``--commit-interval-s``.
        ui: start ``dg dev`` (when ``dagster_home`` is given); ``False`` keeps only the
            writer's materializations in the instance (tests).
        secure: TLS with client certificates, token authentication and authorization
            (:mod:`danube_pipeline.dev.secure`); the writer and Dagster connect as
            ``pipeline``, ``env.sh`` exports the ``app`` credentials. etcd serves TLS only,
            with authentication on (:mod:`danube_pipeline.dev.etcd_auth`): every process of
            the stack, and ``env.sh``, reach it as etcd user ``danube``.
        writer_metrics_listen: the writer's ``--metrics-listen`` (``None``: off); once it is
            started, the address it serves ``/metrics`` on is ``writer_metrics_addr``.
        log_format: ``--log-format`` of the brokers and the writer (``text`` or ``json``).
        metrics: broker ``i`` serves ``/metrics`` on ``127.0.0.1:{9400 + i}``, and a Prometheus
            (:mod:`danube_pipeline.dev.prometheus`, state in ``home/prometheus``) scrapes the
            brokers and the writer (give ``writer_metrics_listen`` too).
        replicate: before the brokers start, set the ``default`` namespace's replication for
            ``brokers`` brokers (:func:`set_dev_replication`; ``make dev BROKERS=3``: factor 3,
            2 in sync).
        """
        self.home = home
        self.dagster_home = dagster_home
        self.dagster_port = dagster_port
        self.ui = ui
        self.replicate = replicate
        self.etcd = EtcdServer(home / "etcd", host=etcd_host or host, client_port=etcd_port)
        self.host = host
        self._log_args = ["--log-format", log_format] if log_format != "text" else []
        self.security = DevSecurity.at(home) if secure else None
        security_args = self.security.broker_args() if self.security is not None else []
        # a broker's own client (the rebalancer's unloader) must not pick up a shell's token
        # or TLS files: it calls as a broker, with the broker's certificate
        broker_env = dict.fromkeys(("DANUBE_TOKEN_FILE", "DANUBE_TLS_CA_FILE", "DANUBE_TLS_CERT_FILE",
                                    "DANUBE_TLS_KEY_FILE"), "") if secure else None
        if self.security is not None:  # etcd over TLS, as user danube (the password stays in its file)
            self.etcd.tls = EtcdTls(self.security.etcd_cert_file, self.security.etcd_key_file, self.security.ca_file)
            broker_env = {**(broker_env or {}), **self.security.etcd_env(self.etcd.client_url)}
        self.brokers = [
            BrokerProcess(
                etcd_endpoints=self.etcd_endpoints,
                data_dir=broker_data_dir(home, i),
                host=host,
                port=broker_port + i if broker_port else 0,
                segment_max_age_s=segment_max_age_s,
                extra_args=["--object-store-url", (home / "objects").as_uri(), *security_args, *self._log_args,
                            *(["--metrics-listen", f"127.0.0.1:{DEV_BROKER_METRICS_PORT + i}"] if metrics else [])],
                env=broker_env,
            )
            for i in range(brokers)
        ]
        self.start_writer = writer
        self.commit_interval_s = commit_interval_s
        self.writer: ContinuousWriterProcess | None = None
        self.writer_metrics_listen = writer_metrics_listen
        self.writer_metrics_addr: str | None = None
        self.metrics = metrics
        self.prometheus: PrometheusServer | None = None
        self.dagster: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}

    def start(self) -> None:
        """Start etcd, the brokers, the writer (waiting until each is ready), then Dagster.

        Call it from the main thread (the children follow the thread that started them).
        When one fails, everything started so far is stopped.

        Raises:
            RuntimeError: a process exited or was not ready in time (the message carries its
                log tail).
            FileNotFoundError: ``dg`` is missing.
        """
        try:
            if self.security is not None:
                DevSecurity.prepare(self.home, hosts=[self.host], etcd_hosts=[self.etcd.host])
            self.etcd.start()
            if self.security is not None:  # before the brokers: their first calls are decided by them
                enable_etcd_auth(self.etcd.client_url, self.security)
                asyncio.run(self.security.write_grants(self.etcd_endpoints, self.etcd_security))
            else:
                refuse_secured_etcd(self.etcd.client_url, self.home)
            if self.replicate:
                asyncio.run(set_dev_replication(self.etcd_endpoints, len(self.brokers), etcd_security=self.etcd_security))
            for broker in self.brokers:
                broker.start()
            exports = settings.environment(self.home, etcd_endpoints=self.etcd_endpoints, broker_addresses=self.addresses)
            if self.security is not None:
                exports |= self.security.etcd_env(self.etcd.client_url)
            if self.dagster_home is not None:
                exports |= {"DAGSTER_HOME": str(self.dagster_home), DAGSTER_STORAGE_ENV: str(self.home / "dagster")}
            own: dict[str, str] = {}
            if self.security is not None:  # env.sh: the app; the writer and Dagster: the pipeline
                own = self.security.client(PIPELINE).env()
                exports |= self.security.client(APP).env()
            write_env_file(self.home, exports)
            self.env = {**os.environ, **exports, **own}
            if self.start_writer:
                # before Dagster: the writer opens (creates) the instance's storage first
                self.writer = ContinuousWriterProcess(
                    state_dir=self.home / "writer",
                    env=self.env,
                    commit_interval_s=self.commit_interval_s,
                    poll_interval_s=DEV_POLL_INTERVAL_S,
                    dagster=self.dagster_home is not None,
                    extra_args=[*(["--metrics-listen", self.writer_metrics_listen] if self.writer_metrics_listen else []),
                                *self._log_args],
                )
                self.writer.start()
                if self.writer_metrics_listen:
                    self.writer_metrics_addr = json.loads(self.writer.ready_file.read_text())["metrics_addr"]
            if self.metrics:  # after the writer: Prometheus scrapes it too
                self.prometheus = PrometheusServer(self.home / "prometheus", etcd_endpoints=self.etcd_endpoints,
                                                   writer_target=self.writer_metrics_addr, etcd_security=self.etcd_security)
                self.prometheus.start()
            if self.dagster_home is not None and self.ui:
                # dies with this launcher even when it is SIGKILLed (no clean-up then). At the
                # default INFO level the daemon logs two lines per sensor tick ("Checking for new
                # runs", "No run requests returned ... skipping"); runs show in the UI. In a
                # session of its own: its webserver, daemon, code servers and the runs the
                # daemon launches share its process group, which stop() empties.
                self.dagster = subprocess.Popen(
                    die_with_parent([dg_binary(), "dev", "-m", "assets.definitions", "-p", str(self.dagster_port),
                                     "--log-level", "warning"]),
                    env=self.env,
                    start_new_session=True,
                )
        except BaseException:
            self.stop()
            raise

    def client_options(self, principal: str) -> dict[str, Any]:
        """:class:`~danube_pipeline.client.DanubeClient` arguments connecting as ``principal``
        (``admin``, ``pipeline``, ``app``) when ``secure``; empty otherwise (plaintext).

        Raises:
            OSError: the token file cannot be read.
        """
        if self.security is None:
            return {}
        creds = self.security.client(principal)
        return {"tls_ca_file": creds.ca_file, "tls_cert_file": creds.cert_file, "tls_key_file": creds.key_file,
                "token": creds.token()}

    @property
    def etcd_endpoints(self) -> list[str]:
        """etcd's endpoints for the stack's clients: ``host:port``, or ``https://host:port``
        when ``secure``."""
        return [self.etcd.client_url] if self.security is not None else self.etcd.endpoints

    @property
    def etcd_security(self) -> EtcdSecurity | None:
        """How this launcher reaches etcd: TLS and user ``danube`` when ``secure``, else ``None``
        (the ``DANUBE_ETCD_*`` variables). Raises ``OSError`` when the password is unreadable."""
        return self.security.etcd_security() if self.security is not None else None

    @property
    def addresses(self) -> list[str]:
        """Every broker's ``host:port``, in start order."""
        return [broker.address for broker in self.brokers]

    def exited(self) -> list[str]:
        """The processes that were started and are no longer running (``"etcd"``,
        ``"broker N"``, ``"continuous writer"``, ``"dagster"``, ``"prometheus"``)."""
        gone = ["etcd"] if self.etcd.exited else []
        gone += [f"broker {i + 1}" for i, broker in enumerate(self.brokers) if broker.exited]
        if self.writer is not None and self.writer.exited:
            gone.append("continuous writer")
        if self.dagster is not None and self.dagster.poll() is not None:
            gone.append("dagster")
        if self.prometheus is not None and self.prometheus.exited:
            gone.append("prometheus")
        return gone

    def stop(self) -> None:
        """Stop every process started, by pid: Dagster (SIGINT to ``dg dev``, then SIGTERM and
        SIGKILL to what is left of its process group: :func:`~danube_pipeline.dev.localcluster.
        child.stop_process_group`); the
        brokers after the first, last first, each drained and stopped once the writer tiered
        what it released (:func:`~danube_pipeline.dev.drain.drain_and_wait`, at most
        :data:`DRAIN_TIMEOUT_S`); the writer; the first broker (it releases its topics and
        keeps their segments, served again at the next start); etcd (SIGTERM, SIGKILL after a
        grace period). Prometheus first, when ``metrics``. Idempotent."""
        if self.prometheus is not None:
            self.prometheus.stop()
        if self.dagster is not None:
            stop_process_group(self.dagster, grace_s=30)
            self.dagster = None
        for broker in reversed(self.brokers[1:]):
            self._drain(broker)
            broker.stop()
        if self.writer is not None:
            self.writer.stop()
        for broker in self.brokers[:1]:
            broker.stop()
        self.etcd.stop()

    def _drain(self, broker: BrokerProcess) -> None:
        """Drain ``broker`` and wait for tiering (while etcd, the broker and the writer run);
        say on stderr what it leaves behind when that fails or times out."""
        if broker.exited or self.etcd.exited:
            return
        if self.writer is None or self.writer.exited:
            print(f"stopping broker {broker.address} without waiting for tiering: no continuous writer runs; "
                  "what it released stays on its disk until it runs again", file=sys.stderr)
            return
        print(f"draining broker {broker.address} (id {broker.broker_id}) ...", file=sys.stderr, flush=True)
        try:
            waiting = asyncio.run(
                drain_and_wait(self.etcd_endpoints, broker.address, broker.broker_id, timeout_s=DRAIN_TIMEOUT_S,
                               client_options=self.client_options(ADMIN), etcd_security=self.etcd_security)
            )
        except Exception as exc:  # noqa: BLE001 - a failed drain must not stop the clean-up
            print(f"draining broker {broker.address} failed ({exc}); stopping it anyway", file=sys.stderr)
            return
        if waiting:
            print(f"broker {broker.address}: not tiered after {DRAIN_TIMEOUT_S:g} s, readable again when it "
                  f"runs: {'; '.join(waiting)}", file=sys.stderr)
