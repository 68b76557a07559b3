"""The lifecycle every launcher shares (:class:`ChildProcess`): a child process that gets
SIGTERM when the thread that started it exits, its output appended to a log file, and stop
(SIGTERM, then SIGKILL after a grace period) / kill (SIGKILL) / context manager."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self


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


def die_with_parent(command: Sequence[str]) -> list[str]:
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


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, read from ``/proc``."""
    members: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # exited meanwhile
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            members.append(int(entry.name))
    return members


def stop_process_group(proc: subprocess.Popen[bytes], *, grace_s: float = 30.0, term_grace_s: float = 10.0) -> None:
    """Stop ``proc`` and every process it left in its process group.

    ``proc`` must lead its own group (started with ``start_new_session=True``), as ``dg dev``
    does here: the runs its daemon launches and its code servers are its descendants in that
    group, and some outlive it when it exits (a run still executing, a code server waiting
    for its heartbeat to time out). First SIGINT to ``proc`` alone (its own clean shutdown,
    up to ``grace_s``), then SIGTERM to whatever is left of the group (up to
    ``term_grace_s``), then SIGKILL.
    """
    pgid = proc.pid
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    for signum, wait_s in ((signal.SIGTERM, term_grace_s), (signal.SIGKILL, 10.0)):
        if not group_members(pgid):
            break
        try:
            os.killpg(pgid, signum)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
    proc.wait(timeout=10)


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

    def start(self, *, timeout_s: float = 30.0) -> None:  # pragma: no cover - overridden
        """Spawn the child and wait until it is ready; each launcher says how, and its own
        default ``timeout_s``."""
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
            die_with_parent(command),
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
    def pid(self) -> int:
        """The child's process id.

        Raises:
            RuntimeError: if not started (or stopped or killed since).
        """
        if self._proc is None:
            raise RuntimeError(f"{type(self).__name__} is not started")
        return self._proc.pid

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
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

