"""Ingest benchmark: one producer, N messages of S bytes, acks awaited (fdatasync before ack).

Starts its own etcd and broker (real processes in a temporary directory), publishes with the
client library's batching producer, and prints messages/s, MB/s, p50/p99/max ack latency and
messages per WAL ``fdatasync`` (from the broker's admin API).

    python benchmarks/ingest.py --messages 200000 --size 256

Ack latency is measured per message from ``send_nowait`` to its ack future resolving.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from danube_pipeline.client import DanubeClient
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer

TOPIC = "/bench/ingest"


async def _run(address: str, messages: int, size: int, window: int, linger_ms: int, batch: int, in_flight: int) -> dict[str, float]:
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    latencies_us: list[float] = []
    async with DanubeClient([address]) as client:
        async with client.producer(
            TOPIC,
            producer_name="bench",
            linger_ms=linger_ms,
            max_batch_messages=batch,
            max_in_flight_batches=in_flight,
        ) as producer:
            # warm-up: topic creation, connections
            await producer.send(payload)
            loop = asyncio.get_running_loop()
            started = time.perf_counter()
            pending: list[asyncio.Future[int]] = []
            def record_latency(t0: float) -> Callable[[asyncio.Future[int]], None]:
                return lambda _fut: latencies_us.append((loop.time() - t0) * 1e6)

            for _ in range(messages):
                t0 = loop.time()
                fut = producer.send_nowait(payload)
                fut.add_done_callback(record_latency(t0))
                pending.append(fut)
                if len(pending) >= window:
                    await asyncio.gather(*pending)
                    pending.clear()
            await asyncio.gather(*pending)
            elapsed_s = time.perf_counter() - started
        topics = await client.admin.list_topics("bench")
    syncs = sum(t.wal_syncs for t in topics if t.topic == TOPIC)
    latencies_us.sort()
    return {
        "elapsed_s": elapsed_s,
        "msgs_per_s": messages / elapsed_s,
        "mb_per_s": messages * size / elapsed_s / 1e6,
        "p50_us": statistics.median(latencies_us),
        "p99_us": latencies_us[int(len(latencies_us) * 0.99) - 1],
        "max_us": latencies_us[-1],
        "syncs": syncs,
        "msgs_per_sync": (messages + 1) / max(syncs, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000, help="messages to publish (N)")
    parser.add_argument("--size", type=int, default=256, help="payload size in bytes (S)")
    parser.add_argument("--window", type=int, default=20_000, help="unacked messages the benchmark allows before waiting")
    parser.add_argument("--linger-ms", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1000, help="max messages per batch")
    parser.add_argument("--in-flight", type=int, default=8, help="max batches in flight")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="danube-bench-") as tmp:
        root = Path(tmp)
        etcd = EtcdServer(root / "etcd")
        etcd.start()
        try:
            broker = BrokerProcess(etcd_endpoints=etcd.endpoints, data_dir=root / "broker", segment_max_bytes=64 * 1024 * 1024)
            broker.start()
            try:
                r = asyncio.run(_run(broker.address, args.messages, args.size, args.window, args.linger_ms, args.batch, args.in_flight))
            finally:
                broker.stop()
        finally:
            etcd.stop()
    print(f"ingest: {args.messages:,} messages x {args.size} B, one producer, acks after fdatasync")
    print(f"  batch<= {args.batch} msgs, linger {args.linger_ms} ms, {args.in_flight} batches in flight, window {args.window:,}")
    print(f"  elapsed          {r['elapsed_s']:10.2f} s")
    print(f"  throughput       {r['msgs_per_s']:10,.0f} msg/s   {r['mb_per_s']:8.2f} MB/s")
    print(f"  ack latency      p50 {r['p50_us'] / 1000:8.2f} ms   p99 {r['p99_us'] / 1000:8.2f} ms   max {r['max_us'] / 1000:8.2f} ms")
    print(f"  fdatasync calls  {r['syncs']:10,.0f}   ({r['msgs_per_sync']:,.1f} messages per sync)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
