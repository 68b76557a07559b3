"""Replay from the WAL, from object storage and from the Iceberg table, in one run: the cost of a cold read.

Starts its own etcd and broker (real processes in a temporary directory), publishes N messages,
by default the nycflights13 flights (all 336,776) as Avro messages of the flights schema
(registered in etcd; their table gets the typed columns and ``_raw_payload``), with ``--size S``
synthetic payloads of S bytes instead (500,000 unless ``--messages``), seals and tiers every segment (the tiering step of the ``segment_objects`` asset:
objects plus descriptors in etcd) to a ``file://`` store, or to S3 with ``--s3`` (moto's
server, started here). Then, with one consumer per replay (Exclusive, ``EARLIEST``, acking
everything):

1. **WAL replay**: a new subscription reads the N messages while every segment is on the
   broker's disk;
2. **cold replay**: local retention deletes every sealed segment from the broker's disk
   (``Admin.ApplyLocalRetention`` with 0 bytes), and another new subscription reads the same N
   messages, now served from the segment objects through their descriptors;
3. **table replay**: the objects are committed to the topic's Iceberg table (the continuous
   writer's step ``commit_objects_to_table``, a SQLite catalog and a ``file://`` warehouse, the
   table layout's ``raw_payload`` on: ``docs/etcd-layout.md`` §3.9), the topic's read path is
   set to ``iceberg`` (§3.10; the broker's own ``--cold-read-path`` stays ``objects``), and,
   after ``--table-open-s`` seconds (the broker opens its table reader as soon as the read path
   names the table: imports, catalog, table metadata; not counted, as the WAL replay does not
   count the broker's start), a third new subscription reads the N messages from the table.

Each replay's rate is messages received per second from the subscribe call to the last
message; every message is checked (offset and payload). Each replay also prints its time, the
time to its first message and the longest wait for any later one (a read source that stalls
shows there). The broker's count of records served
from object storage (the table's records included) is checked to be 0, N and N; that the table
served all of the third replay is checked on the broker's metrics (``--metrics-listen``): the
object cache neither fetched a byte nor answered a read meanwhile.

    .venv/bin/python benchmarks/replay.py                       # the 336,776 flights, file://
    .venv/bin/python benchmarks/replay.py --size 100            # 500,000 x 100 B
    .venv/bin/python benchmarks/replay.py --size 1024 --s3

It ends with one line, figures of that run:
``replay: wal_msgs_per_s=X cold_msgs_per_s=X iceberg_msgs_per_s=X iceberg_ratio=X``, where
``iceberg_ratio`` is the table replay's rate over the WAL replay's (target: >= 0.8; the cold
replay's own ratio is printed above it).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from danube_pipeline.client import AvroSchema, DanubeClient, InitialPosition
from danube_pipeline.dev.flights import FLIGHT_AVRO_SCHEMA_JSON, FLIGHTS_SUBJECT, encode_flight, iter_flights
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer, free_port
from danube_pipeline.lake.tiering import commit_objects_to_table, tier_sealed_segments
from danube_pipeline.metadata import keys
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.metadata.values import TableLayout, TopicReadPath
from danube_pipeline.names import TopicName
from danube_pipeline.schemas.registry import SchemaRegistry
from danube_pipeline.storage.catalog import load_catalog
from danube_pipeline.storage.objectstore import ObjectStore

TOPIC = "/bench/replay"
CATALOG = "replay"
OBJECT_CACHE_COUNTERS = ("danube_tiered_fetched_bytes", "danube_tiered_cache_hits", "danube_tiered_cache_misses")


def _synthetic(size: int) -> Callable[[int], bytes]:
    """The payload of offset ``i``: ``i`` (8 bytes) and ``size - 8`` bytes of ``x``."""
    body = b"x" * max(0, size - 8)
    return lambda i: i.to_bytes(8, "big") + body


async def _publish(client: DanubeClient, count: int, payload_of: Callable[[int], bytes], schema: AvroSchema | None) -> float:
    start = time.perf_counter()
    async with client.producer(TOPIC, producer_name="replay-loader", schema=schema) as producer:
        pending = []
        for i in range(count):
            pending.append(producer.send_nowait(payload_of(i)))
            if len(pending) >= 2000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    return time.perf_counter() - start


async def _replay(client: DanubeClient, subscription: str, count: int, payload_of: Callable[[int], bytes]) -> float:
    """Read ``count`` messages from the earliest offset; returns messages per second (and
    prints the time to the first message and the longest wait for one)."""
    start = time.perf_counter()
    first_s = longest_s = 0.0
    async with client.consumer(
        TOPIC, subscription=subscription, initial_position=InitialPosition.EARLIEST,
        receiver_queue_size=4000, ack_batch_size=2000,
    ) as consumer:
        for expected in range(count):
            waited = time.perf_counter()
            message = await consumer.receive(timeout_ms=60_000)
            now = time.perf_counter()
            if expected == 0:
                first_s = now - start
            else:
                longest_s = max(longest_s, now - waited)
            if message.offset != expected or message.payload != payload_of(expected):
                raise SystemExit(f"{subscription}: offset {message.offset}, expected {expected}")
            await consumer.ack(message)
    elapsed_s = time.perf_counter() - start
    print(f"  {subscription}: {elapsed_s:.2f} s, first message after {first_s * 1e3:.0f} ms, "
          f"longest wait {longest_s * 1e3:.0f} ms", flush=True)
    return count / elapsed_s


def _object_cache_counters(metrics_address: str) -> dict[str, float]:
    """The broker's object-cache counters (``broker.metrics``), summed over their labels."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as response:  # noqa: S310 - loopback
        text = response.read().decode()
    out = dict.fromkeys(OBJECT_CACHE_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in out and not sample.name.endswith("_created"):
                out[name] += sample.value
    return out


async def _run(
    args: argparse.Namespace, broker: BrokerProcess, etcd: EtcdServer, objects: ObjectStore, catalog_env: dict[str, str],
    metrics_address: str,
) -> int:
    topic = TopicName.parse(TOPIC)
    async with DanubeClient([broker.address]) as client, await MetadataStore.connect(etcd.endpoints) as meta:
        # the table keeps every message's exact bytes and key (§3.9): the table path can serve it
        await meta.put(keys.topic_table(topic), TableLayout(raw_payload=True))
        if args.size is None:
            payloads = [encode_flight(f) for f in iter_flights(args.messages)]
            payload_of: Callable[[int], bytes] = payloads.__getitem__
            schema: AvroSchema | None = AvroSchema(subject=FLIGHTS_SUBJECT, raw_schema=FLIGHT_AVRO_SCHEMA_JSON)
            args.messages = len(payloads)
            mean_size = sum(map(len, payloads)) / max(1, len(payloads))
        else:
            payload_of, schema, mean_size = _synthetic(args.size), None, float(args.size)
        publish_s = await _publish(client, args.messages, payload_of, schema)
        print(f"  published {args.messages:,} messages ({mean_size:.0f} B each on average) in {publish_s:.1f} s", flush=True)
        await client.admin.seal_active_segment(TOPIC)
        start = time.perf_counter()
        report = await tier_sealed_segments(topic, store=meta, admin=client.admin, objects=objects)
        print(
            f"  tiered {report.objects_written} objects, {report.bytes_written:,} bytes in {time.perf_counter() - start:.1f} s",
            flush=True,
        )
        wal_rate = await _replay(client, "replay-wal", args.messages, payload_of)
        retained = await client.admin.apply_local_retention(TOPIC, retention_bytes=0)
        print(
            f"  local retention: {retained.deleted_segments} segments ({retained.deleted_bytes:,} bytes) deleted, "
            f"WAL now {retained.wal_bytes:,} bytes from offset {retained.first_local_offset:,}",
            flush=True,
        )
        cold_rate = await _replay(client, "replay-cold", args.messages, payload_of)

        start = time.perf_counter()
        catalog = load_catalog(
            uri=catalog_env["DANUBE_CATALOG_URI"], warehouse=catalog_env["DANUBE_WAREHOUSE"],
            name=catalog_env["DANUBE_CATALOG_NAME"],
        )
        committed = await commit_objects_to_table(
            topic, store=meta, objects=objects, catalog=catalog, registry=SchemaRegistry(meta)
        )
        print(
            f"  committed {committed.objects_appended} objects ({committed.rows_appended:,} rows, "
            f"{committed.data_files} data files) to {committed.table} in {time.perf_counter() - start:.1f} s",
            flush=True,
        )
        retained = await client.admin.apply_local_retention(TOPIC, retention_bytes=0)
        if retained.first_local_offset != args.messages:
            print(f"  the WAL still holds offsets from {retained.first_local_offset:,}; expected none below {args.messages:,}")
            return 1
        await meta.put(keys.topic_read_path(topic), TopicReadPath(cold_read_path="iceberg"))
        # the broker opens the table reader as soon as the read path names the table (imports,
        # catalog, table metadata): not counted, as the WAL replay does not count the broker's start
        await asyncio.sleep(args.table_open_s)
        before = _object_cache_counters(metrics_address)
        iceberg_rate = await _replay(client, "replay-iceberg", args.messages, payload_of)
        after = _object_cache_counters(metrics_address)
        described = await client.admin.describe_topic(TOPIC)
    served = {s.name: s.records_from_object_storage for s in described.subscriptions}
    expected = {"replay-wal": 0, "replay-cold": args.messages, "replay-iceberg": args.messages}
    if any(served.get(name) != n for name, n in expected.items()):
        print(f"  records from object storage per subscription: {served}; expected {expected}")
        return 1
    touched = {name: after[name] - before[name] for name in OBJECT_CACHE_COUNTERS if after[name] != before[name]}
    if touched:
        print(f"  the table replay read segment objects too ({touched}): the table did not serve it all")
        return 1
    print(f"  WAL replay      {wal_rate:>10,.0f} msg/s  {wal_rate * mean_size / 1e6:7.1f} MB/s")
    print(f"  cold replay     {cold_rate:>10,.0f} msg/s  {cold_rate * mean_size / 1e6:7.1f} MB/s   "
          f"(all {served['replay-cold']:,} from segment objects; {cold_rate / wal_rate:.2f} of the WAL replay)")
    print(f"  table replay    {iceberg_rate:>10,.0f} msg/s  {iceberg_rate * mean_size / 1e6:7.1f} MB/s   "
          f"(all {served['replay-iceberg']:,} from the Iceberg table, no object read; target >= 80% of the WAL replay)")
    print(
        f"replay: wal_msgs_per_s={wal_rate:.0f} cold_msgs_per_s={cold_rate:.0f} "
        f"iceberg_msgs_per_s={iceberg_rate:.0f} iceberg_ratio={iceberg_rate / wal_rate:.2f}"
    )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=None,
                   help="messages to publish and replay (default: every flight; 500,000 with --size)")
    p.add_argument("--size", type=int, default=None,
                   help="synthetic payloads of this many bytes instead of the flights (Avro)")
    p.add_argument("--segment-max-bytes", type=int, default=8 * 1024 * 1024, help="WAL segment size (default 8 MiB)")
    p.add_argument("--s3", action="store_true", help="tier to S3 (moto's server) instead of file://")
    p.add_argument("--table-open-s", type=float, default=3.0,
                   help="seconds the broker gets to open the table reader before the table replay (default 3)")
    args = p.parse_args()
    if args.size is not None and args.messages is None:
        args.messages = 500_000
    with tempfile.TemporaryDirectory(prefix="danube-replay-") as tmp:
        root = Path(tmp)
        broker_args: list[str] = []
        env: dict[str, str] = {}
        moto = None
        if args.s3:
            import boto3
            from moto.server import ThreadedMotoServer

            port = free_port()
            moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
            moto.start()
            endpoint = f"http://127.0.0.1:{port}"
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                         aws_access_key_id="test", aws_secret_access_key="test").create_bucket(Bucket="replay")
            url = "s3://replay/objects"
            objects = ObjectStore(url, storage_options={"endpoint_url": endpoint, "key": "test", "secret": "test",
                                                        "client_kwargs": {"region_name": "us-east-1"}})
            broker_args = ["--s3-endpoint-url", endpoint, "--s3-region", "us-east-1"]
            env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
        else:
            url = (root / "objects").as_uri()
            objects = ObjectStore(url)
        # the table's warehouse is local either way (the table path's cost is the reader's, not S3's)
        catalog_env = {
            "DANUBE_CATALOG_URI": f"sqlite:///{root / 'catalog.db'}",
            "DANUBE_WAREHOUSE": (root / "warehouse").as_uri(),
            "DANUBE_CATALOG_NAME": CATALOG,
        }
        metrics_address = f"127.0.0.1:{free_port()}"
        what = "the nycflights13 flights (Avro)" if args.size is None else f"{args.messages:,} messages x {args.size} B"
        print(f"replay: {what}, segments of {args.segment_max_bytes:,} B, "
              f"objects in {'S3 (moto)' if args.s3 else 'file://'}, table in a file:// warehouse", flush=True)
        try:
            with EtcdServer(root / "etcd") as etcd:
                broker = BrokerProcess(
                    etcd_endpoints=etcd.endpoints,
                    data_dir=root / "broker",
                    segment_max_bytes=args.segment_max_bytes,
                    extra_args=[
                        "--object-store-url", url, "--local-retention-check-s", "3600",
                        "--metrics-listen", metrics_address, *broker_args,
                    ],
                    env={**env, **catalog_env},
                )
                broker.start()
                try:
                    return asyncio.run(_run(args, broker, etcd, objects, catalog_env, metrics_address))
                finally:
                    broker.stop()
        finally:
            if moto is not None:
                moto.stop()


if __name__ == "__main__":
    sys.exit(main())
