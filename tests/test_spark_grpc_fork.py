"""Spark's JVM launched in a Dagster run worker that holds gRPC channels.

A run of the ``retention`` asset opens its etcd and broker channels and then, only when the
table has work, starts Spark: PySpark forks (with a ``preexec_fn``) to exec ``java`` while
gRPC's threads run. With gRPC's fork support on (its default in this build), its fork
handlers run at that fork: every launch logs ``Other threads are currently calling into gRPC,
skipping fork() handlers``, and the parent's poller can break. The ``assets`` package turns
fork support off before ``grpc`` is imported; these tests check that in a process of its own
(the test process imported ``grpc`` long ago), in the order a run worker does it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from danube_pipeline.lake.spark.session import GRPC_FORK_SUPPORT_ENV

pytestmark = pytest.mark.spark

REPO = Path(__file__).resolve().parents[1]

# What a run worker does: load the code location, open a gRPC channel (etcd), start Spark while
# it is open, then use the channel again.
CHILD = r"""
import asyncio, json, sys

args = json.loads(sys.argv[1])

import assets.definitions  # the code location, loaded first, as by a run worker
from assets.resources import EtcdResource, SparkResource


async def main():
    async with await EtcdResource(endpoints=args["etcd"]).connect() as store:
        await store.put("/fork-test/before", {"n": 1})
        spark = SparkResource(catalog_name="fork", catalog_uri=args["uri"], warehouse=args["warehouse"],
                              master="local[1]", shuffle_partitions=1)
        with spark.session() as session:
            n = session.sql("SELECT 41 + 1 AS n").collect()[0]["n"]
        assert (await store.get("/fork-test/before")) is not None
    print("answer", n, flush=True)


asyncio.run(main())
"""

_FORK_LINES = ("fork_posix", "skipping fork() handlers", "epoll_wait error")


def test_a_run_worker_starts_spark_with_grpc_channels_open_without_grpc_fork_handlers(
    etcd_endpoints: list[str], tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != GRPC_FORK_SUPPORT_ENV}
    env["SPARK_SUBMIT_OPTS"] = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"  # a short-lived JVM
    args = {
        "etcd": ",".join(etcd_endpoints),
        "uri": f"sqlite:///{tmp_path / 'catalog.db'}",
        "warehouse": (tmp_path / "warehouse").as_uri(),
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "answer 42" in proc.stdout
    fork_lines = [line for line in proc.stderr.splitlines() if any(m in line for m in _FORK_LINES)]
    assert fork_lines == [], fork_lines
    assert "fork support on" not in proc.stderr  # build_spark_session saw no hazard


def test_the_hazard_check_names_grpc_fork_support(monkeypatch: pytest.MonkeyPatch) -> None:
    """``grpc_fork_hazard`` in a process that imported grpc and has no JVM yet (pyspark's
    gateway is unset in this check; the process's real JVM, if any, is not touched)."""
    import grpc  # noqa: F401 - imported, as in every process that talks to etcd
    from pyspark import SparkContext

    from danube_pipeline.lake.spark.session import grpc_fork_hazard

    monkeypatch.setattr(SparkContext, "_gateway", None)
    monkeypatch.setenv(GRPC_FORK_SUPPORT_ENV, "false")
    assert grpc_fork_hazard() is None
    monkeypatch.delenv(GRPC_FORK_SUPPORT_ENV)
    hazard = grpc_fork_hazard()
    assert hazard is not None and GRPC_FORK_SUPPORT_ENV in hazard
