"""The process launchers leave nothing behind when their parent dies without cleaning up, and
`make dev BROKERS=N`'s cluster stops every process it started on Ctrl-C."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import eventually_sync

from danube_pipeline.client import DanubeClient

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


def test_etcd_dies_with_a_sigkilled_launcher(tmp_path: Path) -> None:
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


def test_a_cluster_of_two_brokers_serves_until_ctrl_c(tmp_path: Path) -> None:
    """``make dev BROKERS=2``'s path: one etcd, two brokers with their own data directories and
    ports, both registered; SIGINT (Ctrl-C) stops all three."""
    command = [sys.executable, "-m", "danube_pipeline.dev.localcluster", "--brokers", "2", "--home", str(tmp_path),
               "--etcd-port", "0", "--broker-port", "0"]
    cluster = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert cluster.stdout is not None
        lines = [cluster.stdout.readline() for _ in range(5)]
        assert lines[4].startswith("Ctrl-C stops etcd and the 2 brokers"), lines
        ready = [json.loads((tmp_path / d / "broker.ready.json").read_text()) for d in ("broker", "broker-2")]
        addresses = [r["broker_addr"].removeprefix("http://") for r in ready]
        assert len(set(addresses)) == 2 and len({r["broker_id"] for r in ready}) == 2
        assert all(a in line for a, line in zip(addresses, lines[1:3]))

        async def registered() -> set[int]:
            async with DanubeClient(addresses[:1]) as client:
                return {b.broker_id for b in (await client.admin.cluster_metadata()).brokers}

        assert asyncio.run(registered()) == {r["broker_id"] for r in ready}
        etcd = subprocess.run(["pgrep", "-f", "--", f"--data-dir {tmp_path / 'etcd'}"], capture_output=True, text=True, check=True)
        etcd_pid = int(etcd.stdout.split()[0])
        cluster.send_signal(signal.SIGINT)
        assert cluster.wait(timeout=60) == 0
        for pid in [etcd_pid, *(r["pid"] for r in ready)]:
            eventually_sync(lambda: not _alive(pid), timeout_s=10, what=f"pid {pid} outlived Ctrl-C")  # noqa: B023
    finally:
        if cluster.poll() is None:
            cluster.kill()
        if cluster.stdout is not None:
            cluster.stdout.close()
