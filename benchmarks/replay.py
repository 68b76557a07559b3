"""Replay from the WAL and from object storage, in one run: the cost of a cold read.

Starts its own etcd and broker (real processes in a temporary directory), publishes N messages
of S bytes, seals and tiers every segment (the tiering step of the ``segment_objects`` asset:
objects plus descriptors in etcd) to a ``file://`` store, or to S3 with ``--s3`` (moto's
server, started here). Then, with one consumer per replay (Exclusive, ``EARLIEST``, acking
everything):

1. **WAL replay**: a new subscription reads the N messages while every segment is on the
   broker's disk;
2. **cold replay**: local retention deletes every sealed segment from the broker's disk
   (``Admin.ApplyLocalRetention`` with 0 bytes), and another new subscription reads the same N
   messages, now served from the segment objects through their descriptors.

Each replay's rate is messages received per second from the subscribe call to the last
message. The broker's own count of records served from object storage is checked to be N for
the cold replay and 0 for the WAL replay.

    .venv/bin/python benchmarks/replay.py                       # 500,000 x 100 B, file://
    .venv/bin/python benchmarks/replay.py --size 1024 --s3

It ends with one line, figures of that run:
``replay: wal_msgs_per_s=X cold_msgs_per_s=X ratio=X`` (target: ratio >= 0.8).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer, free_port
from danube_pipeline.metadata.store import MetadataStore
from danube_pipeline.names import TopicName
from danube_pipeline.storage.objectstore import ObjectStore
from danube_pipeline.lake.tiering import tier_sealed_segments

TOPIC = "/bench/replay"


async def _publish(client: DanubeClient, count: int, size: int) -> float:
    start = time.perf_counter()
    async with client.producer(TOPIC, producer_name="replay-loader") as producer:
        body = b"x" * max(0, size - 8)
        pending = []
        for i in range(count):
            pending.append(producer.send_nowait(i.to_bytes(8, "big") + body))
            if len(pending) >= 2000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    return time.perf_counter() - start


async def _replay(client: DanubeClient, subscription: str, count: int) -> float:
    """Read ``count`` messages from the earliest offset; returns messages per second."""
    start = time.perf_counter()
    async with client.consumer(
        TOPIC, subscription=subscription, initial_position=InitialPosition.EARLIEST,
        receiver_queue_size=4000, ack_batch_size=2000,
    ) as consumer:
        for expected in range(count):
            message = await consumer.receive(timeout_ms=60_000)
            if message.offset != expected or int.from_bytes(message.payload[:8], "big") != expected:
                raise SystemExit(f"{subscription}: offset {message.offset}, expected {expected}")
            await consumer.ack(message)
    return count / (time.perf_counter() - start)


async def _run(args: argparse.Namespace, broker: BrokerProcess, etcd: EtcdServer, objects: ObjectStore) -> int:
    async with DanubeClient([broker.address]) as client:
        publish_s = await _publish(client, args.messages, args.size)
        print(f"  published {args.messages:,} x {args.size} B in {publish_s:.1f} s", flush=True)
        await client.admin.seal_active_segment(TOPIC)
        start = time.perf_counter()
        async with await MetadataStore.connect(etcd.endpoints) as meta:
            report = await tier_sealed_segments(TopicName.parse(TOPIC), store=meta, admin=client.admin, objects=objects)
        print(
            f"  tiered {report.objects_written} objects, {report.bytes_written:,} bytes in {time.perf_counter() - start:.1f} s",
            flush=True,
        )
        wal_rate = await _replay(client, "replay-wal", args.messages)
        retained = await client.admin.apply_local_retention(TOPIC, retention_bytes=0)
        print(
            f"  local retention: {retained.deleted_segments} segments ({retained.deleted_bytes:,} bytes) deleted, "
            f"WAL now {retained.wal_bytes:,} bytes from offset {retained.first_local_offset:,}",
            flush=True,
        )
        cold_rate = await _replay(client, "replay-cold", args.messages)
        described = await client.admin.describe_topic(TOPIC)
    served = {s.name: s.records_from_object_storage for s in described.subscriptions}
    if served.get("replay-wal") != 0 or served.get("replay-cold") != args.messages:
        print(f"  records from object storage per subscription: {served}; expected 0 and {args.messages}")
        return 1
    print(f"  WAL replay   {wal_rate:>10,.0f} msg/s  {wal_rate * args.size / 1e6:7.1f} MB/s")
    print(f"  cold replay  {cold_rate:>10,.0f} msg/s  {cold_rate * args.size / 1e6:7.1f} MB/s   "
          f"(all {served['replay-cold']:,} from object storage; target >= 80% of the WAL replay)")
    print(f"replay: wal_msgs_per_s={wal_rate:.0f} cold_msgs_per_s={cold_rate:.0f} ratio={cold_rate / wal_rate:.2f}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=500_000, help="messages to publish and replay (default 500,000)")
    p.add_argument("--size", type=int, default=100, help="payload bytes (default 100)")
    p.add_argument("--segment-max-bytes", type=int, default=8 * 1024 * 1024, help="WAL segment size (default 8 MiB)")
    p.add_argument("--s3", action="store_true", help="tier to S3 (moto's server) instead of file://")
    args = p.parse_args()
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
        print(f"replay: {args.messages:,} messages x {args.size} B, segments of {args.segment_max_bytes:,} B, "
              f"objects in {'S3 (moto)' if args.s3 else 'file://'}", flush=True)
        try:
            with EtcdServer(root / "etcd") as etcd:
                broker = BrokerProcess(
                    etcd_endpoints=etcd.endpoints,
                    data_dir=root / "broker",
                    segment_max_bytes=args.segment_max_bytes,
                    extra_args=["--object-store-url", url, "--local-retention-check-s", "3600", *broker_args],
                    env=env,
                )
                broker.start()
                try:
                    return asyncio.run(_run(args, broker, etcd, objects))
                finally:
                    broker.stop()
        finally:
            if moto is not None:
                moto.stop()


if __name__ == "__main__":
    sys.exit(main())
