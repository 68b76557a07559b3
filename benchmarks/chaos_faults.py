"""The cluster of ``benchmarks/chaos.py`` and the faults it injects.

:class:`ChaosCluster`: etcd and 3 brokers on loopback, each broker on a fixed port (clients
bootstrap to all three, also across restarts), objects on a local ``file://`` store shared
with the tiering writers. Broker 3 reaches etcd only through a :class:`BlackholeProxy`; broker
2's data directory is a small tmpfs when one can be mounted (root only). Every process is
stopped by pid (:meth:`ChaosCluster.stop`), paused ones are continued first, the tmpfs is
unmounted.

:class:`Faults`: one method per fault kind (:data:`KINDS`); each injects its fault, lets it
last, heals it, and returns a line describing what it did.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import faults_scenarios as fs
from chaos_load import TieringLoop, new_client, two_writers_at_once
from chaos_proxy import BlackholeProxy

from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer

KINDS = ("kill", "pause", "etcd-cut", "disk-full", "etcd-restart", "move", "tiering-race")
"""Fault kinds, in the order of the summary."""

PAUSED_PIDS: set[int] = set()
"""Processes SIGSTOPped and not yet continued (every exit path continues them)."""
MOUNTS: list[Path] = []
"""tmpfs mounts made and not yet unmounted."""


def stable_port(host: str = "127.0.0.1") -> int:
    """A free TCP port below the kernel's ephemeral range (``ip_local_port_range``), so that no
    outgoing connection takes it while its broker is down between a kill and a restart.

    Raises:
        RuntimeError: no free port found in 200 tries.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def continue_paused() -> None:
    """SIGCONT every process this run paused (safe from a signal handler or another thread)."""
    for pid in list(PAUSED_PIDS):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)
        PAUSED_PIDS.discard(pid)


def unmount_all() -> None:
    """Unmount every tmpfs this run mounted (lazily if busy)."""
    for mount in list(MOUNTS):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            if subprocess.run(["umount", str(mount)], capture_output=True, timeout=15, check=False).returncode:
                subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=15, check=False)
        with contextlib.suppress(ValueError):
            MOUNTS.remove(mount)


