"""``danube-pipeline dev`` (``make dev``) stopped by a signal, as an operator or a service
manager stops it: SIGTERM and SIGHUP clean up exactly as Ctrl-C does.

The launcher runs for real with 2 brokers, the continuous writer and the Dagster UI and daemon
(``dg dev``). After SIGTERM no process it started is left (the whole tree below it is gone),
and a restart with 1 broker finds no unavailable range (every topic was released, ``docs/etcd-
layout.md`` §5.5) and reads every acked message; the restart also says which broker ids hold
topics but were not started.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import re
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import eventually_sync

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import free_port, group_members
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import UnavailableRange

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = Path(sys.executable).parent / "danube-pipeline"
TOPICS = [f"/default/stop-{i}" for i in range(4)]
#: The writer's ``--commit-interval-s``, ``make dev``'s own (``DEV_COMMIT_INTERVAL_S``), set
#: explicitly: what the test waits for (the first commit, the table's rows, tiering of what a
#: drained broker released) must not slow down if the default grows.
COMMIT_INTERVAL_S = 1.0
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)


def _descendants(root: int) -> set[int]:
    """Every live process below ``root`` (its children, their children, ...), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (e.g. a test's directory: Dagster's
    code server is started lazily, after any snapshot of the launcher's children)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline and _alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def _pgid(pid: int) -> int | None:
    """The process group of ``pid``; ``None`` when it has exited."""
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead; only its parent has not reaped it yet
        return (Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]) != "Z"
    except OSError:
        return False


class Launcher:
    """``danube-pipeline dev`` as a child process, its output collected in ``log``."""

    def __init__(self, home: Path, env: dict[str, str], brokers: int, log: Path) -> None:
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [str(LAUNCHER), "dev", "--home", str(home), "--brokers", str(brokers),
                 "--port", env["DANUBE_TEST_DAGSTER_PORT"], "--commit-interval-s", str(COMMIT_INTERVAL_S)],
                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
            )  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self) -> None:
        eventually_sync(lambda: "stops them all" in self.output() or self.proc.poll() is not None,
                        timeout_s=180, interval_s=0.5, what="danube-pipeline dev ready")  # fmt: skip
        assert self.proc.poll() is None, self.output()

    def stop(self, signum: int) -> int:
        self.proc.send_signal(signum)
        return self.proc.wait(timeout=180)

    def clean_up(self) -> None:
        """After a failed test: the launcher's own clean stop first (a SIGKILL would leave
        Dagster's code server behind), SIGKILL only if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def _produce(addresses: list[str]) -> dict[str, int]:
    async with DanubeClient(addresses) as client:
        counts: dict[str, int] = {}
        for topic in TOPICS:
            async with client.producer(topic, producer_name="stop") as producer:
                for i in range(20):
                    await producer.send(b"%d" % i)
            counts[topic] = 20
        return counts


async def _read_all(addresses: list[str], topic: str, expected: int) -> list[bytes]:
    async with DanubeClient(addresses) as client, client.consumer(
        topic, subscription="check", initial_position=InitialPosition.EARLIEST
    ) as consumer:
        got: list[bytes] = []
        while len(got) < expected:
            message = await consumer.receive(timeout_ms=30_000)
            got.append(message.payload)
            await consumer.ack(message)
        return got


async def _unresolved_ranges(etcd: str) -> list[str]:
    """Unavailable ranges (§5.5) whose broker never said what it wrote (``last_written``
    null): a broker that failed, not one that released its topics."""
    async with await MetadataStore.connect([etcd]) as store:
        kvs, _ = await store.get_prefix(keys.DANUBE_DATA)
    return [
        f"{kv.key} {kv.value}"
        for kv in kvs
        if "/unavailable/" in kv.key and UnavailableRange.from_json(kv.value).last_written is None
    ]


def _danube_pipeline(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LAUNCHER), *args], env=env, capture_output=True, text=True, timeout=300, cwd="/")


def _env_and_backfill_work_as_written(home: Path, env: dict[str, str]) -> None:
    """``danube-pipeline env`` prints the running stack's exports; ``danube-pipeline backfill``
    submits a backfill with nothing else in the environment, from any directory, once the
    writer has registered the topic's partition, for a day that was no partition yet."""
    bare = {k: v for k, v in os.environ.items() if not k.startswith(("DANUBE_", "DAGSTER_"))}
    printed = _danube_pipeline("env", "--home", str(home), env=bare)
    assert printed.returncode == 0, printed.stderr
    exports = dict(line.removeprefix("export ").split("=", 1) for line in printed.stdout.splitlines())
    assert exports["DANUBE_ETCD_ENDPOINTS"] == env["DANUBE_ETCD_ENDPOINTS"]
    assert exports["DANUBE_HOME"] == str(home) and exports["DAGSTER_HOME"] == env["DAGSTER_HOME"]
    assert set(exports) >= {"DANUBE_CATALOG_URI", "DANUBE_WAREHOUSE", "DANUBE_OBJECT_STORE_URL", "DANUBE_DAGSTER_STORAGE"}
    # yesterday: no commit made it a day partition; the command adds it
    day = (dt.datetime.now(dt.UTC).date() - dt.timedelta(days=1)).isoformat()
    key = f"{day}|default.stop-0"
    outcome: list[subprocess.CompletedProcess[str]] = []

    def submitted() -> bool:  # refused until the writer's first commit registers the topic
        outcome[:] = [_danube_pipeline("backfill", "compaction_job", "--partitions", key, "--home", str(home), env=bare)]
        return outcome[0].returncode == 0

    eventually_sync(submitted, timeout_s=120, interval_s=2, what="the backfill submitted")
    assert "backfill of compaction_job submitted" in outcome[0].stdout, outcome[0].stdout
    assert "Partitions:\n" not in outcome[0].stdout + "\n"


