"""A real Spark standalone cluster for tests: one master and one worker, started from the
pyspark wheel's own ``bin/spark-class`` on free loopback ports (Spark docs, "Spark Standalone
Mode": ``org.apache.spark.deploy.master.Master`` and ``org.apache.spark.deploy.worker.Worker``),
each with its log and the worker's work directory under a given directory, and stopped by pid.

Python tasks on the worker run ``sys.executable`` (PySpark ships the driver's
``PYSPARK_PYTHON`` with each task, and :func:`danube_pipeline.lake.spark.session.build_spark_session` sets it),
so they import this checkout's packages.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Self

import pyspark

__all__ = ["SparkStandaloneCluster", "free_port"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SparkStandaloneCluster:
    """A master and a worker on loopback; ``master_url`` is ``spark://127.0.0.1:{port}``.

    Args:
        root: directory for the logs (``master.log``, ``worker.log``) and the worker's work
            directory.
        worker_cores: cores the worker offers.
        worker_memory: memory the worker offers, in Spark's notation (``1g``).
        ready_timeout_s: seconds to wait for each process to be ready.
    """

    def __init__(self, root: Path, *, worker_cores: int = 1, worker_memory: str = "1g", ready_timeout_s: float = 120.0) -> None:
        self.root = root
        self.worker_cores = worker_cores
        self.worker_memory = worker_memory
        self.ready_timeout_s = ready_timeout_s
        self.port = 0
        self._procs: list[subprocess.Popen[bytes]] = []

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    @property
    def spark_home(self) -> Path:
        return Path(pyspark.__file__).parent

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            SPARK_HOME=str(self.spark_home),
            SPARK_LOCAL_IP="127.0.0.1",
            SPARK_LOG_DIR=str(self.root),
            SPARK_WORKER_DIR=str(self.root / "work"),
            PYSPARK_PYTHON=sys.executable,
            # short-lived JVMs (the master, the worker and the executors it launches with its
            # environment): the C1 compiler alone starts faster
            JDK_JAVA_OPTIONS="-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        )
        return env

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = (self.root / f"{name}.log").open("wb")
        try:
            proc = subprocess.Popen(
                [str(self.spark_home / "bin" / "spark-class"), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env(),
                cwd=self.root,
                start_new_session=True,
            )
        finally:
            log.close()
        self._procs.append(proc)
        return proc

    def _wait_for(self, name: str, proc: subprocess.Popen[bytes], marker: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        log = self.root / f"{name}.log"
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"spark {name} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
            if marker in log.read_text(errors="replace"):
                return
            time.sleep(0.5)
        raise TimeoutError(f"spark {name} not ready after {self.ready_timeout_s} s:\n{log.read_text(errors='replace')[-4000:]}")

    def start(self) -> Self:
        """Start the master, then the worker, and wait until the worker has registered.

        Raises:
            RuntimeError: a process exited (its log tail is in the message).
            TimeoutError: a process was not ready within ``ready_timeout_s``.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "work").mkdir(exist_ok=True)
        self.port = free_port()
        master = self._spawn(
            "master",
            ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(self.port),
             "--webui-port", str(free_port())],
        )
        self._wait_for("master", master, "I have been elected leader")
        worker = self._spawn(
            "worker",
            ["org.apache.spark.deploy.worker.Worker", self.master_url, "--host", "127.0.0.1",
             "--port", str(free_port()), "--webui-port", str(free_port()),
             "--cores", str(self.worker_cores), "--memory", self.worker_memory,
             "--work-dir", str(self.root / "work")],
        )
        self._wait_for("worker", worker, "Successfully registered with master")
        return self

    def stop(self) -> None:
        """Stop the worker, then the master: SIGTERM by pid, SIGKILL after 20 s."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self._procs.clear()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