def mount_tmpfs(directory: Path, size_mib: int) -> str | None:
    """Mount a tmpfs of ``size_mib`` MiB on ``directory``; ``None`` on success, else why not."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "not root"
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(directory)],
                              capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mount failed: {exc}"
    if proc.returncode != 0:
        return f"mount failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()}"
    MOUNTS.append(directory)
    return None


def fill(path: Path) -> int:
    """Write zeros into ``path`` until its file system is full (``ENOSPC`` ends it); bytes written."""
    chunk = b"\0" * (1 << 20)
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with contextlib.suppress(OSError):  # ENOSPC: full
            while True:
                written += os.write(fd, chunk)
    finally:
        os.close(fd)
    return written


FAILURE_LINES = 25
"""Lines of a failed fault's error (a broker's log tail) printed below its note."""


@dataclass
class ChaosCluster:
    """etcd, 3 brokers (fixed ports), the proxy in front of etcd for broker 3, the tmpfs of broker 2.

    Attributes:
        root: the run's directory (etcd data, broker data, logs, objects).
        lease_ttl_s: the brokers' ``--lease-ttl-s``.
        tmpfs_mib: size of broker 2's tmpfs.
        disk_note: why broker 2 has no tmpfs (the disk-full fault is then skipped), or ``None``.
    """

    root: Path
    lease_ttl_s: int = 3
    tmpfs_mib: int = 96
    segment_max_age_s: float = 2.0
    etcd: EtcdServer = field(init=False)
    proxy: BlackholeProxy = field(init=False)
    brokers: list[BrokerProcess] = field(default_factory=list)
    disk_note: str | None = None
    objects_url: str = ""
    pids: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.etcd = EtcdServer(self.root / "etcd", log_path=self.root / "logs" / "etcd.log", client_port=stable_port(),
                               peer_port=stable_port())
        self.proxy = BlackholeProxy(self.etcd.endpoint)
        self.objects_url = (self.root / "objects").as_uri()

    @property
    def addresses(self) -> list[str]:
        """Every broker's fixed ``host:port``."""
        return [f"{b.host}:{b.port}" for b in self.brokers]

    @property
    def tmpfs(self) -> Path:
        return self.root / "tmpfs"

    def name(self, index: int) -> str:
        return f"broker {index + 1}"

    async def start(self) -> None:
        """Start etcd, the proxy, then the 3 brokers (from the main thread: the children follow it).

        Raises:
            RuntimeError: a process did not become ready (with its log tail).
        """
        self.etcd.start()
        self.pids.add(self.etcd.pid)
        await self.proxy.start()
        self.disk_note = mount_tmpfs(self.tmpfs, self.tmpfs_mib)
        args = ["--lease-ttl-s", str(self.lease_ttl_s), "--object-store-url", self.objects_url,
                "--segment-max-age-s", str(self.segment_max_age_s)]
        for index in range(3):
            data_dir = self.tmpfs / "broker" if index == 1 and self.disk_note is None else self.root / f"broker-{index + 1}"
            endpoints = [self.proxy.address] if index == 2 else self.etcd.endpoints
            broker = BrokerProcess(etcd_endpoints=endpoints, data_dir=data_dir, port=stable_port(),
                                   log_path=self.root / "logs" / f"broker-{index + 1}.log", extra_args=args)
            self.brokers.append(broker)
            await broker.start_async(timeout_s=60)
            self.pids.add(broker.pid)

    async def ensure_running(self) -> list[str]:
        """Continue paused processes, heal the proxy, start what is not running; lines of what was done."""
        done: list[str] = []
        if PAUSED_PIDS:
            continue_paused()
            done.append("continued paused processes")
        if self.proxy.blackholed:
            self.proxy.heal()
            done.append("healed the proxy")
        (self.tmpfs / "filler").unlink(missing_ok=True)
        if not self.etcd.running:
            await self.restart_etcd()
            done.append("started etcd")
        for index, broker in enumerate(self.brokers):
            if not broker.running:
                await broker.start_async(timeout_s=60)
                self.pids.add(broker.pid)
                done.append(f"started {self.name(index)}")
        return done

    async def restart_etcd(self, *, timeout_s: float = 30.0) -> float:
        """Start etcd again on the same data directory and ports without blocking the loop.

        Returns:
            Seconds until it reported healthy.

        Raises:
            TimeoutError: not healthy within ``timeout_s``.
        """
        started = time.monotonic()
        self.etcd.spawn_and_wait(self.etcd.command(), what="etcd (restart)", ready=lambda: True, timeout_s=1.0,
                                 on_timeout=self.etcd.stop)
        self.pids.add(self.etcd.pid)
        url = f"{self.etcd.client_url}/health"
        while time.monotonic() - started < timeout_s:
            if await asyncio.to_thread(fs._healthy, url):
                return time.monotonic() - started
            await asyncio.sleep(0.1)
        raise TimeoutError(f"etcd not healthy within {timeout_s:g} s after its restart")

    def stop(self) -> None:
        """Continue paused processes, stop the brokers and etcd by pid, unmount the tmpfs. Idempotent."""
        continue_paused()
        for broker in reversed(self.brokers):
            with contextlib.suppress(Exception):
                broker.stop(timeout_s=10)
        with contextlib.suppress(Exception):
            self.etcd.stop()
        for pid in list(self.pids):  # a child a failed restart lost track of
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.pids.clear()
        unmount_all()


@dataclass
class FaultRecord:
    """One fault injected: kind, target, start and end (monotonic), and what happened."""

    kind: str
    target: str
    started: float
    ended: float = 0.0
    note: str = ""