def _readme_blocks(title: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block under the README's ``## title``."""
    text = (REPO / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(text[start : end if end > 0 else None])]


def _quickstart_then_read_your_table_as_written(home: Path, env: dict[str, str]) -> None:
    """The README's path: ``quickstart.py``, then "Read your table" in a shell that ran
    ``eval "$(danube-pipeline env)"``: the pyiceberg block prints the text block after it once
    the continuous writer committed, and the Spark SQL block shows the same rows."""
    bare = {k: v for k, v in os.environ.items() if not k.startswith(("DANUBE_", "DAGSTER_"))}
    exports = dict(
        line.removeprefix("export ").split("=", 1)
        for line in _danube_pipeline("env", "--home", str(home), env=bare).stdout.splitlines()
    )
    shell = {**bare, **{k: v.strip("'") for k, v in exports.items()}}
    quickstart = subprocess.run([sys.executable, str(REPO / "quickstart.py")], env=shell, capture_output=True,
                                text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert quickstart.returncode == 0, quickstart.stderr
    blocks = _readme_blocks("Read your table")
    assert [lang for lang, _ in blocks] == ["sh", "python", "text", "python", "text"]
    assert blocks[0][1].strip() == 'eval "$(.venv/bin/danube-pipeline env)"'
    (_, pyiceberg), (_, printed), (_, spark_sql), (_, shown) = blocks[1:]
    runs: list[subprocess.CompletedProcess[str]] = []

    def table_read() -> bool:  # the rows appear once the writer commits (seconds)
        runs[:] = [subprocess.run([sys.executable, "-c", pyiceberg], env=shell, capture_output=True, text=True,
                                  timeout=120, cwd="/")]  # fmt: skip
        return runs[0].returncode == 0 and runs[0].stdout == printed

    try:
        eventually_sync(table_read, timeout_s=90, interval_s=2, what="the README's pyiceberg block prints its rows")
    except AssertionError:
        raise AssertionError(f"the pyiceberg block printed {runs[0].stdout!r}, {runs[0].stderr[-2000:]}") from None
    # a short-lived JVM: the C1 compiler alone starts faster (the block runs as written)
    jvm = {"JDK_JAVA_OPTIONS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"}
    spark = subprocess.run([sys.executable, "-c", spark_sql], env={**shell, **jvm}, capture_output=True, text=True,
                           timeout=300, cwd="/")  # fmt: skip
    assert spark.returncode == 0, spark.stderr[-3000:]
    assert spark.stdout.strip() == shown.strip(), spark.stdout


def test_sigterm_stops_everything_and_releases_every_topic(tmp_path: Path) -> None:
    instance_dir = tmp_path / "dagster_home"
    instance_dir.mkdir()
    shutil.copy(REPO / "dagster_home" / "dagster.yaml", instance_dir / "dagster.yaml")  # the repository's instance
    etcd = f"127.0.0.1:{free_port()}"
    env = {
        **os.environ,
        "DAGSTER_HOME": str(instance_dir),
        "DANUBE_ETCD_ENDPOINTS": etcd,
        "DANUBE_BROKER_ADDRESSES": f"127.0.0.1:{free_port()}",
        "DANUBE_TEST_DAGSTER_PORT": str(free_port()),
    }
    home = tmp_path / "dev"
    first = Launcher(home, env, brokers=2, log=tmp_path / "first.log")
    try:
        first.wait_ready()
        addresses = env["DANUBE_BROKER_ADDRESSES"]
        host, _, port = addresses.partition(":")
        both = [addresses, f"{host}:{int(port) + 1}"]
        counts = asyncio.run(_produce(both))
        # two independent checks, each waiting for the writer's commits: side by side
        with ThreadPoolExecutor(max_workers=1) as pool:
            backfill = pool.submit(_env_and_backfill_work_as_written, home, env)
            _quickstart_then_read_your_table_as_written(home, env)
            backfill.result()
        started = _descendants(first.proc.pid)
        assert len(started) >= 5, first.output()  # etcd, 2 brokers, the writer, dg and its children
        # each child leads a process group; `dg dev`'s holds its webserver, daemon, code
        # servers and the runs its daemon launches
        groups = {g for g in map(_pgid, started) if g is not None} - {os.getpgid(0)}
        assert max(len(group_members(g)) for g in groups) >= 3, first.output()
        assert first.stop(signal.SIGTERM) == 0, first.output()
        # emptied by the stop itself, not left to a code server's heartbeat timeout
        assert {g: group_members(g) for g in groups if group_members(g)} == {}
    finally:
        first.clean_up()
    eventually_sync(lambda: not any(_alive(p) for p in started), timeout_s=60, interval_s=0.5,
                    what="every process below the launcher stopped")  # fmt: skip
    eventually_sync(lambda: _mentioning(str(tmp_path)) == [], timeout_s=60, interval_s=0.5,
                    what="no process of this stack left, Dagster's code server included")  # fmt: skip
    for log in (home / "broker" / "broker.log", home / "broker-2" / "broker.log"):
        assert "cannot revoke lease" not in log.read_text(errors="replace"), log  # etcd outlived them

    second = Launcher(home, env, brokers=1, log=tmp_path / "second.log")
    try:
        second.wait_ready()
        assert "which this run did not start" not in second.output()  # every topic was released
        assert asyncio.run(_unresolved_ranges(etcd)) == []
        for topic, count in counts.items():
            assert asyncio.run(_read_all([env["DANUBE_BROKER_ADDRESSES"]], topic, count)) == [
                b"%d" % i for i in range(count)
            ]
        assert second.stop(signal.SIGHUP) == 0, second.output()
    finally:
        second.clean_up()
