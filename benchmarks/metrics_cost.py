"""What the broker's Prometheus metrics cost: ``benchmarks/ingest.py --metrics-cost``.

Two brokers with the same settings, each with its own etcd, one with ``--metrics-listen`` and
one without. Rounds alternate between them (off then on, then on then off, ...); each round
publishes ``--messages`` messages of ``--size`` bytes from one producer in this process with
at most ``--window`` unacked, after an unmeasured warm-up, and measures the ingest rate
(messages acked per second) and the broker's CPU time per message. The overhead is
``1 - median(on) / median(off)`` of the ingest rates, in percent; the median of each round's own
overhead and the CPU per message are printed too (less sensitive to a busy machine).

Then a broker with metrics on gets 100 topics (one message and one subscription each) and its
``/metrics`` exposition is parsed: the series count is the number of samples in it. The same
is done with ``--no-metrics-per-topic``, whose count must not depend on the topic count.

It ends with ``metrics: overhead_pct=X series=N`` (``series``: the default, per-topic labels).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from danube_pipeline.client import DanubeClient, InitialPosition
from danube_pipeline.dev.localcluster import BrokerProcess, EtcdServer, free_port

import loadgen

SERIES_TOPICS = 100


async def _round(address: str, topic: str, args: argparse.Namespace, broker_pid: int) -> tuple[float, float]:
    """One measured ingest run against ``address``: messages acked per second, and the
    broker's CPU time per message in microseconds."""
    payload = loadgen.make_payload(args.size)
    async with DanubeClient([address]) as client:
        async with client.producer(
            topic, producer_name="bench", max_batch_messages=max(1, args.window // 2), max_in_flight_batches=4
        ) as producer:

            async def send(data: bytes) -> asyncio.Future[int]:
                return producer.send_nowait(data)

            await loadgen.window_loop(send, payload, messages=min(args.messages, loadgen.WARMUP_MESSAGES),
                                      window=args.window)  # fmt: skip
            cpu_before_s = loadgen.proc_cpu_s(broker_pid)
            result = await loadgen.window_loop(
                send, payload, messages=args.messages, window=args.window, time_limit_s=args.time_limit_s
            )
            cpu_us = (loadgen.proc_cpu_s(broker_pid) - cpu_before_s) / args.messages * 1e6
    if result.acked != args.messages:
        raise RuntimeError(f"{result.acked} of {args.messages} messages acked")
    return result.msgs_per_s, cpu_us


def _series(url: str) -> int:
    with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310 - a loopback URL
        text = response.read().decode()
    return sum(len(family.samples) for family in text_string_to_metric_families(text))


async def _fill(address: str, topics: int) -> None:
    """``topics`` topics with one message and one subscription each."""
    async with DanubeClient([address]) as client:
        for i in range(topics):
            topic = f"/bench/series-{i}"
            async with client.producer(topic, producer_name="bench") as producer:
                await producer.send(b"x")
            earliest = InitialPosition.EARLIEST
            async with client.consumer(topic, subscription="s", initial_position=earliest) as consumer:
                await consumer.ack(await consumer.receive(timeout_ms=30_000))


def _start(root: Path, name: str, extra: list[str]) -> tuple[EtcdServer, BrokerProcess]:
    etcd = EtcdServer(root / f"etcd-{name}")
    etcd.start()
    broker = BrokerProcess(etcd_endpoints=etcd.endpoints, data_dir=root / f"broker-{name}", extra_args=extra)
    broker.start()
    return etcd, broker


def run(args: argparse.Namespace) -> int:
    """The ``--metrics-cost`` mode of ``benchmarks/ingest.py``; see the module docstring.

    Returns:
        The exit status: 0.
    """
    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpu_us: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="danube-metrics-cost-") as tmp:
        root = Path(tmp)
        on_port = free_port()
        started = {
            "off": _start(root, "off", []),
            "on": _start(root, "on", ["--metrics-listen", f"127.0.0.1:{on_port}"]),
        }
        try:
            for i in range(args.rounds):
                for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                    broker = started[mode][1]
                    rate, cpu = asyncio.run(_round(broker.address, f"/bench/cost-{i}", args, broker.pid))
                    rates[mode].append(rate)
                    cpu_us[mode].append(cpu)
                    print(f"  round {i + 1} metrics {mode:3}  {rate:12,.0f} msg/s  broker CPU {cpu:6.1f} us/msg",
                          flush=True)
            asyncio.run(_fill(started["on"][1].address, SERIES_TOPICS))
            per_topic = _series(f"http://127.0.0.1:{on_port}/metrics")
        finally:
            for etcd, broker in started.values():
                broker.stop()
                etcd.stop()
        ns_port = free_port()
        etcd, broker = _start(root, "ns", ["--metrics-listen", f"127.0.0.1:{ns_port}", "--no-metrics-per-topic"])
        try:
            asyncio.run(_fill(broker.address, 1))
            one_topic = _series(f"http://127.0.0.1:{ns_port}/metrics")
            asyncio.run(_fill(broker.address, SERIES_TOPICS))
            per_namespace = _series(f"http://127.0.0.1:{ns_port}/metrics")
        finally:
            broker.stop()
            etcd.stop()
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    overhead_pct = (1 - on / off) * 100
    paired_pct = statistics.median((1 - n / f) * 100 for f, n in zip(rates["off"], rates["on"], strict=True))
    cpu_off, cpu_on = statistics.median(cpu_us["off"]), statistics.median(cpu_us["on"])
    print(f"metrics cost: {args.rounds} interleaved rounds of {args.messages:,} x {args.size} B (W={args.window}); "
          f"median ingest off {off:,.0f} msg/s, on {on:,.0f} msg/s; median of the rounds' own overheads "
          f"{paired_pct:.1f}%; broker CPU per message off {cpu_off:.1f} us, on {cpu_on:.1f} us "
          f"({(cpu_on / cpu_off - 1) * 100:+.1f}%)")  # fmt: skip
    print(f"  series with {SERIES_TOPICS} topics (one subscription each): per topic {per_topic:,}; per namespace "
          f"{per_namespace:,} (with 1 topic: {one_topic:,})")  # fmt: skip
    print(f"metrics: overhead_pct={overhead_pct:.1f} series={per_topic}")
    return 0
