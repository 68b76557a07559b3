"""Ingest with a consumer attached: ingest rate, consume rate while ingest runs, broker memory.

Starts its own etcd and broker (real processes in a temporary directory). One producer in this
process publishes N messages of S bytes through the client library with at most W unacked
(the loop of ``loadgen.window_loop``; every ack follows the broker's ``fdatasync``). One
consumer in a separate process (its own interpreter, as a real consumer would be) subscribes
before the first message and acks everything it receives. Defaults: 1 GiB of 1 KiB payloads.

    .venv/bin/python benchmarks/ingest.py                  # 1 GiB of 1 KiB messages
    .venv/bin/python benchmarks/ingest.py --size 100 --messages 2000000
    .venv/bin/python benchmarks/ingest.py --metrics-cost     # metrics on vs off, series count

It prints:

* the ingest rate (messages acked per second over the producer's run) and the consume rate
  (messages received per second from the consumer's first message to the last), and their
  ratio: the issue's target is consume >= 80 % of ingest while ingest runs;
* the broker's resident memory (``VmRSS`` from ``/proc``) before, at its peak (sampled every
  100 ms) and after: the target is under 300 MiB after ingesting 1 GiB;
* ``fdatasync`` calls and messages per sync (from the broker's admin API).

It ends with one line, figures of that run:
``ingest: msgs_per_s=X consume_ratio=X rss_peak_mib=X rss_after_mib=X msgs_per_sync=X``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.connection
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadgen  # noqa: E402 - a sibling module of this script
from results import quantiles_ms, write_result  # noqa: E402 - a sibling module too

TOPIC = "/bench/ingest"
SUBSCRIPTION = "bench-consumer"


def _rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (``VmRSS``), ``nan`` when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _consume(address: str, expected: int, conn: multiprocessing.connection.Connection) -> None:
    """The consumer process: receive and ack ``expected`` messages, report times to the parent."""

    async def run() -> tuple[float, float, int]:
        async with DanubeClient([address]) as client:
            async with client.consumer(
                TOPIC, subscription=SUBSCRIPTION, initial_position=InitialPosition.EARLIEST,
                receiver_queue_size=4000, ack_batch_size=2000,
            ) as consumer:
                conn.send("subscribed")
                first = last = 0.0
                count = 0
                while count < expected:
                    message = await consumer.receive(timeout_ms=60_000)
                    if count == 0:
                        first = time.time()
                    await consumer.ack(message)
                    count += 1
                last = time.time()
                return first, last, count

    conn.send(asyncio.run(run()))


async def _produce(address: str, args: argparse.Namespace, broker_pid: int) -> dict[str, Any]:
    payload = loadgen.make_payload(args.size)
    samples: list[float] = [_rss_mib(broker_pid)]

    async def sample_rss() -> None:
        while True:
            await asyncio.sleep(0.1)
            samples.append(_rss_mib(broker_pid))

    async with DanubeClient([address]) as client:
        async with client.producer(
            TOPIC, producer_name="bench", max_batch_messages=max(1, args.window // 2), max_in_flight_batches=4
        ) as producer:
            await producer.send(payload)  # the topic exists before the consumer subscribes

            async def send(data: bytes) -> asyncio.Future[int]:
                return producer.send_nowait(data)

            parent, child = multiprocessing.get_context("spawn").Pipe()
            consumer = multiprocessing.get_context("spawn").Process(
                target=_consume, args=(address, args.messages + 1, child), daemon=True
            )
            consumer.start()
            assert parent.poll(60) and parent.recv() == "subscribed"
            sampler = asyncio.create_task(sample_rss())
            started = time.time()
            result = await loadgen.window_loop(
                send, payload, messages=args.messages, window=args.window, server_pids=[broker_pid],
                time_limit_s=args.time_limit_s,
            )
            ingest_end = time.time()
            received = await asyncio.to_thread(parent.poll, args.time_limit_s)
            first, last, count = parent.recv() if received else (started, time.time(), 0)
            sampler.cancel()
            consumer.join(10)
        topics = await client.admin.list_topics("bench")
    syncs = sum(t.wal_syncs for t in topics if t.topic == TOPIC)
    samples.append(_rss_mib(broker_pid))
    consume_s = max(last - first, 1e-9)
    return {
        "ingest_msgs_per_s": result.msgs_per_s,
        "ingest_mb_per_s": result.mb_per_s,
        "ingest_s": ingest_end - started,
        "p50_ms": loadgen.percentile(result.latencies_s, 0.5) * 1e3,
        "p99_ms": loadgen.percentile(result.latencies_s, 0.99) * 1e3,
        "consumed": count,
        "consume_msgs_per_s": (count - 1) / consume_s,
        "consume_lag_s": last - ingest_end,
        "rss_before_mib": samples[0],
        "rss_peak_mib": max(samples),
        "rss_after_mib": samples[-1],
        "syncs": syncs,
        "acked": result.acked,
        "latency_quantiles_ms": quantiles_ms(result.latencies_s),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024, help="payload size in bytes (S)")
    parser.add_argument("--messages", type=int, default=None, help="messages (N); default 1 GiB worth")
    parser.add_argument("--window", type=int, default=256, help="most unacked messages (W)")
    parser.add_argument("--time-limit-s", type=float, default=600.0, help="give up after this many seconds")
    parser.add_argument("--metrics-cost", action="store_true",
                        help="measure instead the cost of the broker's metrics: ingest with metrics on and off in "
                             "interleaved rounds (median), and the series of a broker with 100 topics "
                             "(benchmarks/metrics_cost.py); --messages is then per round (default 50,000)")
    parser.add_argument("--rounds", type=int, default=5, help="--metrics-cost: rounds per setting")
    args = parser.parse_args()
    if args.metrics_cost:
        import metrics_cost  # noqa: PLC0415 - a sibling module, only for this mode

        args.messages = args.messages or 50_000
        return metrics_cost.run(args)
    if args.messages is None:
        args.messages = (1 << 30) // args.size
    with tempfile.TemporaryDirectory(prefix="danube-ingest-") as tmp:
        root = Path(tmp)
        with EtcdServer(root / "etcd") as etcd:
            broker = BrokerProcess(etcd_endpoints=etcd.endpoints, data_dir=root / "broker")
            broker.start()
            try:
                r = asyncio.run(_produce(broker.address, args, broker.pid))
            finally:
                broker.stop()
    total = args.messages * args.size
    ratio = r["consume_msgs_per_s"] / r["ingest_msgs_per_s"]
    print(f"ingest: {args.messages:,} messages x {args.size} B ({total / 2**30:.2f} GiB), one producer (W={args.window}),"
          " one consumer in its own process; acks after fdatasync")
    print(f"  ingest        {r['ingest_msgs_per_s']:12,.0f} msg/s  {r['ingest_mb_per_s']:8.1f} MB/s   over {r['ingest_s']:.1f} s"
          f"   send->ack p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms   acked {r['acked']:,}")
    print(f"  consume       {r['consume_msgs_per_s']:12,.0f} msg/s   received {r['consumed']:,}; last message "
          f"{r['consume_lag_s']:+.2f} s after ingest ended   ({ratio:.0%} of ingest; target >= 80%)")
    print(f"  broker RSS    before {r['rss_before_mib']:.0f} MiB, peak {r['rss_peak_mib']:.0f} MiB, after "
          f"{r['rss_after_mib']:.0f} MiB   (target < 300 MiB after 1 GiB)")
    print(f"  fdatasync     {r['syncs']:,.0f} calls   ({(args.messages + 1) / max(r['syncs'], 1):,.1f} messages per sync)")
    print(
        f"ingest: msgs_per_s={r['ingest_msgs_per_s']:.0f} consume_ratio={ratio:.2f} rss_peak_mib={r['rss_peak_mib']:.0f} "
        f"rss_after_mib={r['rss_after_mib']:.0f} msgs_per_sync={(args.messages + 1) / max(r['syncs'], 1):.1f}"
    )
    write_result("ingest", {"size_bytes": args.size, "messages": args.messages, "window": args.window, **r})
    return 0 if r["consumed"] == args.messages + 1 and r["acked"] == args.messages else 1


if __name__ == "__main__":
    sys.exit(main())
