"""Reliable against NonReliable delivery: publish rate of the same load on one broker.

Starts its own etcd and one broker (real processes in a temporary directory), creates two
topics, ``/bench/reliable`` (``Reliable``: every batch is in the WAL and ``fdatasync``-ed before
its ack) and ``/bench/nonreliable`` (``NonReliable``: the batch is acknowledged once it is in the
broker's bounded in-memory buffer, no WAL write, no ``fdatasync``; ``docs/etcd-layout.md`` §3.2),
and publishes the same N messages of S bytes to each through the client library with at most W
unacked (``loadgen.window_loop``). The two runs alternate ``--rounds`` times (reliable first,
then nonreliable) and the best round of each counts, so a noisy neighbour on the machine hurts
both alike.

    .venv/bin/python benchmarks/delivery.py                      # 20,000 x 1 KiB, W=1
    .venv/bin/python benchmarks/delivery.py --window 64 --messages 100000

W=1 (the default) measures what a producer waiting for each ack sees: the WAL's ``fdatasync``
is on every message's path. With a larger window the WAL's group commit shares one
``fdatasync`` among many messages and the gap narrows.

It prints both rates, the send-to-ack latencies and the WAL syncs of each topic, and ends with
one line, figures of that run:
``delivery: reliable_msg_s=X nonreliable_msg_s=Y speedup=Z``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

from danube_pipeline.client import DanubeClient
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer
from danube_pipeline.modes import DeliveryMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadgen  # a sibling module of this script

TOPICS = {DeliveryMode.RELIABLE: "/bench/reliable", DeliveryMode.NON_RELIABLE: "/bench/nonreliable"}


async def _publish(client: DanubeClient, topic: str, args: argparse.Namespace, broker_pid: int) -> loadgen.LoopResult:
    payload = loadgen.make_payload(args.size)
    async with client.producer(
        topic, producer_name="bench", max_batch_messages=max(1, args.window // 2), max_in_flight_batches=4
    ) as producer:

        async def send(data: bytes) -> asyncio.Future[int]:
            return producer.send_nowait(data)

        return await loadgen.window_loop(
            send, payload, messages=args.messages, window=args.window, server_pids=[broker_pid],
            time_limit_s=args.time_limit_s,
        )


async def _run(address: str, args: argparse.Namespace, broker_pid: int) -> dict[DeliveryMode, dict[str, Any]]:
    best: dict[DeliveryMode, dict[str, Any]] = {}
    async with DanubeClient([address]) as client:
        for mode, topic in TOPICS.items():
            await client.admin.create_topic(topic, delivery=mode)
        for _ in range(args.rounds):
            for mode, topic in TOPICS.items():
                result = await _publish(client, topic, args, broker_pid)
                if result.acked != args.messages:
                    raise RuntimeError(f"{topic}: {result.acked} of {args.messages} messages acked")
                if mode not in best or result.msgs_per_s > best[mode]["msgs_per_s"]:
                    best[mode] = {
                        "msgs_per_s": result.msgs_per_s,
                        "mb_per_s": result.mb_per_s,
                        "p50_ms": loadgen.percentile(result.latencies_s, 0.5) * 1e3,
                        "p99_ms": loadgen.percentile(result.latencies_s, 0.99) * 1e3,
                    }
        syncs = {t.topic: t.wal_syncs for t in await client.admin.list_topics("bench")}
        for mode, topic in TOPICS.items():
            best[mode]["syncs"] = syncs.get(topic, 0)
            best[mode]["dropped"] = (await client.admin.describe_topic(topic)).dropped_messages
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024, help="payload size in bytes (S)")
    parser.add_argument("--messages", type=int, default=20_000, help="messages per run (N)")
    parser.add_argument("--window", type=int, default=1, help="most unacked messages (W)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each mode; the best counts")
    parser.add_argument("--time-limit-s", type=float, default=300.0, help="give up a run after this many seconds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="danube-delivery-") as tmp:
        root = Path(tmp)
        with EtcdServer(root / "etcd") as etcd:
            broker = BrokerProcess(etcd_endpoints=etcd.endpoints, data_dir=root / "broker")
            broker.start()
            try:
                r = asyncio.run(_run(broker.address, args, broker.pid))
            finally:
                broker.stop()
    rel, non = r[DeliveryMode.RELIABLE], r[DeliveryMode.NON_RELIABLE]
    print(f"delivery: {args.messages:,} messages x {args.size} B per run, one producer (W={args.window}), "
          f"best of {args.rounds} rounds")
    for name, x in (("Reliable", rel), ("NonReliable", non)):
        print(f"  {name:<12} {x['msgs_per_s']:12,.0f} msg/s  {x['mb_per_s']:8.1f} MB/s   send->ack p50 {x['p50_ms']:.3f} ms"
              f"  p99 {x['p99_ms']:.3f} ms   WAL fdatasync calls {x['syncs']:,}   dropped {x['dropped']:,}")
    speedup = non["msgs_per_s"] / rel["msgs_per_s"]
    print(f"delivery: reliable_msg_s={rel['msgs_per_s']:.0f} nonreliable_msg_s={non['msgs_per_s']:.0f} speedup={speedup:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