class Faults:
    """The fault kinds; :meth:`inject` runs one and records it in :attr:`log`."""

    def __init__(self, cluster: ChaosCluster, rng: random.Random, *, topics: Sequence[str],
                 tiering_topics: Sequence[str], say: Callable[[str], None], t0: float) -> None:
        self.cluster = cluster
        self.rng = rng
        self.topics = list(topics)
        self.tiering_topics = list(tiering_topics)
        self.say = say
        self.t0 = t0
        self.log: list[FaultRecord] = []
        self.kinds = [k for k in KINDS if not (k == "disk-full" and cluster.disk_note is not None)]

    def at(self, t: float) -> str:
        return f"{t - self.t0:7.1f} s"

    async def inject(self, kind: str) -> FaultRecord:
        """Inject fault ``kind`` and heal it; errors go into the record's note (never raised)."""
        runners = {
            "kill": self._kill, "pause": self._pause, "etcd-cut": self._etcd_cut, "disk-full": self._disk_full,
            "etcd-restart": self._etcd_restart, "move": self._move, "tiering-race": self._tiering_race,
        }  # fmt: skip
        record = FaultRecord(kind, "", time.monotonic())
        self.log.append(record)
        outcome = await fs.bounded(runners[kind](record), 90)
        if not outcome.ok:
            record.note += f" FAILED: {fs.describe(outcome.error or RuntimeError('?'))}"
            with contextlib.suppress(Exception):
                await self.cluster.ensure_running()
        record.ended = time.monotonic()
        self.say(f"  {self.at(record.started)}  {kind:<12} {record.target:<22} {record.note.strip()}")
        if not outcome.ok and outcome.error is not None:
            # the one-line note cuts a start failure's log tail: show its last lines
            for line in str(outcome.error).splitlines()[-FAILURE_LINES:]:
                self.say(f"      | {line}")
        return record

    def _broker(self, record: FaultRecord) -> tuple[int, BrokerProcess]:
        index = self.rng.randrange(3)
        record.target = self.cluster.name(index)
        return index, self.cluster.brokers[index]

    async def _kill(self, record: FaultRecord) -> None:
        _, broker = self._broker(record)
        down_s = self.rng.uniform(0.5, 3.0)
        self.cluster.pids.discard(broker.pid)
        broker.kill()
        await asyncio.sleep(down_s)
        await broker.start_async(timeout_s=60)
        self.cluster.pids.add(broker.pid)
        record.note = f"SIGKILL, down {down_s:.1f} s, restarted"

    async def _pause(self, record: FaultRecord) -> None:
        _, broker = self._broker(record)
        pause_s = self.cluster.lease_ttl_s + self.rng.uniform(1.0, 3.0)
        pid = broker.pid
        os.kill(pid, signal.SIGSTOP)
        PAUSED_PIDS.add(pid)
        try:
            await asyncio.sleep(pause_s)
        finally:
            os.kill(pid, signal.SIGCONT)
            PAUSED_PIDS.discard(pid)
        record.note = f"SIGSTOP {pause_s:.1f} s (lease TTL {self.cluster.lease_ttl_s} s), SIGCONT"

    async def _etcd_cut(self, record: FaultRecord) -> None:
        record.target = f"{self.cluster.name(2)} from etcd"
        cut_s = self.cluster.lease_ttl_s + self.rng.uniform(1.0, 4.0)
        self.cluster.proxy.blackhole()
        try:
            await asyncio.sleep(cut_s)
        finally:
            self.cluster.proxy.heal()
        record.note = f"proxy blackholed {cut_s:.1f} s, healed"

    async def _disk_full(self, record: FaultRecord) -> None:
        record.target = f"{self.cluster.name(1)} WAL disk"
        filler = self.cluster.tmpfs / "filler"
        hold_s = self.rng.uniform(2.0, 5.0)
        written = await asyncio.to_thread(fill, filler)
        try:
            await asyncio.sleep(hold_s)
        finally:
            filler.unlink(missing_ok=True)
        record.note = f"filled ({written / 2**20:.0f} MiB), full {hold_s:.1f} s, freed"

    async def _etcd_restart(self, record: FaultRecord) -> None:
        record.target = "etcd"
        down_s = self.rng.uniform(0.5, 3.0)
        self.cluster.pids.discard(self.cluster.etcd.pid)
        self.cluster.etcd.kill()
        await asyncio.sleep(down_s)
        healthy_s = await self.cluster.restart_etcd()
        record.note = f"SIGKILL, down {down_s:.1f} s, restarted (healthy after {healthy_s:.1f} s)"

    async def _move(self, record: FaultRecord) -> None:
        topic = self.rng.choice(self.topics)
        record.target = topic
        client = new_client(self.cluster.addresses, request_timeout_ms=10_000)
        try:
            await client.connect()
            next_offset = await client.admin.unload_topic(topic)
            record.note = f"unloaded; next owner starts at offset {next_offset}"
        finally:
            await fs.bounded(client.close(), 5)

    async def _tiering_race(self, record: FaultRecord) -> None:
        record.target = f"{len(self.tiering_topics)} topics"
        client = new_client(self.cluster.addresses, request_timeout_ms=10_000)
        try:  # fresh sealed segments, so that both writers find work and race for it
            await client.connect()
            for topic in self.tiering_topics:
                await fs.bounded(client.admin.seal_active_segment(topic), 10)
        finally:
            await fs.bounded(client.close(), 5)
        loops = [TieringLoop(f"race-{i}", self.cluster.addresses, self.cluster.etcd.endpoints, self.cluster.objects_url,
                             self.tiering_topics) for i in range(2)]
        try:
            written = await two_writers_at_once(*loops)
            errors = sum(sum(loop.errors.values()) for loop in loops)
            record.note = f"two tier_sealed_segments writers at once: {written} objects, {errors} errors"
        finally:
            for loop in loops:
                await loop.close()
