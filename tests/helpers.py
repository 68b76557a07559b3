"""Waiting on conditions instead of sleeping a fixed time, and raw stubs on a broker.

``eventually`` polls until a condition holds (fails after a deadline); ``stays`` checks that a
condition keeps holding for a while, for the few assertions that something does NOT happen
(a window that stays full, a standby that receives nothing).
:class:`RegisterCatalog` types the ``spark_on_catalog`` fixture of ``conftest.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from danube_pipeline.client._connection import ConnectionPool, Stubs
from danube_pipeline.metadata import keys

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from danube_pipeline.metadata.store import MetadataStore

Check = Callable[[], bool | Awaitable[bool]]


@contextlib.asynccontextmanager
async def broker_stubs(address: str) -> AsyncIterator[Stubs]:
    """Every service stub on a channel of its own to the broker at ``address``, closed after."""
    pool = ConnectionPool()
    try:
        yield pool.stubs(address)
    finally:
        await pool.close()


async def _holds(check: Check) -> bool:
    result = check()
    if inspect.isawaitable(result):
        result = await result
    return bool(result)


async def eventually(check: Check, *, timeout_s: float = 10.0, interval_s: float = 0.02, what: str = "") -> None:
    """Poll ``check`` every ``interval_s`` until it is true.

    Raises:
        AssertionError: still false after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while not await _holds(check):
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s}s: {what or check}")
        await asyncio.sleep(interval_s)


async def stays(check: Check, *, for_s: float, interval_s: float = 0.02, what: str = "") -> None:
    """Check ``check`` every ``interval_s`` for ``for_s`` seconds; it must hold every time.

    Raises:
        AssertionError: it was false once.
    """
    deadline = time.monotonic() + for_s
    while True:
        if not await _holds(check):
            raise AssertionError(f"stopped holding: {what or check}")
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(interval_s)


def eventually_sync(check: Callable[[], bool], *, timeout_s: float = 10.0, interval_s: float = 0.02, what: str = "") -> None:
    """:func:`eventually` for synchronous tests."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s}s: {what or check}")
        time.sleep(interval_s)


def stays_sync(check: Callable[[], bool], *, for_s: float, interval_s: float = 0.02, what: str = "") -> None:
    """:func:`stays` for synchronous tests."""
    deadline = time.monotonic() + for_s
    while True:
        if not check():
            raise AssertionError(f"stopped holding: {what or check}")
        if time.monotonic() > deadline:
            return
        time.sleep(interval_s)


class RegisterCatalog(Protocol):
    """The ``spark_on_catalog`` fixture of ``conftest.py``: the run's Spark session with the
    Iceberg catalog ``name`` registered on pyiceberg's ``uri`` and ``warehouse``."""

    def __call__(self, *, name: str, uri: str, warehouse: str) -> SparkSession: ...


async def topic_owners(meta: MetadataStore) -> dict[str, int]:
    """``{"/ns/topic": broker_id}`` of every assignment under ``/cluster/brokers/`` (§1.4)."""
    kvs, _ = await meta.get_prefix(keys.BROKERS_PREFIX)
    found: dict[str, int] = {}
    for kv in kvs:
        parts = kv.key[len(keys.BROKERS_PREFIX) :].split("/")
        if len(parts) == 3 and parts[0].isdigit():
            found[f"/{parts[1]}/{parts[2]}"] = int(parts[0])
    return found


async def owners_of_all(meta: MetadataStore, topics: Sequence[str], *, timeout_s: float = 20.0) -> dict[str, int]:
    """:func:`topic_owners` once every one of ``topics`` has an owner.

    Raises:
        AssertionError: some topic still had none after ``timeout_s`` seconds.
    """

    async def assigned() -> bool:
        owners = await topic_owners(meta)
        return all(t in owners for t in topics)

    await eventually(assigned, timeout_s=timeout_s, what="every topic has an owner")
    return await topic_owners(meta)


ADMIN = Path(sys.executable).parent / "danube-admin"
"""The ``danube-admin`` script of this virtualenv."""


@dataclass
class AdminRun:
    """One ``danube-admin`` run: exit code, stdout and stderr."""

    code: int
    out: str
    err: str

    def ok(self) -> Any:
        """The JSON document of a successful run."""
        assert self.code == 0, self.err
        assert "Traceback" not in self.err, self.err
        return json.loads(self.out)


async def run_admin(
    *args: str,
    etcd: Sequence[str],
    brokers: Sequence[str] | None = None,
    output: str | None = "json",
    stdin: bytes | None = None,
    timeout_s: float = 60.0,
) -> AdminRun:
    """Run ``danube-admin --etcd-endpoints ... [--brokers ...] [--output OUTPUT] ARGS``.

    Raises:
        TimeoutError: it did not finish within ``timeout_s`` seconds.
    """
    command = [str(ADMIN), "--etcd-endpoints", ",".join(etcd)]
    if brokers is not None:
        command += ["--brokers", ",".join(brokers)]
    if output is not None:
        command += ["--output", output]
    proc = await asyncio.create_subprocess_exec(
        *command, *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(stdin), timeout_s)
    assert proc.returncode is not None
    return AdminRun(proc.returncode, out.decode(), err.decode())


def broker_config_args(path: Path, settings: Mapping[str, Any]) -> list[str]:
    """``["--config", path]`` for a broker, after writing ``settings`` there as its YAML
    configuration file (``BrokerConfig`` field names, ``docs/danube_broker.example.yml``; a
    ``Path`` value is written as its string). The broker reads them the way an operator's file
    is read, below the flags ``BrokerProcess`` gives.

    Raises:
        OSError: the file cannot be written.
    """
    import yaml

    path.write_text(yaml.safe_dump({k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}))
    return ["--config", str(path)]
