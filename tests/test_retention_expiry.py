"""A retention run killed inside its snapshot expiry, after the commit and before the expired
files are deleted (``danube_pipeline.lake.retention.expiry``), against a real etcd, a real
broker, the real SQL catalog and real Spark.

The crash is real: the run is a child process armed with the fault point
``retention.after_expire_commit`` (``danube_pipeline/faults.py``), which SIGKILLs it right
after Iceberg committed the expiry and before any expired file is deleted. Iceberg's
``expire_snapshots`` procedure commits and deletes in one call, so retention commits the
expiry with file deletion disabled (``cleanExpiredFiles(false)``) and deletes the files it
recorded itself; the point sits between the two.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import RegisterCatalog
from pyiceberg.catalog.sql import SqlCatalog
from test_retention import _produce, _set_policy, _tier

from danube_pipeline import faults
from danube_pipeline.dev.localcluster import BrokerProcess
from danube_pipeline.lake import iceberg
from danube_pipeline.lake.retention import apply_retention
from danube_pipeline.lake.retention.expiry import live_files, record_location
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import NamespacePolicy
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore

pytestmark = pytest.mark.spark

CATALOG = "expiry"
MINUTE_MS = 60_000
REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import asyncio, json, sys

args = json.loads(sys.argv[1])

from danube_pipeline.lake import iceberg
from danube_pipeline.client import DanubeClient
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore
from danube_pipeline.lake.retention import apply_retention
from danube_pipeline.lake.spark.session import build_spark_session, spark_conf

conf = spark_conf(catalog_name=args["catalog"], catalog_uri=args["uri"], warehouse=args["warehouse"],
                  master="local[1]", shuffle_partitions=1)
conf["spark.driver.extraJavaOptions"] = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
# the JVM starts before any gRPC channel exists (pyspark forks to launch it)
spark = build_spark_session(conf)


async def main():
    catalog = iceberg.load_catalog(name=args["catalog"], uri=args["uri"], warehouse=args["warehouse"])
    async with await MetadataStore.connect(args["etcd"]) as store, DanubeClient([args["broker"]]) as client:
        await apply_retention(TopicName.parse(args["topic"]), store=store, objects=ObjectStore(args["objects"]),
                              catalog=catalog, spark=spark, admin=client.admin, now_ms=args["now_ms"])


asyncio.run(main())
sys.exit(3)
"""


def _now_ms() -> int:
    return int(time.time() * 1000)


def _local(location: str) -> Path:
    return Path(location.removeprefix("file:").removeprefix("//"))


def _unreferenced(catalog: SqlCatalog, topic: TopicName) -> set[str]:
    """Data files and manifests (lists) under the table's location that no snapshot references."""
    table = catalog.load_table(iceberg.table_identifier(topic))
    live = {str(_local(p)) for p in live_files(table)}
    root = _local(table.location())
    on_disk = {str(p) for p in (root / "data").rglob("*.parquet")} | {str(p) for p in (root / "metadata").glob("*.avro")}
    return on_disk - live


def test_files_left_by_a_run_killed_after_the_expiry_commit_are_deleted_by_the_next_run(
    etcd_endpoints: list[str],
    start_broker: Callable[..., BrokerProcess],
    spark_on_catalog: RegisterCatalog,
    tmp_path: Path,
) -> None:
    """Two batches, each committed to the table in its own append (so each has its own data
    file); the first expires. A child run deletes its rows, commits the snapshot expiry and is
    SIGKILLed before deleting anything: the expired data file stays on disk, referenced by no
    snapshot. The next run deletes exactly those files and leaves every live file alone."""
    uri, warehouse = f"sqlite:///{tmp_path / 'catalog.db'}", (tmp_path / "warehouse").as_uri()
    catalog = iceberg.load_catalog(name=CATALOG, uri=uri, warehouse=warehouse)
    spark = spark_on_catalog(name=CATALOG, uri=uri, warehouse=warehouse)
    broker = start_broker(segment_max_bytes=64 * 1024, segment_max_age_s=600.0)
    topic = TopicName("default", "expiry")
    objects = ObjectStore((tmp_path / "objects").as_uri())
    asyncio.run(_set_policy(etcd_endpoints, "default", NamespacePolicy(retention_time_minutes=1).to_json()))

    asyncio.run(_produce(broker.address, topic.path, 10))
    asyncio.run(_tier(broker.address, etcd_endpoints, topic, objects, catalog))
    time.sleep(0.03)
    boundary_ms = _now_ms()  # batch 0 published before it, batch 1 after
    time.sleep(0.03)
    asyncio.run(_produce(broker.address, topic.path, 10))
    asyncio.run(_tier(broker.address, etcd_endpoints, topic, objects, catalog))
    table = catalog.load_table(iceberg.table_identifier(topic))
    assert iceberg.committed_end_offset(table) == 19
    first_files = set(live_files(table))
    now_ms = boundary_ms + MINUTE_MS

    args = {
        "catalog": CATALOG,
        "uri": uri,
        "warehouse": warehouse,
        "etcd": etcd_endpoints,
        "broker": broker.address,
        "topic": topic.path,
        "objects": objects.root_url,
        "now_ms": now_ms,
    }
    env = {**os.environ, **faults.environment({faults.RETENTION_AFTER_EXPIRE_COMMIT: faults.SIGKILL})}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert f"fault injection {faults.RETENTION_AFTER_EXPIRE_COMMIT}" in proc.stderr

    # the dead run committed the expiry and deleted nothing: its files are on disk, unreferenced
    table = catalog.load_table(iceberg.table_identifier(topic))
    assert len(table.snapshots()) == 1
    assert sorted(table.scan(selected_fields=("_offset",)).to_arrow().column("_offset").to_pylist()) == list(
        range(10, 20)
    )
    left = _unreferenced(catalog, topic)
    assert any(p.endswith(".parquet") for p in left), left  # the expired rows' data file
    assert {p for p in left if p.endswith(".parquet")} <= {str(_local(p)) for p in first_files}
    live_after_crash = {str(_local(p)) for p in live_files(table)}
    record = _local(record_location(table, topic))
    assert record.exists()

    # the next run (nothing else left to do: same retained start) deletes exactly those files
    async def rerun() -> int:
        async with await MetadataStore.connect(etcd_endpoints) as store:
            report = await apply_retention(
                topic, store=store, objects=objects, catalog=catalog, spark=spark, admin=object(), now_ms=now_ms
            )
        return report.data_files_deleted

    deleted = asyncio.run(rerun())
    assert deleted == len([p for p in left if p.endswith(".parquet")])
    assert _unreferenced(catalog, topic) == set()
    assert all(Path(p).exists() for p in live_after_crash)
    assert not record.exists()
    table = catalog.load_table(iceberg.table_identifier(topic))
    assert {str(_local(p)) for p in live_files(table)} == live_after_crash
    count = spark.sql(f"SELECT count(*) AS n FROM {CATALOG}.default.expiry").collect()[0]["n"]
    assert count == 10
