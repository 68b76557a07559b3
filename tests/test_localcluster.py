"""The process launchers leave nothing behind when their parent dies without cleaning up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from helpers import eventually_sync

pytestmark = pytest.mark.integration

_LAUNCHER = """
import sys, time
from pathlib import Path
from danube_pipeline.dev.localcluster import EtcdServer
etcd = EtcdServer(Path(sys.argv[1]))
etcd.start()
print(etcd.pid, flush=True)
time.sleep(120)  # the launcher is SIGKILLed long before
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it has exited all the same
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_etcd_dies_with_a_sigkilled_launcher(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path / "etcd")], stdout=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        etcd_pid = int(launcher.stdout.readline())
        assert _alive(etcd_pid)
        launcher.send_signal(signal.SIGKILL)  # no clean-up code runs
        launcher.wait(timeout=10)
        eventually_sync(lambda: not _alive(etcd_pid), timeout_s=10, what="etcd outlived the process that started it")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if launcher.stdout is not None:
            launcher.stdout.close()
